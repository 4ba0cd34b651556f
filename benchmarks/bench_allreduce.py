"""Seconds per all-reduce round: swarm's butterfly vs hivemind's averager vs torch.distributed gloo.

Every peer is its own process (spawned, ``torch.set_num_threads(1)``), all on loopback:

- ``ours``: ``swarm.averaging.Averager.average`` on a ``SpawnedDHT`` per peer, part streams over the
  direct TCP data path (what dialable volunteers use);
- ``ours-p2p`` (only when named in ``--systems``): the same with part streams over libp2p, the path of
  peers that cannot be dialed directly;
- ``hivemind``: ``hivemind.averaging.DecentralizedAverager.step`` on a DHT per peer (hivemind runs the
  averager in a further child process of each peer, as it always does);
- ``gloo``: ``torch.distributed.all_reduce`` (sum, then divide: the mean) in a gloo process group.

A round of ours and of hivemind's starts with matchmaking, which lasts about ``--matchmaking-time-s`` by
design. The time reported is the all-reduce alone: from the first peer starting the all-reduce (after its
group was formed) to the last peer holding the result, timed inside each peer on the shared wall clock.
The whole round, matchmaking included, is in the ``e2e`` columns and the JSON. Gloo is timed the same way
from a barrier. Each cell is the median of ``--repeats`` rounds after one warmup round.

Usage::

    python benchmarks/bench_allreduce.py                    # 2 and 4 peers, 1M and 16M values, fp32 and fp16
    python benchmarks/bench_allreduce.py --quick            # 2 peers, 1M values, fp16, one round (smoke test)
    python benchmarks/bench_allreduce.py --peers 4 --sizes 16M --dtypes fp16 --json results.json

``1M`` is 2**20 values. fp16 means fp16 on the wire: ours and hivemind's average fp32 tensors and send
them as fp16; gloo reduces fp16 tensors.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import logging
import multiprocessing as mp
import os
import platform
import signal
import socket
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path

os.environ.setdefault("HIVEMIND_LOGLEVEL", "WARNING")
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

SYSTEMS = ("ours", "ours-p2p", "hivemind", "gloo")
DEFAULT_SYSTEMS = ("ours", "hivemind", "gloo")
DTYPES = ("fp32", "fp16")
TARGET = {"peers": 4, "numel": 16 << 20, "dtype": "fp16", "vs_hivemind": 1.0, "vs_gloo": 3.0}
START_TIMEOUT_S = 120.0
SHUTDOWN_TIMEOUT_S = 15.0


@dataclass(frozen=True)
class Settings:
    """What every worker needs to know; picklable, so it crosses the spawn boundary."""

    matchmaking_time_s: float
    averaging_timeout_s: float


@dataclass
class Cell:
    """One (system, peers, size, dtype) configuration and its measured rounds."""

    system: str
    peers: int
    numel: int
    dtype: str
    allreduce_s: list[float] = field(default_factory=list)
    e2e_s: list[float] = field(default_factory=list)
    bytes_sent_per_peer: int = 0
    failed_rounds: int = 0
    error: str = ""

    @property
    def median_s(self) -> float | None:
        return statistics.median(self.allreduce_s) if self.allreduce_s else None

    @property
    def median_e2e_s(self) -> float | None:
        return statistics.median(self.e2e_s) if self.e2e_s else None


# --- peers of ours and of hivemind: one process each, driven round by round over a pipe -----------------


def _seeded_vector(rank: int, numel: int):
    import torch

    return torch.randn(numel, generator=torch.Generator().manual_seed(rank))


class OursPeer:
    """A peer averaging through ``swarm.averaging.Averager``; the runner subclass times the all-reduce."""

    def __init__(self, dht, settings: Settings, key=None):
        from swarm.averaging.allreduce import ButterflyAllReduce

        timings: dict[bytes, tuple[float, float]] = {}

        class TimedAllReduce(ButterflyAllReduce):
            async def run(self):
                started = time.time()
                try:
                    return await super().run()
                finally:
                    timings[self.group_id] = (started, time.time())

        self.dht, self.settings, self.timings, self.runner_type = dht, settings, timings, TimedAllReduce
        self.key = key
        self.averager = self.vector = None

    async def setup(self, rank: int, prefix: str, numel: int, dtype: str, peers: int) -> None:
        import torch

        from swarm.averaging.averager import Averager

        self.vector = _seeded_vector(rank, numel)
        self.out = torch.empty(numel)  # reused every round, as the trainer does
        self.averager = Averager(
            self.dht,
            prefix=prefix,
            numel=numel,
            compression="fp16" if dtype == "fp16" else "none",
            max_group_size=peers,
            matchmaking_time_s=self.settings.matchmaking_time_s,
            sender_timeout_s=self.settings.averaging_timeout_s,
            averaging_timeout_s=self.settings.averaging_timeout_s,
            runner_type=self.runner_type,
            signing_key=self.key,
        )
        await self.averager.start()

    async def round(self) -> dict:
        round_start = time.time()
        outcome = await self.averager.average(self.vector, weight=1.0, out=self.out)
        round_end = time.time()
        if outcome is None:
            return {"ok": False, "error": "no group formed"}
        group, result = outcome
        start, end = self.timings.pop(group.group_id)
        return {
            "ok": result.complete, "group": len(group.peer_ids), "start": start, "end": end,
            "round_start": round_start, "round_end": round_end, "bytes_sent": result.bytes_sent,
            "error": "" if result.complete else f"incomplete: {result.dropped}",
        }  # fmt: skip

    async def teardown(self) -> None:
        await self.averager.shutdown()
        self.averager = None


class HivemindPeer:
    """A peer averaging through hivemind's own ``DecentralizedAverager.step`` (synchronous, like its users)."""

    def __init__(self, dht, settings: Settings):
        self.dht, self.settings = dht, settings
        self.averager = None

    def setup(self, rank: int, prefix: str, numel: int, dtype: str, peers: int) -> None:
        from hivemind.averaging import DecentralizedAverager
        from hivemind.compression import Float16Compression, NoCompression

        class TimedAverager(DecentralizedAverager):
            async def _aggregate_with_group(self, group_info, *args, **kwargs):
                started = time.time()
                try:
                    return await super()._aggregate_with_group(group_info, *args, **kwargs)
                finally:
                    self.timing[:] = [started, time.time(), float(len(group_info.peer_ids))]

        self.averager = TimedAverager(
            [_seeded_vector(rank, numel)],
            self.dht,
            start=False,
            prefix=prefix,
            target_group_size=peers,
            min_group_size=peers,
            min_matchmaking_time=self.settings.matchmaking_time_s,
            request_timeout=max(0.5, self.settings.matchmaking_time_s / 2),
            allreduce_timeout=self.settings.averaging_timeout_s,
            compression=Float16Compression() if dtype == "fp16" else NoCompression(),
        )
        # Shared with the averager's own process, which hivemind forks from this one.
        self.averager.timing = mp.get_context("fork").Array("d", 3, lock=False)
        self.averager.run_in_background(await_ready=True, timeout=START_TIMEOUT_S)

    def round(self) -> dict:
        self.averager.timing[:] = [0.0, 0.0, 0.0]
        round_start = time.time()
        try:
            self.averager.step(timeout=self.settings.averaging_timeout_s, allow_retries=False)
        except Exception as e:
            return {"ok": False, "error": repr(e)}
        round_end = time.time()
        start, end, group = self.averager.timing[:]
        return {
            "ok": end > 0, "group": int(group), "start": start, "end": end,
            "round_start": round_start, "round_end": round_end, "bytes_sent": 0, "error": "",
        }  # fmt: skip

    def teardown(self) -> None:
        self.averager.shutdown()
        self.averager = None


def _start_dht(conn: Connection, initial_peers: list[str], identity_path: str | None = None):
    from swarm.dht import SpawnedDHT

    identity = {"identity_path": identity_path, "check_if_identity_free": False} if identity_path else {}
    dht = SpawnedDHT(
        start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=initial_peers, **identity
    )
    conn.send(("ready", [str(m) for m in dht.get_visible_maddrs()]))
    return dht


def _call(peer, command: str, payload: dict | None):
    try:
        return getattr(peer, command)(**(payload or {}))
    except Exception as e:
        return {"ok": False, "error": f"{command} failed: {e!r}"}


async def _call_async(peer, command: str, payload: dict | None):
    try:
        return await getattr(peer, command)(**(payload or {}))
    except Exception as e:
        return {"ok": False, "error": f"{command} failed: {e!r}"}


async def _serve_ours(conn: Connection, initial_peers: list[str], settings: Settings, tcp: bool) -> None:
    import tempfile

    from swarm.identity import create_identity

    # The averager's handlers run in this loop, so it keeps running while we wait for the next command.
    with tempfile.TemporaryDirectory(prefix="swarm-bench-") as home:
        # The data path needs the peer's signing key, which is also its DHT identity (as for a volunteer).
        key = create_identity(Path(home) / "peer.key") if tcp else None
        dht = _start_dht(conn, initial_peers, str(Path(home) / "peer.key") if tcp else None)
        peer = OursPeer(dht, settings, key)
        try:
            while (message := await asyncio.to_thread(conn.recv))[0] != "exit":
                conn.send(("done", await _call_async(peer, *message)))
        finally:
            dht.shutdown()


def _serve_hivemind(conn: Connection, initial_peers: list[str], settings: Settings) -> None:
    # hivemind forks its averager process; outside a bench it is usually started from a forking parent too.
    mp.set_start_method("fork", force=True)
    dht = _start_dht(conn, initial_peers)
    peer = HivemindPeer(dht, settings)
    try:
        while (message := conn.recv())[0] != "exit":
            conn.send(("done", _call(peer, *message)))
    finally:
        dht.shutdown()


def peer_main(system: str, rank: int, conn: Connection, initial_peers: list[str], settings: Settings) -> None:
    import torch

    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    if system in ("ours", "ours-p2p"):
        from swarm.runtime import run

        run(_serve_ours(conn, initial_peers, settings, tcp=system == "ours"))
    else:
        _serve_hivemind(conn, initial_peers, settings)


def _descendants(pid: int) -> list[int]:
    """Child processes of ``pid``, recursively (Linux /proc; elsewhere none are found)."""
    children = []
    for path in Path(f"/proc/{pid}/task").glob("*/children"):
        with contextlib.suppress(OSError, ValueError):
            children += [int(c) for c in path.read_text().split()]
    return [d for c in children for d in (*_descendants(c), c)]


def reap(processes: list, timeout_s: float) -> None:
    """Join ``processes``; kill what is left after ``timeout_s``, with its children (DHT, p2pd).

    A DHT child still starting when its parent dies would otherwise outlive it.
    """
    deadline = time.monotonic() + timeout_s
    for process in processes:
        process.join(max(0.1, deadline - time.monotonic()))
        if process.is_alive():
            for pid in [*_descendants(process.pid), process.pid]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            process.join(5)


class PeerGroup:
    """``peers`` worker processes of ``system``, started together, joining the DHT at ``initial_peers``."""

    def __init__(self, system: str, peers: int, initial_peers: list[str], settings: Settings):
        self.context = mp.get_context("spawn")
        self.processes: list[mp.Process] = []
        self.conns: list[Connection] = []
        try:
            for rank in range(peers):
                self._start(system, rank, initial_peers, settings)
            deadline = time.monotonic() + START_TIMEOUT_S
            for conn in self.conns:
                self._recv(conn, max(0.1, deadline - time.monotonic()))
        except BaseException:
            self.close()
            raise

    def _start(self, system: str, rank: int, initial_peers: list[str], settings: Settings) -> Connection:
        parent, child = self.context.Pipe()
        process = self.context.Process(target=peer_main, args=(system, rank, child, initial_peers, settings))
        process.start()
        self.processes.append(process)
        self.conns.append(parent)
        return parent

    @staticmethod
    def _recv(conn: Connection, timeout_s: float):
        if not conn.poll(timeout_s):
            raise TimeoutError(f"a peer did not answer within {timeout_s:.0f}s")
        return conn.recv()

    def ask(self, peers: int, command: str, payloads: list[dict], timeout_s: float) -> list[dict]:
        """Send ``command`` to the first ``peers`` workers and wait for all their replies."""
        conns = self.conns[:peers]
        for conn, payload in zip(conns, payloads, strict=True):
            conn.send((command, payload))
        deadline = time.monotonic() + timeout_s
        return [self._recv(conn, max(0.1, deadline - time.monotonic()))[1] for conn in conns]

    def close(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send(("exit", None))
        reap(self.processes, SHUTDOWN_TIMEOUT_S)


def round_times(replies: list[dict]) -> tuple[float, float]:
    """A round's all-reduce seconds (first peer starting it to last peer holding the result) and its whole
    seconds, matchmaking included, from every peer's reply."""
    allreduce_s = max(r["end"] for r in replies) - min(r["start"] for r in replies)
    return allreduce_s, max(r["round_end"] for r in replies) - min(r["round_start"] for r in replies)


def round_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of ``Settings``: the matchmaking window and the bound on one all-reduce."""
    parser.add_argument(
        "--matchmaking-time-s", type=float, default=1.5, help="matchmaking window of ours and hivemind"
    )
    parser.add_argument("--averaging-timeout-s", type=float, default=60.0, help="bound on one all-reduce")


def _round_cells(cell: Cell, replies: list[dict]) -> None:
    allreduce_s, e2e_s = round_times(replies)
    cell.allreduce_s.append(allreduce_s)
    cell.e2e_s.append(e2e_s)
    cell.bytes_sent_per_peer = int(statistics.mean(r["bytes_sent"] for r in replies))


def measure_p2p(
    system: str,
    peer_counts: list[int],
    configs: list[tuple[int, str]],
    repeats: int,
    initial_peers: list[str],
    settings: Settings,
) -> list[Cell]:
    """All cells of ``system``; the same worker processes serve every group size (the first ``n`` of them)."""
    cells = [Cell(system, n, numel, dtype) for n in peer_counts for numel, dtype in configs]
    # One round's bound: matchmaking, the all-reduce, and the reply over the pipe.
    round_timeout_s = settings.matchmaking_time_s + 2 * settings.averaging_timeout_s + 10
    try:
        group = PeerGroup(system, max(peer_counts), initial_peers, settings)
    except Exception as e:
        for cell in cells:
            cell.error = f"peers did not start: {e!r}"
        return cells
    try:
        for index, cell in enumerate(cells):
            n = cell.peers
            prefix = f"bench{index}_{n}_{cell.numel}_{cell.dtype}"
            setup = [
                dict(rank=r, prefix=prefix, numel=cell.numel, dtype=cell.dtype, peers=n) for r in range(n)
            ]
            replies = group.ask(n, "setup", setup, START_TIMEOUT_S)
            if any(r and not r.get("ok", True) for r in replies):
                cell.error = next(r["error"] for r in replies if r and not r.get("ok", True))
                continue
            measured, attempts = 0, 0
            # A warmup round first; a round whose group was not all n peers is retried, a few times at most.
            while measured < repeats + 1 and attempts < 2 * (repeats + 1) + 1:
                attempts += 1
                replies = group.ask(n, "round", [{}] * n, round_timeout_s)
                if not all(r["ok"] and r["group"] == n for r in replies):
                    cell.failed_rounds += 1
                    cell.error = next((r["error"] for r in replies if r.get("error")), "partial group")
                    continue
                measured += 1
                if measured > 1:
                    _round_cells(cell, replies)
            if cell.allreduce_s:
                cell.error = ""
            group.ask(n, "teardown", [{}] * n, SHUTDOWN_TIMEOUT_S)
    except Exception as e:
        for cell in cells:
            if not cell.allreduce_s:
                cell.error = cell.error or f"aborted: {e!r}"
    finally:
        group.close()
    return cells


# --- gloo -----------------------------------------------------------------------------------------------


def gloo_main(
    rank: int, world: int, port: int, plan: list[tuple[int, int, str]], repeats: int, queue
) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=START_TIMEOUT_S)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timeout
    )
    try:
        groups = {n: dist.new_group(list(range(n)), timeout=timeout) for n in sorted({n for n, _, _ in plan})}
        results = []
        for n, numel, dtype in plan:
            rounds = []
            if rank < n:
                tensor = _seeded_vector(rank, numel).to(torch.float16 if dtype == "fp16" else torch.float32)
                for _ in range(repeats + 1):
                    work = tensor.clone()
                    dist.barrier(group=groups[n])
                    started = time.time()
                    dist.all_reduce(work, group=groups[n])
                    work /= n
                    rounds.append({"start": started, "end": time.time(), "round_start": started,
                                   "round_end": time.time(), "bytes_sent": 0})  # fmt: skip
            results.append(rounds[1:])
            dist.barrier()
        queue.put((rank, results))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure_gloo(peer_counts: list[int], configs: list[tuple[int, str]], repeats: int) -> list[Cell]:
    cells = [Cell("gloo", n, numel, dtype) for n in peer_counts for numel, dtype in configs]
    plan = [(c.peers, c.numel, c.dtype) for c in cells]
    world = max(peer_counts)
    context = mp.get_context("spawn")
    queue = context.Queue()
    port = _free_port()
    processes = [
        context.Process(target=gloo_main, args=(r, world, port, plan, repeats, queue), daemon=True)
        for r in range(world)
    ]
    for process in processes:
        process.start()
    try:
        deadline = time.monotonic() + START_TIMEOUT_S + 60 * len(plan)
        per_rank = dict(queue.get(timeout=max(0.1, deadline - time.monotonic())) for _ in range(world))
        for index, cell in enumerate(cells):
            for r in range(repeats):
                _round_cells(cell, [per_rank[rank][index][r] for rank in range(cell.peers)])
    except Exception as e:
        for cell in cells:
            cell.error = f"gloo run failed: {e!r}"
    finally:
        reap(processes, SHUTDOWN_TIMEOUT_S)
    return cells


# --- report ---------------------------------------------------------------------------------------------


def parse_size(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text.rstrip("KMG")) * scale)


def show_size(numel: int) -> str:
    return f"{numel / (1 << 20):g}M" if numel >= 1 << 20 else f"{numel / (1 << 10):g}K"


def _seconds(value: float | None) -> str:
    return "failed" if value is None else f"{value:.3f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "n/a" if a is None or b is None else f"{a / b:.2f}x"


def report(cells: list[Cell], systems: list[str]) -> list[str]:
    index = {(c.system, c.peers, c.numel, c.dtype): c for c in cells}
    keys = sorted({(c.peers, c.numel, c.dtype) for c in cells}, key=lambda k: (k[0], k[1], k[2] != "fp32"))
    header = f"{'peers':>5} {'values':>6} {'wire':>4} |"
    header += "".join(f" {s + ' s':>10}" for s in systems)
    header += " | ours/hivemind  ours/gloo  hivemind/gloo |" + "".join(
        f" {s + ' e2e s':>14}" for s in systems if s != "gloo"
    )
    lines = [header, "-" * len(header)]
    for peers, numel, dtype in keys:
        median = {s: index[(s, peers, numel, dtype)].median_s for s in systems}
        e2e = {s: index[(s, peers, numel, dtype)].median_e2e_s for s in systems}
        line = f"{peers:>5} {show_size(numel):>6} {dtype:>4} |"
        line += "".join(f" {_seconds(median[s]):>10}" for s in systems)
        line += (
            f" | {_ratio(median.get('ours'), median.get('hivemind')):>13}"
            f" {_ratio(median.get('ours'), median.get('gloo')):>10}"
            f" {_ratio(median.get('hivemind'), median.get('gloo')):>14} |"
        )
        line += "".join(f" {_seconds(e2e[s]):>14}" for s in systems if s != "gloo")
        lines.append(line)
    for cell in cells:
        if cell.error or cell.failed_rounds:
            lines.append(
                f"note: {cell.system} {cell.peers} peers {show_size(cell.numel)} {cell.dtype}: "
                f"{cell.failed_rounds} failed rounds{'; ' + cell.error if cell.error else ''}"
            )
    key = (TARGET["peers"], TARGET["numel"], TARGET["dtype"])
    if key in keys and {"ours", "hivemind", "gloo"} <= set(systems):
        ours, hm, gloo = (index[(s, *key)].median_s for s in ("ours", "hivemind", "gloo"))
        if None not in (ours, hm, gloo):
            met_hm = "met" if ours / hm <= TARGET["vs_hivemind"] else "MISSED"
            met_gloo = "met" if ours / gloo <= TARGET["vs_gloo"] else "MISSED"
            lines.append(
                f"target at 4 peers x 16M fp16: ours/hivemind {ours / hm:.2f}x (<= 1.0x: {met_hm}), "
                f"ours/gloo {ours / gloo:.2f}x (<= 3.0x: {met_gloo}); hivemind/gloo {hm / gloo:.2f}x"
            )
    return lines


def machine() -> dict:
    import hivemind
    import numpy
    import torch

    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), "")
    memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {
        "cpu": cpu or platform.processor(), "cores": os.cpu_count(), "memory_gib": round(memory_gib, 1),
        "load_1min": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "python": platform.python_version(), "torch": torch.__version__, "hivemind": hivemind.__version__,
        "numpy": numpy.__version__,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", default="2,4", help="comma-separated group sizes")
    parser.add_argument(
        "--sizes", default="1M,16M", help="comma-separated float32 counts (K, M = 2**10, 2**20)"
    )
    parser.add_argument("--dtypes", default="fp32,fp16", help="on the wire: fp32, fp16")
    parser.add_argument(
        "--systems", default=",".join(DEFAULT_SYSTEMS), help=f"which of {', '.join(SYSTEMS)} to run"
    )
    parser.add_argument("--repeats", type=int, default=3, help="measured rounds per cell, after one warmup")
    round_flags(parser)
    parser.add_argument(
        "--quick", action="store_true", help="2 peers, 1M values, fp16, one round: a smoke test"
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)

    if args.quick:
        args.peers, args.sizes, args.dtypes, args.repeats = "2", "1M", "fp16", 1
        args.matchmaking_time_s = 1.0
    peer_counts = [int(p) for p in args.peers.split(",")]
    configs = [(parse_size(s), d) for s in args.sizes.split(",") for d in args.dtypes.split(",")]
    systems = [s for s in SYSTEMS if s in args.systems.split(",")]
    if bad := [d for _, d in configs if d not in DTYPES] + [
        s for s in args.systems.split(",") if s not in SYSTEMS
    ]:
        parser.error(f"unknown dtype or system: {', '.join(bad)}")
    if args.repeats < 1 or any(p < 2 for p in peer_counts):
        parser.error("--repeats must be >= 1 and every --peers value >= 2")
    settings = Settings(args.matchmaking_time_s, args.averaging_timeout_s)

    info = machine()
    print(
        f"machine: {info['cpu']}, {info['cores']} cores, {info['memory_gib']} GiB; python {info['python']}, "
        f"torch {info['torch']}, hivemind {info['hivemind']}, numpy {info['numpy']}; load {info['load_1min']}"
    )
    print(
        f"one process per peer (torch threads 1); median of {args.repeats} rounds after 1 warmup; "
        f"'s' columns: all-reduce only (matchmaking excluded), 'e2e' columns: whole round incl. "
        f"{args.matchmaking_time_s:g}s matchmaking window",
        flush=True,
    )
    cells: list[Cell] = []
    started = time.monotonic()
    bootstrap = None
    if {"ours", "ours-p2p", "hivemind"} & set(systems):
        from swarm.dht import SpawnedDHT

        # A DHT node that only introduces the peers to each other, so that they can all start at once.
        bootstrap = SpawnedDHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        for system in systems:
            t0 = time.monotonic()
            if system == "gloo":
                cells += measure_gloo(peer_counts, configs, args.repeats)
            else:
                maddrs = [str(m) for m in bootstrap.get_visible_maddrs()]
                cells += measure_p2p(system, peer_counts, configs, args.repeats, maddrs, settings)
            print(f"  measured {system} in {time.monotonic() - t0:.0f}s", flush=True)
    finally:
        if bootstrap is not None:
            bootstrap.shutdown()
    print()
    print("\n".join(report(cells, systems)))
    # Other work on the machine slows every system, unevenly: the load says whether the numbers are clean.
    print(f"\ntotal {time.monotonic() - started:.0f}s; 1-minute load average now {os.getloadavg()[0]:.1f}")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "machine": info,
                    "settings": asdict(settings),
                    "repeats": args.repeats,
                    "cells": [
                        {**asdict(c), "median_s": c.median_s, "median_e2e_s": c.median_e2e_s} for c in cells
                    ],
                },
                indent=2,
            )
        )
    return 0 if all(c.allreduce_s for c in cells) else 1


if __name__ == "__main__":
    sys.exit(main())
