"""Fixtures for tests that run real coordinator and peer processes on loopback (see coordinator/localswarm.py).

Every child process is started in its own session and reaped after each test, whatever the outcome.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator.localswarm import LocalSwarm


@pytest.fixture
def swarm(tmp_path: Path) -> Iterator[LocalSwarm]:
    harness = LocalSwarm(tmp_path)
    try:
        yield harness
    finally:
        harness.kill_all()
