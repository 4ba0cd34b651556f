"""Fixtures for tests that run real coordinator and peer processes on loopback (see lab/localswarm.py).

Every child process is started in its own session and reaped after each test, whatever the outcome.
The tests' own DHT nodes, coordinators and peers are forked from the fork server that
``lab.testsession`` (a ``-p`` plugin in pyproject's ``addopts``) starts when pytest's command begins.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import hivemind
import pytest
from helpers import ready_for_a_new_loop, run_tiny_sim

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


@pytest.fixture(scope="session")
def session_keyed_dhts(tmp_path_factory) -> Iterator[list[tuple[hivemind.DHT, SigningKey]]]:
    """The three DHT nodes behind ``keyed_dhts``, started once for the whole session: three DHT processes
    take seconds to start and stop on a loaded machine, and dozens of tests average among them."""
    nodes = start_local_dhts(3, tmp_path_factory.mktemp("dhts"))
    yield nodes
    for node, _ in nodes:
        node.shutdown()


@pytest.fixture
def keyed_dhts(session_keyed_dhts) -> list[tuple[hivemind.DHT, SigningKey]]:
    """Three DHT peers on loopback whose libp2p identities are signing keys we hold, as a volunteer's
    are: ``[(dht, key), ...]``, shared by every test that asks for them (``session_keyed_dhts``) and ready
    for this test's event loop (``ready_for_a_new_loop``). A test works under an averager ``prefix`` or a
    run ID (DHT keys and libp2p handler names) that no other test uses, and leaves every node running."""
    ready_for_a_new_loop([node for node, _ in session_keyed_dhts])
    return session_keyed_dhts


@pytest.fixture(scope="session")
def clean_tiny_sim(tmp_path_factory) -> dict:
    """One clean ``swarm-sim`` run (3 peers, 6 steps, tiny model, every part checked), shared by the
    tests that compare a variant with it: about 25 s of processes, started once. Its peers are fresh
    interpreters, each with its own hash seed as on volunteers' machines, so that the runs that check
    bit-identical peers include one where nothing is inherited from a common fork."""
    return run_tiny_sim(tmp_path_factory.mktemp("clean-sim"), "--fresh-interpreters")
