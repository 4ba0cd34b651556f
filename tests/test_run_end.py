"""A run that ends: at ``max_steps`` the coordinator saves the final checkpoint and says the run finished,
its peers leave with exit code 0, and a restart with a higher ``max_steps`` extends the run for the
peers still running. ``swarm.load_model`` reads the result back.
"""

from __future__ import annotations

import json
import signal
import urllib.request
from pathlib import Path

import pytest
import torch

import swarm as swarm_api
from lab.localswarm import LocalSwarm, free_port, status, tiny_run, wait_until
from protocols.errors import ConfigError
from swarm.models import build_model
from swarm.training.checkpoint import list_checkpoints, save_checkpoint
from swarm.training.state import build_shared_optimizer, ensure_optimizer_state, state_tensors


def _newest_checkpoint(data_dir: Path) -> int:
    found = list_checkpoints(data_dir / "checkpoints")
    return int(found[-1].stem.split("-")[1]) if found else 0


def _training(address: str) -> set[str]:
    return {p.name for p in status(address).peers if p.state == "online" and p.step >= 1}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_run_extended_by_a_restart_finishes_and_its_peers_exit_0(swarm: LocalSwarm):
    port = free_port()
    # The organizer stops the coordinator once both peers train (step 1 in its status). The first run can
    # finish only through this coordinator (its checkpoint at max_steps), so peers that reach max_steps
    # while it is down wait for it instead of leaving. Waiting for a first checkpoint instead raced the
    # peers: CI rehearsals saw it land only after the peers had reached max_steps.
    first = tiny_run(checkpoint_every_steps=2, max_steps=8)
    coordinator = swarm.start_coordinator(first, port=port)
    address, data_dir = coordinator.extra["address"], coordinator.extra["data_dir"]
    peers = [
        swarm.start_peer(address, name, "--max-retry-interval-s", "1", leave_when_finished=True)
        for name in ("a", "b")
    ]
    wait_until(lambda: _training(address) == {"a", "b"}, timeout_s=120, what="both peers training")
    coordinator.signal(signal.SIGINT)
    assert coordinator.wait(timeout_s=30) == 0

    # The organizer raises max_steps; the running peers take the new limit from the restarted coordinator.
    longer = first.model_copy(deep=True)
    longer.training.max_steps = 12
    coordinator = swarm.start_coordinator(
        longer, port=port, data_dir=data_dir, extra_args=["--dashboard-port", "0"]
    )
    for peer in peers:
        assert peer.wait(timeout_s=180) == 0, peer.output()[-3000:]
        out = peer.output()
        assert "the run's max_steps is now 12" in out
        assert "finished at step 12" in out and "leaving" in out

    assert _newest_checkpoint(data_dir) == 12, "the final checkpoint is at the new max_steps"
    snapshot = status(address)
    assert snapshot.finished_step == 12 and snapshot.max_steps == 12
    assert {p.name: p.state for p in snapshot.peers} == {"a": "left", "b": "left"}
    dashboard = coordinator.extra["dashboard_url"].rstrip("/")
    with urllib.request.urlopen(dashboard + "/api/status", timeout=10) as page:
        served = json.load(page)
    assert served["finished"] is True and served["finished_step"] == 12
    with urllib.request.urlopen(dashboard + "/metrics", timeout=10) as page:
        assert "swarm_run_finished 1.0" in page.read().decode()

    model = swarm_api.load_model(data_dir)
    assert isinstance(model, torch.nn.Module) and not model.training


def _perturbed_checkpoint(directory: Path) -> torch.nn.Module:
    run = tiny_run("load")
    model = build_model(run.model.name, run.model.config, seed=run.training.seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.25)
    optimizer = build_shared_optimizer(model, run)
    ensure_optimizer_state(model, optimizer)
    save_checkpoint(directory / "checkpoints", 3, state_tensors(model, optimizer), run, keep=1)
    return model


@pytest.mark.timeout(60)
def test_load_model_returns_the_checkpoints_parameters(tmp_path: Path):
    trained = _perturbed_checkpoint(tmp_path)
    for path in (tmp_path, tmp_path / "checkpoints", list_checkpoints(tmp_path / "checkpoints")[0]):
        loaded = swarm_api.load_model(path)
        for (name, want), (_, got) in zip(
            trained.state_dict().items(), loaded.state_dict().items(), strict=True
        ):
            assert torch.equal(want, got), f"{name} differs after loading {path}"
    assert "load_model" in swarm_api.__all__
    with pytest.raises(ConfigError, match="no checkpoint in"):
        swarm_api.load_model(tmp_path / "empty")
