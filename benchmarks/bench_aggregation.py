"""What robust aggregation costs: ``centered_clip`` (and the other rules) against ``mean``.

Two measurements, each printing ratios to ``mean`` on the same input:

1. **The aggregation step** alone, in this process with one torch thread (as a peer runs it): one
   2**18-value chunk, and a whole vector (16M values by default) cut into such chunks, which is what the
   reducers of a round aggregate between them. The contributions are a common gradient plus per-peer
   noise, rounded through fp16 as they come off the wire. ``centered_clip`` is timed twice: on honest
   contributions (it stops early) and with the most attackers a group tolerates sending sign-flipped,
   scaled gradients (it runs every iteration): its worst case.
2. **A whole all-reduce round** among peer processes on loopback (the peers and helpers of
   ``bench_allreduce.py``: a ``SpawnedDHT`` and an ``Averager`` per process), the same group running
   ``mean`` and ``centered_clip`` rounds alternately, so that both see the same machine load. The time is
   the all-reduce alone, from the first peer starting it to the last peer holding the result.
   Target: ``centered_clip`` within 1.5x of ``mean``.

Usage::

    python benchmarks/bench_aggregation.py                         # 4 and 8 peers; round: 4 peers x 16M fp16
    python benchmarks/bench_aggregation.py --quick                 # small sizes, 3-peer round (smoke test)
    python benchmarks/bench_aggregation.py --round-peers 4,8 --round-size 16M --json agg.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection

os.environ.setdefault("HIVEMIND_LOGLEVEL", "WARNING")
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

from bench_allreduce import (  # noqa: E402 - the environment above must be set before hivemind loads
    SHUTDOWN_TIMEOUT_S,
    START_TIMEOUT_S,
    Cell,
    OursPeer,
    PeerGroup,
    Settings,
    _call_async,
    _round_cells,
    _start_dht,
    machine,
    parse_size,
    show_size,
)

CHUNK = 1 << 18
RULES = ("mean", "centered_clip", "trimmed_mean", "coordinate_median")
ROUND_RULES = ("mean", "centered_clip")
TARGET_ROUND_RATIO = 1.5


# --- 1. the aggregation step ---------------------------------------------------------------------------


@dataclass
class StepResult:
    peers: int
    numel: int
    case: str  # "chunk" or "vector"
    seconds: dict[str, float] = field(default_factory=dict)


def _contributions(peers: int, numel: int, seed: int, attackers: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    common = torch.randn(numel, generator=g)
    x = common + torch.randn(peers, numel, generator=g)
    if attackers:
        x[:attackers] *= -10.0
    return x.half()  # fp16 as on the wire; widened to float32 chunk by chunk, untimed


def _time(fn, repeats: int) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def measure_step(peers: int, numel: int, repeats: int) -> list[StepResult]:
    import torch

    from swarm.averaging.aggregators import get_aggregator

    weights = torch.ones(peers, dtype=torch.float64)
    attackers = (peers - 1) // 2
    cases = {rule: (get_aggregator(rule), 0) for rule in RULES}
    # The default's median projection (5 senders or more) against the clipped center alone, attacked too.
    clipped = get_aggregator("centered_clip", {"magnitude": "clipped"})
    cases["centered_clip, clipped"] = (clipped, 0)
    cases["centered_clip, attacked"] = (cases["centered_clip"][0], attackers)
    cases["centered_clip, clipped, attacked"] = (clipped, attackers)
    chunk, vector = StepResult(peers, CHUNK, "chunk"), StepResult(peers, numel, "vector")
    for label, (rule, bad) in cases.items():
        data = _contributions(peers, numel, seed=peers, attackers=bad)
        first = data[:, :CHUNK].float()
        chunk.seconds[label] = _time(lambda r=rule, c=first: r(c, weights, seed=0), repeats)
        total = 0.0
        for lo in range(0, numel, CHUNK):
            part = data[:, lo : lo + CHUNK].float()
            started = time.perf_counter()
            rule(part, weights, seed=lo)
            total += time.perf_counter() - started
        vector.seconds[label] = total
    return [chunk, vector]


def step_report(results: list[StepResult]) -> list[str]:
    labels = list(results[0].seconds)
    header = f"{'peers':>5} {'values':>12} |" + "".join(f" {label:>23}" for label in labels)
    lines = [header, "-" * len(header)]
    for r in results:
        what = f"{show_size(r.numel)} {'chunk' if r.case == 'chunk' else 'in chunks'}"
        mean = r.seconds["mean"]
        cells = "".join(
            f" {r.seconds[label] * 1e3:>9.2f} ms" + (f" {r.seconds[label] / mean:>7.1f}x" if label != "mean" else " " * 8)
            for label in labels
        )  # fmt: skip
        lines.append(f"{r.peers:>5} {what:>12} |{cells}")
    return lines


# --- 2. a whole round ----------------------------------------------------------------------------------


class RulePeer(OursPeer):
    """A benchmark peer of ``bench_allreduce.py`` whose every round names the rule its reducer applies."""

    async def round(self, aggregator: str = "mean") -> dict:
        from swarm.averaging.aggregators import get_aggregator

        self.averager.aggregator = get_aggregator(aggregator)
        return await super().round()


async def _serve_rule_peer(conn: Connection, initial_peers: list[str], settings: Settings) -> None:
    dht = _start_dht(conn, initial_peers)
    peer = RulePeer(dht, settings)
    try:
        while (message := await asyncio.to_thread(conn.recv))[0] != "exit":
            conn.send(("done", await _call_async(peer, *message)))
    finally:
        dht.shutdown()


def rule_peer_main(rank: int, conn: Connection, initial_peers: list[str], settings: Settings) -> None:
    import torch

    from swarm.runtime import run

    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    run(_serve_rule_peer(conn, initial_peers, settings))


class RulePeerGroup(PeerGroup):
    def _start(self, system: str, rank: int, initial_peers: list[str], settings: Settings) -> Connection:
        parent, child = self.context.Pipe()
        process = self.context.Process(target=rule_peer_main, args=(rank, child, initial_peers, settings))
        process.start()
        self.processes.append(process)
        self.conns.append(parent)
        return parent


def measure_rounds(
    peers: int, numel: int, repeats: int, initial_peers: list[str], settings: Settings
) -> list[Cell]:
    """Rounds of every rule in ``ROUND_RULES`` in turn, in one group of ``peers`` processes."""
    cells = {rule: Cell(rule, peers, numel, "fp16") for rule in ROUND_RULES}
    round_timeout_s = settings.matchmaking_time_s + 2 * settings.averaging_timeout_s + 10
    try:
        group = RulePeerGroup("ours", peers, initial_peers, settings)
    except Exception as e:
        for cell in cells.values():
            cell.error = f"peers did not start: {e!r}"
        return list(cells.values())
    try:
        setup = [dict(rank=r, prefix=f"aggbench_{peers}_{numel}", numel=numel, dtype="fp16", peers=peers) for r in range(peers)]  # fmt: skip
        replies = group.ask(peers, "setup", setup, START_TIMEOUT_S)
        if failed := [r["error"] for r in replies if r and not r.get("ok", True)]:
            raise RuntimeError(failed[0])
        # One warmup round of each rule, then `repeats` measured rounds of each, alternating.
        for index in range(repeats + 1):
            for rule, cell in cells.items():
                for _attempt in range(3):  # a round whose group was not all peers is retried, twice at most
                    replies = group.ask(peers, "round", [{"aggregator": rule}] * peers, round_timeout_s)
                    if all(r["ok"] and r["group"] == peers for r in replies):
                        if index:
                            _round_cells(cell, replies)
                        break
                    cell.failed_rounds += 1
                    cell.error = next((r["error"] for r in replies if r.get("error")), "partial group")
        for cell in cells.values():
            if cell.allreduce_s:
                cell.error = ""
        group.ask(peers, "teardown", [{}] * peers, SHUTDOWN_TIMEOUT_S)
    except Exception as e:
        for cell in cells.values():
            cell.error = cell.error or f"aborted: {e!r}"
    finally:
        group.close()
    return list(cells.values())


def round_report(cells: list[Cell]) -> list[str]:
    lines = [f"{'peers':>5} {'values':>6} | {'mean s':>8} {'centered_clip s':>16} | {'ratio':>6}", "-" * 50]
    by_key: dict[tuple[int, int], dict[str, Cell]] = {}
    for cell in cells:
        by_key.setdefault((cell.peers, cell.numel), {})[cell.system] = cell
    for (peers, numel), rules in sorted(by_key.items()):
        mean, clip = rules["mean"].median_s, rules["centered_clip"].median_s
        if mean is None or clip is None:
            lines.append(f"{peers:>5} {show_size(numel):>6} | failed")
            continue
        ratio = clip / mean
        verdict = "met" if ratio <= TARGET_ROUND_RATIO else "MISSED"
        lines.append(
            f"{peers:>5} {show_size(numel):>6} | {mean:>8.3f} {clip:>16.3f} | {ratio:>5.2f}x"
            f"  (target <= {TARGET_ROUND_RATIO}x: {verdict}; rounds {len(rules['mean'].allreduce_s)} each)"
        )
    for cell in cells:
        if cell.error or cell.failed_rounds:
            lines.append(
                f"note: {cell.system} {cell.peers} peers: {cell.failed_rounds} failed rounds; {cell.error}"
            )
    return lines


# --- main ----------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", default="4,8", help="group sizes for the aggregation step")
    parser.add_argument(
        "--size", default="16M", help="whole vector of the step measurement (K, M = 2**10, 2**20)"
    )
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per chunk measurement")
    parser.add_argument("--round-peers", default="4", help="group sizes of the round measurement; 0: skip")
    parser.add_argument("--round-size", default="16M", help="values averaged in a round (fp16 on the wire)")
    parser.add_argument(
        "--round-repeats", type=int, default=5, help="measured rounds per rule, after 1 warmup"
    )
    parser.add_argument("--matchmaking-time-s", type=float, default=1.0, help="matchmaking window of a round")
    parser.add_argument("--averaging-timeout-s", type=float, default=60.0, help="bound on one all-reduce")
    parser.add_argument("--quick", action="store_true", help="small sizes and a 3-peer round: a smoke test")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    if args.quick:
        args.peers, args.size, args.repeats = "4", "1M", 3
        args.round_peers, args.round_size, args.round_repeats = "3", "1M", 1
    step_peers = [int(p) for p in args.peers.split(",")]
    round_peers = [int(p) for p in args.round_peers.split(",") if int(p) > 0]
    if (
        any(p < 1 for p in step_peers)
        or any(p < 2 for p in round_peers)
        or min(args.repeats, args.round_repeats) < 1
    ):
        parser.error("--peers values must be >= 1, --round-peers values >= 2 (or 0), repeats >= 1")

    import torch

    torch.set_num_threads(1)
    info = machine()
    print(
        f"machine: {info['cpu']}, {info['cores']} cores, {info['memory_gib']} GiB; python {info['python']}, "
        f"torch {info['torch']}, hivemind {info['hivemind']}; load {info['load_1min']}",
        flush=True,
    )
    started = time.monotonic()
    steps = [r for peers in step_peers for r in measure_step(peers, parse_size(args.size), args.repeats)]
    print(
        f"\naggregation step, one thread (median of {args.repeats} calls per chunk; vector: sum over its chunks)"
    )
    print("\n".join(step_report(steps)), flush=True)

    cells: list[Cell] = []
    if round_peers:
        from swarm.dht import SpawnedDHT

        settings = Settings(args.matchmaking_time_s, args.averaging_timeout_s)
        bootstrap = SpawnedDHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        try:
            maddrs = [str(m) for m in bootstrap.get_visible_maddrs()]
            for peers in round_peers:
                cells += measure_rounds(
                    peers, parse_size(args.round_size), args.round_repeats, maddrs, settings
                )
        finally:
            bootstrap.shutdown()
        print(
            f"\nall-reduce round, one process per peer, fp16 on the wire, median of {args.round_repeats} rounds "
            "per rule after 1 warmup, rules alternating"
        )
        print("\n".join(round_report(cells)))
    print(f"\ntotal {time.monotonic() - started:.0f}s; 1-minute load average now {os.getloadavg()[0]:.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "machine": info,
                    "steps": [asdict(s) for s in steps],
                    "rounds": [{**asdict(c), "median_s": c.median_s} for c in cells],
                },
                f,
                indent=2,
            )
    return 0 if all(c.allreduce_s for c in cells) else 1


if __name__ == "__main__":
    sys.exit(main())
