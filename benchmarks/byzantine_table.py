"""Final validation loss under each rehearsed attack, with `mean` and with `centered_clip`, against a clean run.

Every cell is one real `swarm-sim` run (a coordinator and N peer processes on loopback), the tiny model
by default so the whole table fits in well under an hour on 2 cores. Prints a markdown table with, per
attack and attacker count f, the final validation loss under `mean` and under `centered_clip`, the
clean run's, centered_clip's gap to the clean run in percent, and how many attackers ended banned, with the
step each ban names (the round of the lie the sender checks proved; "-": a false weight claim, which names
none). Every run of a row forms its groups under swarm-sim's floor with f attackers, max(2f + 1, peers - f),
the clean run included; with fewer than 3f + 1 peers no floor both keeps an honest majority in every group
and lets the honest peers go on once the attackers are banned, and the table refuses to run unless told
`--min-group-size`.

Usage::

    python benchmarks/byzantine_table.py                         # 8 peers, f = 2, every attack
    python benchmarks/byzantine_table.py --peers 7 --f 2 --attacks sign_flip,bad_reducer --json t.json
    python benchmarks/byzantine_table.py --sync diloco --inner-steps 10 --compression int8 --steps 4
    python benchmarks/byzantine_table.py --rules centered_clip --repeats 2 --peers 7 --f 2 --attacks ipm
    python benchmarks/byzantine_table.py --sync diloco --inner-steps 10 --compression int8 --window-stretch 1 \
        --peers 7 --f 2 --steps 8 --rules centered_clip --repeats 2
"""

from __future__ import annotations

import argparse
import json
import re
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


def _loss(value) -> str:
    return "n/a" if value is None else f"{value:.4f}"


def _gap(value, clean) -> str:
    return "n/a" if value is None or clean is None else f"{100 * (value - clean) / clean:+.1f}%"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--peers", type=int, default=8)
    parser.add_argument("--f", default="2", help="attacker counts, comma-separated (each needs 3f + 1 peers)")
    parser.add_argument("--attacks", default=",".join(attack_names()))
    parser.add_argument("--rules", default=",".join(RULES), help="robust rules, comma-separated")
    parser.add_argument(
        "--repeats", type=int, default=1, help="runs of the whole table, each with its own clean run"
    )
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--model-size", default="tiny")
    parser.add_argument("--timeout-s", type=float, default=600)
    parser.add_argument("--sync", default="every_step", choices=["every_step", "diloco"])
    parser.add_argument("--inner-steps", type=int, default=10, help="diloco: local steps per outer step")
    parser.add_argument(
        "--window-stretch", type=float, default=None,
        help="diloco: passed to swarm-sim (1: every window exactly --inner-steps, the same samples in every run)",
    )  # fmt: skip
    parser.add_argument("--compression", default="fp16", help="codec on the wire (int8 for the diloco table)")
    parser.add_argument(
        "--min-group-size", type=int, default=None,
        help="training.min_group_size of every run (default: swarm-sim's with f attackers, max(2f + 1, peers - f)); "
        "needed to rehearse fewer than 3f + 1 peers",
    )  # fmt: skip
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    rules = [r for r in args.rules.split(",") if r]
    unknown = sorted(set(rules) - set(RULES))
    if unknown or not rules:
        parser.error(f"--rules {args.rules!r}: known rules are {', '.join(RULES)}")
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: at least 1")
    base = ["--peers", str(args.peers), "--steps", str(args.steps), "--model-size", args.model_size,
            "--sync", args.sync, "--compression", args.compression]  # fmt: skip
    if args.sync == "diloco":
        base += ["--inner-steps", str(args.inner_steps)]
        if args.window_stretch is not None:
            base += ["--window-stretch", str(args.window_stretch)]
    # Repeat by repeat, the clean run first and then every cell: each repeat's cells are compared with its
    # own clean run, and the systems interleave (clean, attacks, clean, attacks) instead of running apart.
    cells: dict = {"clean": [], "runs": []}
    fs = [int(x) for x in args.f.split(",")]
    problems = [p for p in (floor_problem(args.peers, f, args.min_group_size) for f in fs) if p]
    if problems:
        parser.error(problems[0])
    # The clean run forms its groups under the attacked runs' floor (with several f, the lowest): a floor
    # below every peer lets groups form without a late honest peer, which then catches up instead of adding
    # its window, and the clean run must pay that as the attacked ones do.
    clean_flags = [
        *base,
        "--min-group-size",
        str(min(group_floor(args.peers, f, args.min_group_size) for f in fs)),
    ]
    for repeat in range(args.repeats):
        clean = run_sim(clean_flags, args.timeout_s)
        cells["clean"].append(clean)
        print(f"repeat {repeat}: clean {_loss(clean.get('final_val_loss'))} "
              f"(initial {_loss(clean.get('initial_val_loss'))})", flush=True)  # fmt: skip
        for f in fs:
            for attack in args.attacks.split(","):
                row = {"attack": attack, "f": f, "repeat": repeat}
                floor = group_floor(args.peers, f, args.min_group_size)
                for rule in rules:
                    report = run_sim([*base, "--byzantine", str(f), "--attack", attack, "--aggregator", rule,
                                      "--min-group-size", str(floor)],
                                     args.timeout_s)  # fmt: skip
                    attackers = [p for p in report.get("peers", []) if p.get("byzantine")]
                    row[rule] = {
                        "final_val_loss": report.get("final_val_loss"),
                        "banned": sum(1 for p in attackers if p.get("banned")),
                        "ban_steps": [
                            ban_step(p.get("ban_reason", "")) for p in attackers if p.get("banned")
                        ],
                        "min_group_size": floor,
                        "honest_agree": report.get("peers_agree"),
                        "honest_banned": sum(
                            1 for p in report.get("peers", []) if p.get("banned") and not p.get("byzantine")
                        ),
                        "duration_s": report.get("duration_s"),
                        "error": report.get("error", ""),
                    }
                cells["runs"].append(row)
                print(json.dumps(row), flush=True)
    print(table(cells, rules))
    if args.json:
        args.json.write_text(json.dumps(cells, indent=2))
    return 0


def group_floor(peers: int, f: int, given: int | None) -> int:
    """``training.min_group_size`` of the runs of a row with ``f`` attackers: ``given``, else swarm-sim's own
    floor with attackers, max(2f + 1, peers - f): every group holds an honest majority, and the honest
    peers alone still form one once sender checks ban the attackers."""
    return given if given is not None else max(2 * f + 1, peers - f)


def floor_problem(peers: int, f: int, given: int | None) -> str | None:
    """Why ``f`` attackers among ``peers`` cannot be rehearsed under the floor ``given`` (None: swarm-sim's),
    or None: with fewer than 3f + 1 peers a floor that keeps every group's honest majority (2f + 1) is
    more than the honest peers can form once the attackers are banned (the run stalls), and a lower one
    lets a group of attackers and one honest peer apply the attackers' update."""
    if given is not None or not f or peers >= 3 * f + 1:
        return None
    return (
        f"--peers {peers} with f = {f}: the honest peers ({peers - f}) cannot form a group of 2f + 1 = {2 * f + 1} "
        f"once sender checks ban the attackers, and a smaller group can hold an attacker majority; rehearse "
        f"{3 * f + 1} peers or more, or choose with --min-group-size"
    )


def ban_step(reason: str) -> str:
    """The step a ban's reason names (the round of the proven lie), or "-" for one that names none (a
    signed weight no loop signs)."""
    found = re.search(r"at step (\d+)", reason)
    return found.group(1) if found else "-"


def table(cells: dict, rules: list[str]) -> str:
    """A markdown row per (attack, f): each rule's loss and its gap to the clean run of the same repeat,
    repeats separated by ' / ', then the attackers banned, honest peers identical and honest peers banned."""
    cleans = [c.get("final_val_loss") for c in cells["clean"]]
    header = ["attack", "f", *(f"{r}" for r in rules), *(f"{r} vs clean" for r in rules), "clean",
              "attackers banned", "honest identical", "honest banned"]  # fmt: skip
    lines = [
        "| " + " | ".join(header) + " |",
        "| --- | ---: |" + " ---: |" * (2 * len(rules) + 1) + " --- | --- | --- |",
    ]
    keys = list(dict.fromkeys((row["attack"], row["f"]) for row in cells["runs"]))
    for attack, f in keys:
        rows = [row for row in cells["runs"] if (row["attack"], row["f"]) == (attack, f)]
        losses = [" / ".join(_loss(row[r]["final_val_loss"]) for row in rows) for r in rules]
        gaps = [
            " / ".join(_gap(row[r]["final_val_loss"], cleans[row["repeat"]]) for row in rows) for r in rules
        ]
        banned = " / ".join(
            f"{row[r]['banned']}/{f}" + (f" at {','.join(row[r]['ban_steps'])}" if row[r].get("ban_steps") else "")
            for row in rows for r in rules
        )  # fmt: skip
        agree = "yes" if all(row[r]["honest_agree"] for row in rows for r in rules) else "NO"
        honest_banned = sum(row[r]["honest_banned"] for row in rows for r in rules)
        lines.append(
            f"| `{attack}` | {f} | {' | '.join(losses)} | {' | '.join(gaps)} | "
            f"{' / '.join(_loss(c) for c in cleans)} | {banned} | {agree} | {honest_banned} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
