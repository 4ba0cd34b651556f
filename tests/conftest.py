"""Fixtures for tests that run real coordinator and peer processes on loopback (see lab/localswarm.py).

Every child process is started in its own session and reaped after each test, whatever the outcome.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import hivemind
import pytest
from helpers import run_tiny_sim

from lab.localswarm import LocalSwarm
from protocols.keys import SigningKey
from swarm.dht import start_local_dhts


@pytest.fixture
def swarm(tmp_path: Path) -> Iterator[LocalSwarm]:
    harness = LocalSwarm(tmp_path)
    try:
        yield harness
    finally:
        harness.kill_all()


@pytest.fixture
def keyed_dhts(tmp_path: Path) -> Iterator[list[tuple[hivemind.DHT, SigningKey]]]:
    """Three DHT peers on loopback whose libp2p identities are signing keys we hold, as a volunteer's
    are: ``[(dht, key), ...]``, shut down after the test."""
    nodes = start_local_dhts(3, tmp_path)
    yield nodes
    for node, _ in nodes:
        node.shutdown()


@pytest.fixture(scope="session")
def clean_tiny_sim(tmp_path_factory) -> dict:
    """One clean ``swarm-sim`` run (3 peers, 6 steps, tiny model, every part checked), shared by the
    tests that compare a variant with it: about 25 s of processes, started once."""
    return run_tiny_sim(tmp_path_factory.mktemp("clean-sim"))
