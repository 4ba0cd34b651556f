"""Whole-swarm rehearsals too long for the test suite: each starts real `swarm-sim` processes on loopback
and checks what an organizer cares about, one line per check, exiting 1 when any check fails.

- ``demo_spike``: the README's demo (the demo model, 3 peers, 9 steps, its learning-rate schedule and
  ``centered_clip``). Checks: no evaluation more than 25% above the one before, the last within 2% of
  the lowest and below 3/4 of the first (a peak learning rate of 2e-3 once doubled the loss after warmup).
- ``pipeline_kill``: 2 stages x 2 replicas and 2 trainers for 14 steps; a replica of stage 1 is killed
  outright at step 3 and a replacement joins stage 0, so a stage-0 replica must move to stage 1. Checks:
  loss fell, no micro-batch lost, every micro-batch completed or still waiting, the killed replica gone
  and the replacement serving, at least one move, the replicas of each stage identical at step 14.
- ``label_flip``, ``huge_weight``: 4 peers of the tiny model, one attacker, 6 steps, every part checked and
  a sender recomputed at each check. Checks: loss fell, the honest peers identical, none of them banned,
  and the attacker, if it contributed, banned for what its evidence proves (a contribution other than its
  public batch seeds give; a weight over the target batch).
- ``nan``: the same swarm at the sim's default checking rates, the attacker sending non-finite values,
  which reducers drop (nothing to prove). Checks: loss fell, the honest peers identical, none banned
  (with 3 peers and a group minimum of 3 it once stalled the swarm).
- ``pipeline_attacks``: all five pipeline attacks at once (a poisoning and a throughput-lying replica of
  stage 1, a replica of stage 0 forging retries, a trainer holding a micro-batch in flight forever, one
  front-running an honest trainer), every micro-batch checked at a second replica. Checks: loss fell,
  nothing lost, the poisoner banned and no honest peer, the honest replicas of each stage identical.

The test suite proves each point more cheaply: the demo's command at a tiny size in CI (``.ci/run``) and
a tiny swarm whose loss falls through churn (``tests/test_sim.py``), the other contribution attacks in whole
runs and the evidence of each of these two in-process (``tests/test_byzantine.py``,
``tests/test_sendercheck.py``), non-finite inputs refused by every codec and left out by every robust rule
(``tests/test_compression.py``, ``tests/test_aggregators.py``), a kill under load with nothing lost
(``tests/test_benchmarks.py``, ``bench_pipeline.py``), moves back and forth while trainers train
(``tests/test_pipeline_moves.py``), each pipeline attack alone (``tests/test_pipeline_attacks.py``).

Usage::

    python benchmarks/rehearsals.py                          # every rehearsal, about 6 minutes on 2 cores
    python benchmarks/rehearsals.py --only pipeline_attacks --json r.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from byzantine_table import run_sim  # noqa: E402
from pipeline_table import ROWS as PIPELINE_ATTACKS  # noqa: E402

Check = tuple[bool, str]


def _fell(report: dict) -> Check:
    first, last = report.get("initial_val_loss"), report.get("final_val_loss")
    if first is None or last is None:
        return False, f"validation loss fell: no loss reported ({first} -> {last})"
    return last < first, f"validation loss fell: {first:.4f} -> {last:.4f}"


def _stage_replicas(report: dict, *, honest_only: bool) -> dict[int, list[dict]]:
    return {
        s["stage"]: [r for r in s["replicas"] if not (honest_only and r.get("byzantine"))]
        for s in report.get("stages", [])
    }


def _identical(report: dict, steps: int, *, honest_only: bool) -> Check:
    stages = _stage_replicas(report, honest_only=honest_only)
    ok = bool(stages) and all(
        rs and len({r["param_hash"] for r in rs}) == 1 and all(r["step"] == steps for r in rs)
        for rs in stages.values()
    )
    counts = {stage: len(rs) for stage, rs in stages.items()}
    return ok, f"replicas of each stage identical at step {steps} (replicas per stage: {counts})"


def check_pipeline_kill(report: dict, steps: int) -> list[Check]:
    trainers = report.get("trainers", [])
    completed = sum(t["microbatches_completed"] for t in trainers)
    waiting = sum(t["microbatches_waiting"] for t in trainers)
    issued = sum(t["microbatches_issued"] for t in trainers)
    killed = report.get("killed") or [{}]
    replaced = report.get("replaced") or [{}]
    survivors = _stage_replicas(report, honest_only=False)
    names = {r["name"] for rs in survivors.values() for r in rs}
    moves = sum(report.get("moves", {}).values())
    return [
        _fell(report),
        (report.get("lost_microbatches") == 0, f"micro-batches lost: {report.get('lost_microbatches')}"),
        (completed + waiting == issued, f"completed {completed} + waiting {waiting} of {issued} issued"),
        (
            killed[0].get("stage") == 1 and replaced[0].get("stage") == 0,
            f"killed {killed}, replaced {replaced}",
        ),
        (
            killed[0].get("name") not in names and replaced[0].get("name") in names,
            "the killed replica is gone and the replacement serves",
        ),
        (moves >= 1, f"replicas moved {moves} times (one must, three against one)"),
        (
            any(r["name"].startswith("stage0-") for r in survivors.get(1, [])),
            "a stage-0 replica serves stage 1",
        ),
        _identical(report, steps, honest_only=False),
    ]


def check_demo_spike(report: dict, steps: int) -> list[Check]:
    """The README's demo (default model, learning-rate schedule and centered_clip) learns without a spike:
    no evaluation more than 25% above the one before, and the last within 2% of the lowest and below 3/4
    of the first. With three honest peers centered_clip discounts the one whose gradient is largest, so an
    evaluation right after warmup may sit above the one before (up to +11% in real runs, once +18%, back
    down two steps on); a peak learning rate of 2e-3 instead doubled the loss right after warmup."""
    history = report.get("val_history") or []
    rises = [later / earlier for earlier, later in zip(history, history[1:], strict=False) if earlier > 0]
    shown = ", ".join(f"{v:.3f}" for v in history)
    return [
        (len(history) >= 4, f"{len(history)} evaluations ({shown})"),
        (
            all(r < 1.25 for r in rises),
            f"no evaluation 25% above the one before (largest ratio {max(rises, default=0):.3f})",
        ),
        (
            bool(history) and history[-1] <= 1.02 * min(history) and history[-1] < 0.75 * history[0],
            "the last evaluation within 2% of the lowest and below 3/4 of the first",
        ),
    ]


def check_honest(report: dict, steps: int) -> list[Check]:
    """An every-step run with an attacker: loss fell, the honest peers identical, none of them banned."""
    honest = [p for p in report.get("peers", []) if not p.get("byzantine")]
    hashes = {p.get("param_hash") for p in honest}
    return [
        _fell(report),
        (len(honest) >= 2 and hashes == {report.get("final_param_hash")}, "the honest peers identical"),
        (not any(p.get("banned") for p in honest), "no honest peer banned"),
    ]


def check_provable(reason: str) -> Callable[[dict, int], list[Check]]:
    """``check_honest``, and the attacker, whose lie is provable, banned with ``reason`` if it contributed."""

    def check(report: dict, steps: int) -> list[Check]:
        attacker = next((p for p in report.get("peers", []) if p.get("byzantine")), {})
        contributed = attacker.get("banned") or attacker.get("contributed_samples", 0) > 0
        return [
            *check_honest(report, steps),
            (
                not contributed or (attacker.get("banned") and reason in attacker.get("ban_reason", "")),
                f"the attacker banned for {reason!r} (banned: {attacker.get('banned')}, "
                f"{attacker.get('ban_reason', '')!r})",
            ),
        ]

    return check


def _byzantine(attack: str, *, checked: bool = True) -> list[str]:
    rates = ["--verify-probability", "1.0", "--sender-check-probability", "1.0"] if checked else []
    return ["--peers", "4", "--model-size", "tiny", "--byzantine", "1", "--attack", attack, *rates]


def check_pipeline_attacks(report: dict, steps: int) -> list[Check]:
    byzantine, banned = report.get("byzantine", []), report.get("banned", [])
    honest_trainer = next((t for t in report.get("trainers", []) if t["name"] == "trainer2"), {})
    return [
        _fell(report),
        (report.get("lost_microbatches") == 0, f"micro-batches lost: {report.get('lost_microbatches')}"),
        ("stage1-0" in banned, f"the poisoning replica banned (banned: {banned})"),
        (set(banned) <= set(byzantine), "no honest peer banned"),
        (honest_trainer.get("microbatches_completed", 0) > 0, "the honest trainer completed micro-batches"),
        _identical(report, steps, honest_only=True),
    ]


REHEARSALS: dict[str, tuple[list[str], int, Callable[[dict, int], list[Check]]]] = {
    # The demo model at 9 steps, evaluated every 2 (5.34, 4.35, 4.62, 4.18, 3.67, 3.60 in one run, 91 s).
    "demo_spike": (["--peers", "3"], 9, check_demo_spike),
    "label_flip": (_byzantine("label_flip"), 6, check_provable("recomputed from its public batch seeds")),
    "huge_weight": (
        _byzantine("huge_weight"),
        6,
        check_provable("a peer stops computing at the target batch"),
    ),
    # Unprovable (reducers drop non-finite inputs): the swarm must go on without it at the sim's rates.
    "nan": (_byzantine("nan", checked=False), 6, check_honest),
    "pipeline_kill": (
        [
            "--stages",
            "2",
            "--peers-per-stage",
            "2",
            "--trainers",
            "2",
            "--kill-stage-peer-at",
            "3",
            "--replace-into-stage",
            "0",
            "--model-size",
            "tiny",
        ],
        14,
        check_pipeline_kill,
    ),
    "pipeline_attacks": (
        [
            "--stages",
            "2",
            "--peers-per-stage",
            "3",
            "--trainers",
            "3",
            "--model-size",
            "tiny",
            "--byzantine",
            "1",
            "--stage-verify-probability",
            "1.0",
        ]
        + ["--attack", ",".join(PIPELINE_ATTACKS)],
        3,
        check_pipeline_attacks,
    ),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", default=",".join(REHEARSALS), help="rehearsals to run, comma-separated")
    parser.add_argument("--timeout-s", type=float, default=400, help="a stall bound for each swarm-sim run")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    names = args.only.split(",")
    unknown = [n for n in names if n not in REHEARSALS]
    if unknown:
        parser.error(f"unknown rehearsal {unknown[0]!r}; known: {', '.join(REHEARSALS)}")
    results, failed = {}, 0
    for name in names:
        flags, steps, check = REHEARSALS[name]
        started = time.monotonic()
        report = run_sim(
            [*flags, "--steps", str(steps), "--timeout-s", str(args.timeout_s)], args.timeout_s + 200
        )
        took = time.monotonic() - started
        checks = (
            [(False, f"swarm-sim gave no report: {report['error']}")]
            if "error" in report
            else [
                (report.get("exit_code") == 0, f"swarm-sim exited {report.get('exit_code')}"),
                *check(report, steps),
            ]
        )
        print(f"{name} ({took:.0f} s):")
        for ok, what in checks:
            print(f"  {'ok  ' if ok else 'FAIL'} {what}")
        failed += sum(not ok for ok, _ in checks)
        results[name] = {
            "seconds": round(took, 1),
            "checks": [{"ok": ok, "what": what} for ok, what in checks],
        }
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))
    print(f"{failed} check(s) failed" if failed else "every check passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
