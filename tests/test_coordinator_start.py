"""Starting a coordinator: one per port and per data dir (a second start beside a running coordinator
exits non-zero naming what is taken, and a SIGKILLed coordinator's data dir can be started again), and a
restart that leaves the peers it knew online until they can have reconnected."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import pytest

from lab.localswarm import LocalSwarm, running_coordinator, status, tiny_run
from protocols.keys import SigningKey
from swarm.coordinator_client import CoordinatorClient

pytestmark = pytest.mark.timeout(120)


def _start_args(*, port: int = 0, dht_port: int = 0, data_dir) -> list[str]:
    return ["-m", "coordinator.cli", "start", "--host", "127.0.0.1", "--port", str(port),
            "--dht-port", str(dht_port), "--data-dir", str(data_dir)]  # fmt: skip


@pytest.mark.slow
def test_a_second_coordinator_on_a_used_port_or_data_dir_is_refused(swarm: LocalSwarm):
    first = swarm.start_coordinator()
    address, data_dir = first.extra["address"], first.extra["data_dir"]
    port = int(address.rpartition(":")[2])
    dht_port = int(first.extra["dht_initial_peers"][0].split("/tcp/")[1].split("/")[0])
    run_id = status(address).run_id

    # Started together: each spends most of its start importing torch.
    clashes = {
        "grpc": swarm.spawn("same-port", _start_args(port=port, data_dir=swarm.root / "b")),
        "dht": swarm.spawn("same-dht-port", _start_args(dht_port=dht_port, data_dir=swarm.root / "c")),
        "data_dir": swarm.spawn("same-data-dir", _start_args(data_dir=data_dir)),
    }
    named = {"grpc": f"127.0.0.1:{port}", "dht": f"127.0.0.1:{dht_port}", "data_dir": str(data_dir)}
    for what, child in clashes.items():
        assert child.wait(timeout_s=60) != 0, f"a second coordinator on the same {what} started"
        assert named[what] in child.output(), child.output()
        assert "listening" not in child.output()
    assert "in use by another coordinator" in clashes["data_dir"].output()
    # The first one still serves alone, with its endpoint file untouched.
    assert [status(address).run_id for _ in range(4)] == [run_id] * 4
    assert (data_dir / "endpoint.json").exists()

    # The lock dies with its holder, even by SIGKILL: the same data dir starts again.
    first.signal(signal.SIGKILL)
    first.wait(timeout_s=10)
    again = swarm.start_coordinator(data_dir=data_dir)
    assert status(again.extra["address"]).run_id == run_id


def test_a_restarted_coordinator_keeps_the_peers_it_knew_online_until_they_can_reconnect(tmp_path: Path):
    run = tiny_run("restart-liveness")  # a peer is offline after 3 s without a heartbeat

    async def join(address: str, name: str) -> str:
        key = SigningKey.generate()
        async with CoordinatorClient(address) as client:
            await client.join(key, run.run_id, name=name, device="cpu")
        return name

    async def scenario() -> dict[str, str]:
        async with running_coordinator(run, tmp_path) as node:
            await join(node.address, "before")
        async with running_coordinator(run, tmp_path) as node:
            # Joins after the restart and never heartbeats: liveness must still catch it.
            await join(node.address, "after")
            await asyncio.sleep(run.membership.offline_after_s + 2.0)
            return {p["name"]: p["state"] for p in (await node.snapshot())["peers"]}

    assert asyncio.run(scenario()) == {"before": "online", "after": "offline"}
