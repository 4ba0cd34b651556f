"""A researcher's own model and loop in a run: ``describe_model``, ``session.collaborate``, ``collab.step``."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

import swarm as swarm_api
from coordinator.accusations import run_layouts
from coordinator.checkpoints import state_layout
from lab.localswarm import FAST_MEMBERSHIP, ROOT, LocalSwarm, status
from protocols.errors import ConfigError, SwarmError
from swarm.models import build_model
from swarm.models.external import model_layout
from swarm.training.collaboration import DiLoCo, EveryStep
from swarm.training.ownmodel import check_own_model
from swarm.training.state import build_optimizer, state_tensors

EXAMPLES = ROOT / "examples"


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 2))


def _run(model: nn.Module, **training) -> swarm_api.RunConfig:
    return swarm_api.RunConfig(run_id="mine", model=swarm_api.describe_model(model), training=training)


def test_a_described_model_is_built_everywhere_with_the_same_state_layout(tmp_path: Path) -> None:
    model = _net()
    run = _run(model)
    run.to_toml(tmp_path / "run.toml")
    again = swarm_api.RunConfig.from_toml(tmp_path / "run.toml")
    stand_in = build_model(again.model.name, again.model.config)
    assert model_layout(stand_in) == model_layout(model)
    assert sum(p.numel() for p in stand_in.parameters()) == sum(p.numel() for p in model.parameters())
    check_own_model(again, model, build_optimizer(model, again.optimizer))  # accepted as it is
    with pytest.raises(ConfigError, match="researcher's own code"):
        stand_in.loss(torch.zeros(1, 1), torch.zeros(1, 1))


def test_the_coordinator_knows_an_external_models_state_without_its_code() -> None:
    model = _net()
    run = _run(model)
    held = state_tensors(model, build_optimizer(model, run.optimizer))
    layout = state_layout(run)  # what bounds a checkpoint download and checks a resume
    assert layout == {name: (tuple(t.shape), t.numel() * t.element_size()) for name, t in held.items()}
    numel = sum(p.numel() for p in model.parameters())
    assert run_layouts(run) == {"mine": numel, "mine_tier2": numel}  # the averaged vector, in both tiers


def test_a_model_that_differs_from_the_run_is_refused_naming_the_tensor() -> None:
    run = _run(_net())
    wider = nn.Sequential(nn.Linear(8, 32), nn.LayerNorm(32), nn.Linear(32, 2))
    with pytest.raises(ConfigError, match=r"tensor '0.weight' is \[32, 8\] float32; .* has \[16, 8\]"):
        check_own_model(run, wider, build_optimizer(wider, run.optimizer))
    fewer = nn.Sequential(nn.Linear(8, 16), nn.Identity(), nn.Linear(16, 2))
    with pytest.raises(
        ConfigError, match=r"has no tensor '1.weight', which the model of run 'mine' \('external'\) has"
    ):
        check_own_model(run, fewer, build_optimizer(fewer, run.optimizer))


def test_an_optimizer_that_would_step_peers_apart_is_refused_saying_why() -> None:
    model = _net()
    run = _run(model)
    fused = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    with pytest.raises(ConfigError, match="foreach=True: those kernels may differ from device to device"):
        check_own_model(run, model, fused)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match="the optimizer is SGD; .* is AdamW"):
        check_own_model(run, model, sgd)
    other_decay = build_optimizer(model, run.optimizer)
    other_decay.param_groups[0]["weight_decay"] = 0.5
    with pytest.raises(ConfigError, match="group 0: 'weight_decay' is 0.5; run 'mine'.* sets 0.01"):
        check_own_model(run, model, other_decay)


def test_a_strategy_other_than_the_runs_is_refused_naming_the_setting() -> None:
    every_step = _run(_net(), sender_check_probability=0.0)  # its own data: nothing to replay
    diloco = _run(_net(), sync="diloco", inner_steps=20, sender_check_probability=0.0)
    EveryStep().check(every_step)
    DiLoCo(inner_steps=20).check(diloco)
    DiLoCo().check(diloco)
    with pytest.raises(ConfigError, match="training.sync = 'every_step'"):
        DiLoCo().check(every_step)
    with pytest.raises(ConfigError, match="training.inner_steps = 20"):
        DiLoCo(inner_steps=100).check(diloco)
    with pytest.raises(ConfigError, match="training.sync = 'diloco'"):
        EveryStep().check(diloco)
    # A diloco run whose validators replay windows from the public batches refuses a loop of its own.
    checked = _run(_net(), sync="diloco", inner_steps=20)
    with pytest.raises(
        ConfigError, match="sender_check_probability = 0.1.*needs a run with sender_check_probability = 0"
    ):
        DiLoCo().check(checked)


def _two_copies(swarm: LocalSwarm, example: Path, *flags: str) -> tuple[list[dict], str]:
    """The run ``example --write-run`` writes, a coordinator for it, and two copies of ``example`` run
    to their end: each copy's JSON summary, and the coordinator's address."""
    swarm.spawn("write-run", [str(example), "--write-run", str(swarm.root / "run-own.toml")]).wait(120)
    run = swarm_api.RunConfig.from_toml(swarm.root / "run-own.toml")
    run = run.model_copy(update={"membership": FAST_MEMBERSHIP})
    run.training.progress_interval_s, run.training.matchmaking_time_s = 0.3, 1.0
    address = swarm.start_coordinator(run).extra["address"]
    peers = [
        swarm.spawn(
            name,
            [
                str(example),
                "--coordinator",
                address,
                "--identity",
                str(swarm.root / f"{name}.key"),
                "--host",
                "127.0.0.1",
                *flags,
            ],
        )  # fmt: skip
        for name in ("a", "b")
    ]
    for peer in peers:
        assert peer.wait(240) == 0, peer.output()[-3000:]
    return [_summary(peer.output()) for peer in peers], address


def _summary(output: str) -> dict:
    """The example's JSON summary: its last line that is one (hivemind's DHT process may still log after
    it, e.g. asyncio's note on the bootstrap timer task it leaves pending at shutdown)."""
    lines = [line for line in output.splitlines() if line.startswith('{"step"')]
    assert lines, f"no JSON summary in the example's output: {output[-3000:]}"
    return json.loads(lines[-1])


def _assert_one_state_with_a_lower_loss(ends: list[dict], address: str, steps: int) -> None:
    assert [e["step"] for e in ends] == [steps, steps] and all(e["agreed"] for e in ends), ends
    assert ends[0]["param_hash"] == ends[1]["param_hash"], ends
    assert all(e["val_loss_last"] < 0.9 * e["val_loss_first"] for e in ends), ends
    # The coordinator's record (swarm-coordinator status --json) holds both on that hash at that step.
    records = [p for p in status(address).peers if p.name != "volunteer"]
    assert len(records) == 2 and {(p.step, p.param_hash) for p in records} == {(steps, ends[0]["param_hash"])}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_copies_of_the_own_loop_example_end_on_one_parameter_hash_with_a_lower_loss(swarm: LocalSwarm):
    ends, address = _two_copies(swarm, EXAMPLES / "own_loop.py", "--steps", "6")
    _assert_one_state_with_a_lower_loss(ends, address, 6)
    # The built-in loop has no code for a model that lives in the example: it says so and exits.
    refused = swarm.start_peer(address, "volunteer")
    assert refused.wait(60) != 0
    assert "model 'external'" in refused.output() and "session.collaborate" in refused.output()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_copies_of_the_hf_trainer_example_end_on_one_parameter_hash_with_a_lower_loss(swarm: LocalSwarm):
    pytest.importorskip("accelerate", reason='the [hf] extra: pip install -e ".[hf]"')
    out = str(swarm.root / "hf-out")
    ends, address = _two_copies(swarm, EXAMPLES / "hf_trainer.py", "--max-steps", "4", "--output-dir", out)
    _assert_one_state_with_a_lower_loss(ends, address, 4)


def _task(seed: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(n, 8, generator=torch.Generator().manual_seed(seed))
    return x, (x[:, 0] > x[:, 1]).long()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_diloco_from_a_plain_loop_and_an_async_loop_ends_on_one_state(swarm: LocalSwarm, tmp_path: Path):
    # One peer steps from a thread, the other awaits astep on an event loop of its own; DiLoCo's inner
    # steps are the callers' micro-batches and its outer steps the run's.
    run = _run(_net(), sync="diloco", inner_steps=4, micro_batch_size=16, target_batch_size=32,
               sender_check_probability=0.0, progress_interval_s=0.3, matchmaking_time_s=1.0, min_group_size=2)  # fmt: skip
    run = run.model_copy(update={"membership": FAST_MEMBERSHIP, "optimizer": run.optimizer.model_copy(
        update={"lr": 0.01, "warmup_steps": 0})})  # fmt: skip
    address = swarm.start_coordinator(run).extra["address"]
    val_x, val_y = _task(0, 256)
    loss_fn = nn.CrossEntropyLoss()

    @torch.no_grad()
    def validate(model: nn.Module) -> float:
        return float(loss_fn(model(val_x), val_y))

    # Both sessions share one known-coordinators file, as two peers under one HOME do.
    options = {"known_coordinators": tmp_path / "known.json", "host": "127.0.0.1", "join_timeout_s": 60}
    ends: dict[str, tuple] = {}

    def plain(name: str) -> None:
        model = _net()
        with swarm_api.connect(address, identity=tmp_path / f"{name}.key", name=name, **options) as session:
            collab = session.collaborate(model, strategy=DiLoCo(inner_steps=4), validate=validate)
            first = validate(collab.peer.synced_model)
            x, y = _task(1, 16 * 400)
            for i in range(0, len(x), 16):
                loss_fn(model(x[i : i + 16]), y[i : i + 16]).backward()
                if collab.step(16) and collab.global_step == 1:
                    assert model.training, "validation gives the caller's model back in training mode"
                    collab.pause()  # drops its window; the other peer waits for it to come back
                    collab.resume()
                if collab.global_step >= 3:
                    break
            agreed = collab.finish()
            last = validate(collab.peer.synced_model)
            ends[name] = (collab.global_step, collab.param_hash, agreed, first, last, collab.metrics())

    def awaiting(name: str) -> None:
        model = _net()
        with swarm_api.connect(address, identity=tmp_path / f"{name}.key", name=name, **options) as session:

            async def train() -> None:
                collab = await session.acollaborate(model, validate=validate)
                first = validate(collab.peer.synced_model)
                x, y = _task(2, 16 * 400)
                for i in range(0, len(x), 16):
                    loss_fn(model(x[i : i + 16]), y[i : i + 16]).backward()
                    await collab.astep(16)
                    if collab.global_step >= 3:
                        break
                ends[name] = (
                    collab.global_step,
                    collab.param_hash,
                    await collab.afinish(),
                    first,
                    collab.metrics(),
                )

            asyncio.run(train())

    threads = [
        threading.Thread(target=plain, args=("plain",)),
        threading.Thread(target=awaiting, args=("async",)),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=240)
    assert set(ends) == {"plain", "async"}, "both loops ended"
    (step_a, hash_a, agreed_a, first, last, metrics), (step_b, hash_b, agreed_b, *_) = (
        ends["plain"],
        ends["async"],
    )
    assert (step_a, step_b) == (3, 3) and agreed_a and agreed_b and hash_a == hash_b, ends
    assert metrics["inner_steps"] >= 12 and last < 0.9 * first, (first, last, metrics)


def test_collaborate_outside_a_running_session_says_so_instead_of_hanging() -> None:
    session = swarm_api.Session(swarm_api.SessionConfig(coordinator="127.0.0.1:31330"))
    with pytest.raises(SwarmError, match="session.collaborate: the session is not running"):
        session.collaborate(_net())


@pytest.mark.parametrize(
    ("tensor", "error"),
    [
        ({"name": "steps", "shape": [3], "dtype": "int64"}, "a trained tensor must be floating point"),
        ({"name": "loss.weight", "shape": [3]}, "'loss' is an attribute"),
        ({"name": "block.training", "shape": [3]}, "'training' is an attribute"),
        ({"name": "w", "shape": [0, 2**70]}, "dimensions must be in"),
        ({"name": "w", "shape": [2**20, 2**20]}, "more than 4294967296 elements"),
        ({"name": "w", "shape": [3], "dtype": "complex64"}, "'complex64' is not one of"),
    ],
)
def test_an_external_model_that_cannot_be_built_within_bounds_is_refused_naming_the_tensor(tensor, error):
    with pytest.raises(ConfigError, match=error):
        build_model("external", {"tensors": [{"name": "ok", "shape": [2]}, tensor]})
