"""The coordinator checkpoints every pipeline stage, and a pipeline swarm restarted from nothing resumes.

A coordinator, one replica per stage and one trainer run as separate processes on loopback to step 4;
the coordinator saves each stage's agreed state at steps 2 and 4 (verified against its replicas' hash).
Then every process is killed, and a new coordinator on the same data dir, new stage peers and a new
trainer (new identities, nothing on disk) resume: the trainer's first validation is at step 4 with the
loss it measured there before the restart.
"""

from __future__ import annotations

import math
import signal
import time
from pathlib import Path

import pytest

from coordinator.cli import status_to_dict
from lab.localswarm import LocalSwarm, status, tiny_run
from swarm.config import RunConfig
from swarm.training.checkpoint import load_latest_checkpoint


def pipeline_run(max_steps: int) -> RunConfig:
    data = tiny_run("pipe-resume", max_steps=max_steps, checkpoint_every_steps=2, min_group_size=1,
                    target_batch_size=16).model_dump(mode="json")  # fmt: skip
    data["model"]["config"]["n_layer"] = 2
    data["pipeline"] = {"stages": 2, "announce_interval_s": 0.3, "request_timeout_s": 5.0,
                        "rebalance_interval_s": 3600.0}  # fmt: skip
    return RunConfig.parse(data)


def trainer_metrics(address: str, name: str) -> dict[str, float]:
    rows = {p["name"]: p for p in status_to_dict(status(address))["peers"]}
    return rows[name]["metrics"] if name in rows else {}


def train(swarm: LocalSwarm, run: RunConfig, data_dir: Path, tag: str, timeout_s: float) -> dict[str, float]:
    coordinator = swarm.start_coordinator(run, name=f"coordinator-{tag}", data_dir=data_dir)
    address = coordinator.extra["address"]
    peers = [
        swarm.start_peer(address, f"stage{k}-{tag}", "--role", "stage", "--stage", str(k)) for k in (0, 1)
    ]
    peers.append(swarm.start_peer(address, f"trainer-{tag}", "--role", "trainer"))
    deadline = time.monotonic() + timeout_s
    last = [
        data_dir / "checkpoints" / f"stage{k}" / f"ckpt-{run.training.max_steps:08d}.safetensors"
        for k in (0, 1)
    ]
    while trainer_metrics(address, f"trainer-{tag}").get("finished") != 1.0 or not all(
        p.exists() for p in last
    ):
        for child in [coordinator, *peers]:
            assert child.process.poll() is None, f"{child.name} exited:\n{child.output()[-3000:]}"
        assert time.monotonic() < deadline, f"no step {run.training.max_steps} within {timeout_s:.0f}s"
        time.sleep(1.0)
    time.sleep(1.5)  # the trainer's last validation reaches its heartbeat
    metrics = trainer_metrics(address, f"trainer-{tag}")
    for child in [*peers, coordinator]:
        child.signal(signal.SIGKILL)
    return metrics


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_restarted_pipeline_swarm_resumes_from_the_stage_checkpoints(swarm: LocalSwarm, tmp_path: Path):
    data_dir = tmp_path / "coordinator-data"
    before = train(swarm, pipeline_run(4), data_dir, "a", timeout_s=180)
    assert before["step"] == 4 and math.isfinite(before["val_loss"])
    for k in (0, 1):
        checkpoint = load_latest_checkpoint(data_dir / "checkpoints" / f"stage{k}")
        assert checkpoint is not None and checkpoint.step == 4, f"stage {k} is checkpointed at step 4"
    after = train(swarm, pipeline_run(6), data_dir, "b", timeout_s=180)
    assert after["val_step_initial"] == 4, "the restarted swarm resumed at the checkpoint's step"
    assert after["val_loss_initial"] == pytest.approx(before["val_loss"], abs=1e-6), "with the same loss"
    assert after["step"] == 6 and after["microbatches_lost"] == 0
