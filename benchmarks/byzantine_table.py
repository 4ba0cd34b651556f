"""Final validation loss under each rehearsed attack, with `mean` and with `centered_clip`, against a clean run.

Every cell is one real `swarm-sim` run (a coordinator and N peer processes on loopback), the tiny model
by default so the whole table fits in well under an hour on 2 cores. Prints a markdown table with, per
attack and attacker count f, the final validation loss under `mean` and under `centered_clip`, the
clean run's, centered_clip's gap to the clean run in percent, and whether the attackers ended banned.

Usage::

    python benchmarks/byzantine_table.py                         # 8 peers, f = 2 and 3, every attack
    python benchmarks/byzantine_table.py --peers 5 --f 2 --attacks sign_flip,bad_reducer --json t.json
    python benchmarks/byzantine_table.py --sync diloco --inner-steps 10 --compression int8 --steps 4
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from swarm.byzantine.attacks import attack_names

RULES = ("mean", "centered_clip")


def run_sim(flags: list[str], timeout_s: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="swarm-table-") as home:
        out = Path(home) / "sim.json"
        started = time.monotonic()
        try:
            result = subprocess.run(
                [sys.executable, "-m", "lab.sim", "--json", str(out), *flags],
                capture_output=True, text=True, timeout=timeout_s,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            return {"error": f"no result within {timeout_s:.0f}s", "duration_s": time.monotonic() - started}
        if not out.exists():
            return {"error": (result.stdout + result.stderr)[-500:], "duration_s": time.monotonic() - started}
        report = json.loads(out.read_text())
        report["exit_code"] = result.returncode
        return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--peers", type=int, default=8)
    parser.add_argument("--f", default="2,3", help="attacker counts, comma-separated")
    parser.add_argument("--attacks", default=",".join(attack_names()))
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--model-size", default="tiny")
    parser.add_argument("--timeout-s", type=float, default=600)
    parser.add_argument("--sync", default="every_step", choices=["every_step", "diloco"])
    parser.add_argument("--inner-steps", type=int, default=10, help="diloco: local steps per outer step")
    parser.add_argument("--compression", default="fp16", help="codec on the wire (int8 for the diloco table)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    base = ["--peers", str(args.peers), "--steps", str(args.steps), "--model-size", args.model_size,
            "--sync", args.sync, "--compression", args.compression]  # fmt: skip
    if args.sync == "diloco":
        base += ["--inner-steps", str(args.inner_steps)]
    cells: dict = {"clean": run_sim(base, args.timeout_s), "runs": []}
    clean = cells["clean"].get("final_val_loss", float("nan"))
    print(
        f"clean: {clean:.4f} (initial {cells['clean'].get('initial_val_loss', float('nan')):.4f})", flush=True
    )
    for f in [int(x) for x in args.f.split(",")]:
        for attack in args.attacks.split(","):
            row = {"attack": attack, "f": f}
            for rule in RULES:
                report = run_sim([*base, "--byzantine", str(f), "--attack", attack, "--aggregator", rule],
                                 args.timeout_s)  # fmt: skip
                attackers = [p for p in report.get("peers", []) if p.get("byzantine")]
                row[rule] = {
                    "final_val_loss": report.get("final_val_loss"),
                    "banned": sum(1 for p in attackers if p.get("banned")),
                    "honest_agree": report.get("peers_agree"),
                    "error": report.get("error", ""),
                }
            cells["runs"].append(row)
            print(json.dumps(row), flush=True)
    lines = [
        "| attack | f | mean | centered_clip | clean | centered_clip vs clean | attackers banned (mean / cclip) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for row in cells["runs"]:
        m, c = row["mean"]["final_val_loss"], row["centered_clip"]["final_val_loss"]
        gap = f"{100 * (c - clean) / clean:+.1f}%" if c is not None else "n/a"
        lines.append(
            f"| {row['attack']} | {row['f']} | {m if m is None else f'{m:.4f}'} | "
            f"{c if c is None else f'{c:.4f}'} | {clean:.4f} | {gap} | "
            f"{row['mean']['banned']}/{row['f']} / {row['centered_clip']['banned']}/{row['f']} |"
        )
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps(cells, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
