"""Fixtures for tests that run real coordinator and peer processes on loopback (see coordinator/localswarm.py).

Every child process is started in its own session and reaped after each test, whatever the outcome.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator.localswarm import LocalSwarm
from protocols.keys import SigningKey
from swarm.dht import SpawnedDHT
from swarm.identity import create_identity


@pytest.fixture
def swarm(tmp_path: Path) -> Iterator[LocalSwarm]:
    harness = LocalSwarm(tmp_path)
    try:
        yield harness
    finally:
        harness.kill_all()


@pytest.fixture
def keyed_dhts(tmp_path: Path) -> Iterator[list[tuple[SpawnedDHT, SigningKey]]]:
    """Three DHT peers on loopback whose libp2p identities are signing keys we hold, as a volunteer's
    are: ``[(dht, key), ...]``, shut down after the test."""
    keys = [create_identity(tmp_path / f"peer{i}.key") for i in range(3)]

    def start(i: int, initial_peers) -> SpawnedDHT:
        return SpawnedDHT(
            start=True, initial_peers=initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
            identity_path=str(tmp_path / f"peer{i}.key"), check_if_identity_free=False,
        )  # fmt: skip

    first = start(0, [])
    nodes = [first, start(1, first.get_visible_maddrs()), start(2, first.get_visible_maddrs())]
    yield list(zip(nodes, keys, strict=True))
    for node in nodes:
        node.shutdown()
