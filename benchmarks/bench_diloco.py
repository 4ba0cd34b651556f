"""DiLoCo against every-step averaging at equal samples processed: loss, bytes per sample, utilization.

Each configuration is a whole ``swarm-sim`` swarm (coordinator plus ``--peers`` volunteer processes),
optionally in the WAN lab with every link capped by the kernel (``--caps``, needs root). The anchor is
today's ``sync = every_step`` with fp16 on the wire; it runs ``samples / target_batch`` steps. Peers of
every_step bring more than the target batch to a step (they compute on while the progress records that
close the batch travel), so each round the anchor runs first and the diloco configurations of that round
take what it *measured*: an inner step takes each peer's share of the anchor's samples per step (to the
nearest sample, a half rounded up), and the outer steps are as many as cover the anchor's samples
(``anchor samples / (peers * H * inner_batch)``).
Every configuration thus processes about the same samples (a diloco window holds at least H inner steps
of every peer, and a faster peer trains on until the slowest has done its H, so a little more: the
samples column shows how many), and an outer step covers at least H anchor steps' samples.
Per configuration it prints:

- final validation loss (the coordinator's last checkpoint, evaluated independently) and its ratio to
  the anchor's;
- bytes on the wire per sample: averaging bytes every honest peer sent / samples in applied rounds, and
  how many times fewer than the anchor (the issue's target: >= 200x for int8 at H=100, >= 2000x topk);
- compute utilization: the share of each peer's training window (its first micro-batch to its last
  step, less its validations) spent in forward, backward and optimizer steps (every inner step, and the
  step that applies a round); the rest is matchmaking, the all-reduce and waiting;
- the robust aggregator's cost per outer step (``centered_clip`` timed in this process on as many
  pseudo-gradients of the model's size as there are peers) as a share of the outer step's wall time.

``--inner-split K`` gives every diloco configuration K times the inner steps at a K-th of the matched
inner batch: the same samples and bytes per outer step, K times the inner optimizer steps (on the small
model, ``diloco_recipes.py`` found H = 200 at batch 14 ahead of H = 100 at batch 28; docs/diloco.md).

Configurations interleave round by round (anchor, then each diloco variant, then the anchor again...)
so that a background load biases none of them; ``--repeat`` rounds, each shown.

Usage::

    python benchmarks/bench_diloco.py                                 # small model, no cap
    python benchmarks/bench_diloco.py --caps 100,10                   # in the WAN lab (root)
    python benchmarks/bench_diloco.py --inner-steps 10,50,100 --codecs fp16,int8,topk --model-size demo
    python benchmarks/bench_diloco.py --inner-steps 100 --codecs int8 --overlap off,on
    python benchmarks/bench_diloco.py --inner-steps 100 --codecs int8 --outer default,1:0
    python benchmarks/bench_diloco.py --inner-steps 100 --codecs int8 --inner-split 2   # H=200, half batch
    python benchmarks/bench_diloco.py --quick                         # smoke test
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MICRO_BATCH = 4
TARGET_BATCH = 32


def sim_command(args, config: dict, out: Path) -> list[str]:
    micro = config.get("inner_batch", MICRO_BATCH)
    command = [
        sys.executable, "-m", "lab.sim", "--peers", str(args.peers), "--model-size", args.model_size,
        "--micro-batch-size", str(micro), "--target-batch-size", str(TARGET_BATCH), "--lr", str(args.lr),
        "--compression", config["codec"], "--json", str(out), "--timeout-s", str(args.timeout_s),
        "--verify-probability", "0.25",
    ]  # fmt: skip
    if config["sync"] == "diloco":
        command += ["--sync", "diloco", "--inner-steps", str(config["H"]), "--steps", str(config["outer"])]
        if config.get("overlap"):
            command += ["--outer-overlap"]
        if config.get("outer_optimizer"):
            outer_lr, outer_momentum = config["outer_optimizer"]
            command += ["--outer-lr", str(outer_lr), "--outer-momentum", str(outer_momentum)]
    else:
        command += ["--steps", str(max(1, args.samples // TARGET_BATCH))]
    if config["cap"]:
        command += ["--wan", f"up={config['cap']}mbit,down={config['cap']}mbit"]
    return command


def run_one(args, config: dict) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "sim.json"
        command = sim_command(args, config, out)
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout_s + 180)
        if done.returncode != 0 or not out.exists():
            raise SystemExit(
                f"swarm-sim failed ({' '.join(command)}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
            )
        report = json.loads(out.read_text())
    outer_steps = report["steps"]
    samples = sum(p["contributed_samples"] for p in report["peers"] if not p["byzantine"])
    return {
        **config,
        "steps": outer_steps,
        "samples": samples,
        "samples_per_round": samples / max(outer_steps, 1),
        "val_loss": report["final_val_loss"],
        "initial_val_loss": report["initial_val_loss"],
        "bytes_per_sample": report["bytes_sent_per_sample"],
        "utilization": report["compute_utilization"],
        "step_s": report["duration_s"] / max(outer_steps, 1),
        "identical": report["peers_agree"],
    }


def aggregator_seconds(model_size: str, peers: int, repeats: int = 3) -> float:
    """centered_clip over ``peers`` pseudo-gradients of the model's size, as one reducer would (the whole
    vector: the upper bound of any reducer's part)."""
    import torch

    from lab.simconfig import PRESETS
    from swarm.averaging.aggregators import get_aggregator
    from swarm.models import build_model

    model = build_model("gpt", PRESETS[model_size], seed=0)
    numel = sum(p.numel() for p in model.parameters())
    contributions = torch.randn(peers, numel, generator=torch.Generator().manual_seed(0))
    weights = torch.ones(peers)
    aggregate = get_aggregator("centered_clip")
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        aggregate(contributions, weights, seed=0)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def configurations(args) -> list[dict]:
    caps = [float(c) if c not in ("", "0", "none") else None for c in args.caps.split(",")]
    configs = []
    for cap in caps:
        configs.append({"sync": "every_step", "H": 1, "codec": "fp16", "cap": cap})
        for h in (int(x) for x in args.inner_steps.split(",")):
            for codec in args.codecs.split(","):
                for overlap in (v == "on" for v in args.overlap.split(",")):
                    for outer in outer_variants(args.outer):
                        configs.append(
                            {
                                "sync": "diloco",
                                "H": h,
                                "codec": codec,
                                "cap": cap,
                                "overlap": overlap,
                                "outer_optimizer": outer,
                            }
                        )
    return configs


def outer_variants(text: str) -> list[tuple[float, float] | None]:
    """``default,1:0`` -> the run's default outer optimizer, then lr 1 with momentum 0 (plain SGD)."""
    from lab.simconfig import parse_outer_optimizer

    variants = []
    for item in text.split(","):
        if item == "default":
            variants.append(None)
            continue
        try:
            variants.append(parse_outer_optimizer(item))
        except ValueError:
            raise SystemExit(f"--outer: {item!r} is neither 'default' nor LR:MOMENTUM") from None
    return variants


def matched_to(anchor: dict, config: dict, peers: int, split: int = 1) -> dict:
    """A diloco configuration sized from the anchor's measured samples (see the module docstring)."""
    micro = max(1, math.floor(anchor["samples_per_round"] / (peers * split) + 0.5))  # half up: 28.5 -> 29
    inner_steps = config["H"] * split
    outer = max(1, round(anchor["samples"] / (peers * inner_steps * micro)))
    return {**config, "H": inner_steps, "inner_batch": micro, "outer": outer}


def label(config: dict) -> str:
    cap = f"{config['cap']:g} Mbit/s" if config["cap"] else "no cap"
    name = "every_step" if config["sync"] == "every_step" else f"diloco H={config['H']}"
    if config.get("overlap"):
        name += " overlap"
    if config.get("outer_optimizer"):
        name += " outer lr {:g} momentum {:g}".format(*config["outer_optimizer"])
    return f"{name} {config['codec']} ({cap})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--peers", type=int, default=2)
    parser.add_argument("--model-size", default="small", choices=["tiny", "small", "demo"])
    parser.add_argument("--samples", type=int, default=6400, help="samples every configuration processes")
    parser.add_argument("--inner-steps", default="10,50,100", help="diloco H values, comma-separated")
    parser.add_argument("--codecs", default="fp16,int8,topk")
    parser.add_argument(
        "--caps", default="none", help="uplink caps in Mbit/s (none: loopback), comma-separated"
    )
    parser.add_argument(
        "--overlap", default="off", help="diloco outer_overlap variants: off, on, or off,on (both)"
    )
    parser.add_argument(
        "--outer",
        default="default",
        help="diloco outer optimizers: 'default' (the run's, which depends on the codec) or LR:MOMENTUM "
        "(momentum 0: plain SGD), comma-separated",
    )
    parser.add_argument(
        "--inner-split", type=int, default=1, help="diloco: K times the inner steps at 1/K of the inner batch"
    )
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--timeout-s", type=int, default=1500)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--quick", action="store_true", help="smoke test: tiny model, 2 configurations")
    args = parser.parse_args(argv)
    if args.inner_split < 1:
        parser.error(f"--inner-split must be at least 1, not {args.inner_split}")
    if args.quick:
        args.model_size, args.samples, args.inner_steps, args.codecs = "tiny", 640, "20", "int8"
        args.timeout_s = 300
    configs = configurations(args)
    rows = []
    for round_index in range(args.repeat):
        anchors: dict = {}
        for config in configs:  # interleaved: every configuration once per round
            if config["sync"] == "diloco":
                config = matched_to(anchors[config["cap"]], config, args.peers, args.inner_split)
            row = run_one(args, config)
            if config["sync"] == "every_step":
                anchors[config["cap"]] = row
            row["round"] = round_index
            rows.append(row)
            print(f"round {round_index} {label(config)}: val {row['val_loss']:.4f}, "
                  f"{row['bytes_per_sample']:.1f} B/sample, util {row['utilization']:.2f}", flush=True)  # fmt: skip
    aggregate_s = aggregator_seconds(args.model_size, args.peers)
    print(f"\n{args.peers} peers, model {args.model_size}, {args.samples} samples each; "
          f"centered_clip over {args.peers} full vectors: {aggregate_s * 1e3:.1f} ms")  # fmt: skip
    header = (
        "| configuration | samples (per round) | val loss (vs anchor) | bytes/sample (x fewer) | utilization "
        "| aggregator share | identical |"
    )
    print(header)
    print("|" + "---|" * 7)
    for row in rows:
        anchor = next(
            r
            for r in rows
            if r["sync"] == "every_step" and r["cap"] == row["cap"] and r["round"] == row["round"]
        )
        row["loss_ratio"] = row["val_loss"] / anchor["val_loss"]
        row["fewer_bytes"] = anchor["bytes_per_sample"] / max(row["bytes_per_sample"], 1e-9)
        row["aggregator_share"] = aggregate_s / max(row["step_s"], 1e-9)
        print(f"| {label(row)} | {row['samples']:.0f} ({row['samples_per_round']:.0f}) | {row['val_loss']:.4f} ({row['loss_ratio']:.3f}) | {row['bytes_per_sample']:.1f} "
              f"({row['fewer_bytes']:.0f}x) | {row['utilization']:.2f} | {row['aggregator_share']:.3f} | "
              f"{row['identical']} |")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
