"""``swarm-peer pause`` / ``resume`` on a real 2-peer run: the paused peer stays a member, computes
nothing, does not hold the other back, and keeps its credit, which grows again after resume."""

from __future__ import annotations

import asyncio
import io
import json
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from lab.localswarm import LocalSwarm, tiny_run, wait_until
from peer.panel import Panel

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


def control(swarm: LocalSwarm, command: str, identity: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "peer.cli", command, "--identity", str(identity), "--timeout-s", "20"],
        capture_output=True, text=True, timeout=60, env=swarm.env,
    )  # fmt: skip


def test_pause_and_resume_keep_the_peer_in_the_run_and_its_credit(swarm: LocalSwarm):
    endpoint = swarm.start_coordinator(
        tiny_run("pause"),
        extra_args=["--dashboard-port", "0", "--history-interval-s", "0.5"],
        ready_timeout_s=90,
    ).extra
    peers = [swarm.start_peer(endpoint["address"], f"peer{i}") for i in range(2)]
    seen_credit: list[float] = []

    def peers_now() -> dict[str, dict]:
        with urllib.request.urlopen(endpoint["dashboard_url"] + "api/status", timeout=10) as response:
            status = json.load(response)
        by_name = {p["name"]: p for p in status["peers"]}
        if "peer0" in by_name:
            seen_credit.append(by_name["peer0"]["contributed_samples"])
        return by_name

    wait_until(
        lambda: all(p["contributed_samples"] > 0 and p["step"] >= 3 for p in peers_now().values())
        and len(peers_now()) == 2,
        timeout_s=150, what="both peers to earn credit",
    )  # fmt: skip

    paused = control(swarm, "pause", peers[0].extra["identity"])
    assert paused.returncode == 0, paused.stderr
    assert "paused peer (pid" in paused.stdout and "it stays in the run" in paused.stdout
    wait_until(
        lambda: peers_now()["peer0"]["paused"], timeout_s=30, what="the coordinator to show peer0 paused"
    )

    # Work done before the pause may still be credited: the coordinator merges a report only once the
    # run's verified step reaches it, which needs two peers at that step with one hash (and a checkpoint
    # within reach). Once peer1 has moved past the paused peer's step nothing can verify that step, so
    # from then on peer0's credit can only change if peer0 itself computes.
    seen: list[tuple[float, int]] = []

    def settled() -> bool:
        now = peers_now()
        seen.append((now["peer0"]["contributed_samples"], now["peer0"]["step"]))
        return now["peer1"]["step"] > now["peer0"]["step"] and len(seen) > 6 and len(set(seen[-6:])) == 1

    wait_until(settled, timeout_s=90, what="peer1 to pass the paused peer and its credit to settle",
               interval_s=0.5)  # fmt: skip
    credit, step = peers_now()["peer0"]["contributed_samples"], peers_now()["peer0"]["step"]
    other_step = peers_now()["peer1"]["step"]

    # The other peer goes on training alone; the paused one stays online, computes nothing, loses nothing.
    wait_until(lambda: peers_now()["peer1"]["step"] >= other_step + 3, timeout_s=90,
               what="peer1 to keep training while peer0 is paused")  # fmt: skip
    now = peers_now()["peer0"]
    assert now["state"] == "online" and now["paused"], "a paused peer is still a member of the run"
    assert now["contributed_samples"] == credit and now["step"] == step
    assert f"paused at step {step}" in peers[0].output()
    assert peers[0].process.poll() is None

    resumed = control(swarm, "resume", peers[0].extra["identity"])
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed peer (pid" in resumed.stdout
    wait_until(lambda: peers_now()["peer0"]["contributed_samples"] > credit, timeout_s=120,
               what="peer0 to contribute again after resuming")  # fmt: skip
    assert not peers_now()["peer0"]["paused"]
    assert all(b >= a for a, b in zip(seen_credit, seen_credit[1:], strict=False)), "credit never fell"
    assert "resumed at step" in peers[0].output()


def test_pause_without_a_running_peer_says_so(tmp_path: Path):
    result = subprocess.run(
        [sys.executable, "-m", "peer.cli", "pause", "--identity", str(tmp_path / "nobody.key")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    assert "no running peer uses identity" in result.stderr and "nobody.key" in result.stderr


def test_the_live_panel_shows_progress_contribution_and_the_last_round():
    """The terminal panel, rendered into a file: state, contribution, and the outcome of the last round
    read from the trainer's round counters."""
    statuses = iter(
        [
            {"state": "online", "step": 4, "rounds_ok": 4, "rounds_failed": 0, "contributed_samples": 96},
            {"state": "online", "step": 5, "rounds_ok": 5, "rounds_failed": 0, "contributed_samples": 128,
             "last_round_peers": 3, "samples_per_s": 812.5},
            {"state": "paused", "step": 5, "rounds_ok": 5, "rounds_failed": 1, "contributed_samples": 128},
        ]
    )  # fmt: skip
    latest: dict = {}

    def status() -> dict:
        latest.update(next(statuses, latest))
        return dict(latest)

    screen = io.StringIO()
    panel = Panel(status, stream=screen, live=True)
    stop = asyncio.Event()

    async def show() -> None:
        asyncio.get_running_loop().call_later(1.8, stop.set)
        await panel.run(stop)

    asyncio.run(show())
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", screen.getvalue())  # without the terminal's colours
    assert "my contribution  128 samples" in text and "812.5" in text
    assert "(ok, 3 peers)" in text, "the round that moved the step to 5 succeeded with 3 peers"
    assert "(failed, will retry)" in text and "paused" in text
