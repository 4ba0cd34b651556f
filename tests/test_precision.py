"""Mixed precision: bf16/fp16 compute with fp32 weights, state and gradients; loss scaling; refusal at join."""

from __future__ import annotations

import pytest
import torch
from helpers import run_tiny_sim

from protocols.errors import ConfigError
from swarm.config import OptimizerConfig, RunConfig
from swarm.models import build_model
from swarm.training.microbatch import MicroBatchRunner
from swarm.training.precision import LossScaler, autocast, check_precision
from swarm.training.state import (
    apply_flat_gradient,
    build_optimizer,
    flat_mean_gradient,
    state_tensors,
)

pytestmark = pytest.mark.timeout(120)

SMALL = {"d_model": 64, "n_layer": 2, "n_head": 2, "seq_len": 32}
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="fp16 autocast needs a CUDA GPU")


def _batch(n: int = 4, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 256, (n, SMALL["seq_len"] + 1), generator=torch.Generator().manual_seed(seed))
    return ids[:, :-1], ids[:, 1:]


def _flat_grad(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def test_a_cpu_peer_refuses_an_fp16_run_naming_the_field() -> None:
    with pytest.raises(ConfigError, match=r"training\.precision = 'fp16'.*CUDA GPU.*cpu"):
        check_precision("fp16", "cpu")
    with pytest.raises(ConfigError, match="training.precision"):
        MicroBatchRunner(build_model("gpt", SMALL, seed=0), device="cpu", precision="fp16")
    check_precision("bf16", "cpu")
    check_precision("fp32", "cpu")
    with pytest.raises(ConfigError, match="training.precision"):
        RunConfig.parse({"run_id": "r", "training": {"precision": "fp8"}})


def test_bf16_computes_in_bf16_but_keeps_weights_gradients_and_optimizer_state_fp32() -> None:
    model = build_model("gpt", SMALL, seed=0)
    with autocast("bf16", "cpu"):
        hidden = model.blocks[0].mlp.fc(torch.zeros(1, SMALL["d_model"]))
    assert hidden.dtype == torch.bfloat16

    runner = MicroBatchRunner(model, precision="bf16")
    runner.run(*_batch())
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())
    params = list(model.parameters())
    averaged = flat_mean_gradient(params, 4)
    assert averaged.dtype == torch.float32
    config = OptimizerConfig(name="adamw", lr=1e-3)
    optimizer = build_optimizer(model, config)
    apply_flat_gradient(model, params, optimizer, config, 0, averaged)
    assert all(t.dtype == torch.float32 for t in state_tensors(model, optimizer).values())


def test_bf16_loss_and_gradient_track_fp32() -> None:
    results = {}
    for precision in ("fp32", "bf16"):
        model = build_model("gpt", SMALL, seed=0)
        loss = MicroBatchRunner(model, precision=precision).run(*_batch())
        results[precision] = (loss, _flat_grad(model))
    (loss32, grad32), (loss16, grad16) = results["fp32"], results["bf16"]
    assert loss16 == pytest.approx(loss32, rel=0.01)
    cosine = torch.nn.functional.cosine_similarity(grad32, grad16, dim=0)
    assert cosine > 0.99, float(cosine)


def test_two_bf16_peers_with_the_same_data_compute_the_same_bits() -> None:
    grads = []
    for _ in range(2):
        model = build_model("gpt", SMALL, seed=0)
        MicroBatchRunner(model, precision="bf16").run(*_batch())
        grads.append(_flat_grad(model))
    assert torch.equal(grads[0], grads[1])


def test_loss_scaler_halves_on_overflow_and_grows_after_clean_steps() -> None:
    scaler = LossScaler(True, init_scale=8.0, growth_interval=2, min_scale=1.0)
    assert scaler.found_overflow([torch.tensor([1.0, float("inf")])])
    assert scaler.scale == 4.0 and scaler.overflows == 1
    assert not scaler.found_overflow([torch.ones(3), None])
    assert not scaler.found_overflow([torch.ones(3)])
    assert scaler.scale == 8.0
    off = LossScaler(False)
    assert off.scale == 1.0 and not off.found_overflow([torch.tensor([float("nan")])])
    floor = LossScaler(True, init_scale=1.0)
    with pytest.raises(FloatingPointError, match="diverged"):
        floor.found_overflow([torch.tensor([float("nan")])])


def test_an_overflowing_scale_is_retried_and_the_unscaled_gradient_is_exact() -> None:
    reference = build_model("gpt", SMALL, seed=0)
    MicroBatchRunner(reference).run(*_batch())
    scaled = []
    for _ in range(2):
        model = build_model("gpt", SMALL, seed=0)
        runner = MicroBatchRunner(model)
        # fp32 overflows past 2**128: the first tries give inf, the scale halves until it fits.
        runner.scaler = LossScaler(True, init_scale=2.0**140)
        runner.run(*_batch())
        assert runner.scaler.overflows >= 10 and runner.scaler.scale < 2.0**128
        scaled.append((runner.scaler.scale, _flat_grad(model)))
    assert scaled[0][0] == scaled[1][0] and torch.equal(scaled[0][1], scaled[1][1]), "deterministic"
    # Powers of two scale and unscale exactly: the gradient is the fp32 one bit for bit.
    assert torch.equal(scaled[0][1], _flat_grad(reference))


@CUDA
def test_fp16_on_a_gpu_keeps_fp32_gradients_and_tracks_fp32() -> None:
    results = {}
    for precision in ("fp32", "fp16"):
        model = build_model("gpt", SMALL, seed=0).to("cuda")
        runner = MicroBatchRunner(model, device="cuda", precision=precision)
        loss = runner.run(*_batch())
        assert all(p.grad.dtype == torch.float32 for p in model.parameters())
        results[precision] = (loss, _flat_grad(model).cpu(), runner.scaler.scale)
    (loss32, grad32, _), (loss16, grad16, scale) = results["fp32"], results["fp16"]
    assert scale > 1.0
    assert loss16 == pytest.approx(loss32, rel=0.01)
    assert torch.nn.functional.cosine_similarity(grad32, grad16, dim=0) > 0.99


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU peer is what cannot honour fp16")
def test_a_cpu_volunteer_of_an_fp16_run_says_so_at_join_and_exits(swarm) -> None:
    from lab.localswarm import tiny_run

    # fp16 cannot be replayed by sender checks (RunConfig refuses the pair): this run checks none.
    coordinator = swarm.start_coordinator(tiny_run(precision="fp16", sender_check_probability=0.0))
    peer = swarm.start_peer(coordinator.extra["address"], "cpu-peer")
    assert peer.wait(timeout_s=90) == 2
    assert "training.precision = 'fp16'" in peer.output() and "CUDA GPU" in peer.output()


@pytest.mark.slow
@pytest.mark.timeout(1000)
def test_a_bf16_swarm_with_checkpointing_stays_bit_identical_and_learns_like_fp32(
    tmp_path, clean_tiny_sim
) -> None:
    """3 peers with ``precision = "bf16"`` and activation checkpointing against the same run in fp32
    (the shared clean run: 3 peers, 6 steps, tiny model)."""
    report = run_tiny_sim(tmp_path, "--precision", "bf16", "--activation-checkpointing")
    for run in (clean_tiny_sim, report):
        assert len(run["peers"]) == 3 and all(p["step"] == 6 for p in run["peers"])
        assert {p["param_hash"] for p in run["peers"]} == {run["final_param_hash"]}, "bit-identical"
        assert run["final_val_loss"] < run["initial_val_loss"]
        # Validators replayed honest senders (a sender drawn at every check) and found every one exact,
        # in bf16 with checkpointing too: nobody accused, nobody banned.
        assert sum(p["senders_checked"] for p in run["peers"]) > 0, run["peers"]
        assert not any(p["senders_caught"] or p["banned"] for p in run["peers"]), run["peers"]
    assert report["final_val_loss"] == pytest.approx(clean_tiny_sim["final_val_loss"], rel=0.02)
