"""A coordinator and real volunteer processes on loopback: join, liveness, leave, bans, restarts."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time

import hivemind
import pytest
from helpers import stock_dht

from lab.localswarm import FAST_MEMBERSHIP, LocalSwarm, free_port, peer_states, status, wait_until
from protocols.certificates import issue_certificate
from protocols.keys import PublicKey, SigningKey
from swarm.config import RunConfig
from swarm.identity import load_identity
from swarm.membership import fetch_members, publish_certificate

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]


def _members_seen(address: str) -> dict[str, float]:
    return {p.name: p.metrics.get("dht_members", 0.0) for p in status(address).peers if p.state == "online"}


def test_peers_join_turn_offline_when_killed_and_left_when_stopped(swarm: LocalSwarm):
    coordinator = swarm.start_coordinator()
    address = coordinator.extra["address"]
    peers = [swarm.start_peer(address, f"peer{i}") for i in range(3)]

    wait_until(
        lambda: peer_states(address) == {"peer0": "online", "peer1": "online", "peer2": "online"},
        timeout_s=90,
        what="3 peers online",
    )
    snapshot = status(address)
    assert snapshot.run_id == "test-run"
    by_name = {p.name: p for p in snapshot.peers}
    for child in peers:
        key = load_identity(child.extra["identity"])
        record = by_name[child.name]
        assert record.peer_id == key.peer_id, "the coordinator must record the peer's own key"
        assert record.device.startswith("cpu")
        assert key.peer_id in child.output()
        assert "fork_posix" not in child.output(), "gRPC's fork notice is noise to a volunteer"
    # Each peer verifies the others' certificates in the DHT: all three see three members.
    wait_until(
        lambda: _members_seen(address) == {"peer0": 3.0, "peer1": 3.0, "peer2": 3.0},
        timeout_s=30,
        what="every peer to see 3 verified DHT members",
    )

    killed_at = time.monotonic()
    peers[0].process.kill()
    wait_until(lambda: peer_states(address)["peer0"] == "offline", timeout_s=30, what="killed peer offline")
    assert time.monotonic() - killed_at < 30
    peers[0].process.wait(timeout=5)
    wait_until(lambda: not peers[0].group_alive(), timeout_s=15, what="the killed peer's DHT process to exit")

    peers[1].signal(signal.SIGTERM)
    assert peers[1].wait(timeout_s=30) == 0, peers[1].output()
    assert peer_states(address)["peer1"] == "left", "a clean leave shows 'left' as soon as the peer exits"
    assert "state: left" in peers[1].output()

    peers[2].signal(signal.SIGINT)
    assert peers[2].wait(timeout_s=30) == 0, peers[2].output()
    assert peer_states(address) == {"peer0": "offline", "peer1": "left", "peer2": "left"}
    assert coordinator.process.poll() is None


def test_stock_hivemind_dht_joins_and_forged_members_are_ignored(swarm: LocalSwarm):
    coordinator = swarm.start_coordinator()
    address = coordinator.extra["address"]
    swarm.start_peer(address, "honest")
    wait_until(
        lambda: _members_seen(address).get("honest") == 1.0, timeout_s=90, what="the peer to announce itself"
    )

    initial_peers = status(address).dht_initial_peers
    assert initial_peers == coordinator.extra["dht_initial_peers"]
    coordinator_key = PublicKey.from_peer_id(status(address).coordinator_peer_id)
    stock = stock_dht(initial_peers)
    try:
        # A record under the run's members key signed by a key that is not the coordinator's.
        impostor, fake_issuer = SigningKey.generate(), SigningKey.generate()
        forged = issue_certificate(
            fake_issuer,
            public_key=impostor.public_key,
            run_id="test-run",
            role="data",
            name="x",
            serial=1,
            ttl_s=600,
        )
        # Honest nodes refuse the record (their validator checks the certificate); readers check again.
        asyncio.run(_publish(stock, impostor, forged))
        members = asyncio.run(_fetch(stock, coordinator_key))
        assert set(members) == {load_identity(swarm.root / "honest.key").peer_id}
        time.sleep(2 * FAST_MEMBERSHIP.heartbeat_interval_s)
        assert _members_seen(address) == {"honest": 1.0}, "peers must not count the forged member"
    finally:
        stock.shutdown()


async def _publish(dht: hivemind.DHT, key: SigningKey, certificate) -> bool:
    return await publish_certificate(dht, key, certificate, ttl_s=60)


async def _fetch(dht: hivemind.DHT, coordinator_key: PublicKey):
    return await fetch_members(dht, "test-run", coordinator_key)


def test_restarted_coordinator_keeps_peers_and_bans(swarm: LocalSwarm):
    port = free_port()
    coordinator = swarm.start_coordinator(port=port)
    address, data_dir = coordinator.extra["address"], coordinator.extra["data_dir"]
    loyal = swarm.start_peer(address, "loyal", "--max-retry-interval-s", "2")
    rogue = swarm.start_peer(address, "rogue")
    wait_until(
        lambda: peer_states(address) == {"loyal": "online", "rogue": "online"}, timeout_s=90, what="2 peers"
    )

    rogue_id = load_identity(rogue.extra["identity"]).peer_id
    banned = subprocess.run(
        [sys.executable, "-m", "coordinator.cli", "ban", rogue_id, "--data-dir", str(data_dir), "--reason", "test ban"],
        capture_output=True, text=True, timeout=30, env=swarm.env,
    )  # fmt: skip
    assert banned.returncode == 0, banned.stderr
    assert rogue.wait(timeout_s=30) == 3, "a banned peer exits with code 3"
    assert "banned" in rogue.output() and "test ban" in rogue.output()

    coordinator.signal(signal.SIGTERM)
    assert coordinator.wait(timeout_s=30) == 0, coordinator.output()
    coordinator = swarm.start_coordinator(port=port, data_dir=data_dir)
    states = peer_states(address)
    assert states["rogue"] == "banned"
    assert "loyal" in states
    wait_until(
        lambda: "reconnected to the coordinator" in loyal.output(), timeout_s=30, what="the peer to reconnect"
    )
    assert peer_states(address)["loyal"] == "online"

    rejoin = swarm.start_peer(address, "rogue", "--join-timeout-s", "20")
    assert rejoin.wait(timeout_s=60) == 3
    assert "is banned" in rejoin.output()
    assert peer_states(address)["rogue"] == "banned"


def test_demo_run_is_served_without_a_config(swarm: LocalSwarm, tmp_path):
    data_dir = tmp_path / "demo-data"
    child = swarm.spawn(
        "demo",
        ["-m", "coordinator.cli", "start", "--host", "127.0.0.1", "--port", "0", "--dht-port", "0",
         "--data-dir", str(data_dir)],
    )  # fmt: skip
    endpoint = data_dir / "endpoint.json"
    wait_until(endpoint.exists, timeout_s=60, what="the demo coordinator")
    address = json.loads(endpoint.read_text())["address"]
    assert status(address).run_id == RunConfig.demo().run_id
    out = subprocess.run(
        [sys.executable, "-m", "coordinator.cli", "status", "--coordinator", address, "--json"],
        capture_output=True, text=True, timeout=30, env=swarm.env,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    parsed = json.loads(out.stdout)
    assert parsed["run_id"] == "demo" and parsed["peers"] == [] and parsed["dht_initial_peers"]
    child.signal(signal.SIGINT)
    assert child.wait(timeout_s=30) == 0
