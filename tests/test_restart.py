"""A coordinator restarted mid-run (SIGKILL, Ctrl-C) rejoins the live swarm: real processes on loopback.

The restarted coordinator's DHT node starts empty, on a new port here (``--dht-port 0``); the running
peers re-enter it, so it sees their progress and checkpoints again, and a peer that joins afterwards
finds the swarm rather than the checkpoint from before the restart.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from coordinator.checkpoints import OUTSIDE_GRACE_S, CheckpointKeeper
from coordinator.store import PeerRecord, diverged_peers
from lab.localswarm import LocalSwarm, free_port, status, tiny_run, wait_until
from protocols.keys import SigningKey
from swarm.training.checkpoint import list_checkpoints


def _newest_checkpoint(data_dir: Path) -> int:
    found = list_checkpoints(data_dir / "checkpoints")
    return int(found[-1].stem.split("-")[1]) if found else 0


def _online(address: str) -> dict:
    return {p.name: p for p in status(address).peers if p.state == "online"}


def _restart(swarm: LocalSwarm, coordinator, signum: int, run, port: int, data_dir: Path):
    """Stop the coordinator with ``signum`` and start it again with the same command; returns the new
    process and the furthest step a peer reported before the stop."""
    reached = max(p.step for p in _online(coordinator.extra["address"]).values())
    coordinator.signal(signum)
    coordinator.wait(timeout_s=30)
    return swarm.start_coordinator(run, port=port, data_dir=data_dir), reached


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_restarted_coordinator_rejoins_the_swarm_and_checkpoints_it(swarm: LocalSwarm):
    run = tiny_run(checkpoint_every_steps=2)
    port = free_port()
    coordinator = swarm.start_coordinator(run, port=port)
    address, data_dir = coordinator.extra["address"], coordinator.extra["data_dir"]
    for name in ("a", "b"):
        swarm.start_peer(address, name, "--max-retry-interval-s", "1")
    wait_until(lambda: _newest_checkpoint(data_dir) >= 2, timeout_s=120, what="a first checkpoint")

    # Killed outright (a Ctrl-C stop and restart is tests/test_run_end.py's, SIGTERM test_membership.py's).
    coordinator, reached = _restart(swarm, coordinator, signal.SIGKILL, run, port, data_dir)
    # Checkpointing resumes from the swarm's state, past where the peers were when it stopped.
    wait_until(
        lambda: _newest_checkpoint(data_dir) > reached, timeout_s=120,
        what=f"a checkpoint past step {reached} after SIGKILL",
    )  # fmt: skip

    late = swarm.start_peer(address, "late", "--max-retry-interval-s", "1")
    # Steps go by faster than heartbeats here: collect what each peer reported at each step, and look
    # for a step the late joiner and the others reported with the same parameters.
    seen: dict[str, dict[int, str]] = {}

    def one_swarm() -> bool:
        online = _online(address)
        for name, p in online.items():
            seen.setdefault(name, {})[p.step] = p.param_hash
        if "late" not in online or online["late"].metrics.get("dht_members") != 3.0:
            return False
        shared = [
            {seen[name].get(step) for name in ("a", "b", "late")} - {None}
            for step in seen.get("late", {})
            if step > reached and (seen.get("a", {}).get(step) or seen.get("b", {}).get(step))
        ]
        return any(len(hashes) == 1 for hashes in shared)

    wait_until(one_swarm, timeout_s=120, what="the late joiner at the others' step and parameters")
    assert "resuming from the coordinator's checkpoint" not in late.output()


@pytest.mark.timeout(30)
def test_a_peer_whose_progress_never_reaches_the_coordinators_dht_shows_as_diverged(tmp_path: Path):
    """A split swarm (peers heartbeating to the coordinator whose DHT does not see them) is visible in
    status and on the dashboard as diverged, once peer and coordinator have been up past the grace."""
    run = tiny_run()
    keeper = CheckpointKeeper(run, None, SigningKey.generate(), tmp_path)
    later = time.time() + OUTSIDE_GRACE_S + 1

    def peer(name: str, uptime_s: float, state: str = "online") -> PeerRecord:
        return PeerRecord(
            peer_id=name, public_key=b"", name=name, device="cpu", role="data", state=state, joined_at=0.0,
            last_seen=later, last_seq=1, cert_serial=1, cert_expires_at=later + 600,
            metrics={"uptime_s": uptime_s}, step=40, param_hash="a" * 64,
        )  # fmt: skip

    records = [peer("split", 600.0), peer("joining", 5.0), peer("gone", 600.0, state="offline")]
    assert keeper.outside_dht(records, time.time()) == set(), "no verdict before the grace has passed"
    assert keeper.outside_dht(records, later) == {"split"}
    assert diverged_peers(records, keeper.outside_dht(records, later)) == {"split"}
