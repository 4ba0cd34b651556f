"""The pipeline issue's table: each pipeline attack rehearsed by `swarm-sim --stages`, against a clean run.

Every cell is one real `swarm-sim` run (a coordinator, the stage servers and the trainers as processes on
loopback, the tiny model). Runs interleave round by round (clean, each attack, then the next round), so a
busy machine slows every row alike; each round is one run of every row. Prints a markdown table: the final
validation loss of every run, the mean gap to the clean runs, whether the honest replicas of each stage
hold identical parameters, micro-batches lost, and whom the coordinator banned.

Usage::

    python benchmarks/pipeline_table.py                                   # 2 stages x 3, 2 trainers, 20 steps
    python benchmarks/pipeline_table.py --rounds 2 --rows stage_poison --json p.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from byzantine_table import run_sim  # noqa: E402

ROWS = {
    "stage_poison": "a replica answering scaled outputs and inflated grad_inputs, signed",
    "stage_throughput_lie": "a replica announcing 1e12 samples/s",
    "forged_retried": "a replica's record claiming huge attempts for every honest micro-batch",
    "stuck_in_flight": "a trainer claiming a micro-batch in flight at every step",
    "front_runner": "a trainer calling first under honest trainers' micro-batch IDs",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--peers-per-stage", type=int, default=3)
    parser.add_argument("--trainers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=1, help="runs of every row, interleaved")
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--model-size", default="tiny")
    parser.add_argument("--timeout-s", type=float, default=900)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    rows = args.rows.split(",")
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        parser.error(f"unknown row {unknown[0]!r}; known: {', '.join(ROWS)}")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    base = ["--stages", str(args.stages), "--peers-per-stage", str(args.peers_per_stage),
            "--trainers", str(args.trainers), "--steps", str(args.steps), "--model-size", args.model_size,
            "--timeout-s", str(args.timeout_s)]  # fmt: skip
    results: dict[str, list[dict]] = {row: [] for row in ["clean", *rows]}
    for round_ in range(args.rounds):
        for row in results:
            extra = [] if row == "clean" else ["--byzantine", "1", "--attack", row]
            cell = run_sim(base + extra, args.timeout_s + 120)
            results[row].append(cell)
            print(f"round {round_ + 1} {row}: {_summary(cell)}", flush=True)
            if args.json:
                args.json.write_text(json.dumps(results, indent=2))
    clean = [c["final_val_loss"] for c in results["clean"] if "error" not in c]
    anchor = statistics.mean(clean) if clean else None
    print()
    print(
        "| attack | final loss, each run | mean vs clean | honest replicas identical | lost | banned | exit | time |"
    )
    print("| --- | ---: | ---: | --- | ---: | --- | --- | ---: |")
    for row, cells in results.items():
        print(_line(row, cells, anchor))
    return 0


def _summary(cell: dict) -> str:
    if "error" in cell:
        return f"error: {cell['error'][-300:]}"
    return (
        f"loss {cell['final_val_loss']:.4f}, identical {cell['stages_agree']}, lost "
        f"{cell['lost_microbatches']}, banned {cell['banned']}, exit {cell['exit_code']}, {cell['duration_s']:.0f}s"
    )


def _line(row: str, cells: list[dict], anchor: float | None) -> str:
    ok = [c for c in cells if "error" not in c]
    failed = len(cells) - len(ok)
    label = "none (clean)" if row == "clean" else f"`{row}`: {ROWS[row]}"
    if not ok:
        return f"| {label} | failed: {cells[-1]['error'][-120:]!r} | | | | | | |"
    losses = ", ".join(f"{c['final_val_loss']:.4f}" for c in ok) + (f" ({failed} failed)" if failed else "")
    mean = statistics.mean(c["final_val_loss"] for c in ok)
    gap = f"{100 * (mean - anchor) / anchor:+.1f}%" if anchor and row != "clean" else "-"
    agree = "yes" if all(c["stages_agree"] for c in ok) else "**no**"
    lost = sum(c["lost_microbatches"] for c in ok)
    banned = "; ".join(",".join(c["banned"]) or "none" for c in ok)
    exits = ",".join(str(c["exit_code"]) for c in ok)
    time_s = "/".join(f"{c['duration_s']:.0f}" for c in ok)
    return f"| {label} | {losses} | {gap} | {agree} | {lost} | {banned} | {exits} | {time_s} s |"


if __name__ == "__main__":
    raise SystemExit(main())
