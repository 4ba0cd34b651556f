"""Rounds to a ban: how soon sender checks ban a peer whose contribution is provably wrong, at the run's rates.

Every cell is one real `swarm-sim` run (a coordinator and N peer processes on loopback, the tiny model) with
one attacker, at the run's default validation and sender-check rates (``TrainingConfig``'s
``verify_probability`` and ``sender_check_probability``; ``--verify-probability`` and
``--sender-check-probability`` set others, ``--sim-rates`` the sim's higher defaults), and at the run's
default batch sizes (``target_batch_size`` 256 in micro-batches of 8, so a peer of 4 computes about 8
micro-batches a step, as a volunteer of such a group would; ``--sim-batches``: the sim's 32 in
micro-batches of 4, 2 a peer and step, which leaves a member the budget for a fit in a fifth of the
rounds). Prints a markdown table with, per mode and attack: whether the attacker was banned, the step its
ban names (the round of the lie that was proven), the samples of the rounds the attacker itself applied
(its own count: 0 when it was in rounds whose outcome it never applied, as when it was banned at its
first) and the steps at which one group held every peer, the attacker included (from the peers' round
journals: 0 when the honest peers trained without it), the honest peers' replays (drawn and for standing out, with how many caught it), the fits to one of a sender's own micro-batches the honest reducers scored and the share of their
training time those took, the final validation loss and whether the honest peers ended identical. The attack `none` is a clean
run: its replays for standing out are what flags cost honest peers. Pass `--replay-outliers off` to
measure the draw alone (the run's `training.replay_outliers = false`).

Usage::

    python benchmarks/ban_table.py                                   # every_step and diloco, 6 attacks
    python benchmarks/ban_table.py --modes diloco --attacks none,sign_flip,label_flip --repeats 2 --json b.json
    python benchmarks/ban_table.py --replay-outliers both --repeats 2   # with and without, interleaved
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from byzantine_table import run_sim  # noqa: E402

from swarm.config import TrainingConfig  # noqa: E402

RUN_DEFAULTS = TrainingConfig()

PROVABLE = ("sign_flip", "label_flip", "huge_weight", "random_direction", "delayed_gradient", "nan")


def mode_flags(mode: str, steps: int, inner_steps: int) -> list[str]:
    if mode == "every_step":
        return ["--steps", str(steps)]
    return ["--sync", "diloco", "--inner-steps", str(inner_steps), "--compression", "int8",
            "--window-stretch", "1", "--steps", str(steps)]  # fmt: skip


def summary(report: dict) -> dict:
    """The row of one run's report."""
    if "error" in report:
        return {"error": report["error"][-200:]}
    peers = report.get("peers", [])
    attackers = [p for p in peers if p.get("byzantine")]
    honest = [p for p in peers if not p.get("byzantine")]
    reason = attackers[0].get("ban_reason", "") if attackers else ""
    step = re.search(r"at step (\d+)", reason)
    return {
        "banned": bool(attackers) and all(p.get("banned") for p in attackers),
        "ban_step": int(step.group(1)) if step else None,
        "ban_reason": reason[:200],
        "attacker_samples": sum(p.get("contributed_samples", 0.0) for p in attackers),
        # Steps whose largest applied group held every peer of the run, the attacker included (the peers'
        # round journals, ``lab.roundfigures``): 0 in a run the honest peers trained without it.
        "steps_with_all": sum(1 for r in report.get("per_step", []) if r.get("largest_group") == len(peers)),
        "replays": sum(p.get("senders_checked", 0.0) for p in honest),
        "outlier_replays": sum(p.get("senders_outliers", 0.0) for p in honest),
        "caught": sum(p.get("senders_caught", 0.0) for p in honest),
        # A replay costs about one sender's step (or window): replays per honest peer and step is the share
        # of an honest peer's compute that checks took.
        "replays_per_peer_step": sum(p.get("senders_checked", 0.0) for p in honest)
        / max(1, len(honest) * int(report.get("steps") or 1)),
        # Fit scores cost a micro-batch's gradient each: their time over the honest peers' training time.
        "fits_scored": sum(p.get("senders_fit_scored", 0.0) for p in honest),
        "fit_share": sum(p.get("sender_fit_s", 0.0) for p in honest)
        / max(1e-9, sum(p.get("compute_s", 0.0) for p in honest)),
        # Replays recompute a sender's whole step (or window): their time over the honest peers' training time.
        "replay_share": sum(p.get("sender_replay_s", 0.0) for p in honest)
        / max(1e-9, sum(p.get("compute_s", 0.0) for p in honest)),
        "honest_banned": sum(1 for p in honest if p.get("banned")),
        "final_val_loss": report.get("final_val_loss"),
        "honest_identical": len({p.get("param_hash") for p in honest}) == 1,
        "duration_s": report.get("duration_s"),
        "exit_code": report.get("exit_code"),
    }


def line(mode: str, attack: str, row: dict) -> str:
    if "error" in row:
        return f"| {mode} | `{attack}` | {row['replay_outliers']} | error: {row['error']!r} |||||||||||"
    step = "n/a" if row["ban_step"] is None else str(row["ban_step"])
    loss = "n/a" if row["final_val_loss"] is None else f"{row['final_val_loss']:.4f}"
    return (
        f"| {mode} | `{attack}` | {row['replay_outliers']} | {'yes' if row['banned'] else 'no'} | {step} | {row['attacker_samples']:.0f} | "
        f"{row['steps_with_all']} | "
        f"{row['replays']:.0f} ({row['outlier_replays']:.0f}) | {row['replays_per_peer_step']:.2f} "
        f"({100 * row['replay_share']:.1f}%) | {row['caught']:.0f} | {row['honest_banned']} | "
        f"{row['fits_scored']:.0f} ({100 * row['fit_share']:.1f}%) | {loss} | {'yes' if row['honest_identical'] else 'NO'} |"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--modes", default="every_step,diloco")
    parser.add_argument("--attacks", default=",".join(PROVABLE))
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8, help="steps (diloco: outer steps)")
    parser.add_argument("--inner-steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument(
        "--replay-outliers", choices=("on", "off", "both"), default="on",
        help="both: each cell with the outlier replays and then without, interleaved",
    )  # fmt: skip
    parser.add_argument("--verify-probability", type=float, default=RUN_DEFAULTS.verify_probability)
    parser.add_argument(
        "--sender-check-probability", type=float, default=RUN_DEFAULTS.sender_check_probability
    )
    parser.add_argument(
        "--sim-rates", action="store_true", help="the sim's default rates instead of the run's"
    )
    parser.add_argument(
        "--sim-batches", action="store_true",
        help="the sim's target and micro-batch sizes instead of the run's (fits are budgeted by micro-batches)",
    )  # fmt: skip
    parser.add_argument("--timeout-s", type=float, default=900.0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.peers < 4 or args.repeats < 1 or args.steps < 1:
        parser.error("--peers must be at least 4 (3 honest), --repeats and --steps at least 1")
    rows = []
    settings = ("on", "off") if args.replay_outliers == "both" else (args.replay_outliers,)
    print(
        "| mode | attack | outlier replays | banned | step of the lie | samples of rounds the attacker applied | steps with every peer in one group | honest "
        "replays (of them for standing out) | replays per honest peer and step (their share of honest compute) | caught | honest banned | "
        "fits scored (their share of honest compute) | final validation loss | honest identical |"
    )
    print("| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for _ in range(args.repeats):
        for mode in args.modes.split(","):
            for attack, setting in itertools.product(args.attacks.split(","), settings):
                attacker = [] if attack == "none" else ["--byzantine", "1", "--attack", attack]
                flags = [
                    "--peers", str(args.peers), "--model-size", "tiny", *attacker,
                    "--timeout-s", str(int(args.timeout_s)), *mode_flags(mode, args.steps, args.inner_steps),
                    *(["--no-replay-outliers"] if setting == "off" else []),
                    *([] if args.sim_rates else ["--verify-probability", str(args.verify_probability),
                                                 "--sender-check-probability", str(args.sender_check_probability)]),
                    *([] if args.sim_batches else ["--target-batch-size", str(RUN_DEFAULTS.target_batch_size),
                                                   "--micro-batch-size", str(RUN_DEFAULTS.micro_batch_size)]),
                ]  # fmt: skip
                row = {"mode": mode, "attack": attack, "replay_outliers": setting}
                row.update(summary(run_sim(flags, args.timeout_s + 120)))
                rows.append(row)
                print(line(mode, attack, row), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
