"""``swarm-sim``, the README's main job: a coordinator and peers as separate processes, with churn."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import sim_failure

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]


def test_swarm_sim_trains_with_churn_and_peers_agree(tmp_path: Path):
    out = tmp_path / "sim.json"
    result = subprocess.run(
        [sys.executable, "-m", "lab.sim", "--peers", "3", "--steps", "8", "--model-size", "tiny",
         "--churn", "--json", str(out), "--timeout-s", "480"],
        capture_output=True, text=True, timeout=540,
    )  # fmt: skip
    assert result.returncode == 0, sim_failure(result)
    report = json.loads(out.read_text())
    assert report["steps"] == 8
    assert report["final_val_loss"] < report["initial_val_loss"], "validation loss fell"
    assert len(report["peers"]) == 3
    hashes = {peer["param_hash"] for peer in report["peers"]}
    assert hashes == {report["final_param_hash"]}, "every peer holds the parameters of the final checkpoint"
    assert all(peer["step"] == 8 for peer in report["peers"])
    assert report["churn_events"] and report["churn_events"][0]["restarted"]
    assert set(report["bytes_sent_per_peer"]) == {peer["peer_id"] for peer in report["peers"]}
    assert sum(report["bytes_sent_per_peer"].values()) > 0
    assert "hold identical parameters" in result.stdout
    # The per-step figures of the peers' round journals: each step applied by a group of 2 or more (the
    # killed peer, when its round was done and not yet written down, counted as its group's), and the
    # restarted peer's first download counted as a joiner's.
    per_step = report["per_step"]
    assert [f["step"] for f in per_step] == list(range(8))
    assert all(f["largest_group"] >= 2 and f["peers_applied"] + f["lives_ended"] >= 2 for f in per_step), (
        per_step
    )
    assert sum(f["lives_ended"] for f in per_step) <= 1, per_step  # the killed peer's first life only
    assert sum(f["joiner_downloads"] for f in per_step) >= 1, per_step


def test_swarm_sim_rejects_bad_flags():
    result = subprocess.run(
        [sys.executable, "-m", "lab.sim", "--peers", "0"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2 and "--peers" in result.stderr
    result = subprocess.run(
        [sys.executable, "-m", "lab.sim", "--stages", "2", "--replace-into-stage", "2",
         "--kill-stage-peer-at", "3"], capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert (
        result.returncode == 2 and "--replace-into-stage 2" in result.stderr and "--stages 2" in result.stderr
    )


def test_two_groups_of_a_step_apply_one_update_through_the_second_tier(tmp_path: Path):
    """4 peers in groups of at most 2: every step has two groups, and from the third step on (the first two
    may start apart while the peers' views fill) every peer applies one update, with no state download."""
    out = tmp_path / "sim.json"
    result = subprocess.run(
        [sys.executable, "-m", "lab.sim", "--peers", "4", "--steps", "5", "--model-size", "tiny",
         "--target-batch-size", "1024", "--max-group-size", "2", "--min-group-size", "2",
         "--json", str(out), "--timeout-s", "300"],
        capture_output=True, text=True, timeout=360,
    )  # fmt: skip
    assert result.returncode == 0, sim_failure(result)
    report = json.loads(out.read_text())
    assert report["final_val_loss"] < report["initial_val_loss"], "validation loss fell"
    assert {peer["param_hash"] for peer in report["peers"]} == {report["final_param_hash"]}
    steady = report["per_step"][2:]
    assert [f["step"] for f in steady] == [2, 3, 4]
    assert all(f["groups"] == 2 and f["largest_group"] == 2 for f in steady), steady
    assert all(f["peers_applied"] == 4 and f["same_update"] for f in steady), steady
    assert report["steady_state_downloads"] == 0
