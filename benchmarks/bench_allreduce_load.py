"""The all-reduce on a busy machine: how much swarm's butterfly and hivemind's averager slow down, interleaved.

A volunteer's machine runs other work. This runs the same peers of both systems (``bench_allreduce.py``'s:
one spawned process per peer, one torch thread, loopback) through rounds on a quiet machine and with
``--loops-per-core`` busy loops per core running beside them, round by round in turn: every round index
runs each system quiet and busy, and the order of the four alternates from one index to the next, so that
a drift in the machine's state falls on both systems alike. The busy loops are paused (SIGSTOP) between the
busy rounds, not restarted.

Per round it records the all-reduce's wall time (as ``bench_allreduce.py`` times it: from the first peer
starting the all-reduce to the last holding the result), the whole round's, and the CPU seconds that every
peer process and its children (DHT, p2p daemon, hivemind's averager process) spent, read from /proc. It
prints each system's medians quiet and busy, its slowdown (busy over quiet; the spread over the round
indices), and ours over hivemind's slowdown, with the target: at most 1.0x.

Usage::

    python benchmarks/bench_allreduce_load.py                 # 4 peers, 4M values, fp16, 2 loops per core, 8 rounds
    python benchmarks/bench_allreduce_load.py --quick         # 2 peers, 256K values, 1 round index (smoke test)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench_allreduce import (
    PeerGroup,
    Settings,
    _descendants,
    machine,
    parse_size,
    round_flags,
    round_times,
    show_size,
)

SYSTEMS = ("ours", "hivemind")
CONDITIONS = ("quiet", "busy")
TARGET_SLOWDOWN_RATIO = 1.0
# A busy loop ends by itself after this long if nothing kills it (the benchmark always does).
LOOP_LIMIT_S = 3600.0


class BusyLoops:
    """``count`` processes that each spin one core, paused until ``on()``; ``close()`` kills them."""

    def __init__(self, count: int):
        spin = (
            f"import time\nend = time.monotonic() + {LOOP_LIMIT_S}\nwhile time.monotonic() < end:\n    pass\n"
        )
        self.processes = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(count)]
        self.off()

    def _signal(self, number: int) -> None:
        for process in self.processes:
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, number)

    def on(self) -> None:
        self._signal(signal.SIGCONT)

    def off(self) -> None:
        self._signal(signal.SIGSTOP)

    def close(self) -> None:
        self._signal(signal.SIGKILL)
        for process in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(5)


def cpu_seconds(pids: list[int]) -> float:
    """User and system CPU seconds of ``pids`` and all their descendants, from /proc (0 where not Linux)."""
    ticks, total = os.sysconf("SC_CLK_TCK"), 0
    for pid in {d for p in pids for d in (p, *_descendants(p))}:
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return total / ticks


@dataclass
class Series:
    """One system's rounds under one condition, in round-index order (``None``: the round failed)."""

    system: str
    condition: str
    allreduce_s: list[float | None] = field(default_factory=list)
    e2e_s: list[float | None] = field(default_factory=list)
    cpu_s: list[float | None] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def median(self, name: str) -> float | None:
        values = [v for v in getattr(self, name) if v is not None]
        return statistics.median(values) if values else None


def one_round(group: PeerGroup, peers: int, timeout_s: float) -> tuple[dict | None, float, str]:
    """Run a round on ``group``; its timings (None if it failed), the CPU seconds it cost, and any error."""
    pids = [p.pid for p in group.processes]
    cpu_before = cpu_seconds(pids)
    replies = group.ask(peers, "round", [{}] * peers, timeout_s)
    cpu = cpu_seconds(pids) - cpu_before
    if not all(r["ok"] and r["group"] == peers for r in replies):
        return None, cpu, next((r["error"] for r in replies if r.get("error")), "partial group")
    allreduce_s, e2e_s = round_times(replies)
    return {"allreduce_s": allreduce_s, "e2e_s": e2e_s}, cpu, ""


def order(index: int) -> list[tuple[str, str]]:
    """The four (system, condition) rounds of round index ``index``, each index the reverse of the last."""
    plan = [(s, c) for c in CONDITIONS for s in SYSTEMS]
    return plan if index % 2 == 0 else plan[::-1]


def measure(
    peers: int, numel: int, dtype: str, rounds: int, loops: int, settings: Settings
) -> tuple[dict[tuple[str, str], Series], list[float]]:
    """Every system's series under both conditions, and the 1-minute load average at each busy round."""
    from swarm.dht import SpawnedDHT

    series = {(s, c): Series(s, c) for s in SYSTEMS for c in CONDITIONS}
    busy_loads: list[float] = []
    round_timeout_s = settings.matchmaking_time_s + 2 * settings.averaging_timeout_s + 10
    bootstrap = SpawnedDHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    groups: dict[str, PeerGroup] = {}
    busy = BusyLoops(loops)
    try:
        maddrs = [str(m) for m in bootstrap.get_visible_maddrs()]
        for system in SYSTEMS:
            groups[system] = PeerGroup(system, peers, maddrs, settings)
            setup = [
                dict(rank=r, prefix=f"load_{system}", numel=numel, dtype=dtype, peers=peers)
                for r in range(peers)
            ]
            if errors := [
                r["error"] for r in groups[system].ask(peers, "setup", setup, 120) if r and not r.get("ok", 1)
            ]:
                raise RuntimeError(f"{system} peers did not set up: {errors[0]}")
        for system in SYSTEMS:  # a warmup round each: connections, first allocations
            one_round(groups[system], peers, round_timeout_s)
        for index in range(rounds):
            for system, condition in order(index):
                (busy.on if condition == "busy" else busy.off)()
                if condition == "busy":
                    time.sleep(0.5)  # the loops take the cores before the round starts
                    busy_loads.append(os.getloadavg()[0])
                timings, cpu, error = one_round(groups[system], peers, round_timeout_s)
                busy.off()
                cell = series[(system, condition)]
                cell.allreduce_s.append(timings and timings["allreduce_s"])
                cell.e2e_s.append(timings and timings["e2e_s"])
                cell.cpu_s.append(cpu if timings else None)
                if error:
                    cell.errors.append(error)
    finally:
        busy.close()
        for group in groups.values():
            group.close()
        bootstrap.shutdown()
    return series, busy_loads


def slowdowns(series: dict[tuple[str, str], Series], system: str, name: str) -> list[float | None]:
    """Busy over quiet per round index: None where either round of ``system`` at that index failed."""
    quiet, busy = getattr(series[(system, "quiet")], name), getattr(series[(system, "busy")], name)
    return [b / q if q and b else None for q, b in zip(quiet, busy, strict=True)]


def report(series: dict[tuple[str, str], Series]) -> tuple[list[str], dict]:
    lines, summary = [], {}
    header = f"{'system':>9} | {'quiet s':>8} {'busy s':>8} {'slowdown':>9} {'spread':>13} | {'e2e quiet':>9} {'e2e busy':>9} | {'CPU-s quiet':>11} {'CPU-s busy':>10}"
    lines += [header, "-" * len(header)]
    for system in SYSTEMS:
        quiet, busy = series[(system, "quiet")], series[(system, "busy")]
        per_round = slowdowns(series, system, "allreduce_s")
        q, b = quiet.median("allreduce_s"), busy.median("allreduce_s")
        slowdown = b / q if q and b else None
        summary[system] = {"quiet_s": q, "busy_s": b, "slowdown": slowdown, "per_round_slowdowns": per_round}
        done = [r for r in per_round if r is not None]
        spread = f"{min(done):.2f}-{max(done):.2f}x" if done else "n/a"

        def cell(value: float | None, width: int) -> str:
            return f"{value:>{width}.3f}" if value is not None else f"{'failed':>{width}}"

        lines.append(
            f"{system:>9} | {cell(q, 8)} {cell(b, 8)} {(f'{slowdown:.2f}x' if slowdown else 'n/a'):>9} {spread:>13} | "
            f"{cell(quiet.median('e2e_s'), 9)} {cell(busy.median('e2e_s'), 9)} | "
            f"{cell(quiet.median('cpu_s'), 11)} {cell(busy.median('cpu_s'), 10)}"
        )
        for condition in CONDITIONS:
            if errors := series[(system, condition)].errors:
                lines.append(f"note: {system} {condition}: {len(errors)} failed rounds; first: {errors[0]}")
    ours, hivemind = summary["ours"]["slowdown"], summary["hivemind"]["slowdown"]
    if ours and hivemind:
        pairs = [
            o / h
            for o, h in zip(
                summary["ours"]["per_round_slowdowns"],
                summary["hivemind"]["per_round_slowdowns"],
                strict=True,
            )
            if o is not None and h is not None
        ]
        met = "met" if ours / hivemind <= TARGET_SLOWDOWN_RATIO else "MISSED"
        spread = f" (per round index {min(pairs):.2f}-{max(pairs):.2f}x)" if pairs else ""
        lines.append(
            f"ours' slowdown over hivemind's: {ours / hivemind:.2f}x{spread}; target <= {TARGET_SLOWDOWN_RATIO:.1f}x: {met}"
        )
        summary["ratio"] = ours / hivemind
    return lines, summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, default=4, help="peers in the group")
    parser.add_argument("--size", default="4M", help="float32 values averaged (K, M = 2**10, 2**20)")
    parser.add_argument("--dtype", default="fp16", choices=("fp32", "fp16"), help="on the wire")
    parser.add_argument(
        "--rounds", type=int, default=8, help="round indices; each runs both systems quiet and busy"
    )
    parser.add_argument(
        "--loops-per-core", type=int, default=2, help="busy loops per core in the busy rounds"
    )
    round_flags(parser)
    parser.add_argument(
        "--quick", action="store_true", help="2 peers, 256K values, 1 round index: a smoke test"
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    if args.quick:
        args.peers, args.size, args.rounds, args.matchmaking_time_s = 2, "256K", 1, 1.0
    if args.peers < 2 or args.rounds < 1 or args.loops_per_core < 1:
        parser.error("--peers must be >= 2, --rounds and --loops-per-core >= 1")
    numel, loops = parse_size(args.size), args.loops_per_core * (os.cpu_count() or 1)
    settings = Settings(args.matchmaking_time_s, args.averaging_timeout_s)

    info = machine()
    print(
        f"machine: {info['cpu']}, {info['cores']} cores; torch {info['torch']}, hivemind {info['hivemind']}; "
        f"load {info['load_1min']}\n{args.peers} peers x {show_size(numel)} {args.dtype}, {args.rounds} round indices, "
        f"busy rounds beside {loops} busy loops; all-reduce seconds, medians",
        flush=True,
    )
    started = time.monotonic()
    series, busy_loads = measure(args.peers, numel, args.dtype, args.rounds, loops, settings)
    lines, summary = report(series)
    print("\n".join(lines))
    if busy_loads:
        print(f"1-minute load average at the busy rounds: {min(busy_loads):.1f}-{max(busy_loads):.1f}")
    print(f"total {time.monotonic() - started:.0f}s")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "machine": info,
                    "settings": asdict(settings),
                    "loops": loops,
                    "summary": summary,
                    "series": [asdict(s) for s in series.values()],
                },
                indent=2,
            )  # fmt: skip
        )
    return 0 if all(s.median("allreduce_s") for s in series.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
