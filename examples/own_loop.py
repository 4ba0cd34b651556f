"""Your own PyTorch model, data and loop, trained with other peers through ``session.collaborate``.

    python examples/own_loop.py --write-run own.toml                   # the organizer: the run for this model
    swarm-coordinator start --config own.toml
    python examples/own_loop.py --coordinator HOST:31330 --identity a.key --steps 20   # each peer
    swarm-coordinator status --coordinator HOST:31330 --json           # every peer on one param_hash

The task: classify 16-dimensional points by which of 4 fixed directions they lie closest to. Each peer
draws its own points (seeded by its peer ID); all peers share one validation set.
"""

from __future__ import annotations

import argparse
import json

import torch
from torch import nn

import swarm


def make_model() -> nn.Module:
    torch.manual_seed(0)  # every peer builds the same initial weights
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))


def make_data(seed: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    directions = torch.randn(16, 4, generator=torch.Generator().manual_seed(1234))  # the task, shared
    x = torch.randn(n, 16, generator=torch.Generator().manual_seed(seed))
    return x, (x @ directions).argmax(dim=1)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--coordinator", help="HOST:PORT of the run's coordinator")
    parser.add_argument("--identity", default="~/.swarm/identity.key", help="this peer's key file")
    parser.add_argument("--steps", type=int, default=20, help="train until the run reaches this step")
    parser.add_argument("--host", default="0.0.0.0", help="address this peer listens on")
    parser.add_argument("--device", default="cpu", help="where the model trains (cpu, cuda)")
    parser.add_argument("--write-run", metavar="PATH", help="write the run's TOML for this model and exit")
    args = parser.parse_args()
    if args.write_run:
        # Each peer trains on its own data, which nobody can replay: no sender checks (docs/robustness.md).
        training = {"target_batch_size": 128, "micro_batch_size": 32, "matchmaking_time_s": 2.0,
                    "sender_check_probability": 0.0}  # fmt: skip
        run = swarm.RunConfig(run_id="own-loop", model=swarm.describe_model(make_model()),
                              optimizer={"lr": 0.01, "warmup_steps": 0}, training=training)  # fmt: skip
        return run.to_toml(args.write_run)

    model, loss_fn = make_model().to(args.device), nn.CrossEntropyLoss()
    val_x, val_y = (t.to(args.device) for t in make_data(seed=0, n=512))
    validate = torch.no_grad()(lambda m: float(loss_fn(m(val_x), val_y)))
    with swarm.connect(
        args.coordinator, identity=args.identity, host=args.host, device=args.device
    ) as session:
        collab = session.collaborate(model, validate=validate)  # checks model and optimizer, catches up
        first = validate(model)
        x, y = (
            t.to(args.device)
            for t in make_data(int.from_bytes(session.key.peer_id.encode()[-6:], "big"), 32000)
        )
        for i in range(0, len(x), 32):
            loss_fn(model(x[i : i + 32]), y[i : i + 32]).backward()
            collab.step(samples=32)
            if collab.global_step >= args.steps or collab.finished:
                break
        agreed = collab.finish()
        print(json.dumps({"step": collab.global_step, "param_hash": collab.param_hash, "agreed": agreed,
                          "val_loss_first": first, "val_loss_last": validate(model)}))  # fmt: skip


if __name__ == "__main__":
    main()
