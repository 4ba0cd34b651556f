"""The trust issue's table: each of its six attacks rehearsed by `swarm-sim`, in every_step and in DiLoCo.

Every cell is one real `swarm-sim` run (a coordinator and N peer processes on loopback, the tiny model).
Per mode, a clean run first, then each attack: admitted attackers as `--byzantine F --attack NAME`, a
stranger's process as `--protocol-attack NAME`. Prints a markdown table: the final validation loss, its
gap to the clean run of the same mode, whether the honest peers hold the final checkpoint's bits, how
many attackers were banned, and what the coordinator made of a stranger's identities.

Usage::

    python benchmarks/trust_table.py                              # 6 peers, f = 2, both modes
    python benchmarks/trust_table.py --modes every_step --rows step_liar,denier --json t.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from byzantine_table import run_sim  # noqa: E402

# (issue item, label, flags): admitted attackers get --byzantine F, strangers are one more process.
ROWS = {
    "far_future": ("1", "a stranger's junk, 30 years out, under every record key", ["--protocol-attack", "far_future"]),
    "hostile": ("1, 2", "a stranger at every DHT key rule, libp2p handler and coordinator RPC", ["--protocol-attack", "hostile"]),
    "step_liar": ("3", "admitted peers signing the next step into their entries", ["--attack", "step_liar"]),
    "denier": ("4", "admitted peers denying every round they joined", ["--attack", "denier"]),
    "refusing_reducer": ("5", "admitted reducers that lie and show no input", ["--attack", "refusing_reducer"]),
    "coordinator_sybils": ("6", "a stranger's cheap identities at the coordinator", ["--protocol-attack", "coordinator_sybils"]),
}  # fmt: skip


def mode_flags(mode: str, steps: int, inner_steps: int) -> list[str]:
    if mode == "diloco":  # every window exactly inner_steps: the same samples in every run of the table
        return [
            "--sync",
            "diloco",
            "--inner-steps",
            str(inner_steps),
            "--window-stretch",
            "1",
            "--steps",
            str(steps),
        ]
    return ["--steps", str(steps)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--peers", type=int, default=6)
    parser.add_argument("--f", type=int, default=2, help="admitted attackers")
    parser.add_argument("--steps", type=int, default=10, help="steps (diloco: outer steps)")
    parser.add_argument("--inner-steps", type=int, default=10)
    parser.add_argument("--modes", default="every_step,diloco")
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--model-size", default="tiny")
    parser.add_argument("--timeout-s", type=float, default=900)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    rows = args.rows.split(",")
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        parser.error(f"unknown row {unknown[0]!r}; known: {', '.join(ROWS)}")
    base = ["--peers", str(args.peers), "--model-size", args.model_size, "--timeout-s", str(args.timeout_s)]
    results: dict[str, dict[str, dict]] = {}
    for mode in args.modes.split(","):
        flags = base + mode_flags(mode, args.steps, args.inner_steps)
        results[mode] = {"clean": run_sim(flags, args.timeout_s + 120)}
        print(f"{mode} clean: {_summary(results[mode]['clean'])}", flush=True)
        for row in rows:
            extra = ROWS[row][2]
            if extra[0] == "--attack":
                # With fewer than 3f + 1 peers the sim's floor of 2f + 1 outlasts banned attackers: the
                # honest peers alone are the floor here (a group at it may then be half attackers).
                floor = str(args.peers - args.f)
                extra = ["--byzantine", str(args.f), "--min-group-size", floor, *extra]
            results[mode][row] = run_sim(flags + extra, args.timeout_s + 120)
            print(f"{mode} {row}: {_summary(results[mode][row])}", flush=True)
            if args.json:
                args.json.write_text(json.dumps(results, indent=2))
    print()
    print(
        "| mode | item | attack | final loss | vs clean | honest identical | attackers banned | stranger's identities (banned) | time |"
    )
    print("| --- | --- | --- | ---: | ---: | --- | --- | --- | ---: |")
    for mode, cells in results.items():
        clean = cells["clean"].get("final_val_loss")
        for row, cell in cells.items():
            item, label = ("-", "none (clean)") if row == "clean" else ROWS[row][:2]
            print(_line(mode, item, f"`{row}`: {label}" if row != "clean" else label, cell, clean))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


def _summary(cell: dict) -> str:
    if "error" in cell:
        return f"error: {cell['error'][-300:]}"
    return f"loss {cell['final_val_loss']:.4f}, identical {cell['peers_agree']}, {cell['duration_s']:.0f}s"


def _line(mode: str, item: str, label: str, cell: dict, clean: float | None) -> str:
    if "error" in cell:
        return f"| {mode} | {item} | {label} | failed: {cell['error'][-120:]!r} | | | | | |"
    loss = cell["final_val_loss"]
    gap = f"{100 * (loss - clean) / clean:+.1f}%" if clean else "-"
    attackers = [p for p in cell["peers"] if p["byzantine"]]
    banned = f"{sum(p['banned'] for p in attackers)}/{len(attackers)}" if attackers else "-"
    strangers = cell.get("strangers", {})
    sybils = f"{strangers['rows']} ({strangers['banned']})" if strangers.get("rows") else "-"
    agree = "yes" if cell["peers_agree"] else "**no**"
    return f"| {mode} | {item} | {label} | {loss:.4f} | {gap} | {agree} | {banned} | {sybils} | {cell['duration_s']:.0f} s |"


if __name__ == "__main__":
    raise SystemExit(main())
