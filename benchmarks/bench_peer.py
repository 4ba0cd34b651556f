"""One peer's device: samples/s and memory with mixed precision and activation checkpointing on and off.

For the demo model (``gpt`` defaults, 4.8M parameters) and one about 4x larger (d_model 512), it runs a
peer's real local step (:class:`swarm.training.microbatch.MicroBatchRunner`: forward and backward of a
micro-batch, gradients of the sum accumulated in fp32) under each setting:

- **precision** fp32 against bf16 (and fp16 with ``--device cuda``), and
- **activation checkpointing** off against on.

Throughput: the settings take turns round by round (A, B, C, D, A, B, ...), so drift of a shared machine
hits all of them alike; each round times ``--steps`` micro-batches; the table shows the median and the
spread (min-max) over ``--rounds`` rounds. On CUDA the device is synchronized before each clock read.

Memory, per setting, from one extra micro-batch:

- *activations*: the peak of bytes autograd holds for backward (tensors saved by the forward pass,
  and those recomputed in backward under checkpointing), tracked through
  ``torch.autograd.graph.saved_tensors_hooks``; the same count on every device, and what
  checkpointing is meant to cut;
- on CUDA also *peak step*: ``torch.cuda.max_memory_allocated`` during the micro-batch minus what was
  allocated before it (activations, gradients and temporaries);
- on the CPU the process's peak RSS (``getrusage``) is printed once at the end: it cannot be reset
  between settings.

Quality: the demo model trains ``--train-steps`` optimizer steps (AdamW, one micro-batch per step) on the
same samples in fp32, bf16, bf16 with checkpointing (and fp16 on CUDA), and the validation loss after
them is compared, evaluated in fp32 and in the setting's own precision. fp32 trained on other samples
of the corpus gives the noise floor such a comparison has.

Usage::

    python benchmarks/bench_peer.py                    # CPU, defaults: 3 rounds x 1 micro-batch of 2
    python benchmarks/bench_peer.py --device cuda --batch 32 --rounds 7 --steps 5
    python benchmarks/bench_peer.py --quick            # smoke test: tiny models, a few seconds of work
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import time
import weakref
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from swarm.config import OptimizerConfig  # noqa: E402
from swarm.data import build_dataset  # noqa: E402
from swarm.models import build_model  # noqa: E402
from swarm.training.memory import peak_memory_bytes, reset_peak_memory  # noqa: E402
from swarm.training.microbatch import MicroBatchRunner  # noqa: E402
from swarm.training.state import apply_flat_gradient, build_optimizer, flat_mean_gradient  # noqa: E402

MIB = 1 << 20
MODELS = {
    "demo": {"d_model": 256, "n_layer": 6, "n_head": 8, "seq_len": 256},
    "4x": {"d_model": 512, "n_layer": 6, "n_head": 8, "seq_len": 256},
}
QUICK_MODELS = {
    "demo": {"d_model": 32, "n_layer": 2, "n_head": 2, "seq_len": 32},
    "4x": {"d_model": 64, "n_layer": 2, "n_head": 2, "seq_len": 32},
}


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class SavedActivations:
    """Peak bytes of the tensors autograd saves for backward, counted once per storage while alive."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.weights = {p.untyped_storage().data_ptr() for p in params}
        self.live: dict[int, list[int]] = {}  # storage pointer -> [bytes, holders]
        self.current = self.peak = 0

    def _release(self, ptr: int) -> None:
        entry = self.live[ptr]
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self.live[ptr]

    def pack(self, tensor: torch.Tensor) -> object:
        holder = _Saved(tensor)
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self.weights and storage.nbytes():
            if ptr in self.live:
                self.live[ptr][1] += 1
            else:
                self.live[ptr] = [storage.nbytes(), 1]
                self.current += storage.nbytes()
                self.peak = max(self.peak, self.current)
            weakref.finalize(holder, self._release, ptr)
        return holder

    @staticmethod
    def unpack(holder: object) -> torch.Tensor:
        return holder.tensor

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


class _Saved:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def make_runner(shape: dict, setting: dict, device: str) -> MicroBatchRunner:
    model = build_model("gpt", shape, seed=0).to(device)
    model.train()
    return MicroBatchRunner(
        model,
        device=device,
        precision=setting["precision"],
        activation_checkpointing=setting["checkpointing"],
    )


def batches(dataset, count: int, batch: int, seq_len: int, offset: int = 0) -> list:
    return [dataset.sample_batch(offset + i, batch, seq_len) for i in range(count)]


def time_round(runner: MicroBatchRunner, data: list, device: str) -> float:
    synchronize(device)
    started = time.perf_counter()
    for inputs, targets in data:
        runner.run(inputs, targets)
        for p in runner.params:
            p.grad = None
    synchronize(device)
    return time.perf_counter() - started


def measure_memory(runner: MicroBatchRunner, data: tuple, device: str) -> dict:
    for p in runner.params:
        p.grad = None
    counter = SavedActivations(runner.params)
    reset_peak_memory(device)
    before = torch.cuda.memory_allocated() if device == "cuda" else 0
    with counter.hooks():
        runner.run(*data)
    result = {"activation_mib": counter.peak / MIB}
    if device == "cuda":
        result["peak_step_mib"] = (peak_memory_bytes(device) - before) / MIB
    for p in runner.params:
        p.grad = None
    return result


def throughput(shape: dict, settings: list[dict], args: argparse.Namespace, dataset) -> list[dict]:
    runners = [make_runner(shape, s, args.device) for s in settings]
    data = batches(dataset, args.steps, args.batch, shape["seq_len"])
    rows = [
        {**s, "memory": measure_memory(r, data[0], args.device), "seconds": []}
        for s, r in zip(settings, runners, strict=True)
    ]
    # The memory pass above was each setting's warm-up (allocator, kernels, autocast caches).
    for _ in range(args.rounds):
        for row, runner in zip(rows, runners, strict=True):
            row["seconds"].append(time_round(runner, data, args.device))
    samples = args.steps * args.batch
    for row in rows:
        rates = [samples / s for s in row["seconds"]]
        row.update(median=statistics.median(rates), low=min(rates), high=max(rates))
    del runners
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return rows


def validation_losses_after_training(
    shape: dict, setting: dict, args: argparse.Namespace, dataset, *, sample_offset: int = 10**6
) -> tuple[float, float]:
    """Train the model ``--train-steps`` steps; its validation loss computed in fp32 and in ``setting``."""
    runner = make_runner(shape, setting, args.device)
    model = runner.model
    config = OptimizerConfig(name="adamw", lr=args.lr, warmup_steps=2, total_steps=args.train_steps)
    optimizer = build_optimizer(model, config)
    data = batches(dataset, args.train_steps, args.batch, shape["seq_len"], sample_offset)
    for step, (inputs, targets) in enumerate(data):
        runner.run(inputs, targets)
        averaged = flat_mean_gradient(runner.params, inputs.shape[0])
        apply_flat_gradient(model, runner.params, optimizer, config, step, averaged)
        optimizer.zero_grad(set_to_none=True)
    model.eval()
    validation = dataset.validation_batches(args.batch, shape["seq_len"], args.val_batches)
    losses = []
    for context in (contextlib.nullcontext(), runner.evaluation()):
        with torch.no_grad(), context:
            values = [float(model.loss(x.to(args.device), y.to(args.device))) for x, y in validation]
        losses.append(sum(values) / len(values))
    return losses[0], losses[1]


def label(setting: dict) -> str:
    return f"{setting['precision']:>4} ckpt {'on ' if setting['checkpointing'] else 'off'}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--batch", type=int, default=2, help="samples per micro-batch")
    parser.add_argument("--steps", type=int, default=1, help="micro-batches per timed round")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per setting, interleaved")
    parser.add_argument(
        "--train-steps", type=int, default=12, help="optimizer steps for the quality check (0: skip it)"
    )
    parser.add_argument("--lr", type=float, default=2e-3, help="peak learning rate of the quality check")
    parser.add_argument("--val-batches", type=int, default=8, help="validation batches for the quality check")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--quick", action="store_true", help="tiny models and few rounds: a smoke test")
    parser.add_argument("--models", default="demo,4x", help="comma-separated: demo, 4x")
    parser.add_argument(
        "--precisions", default=None, help="comma-separated (default: fp32,bf16, and fp16 on cuda)"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)
    models = QUICK_MODELS if args.quick else MODELS
    models = {name: models[name] for name in args.models.split(",")}
    if args.quick:
        args.batch, args.steps, args.rounds, args.train_steps, args.val_batches = 2, 1, 2, 3, 1
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible to this torch build")
    precisions = ["fp32", "bf16"] + (["fp16"] if args.device == "cuda" else [])
    if args.precisions:
        precisions = args.precisions.split(",")
    settings = [{"precision": p, "checkpointing": c} for p in precisions for c in (False, True)]
    dataset = build_dataset("stdlib", {"max_bytes": 2_000_000})

    machine = (
        torch.cuda.get_device_name(0)
        if args.device == "cuda"
        else f"{platform.processor() or platform.machine()}"
    )
    print(
        f"device {args.device} ({machine}), {torch.get_num_threads()} threads, torch {torch.__version__}, "
        f"python {platform.python_version()}; micro-batch {args.batch}, {args.steps} per round, "
        f"{args.rounds} rounds interleaved; 1-minute load average {os.getloadavg()[0]:.1f}"
    )
    started = time.monotonic()
    result: dict = {"device": args.device, "machine": machine, "torch": torch.__version__,
                    "threads": torch.get_num_threads(), "batch": args.batch, "models": {}}  # fmt: skip
    for name, shape in models.items():
        params = sum(p.numel() for p in build_model("gpt", shape, seed=0).parameters())
        rows = throughput(shape, settings, args, dataset)
        result["models"][name] = {"shape": shape, "params": params, "rows": rows}
        base = rows[0]
        gpu = args.device == "cuda"
        print(f"\nmodel {name}: {shape} ({params / 1e6:.1f}M parameters)")
        print(
            "  setting        | samples/s (min-max)      | vs fp32 | activations MiB"
            + (" | peak step MiB" if gpu else "")
        )
        for row in rows:
            memory = row["memory"]
            print(
                f"  {label(row)} | {row['median']:8.3g} ({row['low']:.3g}-{row['high']:.3g})".ljust(44)
                + f"| {row['median'] / base['median']:6.2f}x | {memory['activation_mib']:9.1f}"
                + (f"       | {memory['peak_step_mib']:9.1f}" if gpu else "")
            )
        for precision in precisions:
            off, on = (next(r for r in rows if r["precision"] == precision and r["checkpointing"] is c)
                       for c in (False, True))  # fmt: skip
            cut = off["memory"]["activation_mib"] / max(on["memory"]["activation_mib"], 1e-9)
            extra = off["median"] / on["median"] - 1
            print(
                f"  {precision} checkpointing: activations {cut:.2f}x smaller, {extra:+.0%} compute per sample"
            )
        for precision in precisions[1:]:
            row = next(r for r in rows if r["precision"] == precision and not r["checkpointing"])
            print(f"  {precision}/{base['precision']} speed: {row['median'] / base['median']:.2f}x")

    if args.train_steps > 0:
        quality_settings = [{"precision": "fp32", "checkpointing": False}, {"precision": "bf16", "checkpointing": False},
                            {"precision": "bf16", "checkpointing": True}]  # fmt: skip
        if args.device == "cuda":
            quality_settings.append({"precision": "fp16", "checkpointing": False})
        shape = models.get("demo") or next(iter(models.values()))
        print(
            f"\nvalidation loss of the {shape['d_model']}-wide model after {args.train_steps} AdamW steps of {args.batch} samples "
            "(evaluated in fp32 | in the setting's precision):"
        )
        quality = []
        for setting in quality_settings:
            fp32_eval, own_eval = validation_losses_after_training(shape, setting, args, dataset)
            quality.append({**setting, "val_loss": fp32_eval, "val_loss_own_precision": own_eval})
        # The noise floor: fp32 again, trained on other samples of the same corpus.
        other, _ = validation_losses_after_training(
            shape, quality_settings[0], args, dataset, sample_offset=2 * 10**6
        )
        base = quality[0]["val_loss"]
        for row in quality:
            print(
                f"  {label(row)}: {row['val_loss']:.4f} ({row['val_loss'] / base - 1:+.2%} vs fp32) | "
                f"{row['val_loss_own_precision']:.4f}"
            )
        print(f"  fp32 on other samples (noise floor): {other:.4f} ({other / base - 1:+.2%} vs fp32)")
        result["quality_noise_floor"] = other
        result["quality"] = quality
    if args.device == "cpu":
        result["peak_rss_mib"] = peak_memory_bytes("cpu") / MIB
        print(f"\nprocess peak RSS (all settings together): {result['peak_rss_mib']:.0f} MiB")
    print(f"\ntotal {time.monotonic() - started:.0f}s; 1-minute load average now {os.getloadavg()[0]:.1f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
