"""A Hugging Face ``Trainer`` script (a tiny GPT-2 on a local text file) that joins a run: the lines
marked ``# swarm`` are all it adds to an ordinary script.

    python examples/hf_trainer.py --write-run hf.toml                  # the organizer: the run for this model
    swarm-coordinator start --config hf.toml
    python examples/hf_trainer.py --coordinator HOST:31330 --identity a.key --max-steps 10   # each peer

Text is read as bytes (a 256-token vocabulary), so no tokenizer is needed; nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

import swarm  # swarm
from swarm.training.hf import SwarmCallback  # swarm

SEQ_LEN = 64
README = Path(__file__).resolve().parents[1] / "README.md"


def make_model() -> GPT2LMHeadModel:
    torch.manual_seed(0)  # every peer builds the same initial weights
    config = GPT2Config(vocab_size=256, n_positions=SEQ_LEN, n_embd=64, n_layer=2, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)  # fmt: skip
    return GPT2LMHeadModel(config)


class ByteWindows(torch.utils.data.Dataset):
    """Consecutive windows of ``SEQ_LEN`` bytes of a text file, as token IDs."""

    def __init__(self, data: bytes):
        self.ids = torch.tensor(list(data), dtype=torch.long)

    def __len__(self) -> int:
        return len(self.ids) // SEQ_LEN

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        window = self.ids[i * SEQ_LEN : (i + 1) * SEQ_LEN]
        return {"input_ids": window, "labels": window}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--coordinator", help="HOST:PORT of the run's coordinator")
    parser.add_argument("--identity", default="~/.swarm/identity.key", help="this peer's key file")
    parser.add_argument("--max-steps", type=int, default=10, help="train until the run reaches this step")
    parser.add_argument("--text", type=Path, default=README, help="a local text file to train on")
    parser.add_argument("--host", default="0.0.0.0", help="address this peer listens on")
    parser.add_argument("--output-dir", default="hf-trainer-out", help="the Trainer's output folder")
    parser.add_argument("--write-run", metavar="PATH", help="write the run's TOML for this model and exit")
    args = parser.parse_args()
    if args.write_run:
        run = swarm.RunConfig(run_id="hf-trainer", model=swarm.describe_model(make_model()),
                              optimizer={"lr": 3e-3, "warmup_steps": 0},
                              # Its own data, which nobody can replay: no sender checks.
                              training={"target_batch_size": 32, "matchmaking_time_s": 2.0,
                                        "sender_check_probability": 0.0})  # fmt: skip
        return run.to_toml(args.write_run)

    logging.getLogger("transformers").setLevel(logging.ERROR)
    data = args.text.read_bytes()
    held_out = len(data) // 10
    train, evaluation = ByteWindows(data[held_out:]), ByteWindows(data[:held_out])
    model = make_model().to("cuda" if torch.cuda.is_available() else "cpu")  # where the Trainer will put it
    with swarm.connect(args.coordinator, identity=args.identity, host=args.host) as session:  # swarm
        collab = session.collaborate(model)  # swarm
        training = TrainingArguments(
            output_dir=args.output_dir, per_device_train_batch_size=8, num_train_epochs=100, report_to=[],
            save_strategy="no", logging_strategy="no", use_cpu=not torch.cuda.is_available(),
            seed=int.from_bytes(session.key.peer_id.encode()[-4:], "big"),  # each peer its own order
            max_grad_norm=0.0,  # swarm: the run clips the averaged gradient
        )  # fmt: skip
        trainer = Trainer(
            model=model,
            args=training,
            train_dataset=train,
            eval_dataset=evaluation,
            callbacks=[SwarmCallback(collab, until_step=args.max_steps)],
        )  # swarm
        first = trainer.evaluate()["eval_loss"]
        trainer.train()
        agreed = collab.finish()  # swarm: serve the state until the peers in view hold this step
        print(json.dumps({"step": collab.global_step, "param_hash": collab.param_hash, "agreed": agreed,
                          "val_loss_first": first, "val_loss_last": trainer.evaluate()["eval_loss"]}))  # fmt: skip


if __name__ == "__main__":
    main()
