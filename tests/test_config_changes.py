"""A coordinator started on a data dir whose checkpoints were made under another run config.

A change that leaves the checkpoint loadable (``max_steps``, the learning rate) resumes from it; one that
does not (the model's shape) is refused at start with the field named, rather than serving a state that
no peer can load while the peers silently train from step 0.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from lab.localswarm import running_coordinator, tiny_run
from swarm.config import RunConfig
from swarm.models import build_model
from swarm.training.checkpoint import save_checkpoint
from swarm.training.state import build_shared_optimizer, ensure_optimizer_state, state_tensors

pytestmark = pytest.mark.timeout(120)


def _checkpoint(run: RunConfig, data_dir: Path, step: int) -> None:
    model = build_model(run.model.name, run.model.config, seed=run.training.seed)
    optimizer = build_shared_optimizer(model, run)
    ensure_optimizer_state(model, optimizer)
    save_checkpoint(data_dir / "checkpoints", step, state_tensors(model, optimizer), run, keep=2)


def _wider(run: RunConfig) -> RunConfig:
    spec = run.model_dump(mode="json")
    spec["model"]["config"]["d_model"] = 48
    return RunConfig.parse(spec, source="test")


def test_a_changed_model_shape_is_refused_at_start_naming_the_field(tmp_path: Path):
    run = tiny_run("changed", max_steps=20)
    _checkpoint(run, tmp_path / "data", 7)
    config = tmp_path / "wider.toml"
    _wider(run).to_toml(config)
    result = subprocess.run(
        [sys.executable, "-m", "coordinator.cli", "start", "--config", str(config), "--host", "127.0.0.1",
         "--port", "0", "--dht-port", "0", "--data-dir", str(tmp_path / "data")],
        capture_output=True, text=True, timeout=90,
    )  # fmt: skip
    assert result.returncode == 2, result.stdout + result.stderr
    assert "model.config.d_model" in result.stderr, result.stderr
    assert "ckpt-00000007" in result.stderr and "--data-dir" in result.stderr
    assert not (tmp_path / "data" / "endpoint.json").exists(), "it must not serve the run"


def test_a_safe_change_resumes_from_the_checkpoint(tmp_path: Path):
    run = tiny_run("changed", max_steps=20)
    _checkpoint(run, tmp_path / "data", 7)
    longer = run.model_copy(deep=True)
    longer.training.max_steps = 40
    longer.optimizer.lr = 1e-3

    async def scenario() -> None:
        async with running_coordinator(longer, tmp_path / "data") as node:
            snapshot = await node.snapshot()
            assert snapshot["checkpoint_step"] == 7 and snapshot["run"]["max_steps"] == 40
            assert not snapshot["finished"]

    asyncio.run(scenario())
