"""Helpers shared by tests that run real DHT nodes and trainers in the test process."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import hivemind
import pytest

from protocols.keys import SigningKey
from swarm.averaging.allreduce import ButterflyAllReduce
from swarm.dht import SpawnedDHT, start_local_dhts


@contextlib.asynccontextmanager
async def serving_coordinator(
    tmp_path: Path, run_id, limits=None, *, dial_back=False, service_options=None, **store_options
):
    """The real coordinator service and store of a tiny run (``run_id``, or a whole ``RunConfig``), served
    over gRPC on a loopback port: yields (address, store, service), stopped as the coordinator node stops
    them (the server, then the judgments, then the store). ``dial_back`` serves ``DialBack`` too, as the
    node does; ``service_options`` go to ``CoordinatorService``."""
    import grpc

    from coordinator.dialback import DialBackService
    from coordinator.service import CoordinatorService
    from coordinator.store import Store
    from lab.localswarm import tiny_run
    from swarm.rpc import CHANNEL_OPTIONS

    run = tiny_run(run_id) if isinstance(run_id, str) else run_id
    tmp_path.mkdir(parents=True, exist_ok=True)
    store = Store.open_sync(tmp_path / "coordinator.db", run.run_id, **store_options)
    service = CoordinatorService(run, SigningKey.generate(), store, [], limits, **(service_options or {}))
    server = grpc.aio.server(options=CHANNEL_OPTIONS)
    server.add_generic_rpc_handlers(
        (service.generic_handler(), *([DialBackService().generic_handler()] if dial_back else []))
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}", store, service
    finally:
        await server.stop(grace=0.5)
        await service.close()
        store.close()


SIM_LOG_LINES = 25  # of each log a failed swarm-sim kept, shown in the failure
KEYS: dict[str, SigningKey] = {}  # peer ID -> the identity its DHT runs under (trainers sign with it)


def run_then_shut_down(scenario, dhts: list) -> None:
    """Run the coroutine ``scenario`` to its end, then shut every DHT of ``dhts`` down, whatever happened."""
    try:
        asyncio.run(scenario)
    finally:
        for dht in dhts:
            dht.shutdown()


def start_dhts(count: int, initial_peers: list[str] | None = None, validators=()) -> list[SpawnedDHT]:
    """``count`` DHT nodes on loopback, each under a fresh identity recorded in ``KEYS``; the first
    bootstraps the others unless ``initial_peers`` is given."""
    home = Path(tempfile.mkdtemp(prefix="swarm-test-keys-"))
    # The p2p daemons read their keys when they start; the test session removes the directory at its end.
    atexit.register(shutil.rmtree, home, ignore_errors=True)
    nodes = start_local_dhts(count, home, initial_peers=initial_peers, validators=validators)
    KEYS.update((key.peer_id, key) for _, key in nodes)
    return [dht for dht, _ in nodes]


def ready_for_a_new_loop(dhts) -> None:
    """DHT nodes that tests share, ready for this test's event loop: hivemind caches a node's replica of
    its libp2p daemon (``replicate_p2p``) on the loop that first asked for it, and each test's
    ``asyncio.run`` closes its loop, so the next test's peers need a replica of their own."""
    for dht in dhts:
        assert dht.is_alive(), "a shared DHT node died in an earlier test"
        dht._p2p_replica = None


def module_dht_fixtures(count: int):
    """Fixtures ``(module_nodes, nodes)`` for a test module: ``count`` DHT nodes started once for the module
    (seconds to start and stop on a loaded machine), and, for each test, those nodes ready for its event loop
    (``ready_for_a_new_loop``). Each test trains a run of its own, so that none reads another's records::

        module_nodes, nodes = module_dht_fixtures(3)
    """

    @pytest.fixture(scope="module")
    def module_nodes():
        dhts = start_dhts(count)
        yield dhts
        for dht in dhts:
            dht.shutdown()

    @pytest.fixture
    def nodes(module_nodes):
        ready_for_a_new_loop(module_nodes)
        return module_nodes

    return module_nodes, nodes


def stock_dht(initial_peers: list[str], attempts: int = 2, ready_timeout_s: float = 60.0) -> hivemind.DHT:
    """A stock ``hivemind.DHT`` with a fresh key and no record validators (what an attacker who skips
    admission runs), joined to ``initial_peers``. Its child process is spawned, not forked
    (``SpawnedDHT``): one forked from this threaded test process hung in a loaded suite, at start-up once
    and mid-test once (a store that never returned). Each start-up try is bounded as well."""
    for attempt in range(attempts):
        dht = SpawnedDHT(initial_peers=list(initial_peers), host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=False)
        try:
            dht.run_in_background(await_ready=True, timeout=ready_timeout_s)
            return dht
        except TimeoutError:
            dht.shutdown()
            if attempt + 1 == attempts:
                raise
    raise AssertionError("unreachable")


class VanishingAllReduce(ButterflyAllReduce):
    """A groupmate that dies right after its group formed: it neither sends nor reduces."""

    async def run(self):
        await asyncio.sleep(3600)


async def relay_from(source_host: str, target: tuple[str, int]) -> asyncio.Server:
    """A TCP relay on loopback whose connections to ``target`` come from ``source_host`` (another
    loopback address, such as 127.0.0.2): to a server, a caller on another host."""

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            while data := await reader.read(1 << 16):
                writer.write(data)
                await writer.drain()
        writer.close()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream_reader, upstream_writer = await asyncio.open_connection(*target, local_addr=(source_host, 0))
        await asyncio.gather(pipe(reader, upstream_writer), pipe(upstream_reader, writer))

    return await asyncio.start_server(handle, "127.0.0.1", 0)


def kept_logs(stderr: str) -> Path | None:
    """The directory a failed ``swarm-sim`` run kept its logs in, as its stderr names it; None if none."""
    kept = re.search(r"logs kept in (\S+)", stderr)
    return None if kept is None else Path(kept.group(1))


def sim_failure(result: subprocess.CompletedProcess) -> str:
    """What a failed ``swarm-sim`` said, with the last lines of each log it kept: a run that stalled on a
    loaded machine is explained by its peers' logs, which are gone with the machine."""
    text = result.stdout[-3000:] + result.stderr[-3000:]
    kept = kept_logs(result.stderr)
    if kept is not None:
        for log in sorted(kept.glob("*.log")):
            lines = log.read_text(errors="replace").splitlines()[-SIM_LOG_LINES:]
            text += f"\n--- {log.name} (last {len(lines)} lines)\n" + "\n".join(lines)
    return text


def run_tiny_sim(out_dir: Path, *flags: str, peers: int = 3, steps: int = 6) -> dict:
    """``swarm-sim`` with the tiny model, every part checked and a sender recomputed at each check
    (``--verify-probability 1.0 --sender-check-probability 1.0``), as a
    subprocess; its JSON report. ``flags`` (an attack, a precision...) go after these settings. The sim
    gives up on its own before the subprocess is killed, so that it keeps its logs and names the stall."""
    out = out_dir / "sim.json"
    result = subprocess.run(
        [sys.executable, "-m", "lab.sim", "--peers", str(peers), "--steps", str(steps), "--model-size",
         "tiny", "--verify-probability", "1.0", "--sender-check-probability", "1.0", "--json", str(out), "--timeout-s", "330", *flags],
        capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    assert result.returncode == 0, sim_failure(result)
    return json.loads(out.read_text())


class ServedStates:
    """What a sender check's accuser serves the coordinator (``coordinator.contributions.ContributionStates``):
    the states it kept, by their hash, as an honest validator (or a Sybil) does; ``asked`` records each
    request (holder, step, state hash)."""

    def __init__(self, *states):
        self.states = {s.state_hash: s for s in states if s is not None}
        self.asked: list[tuple[str, int, str]] = []

    async def fetch(self, holder, step, state_hash):
        self.asked.append((holder, step, state_hash))
        return self.states.get(state_hash)


def signed_entries(keys, prefix: str, commits, *, step: int, state_hash: str, weights) -> list[bytes]:
    """Each member's signed group entry (as ``Averager.find_group`` signs one: its weight, its nonce
    commitment, and the step and state hash in ``extra``), in member order."""
    from swarm.averaging.groups import GroupEntryBody, make_entry

    return [
        make_entry(
            key,
            prefix,
            GroupEntryBody(
                schema_hash=bytes(32),
                weight=weight,
                commit=commit,
                extra={"step": step, "state_hash": state_hash},
            ),
        )  # fmt: skip
        for key, commit, weight in zip(keys, commits, weights, strict=True)
    ]
