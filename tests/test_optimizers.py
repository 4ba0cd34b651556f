"""LAMB and LARS: the papers' update rules, and the bit-for-bit guarantees every optimizer of a run gives."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from swarm.components import check_components
from swarm.config import OptimizerConfig, RunConfig
from swarm.models import build_model
from swarm.training.optimizers import Lamb, Lars
from swarm.training.state import (
    build_optimizer,
    decode_state,
    encode_state,
    ensure_optimizer_state,
    load_state_tensors,
    state_hash,
    state_tensors,
)

pytestmark = pytest.mark.timeout(60)

TINY = {"d_model": 32, "n_layer": 1, "n_head": 2, "seq_len": 16}
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "large_batch.toml"


def _grads(params: list[torch.Tensor], seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=generator) * (0.1 + i) for i, p in enumerate(params)]


def _paper_lamb(weights, grads_per_step, lr, beta1, beta2, eps, decay, clamp):
    """Algorithm 2 of arXiv:1904.00962, written out per layer in float64 lists of numbers."""
    weights = [w.double().flatten().tolist() for w in weights]
    m = [[0.0] * len(w) for w in weights]
    v = [[0.0] * len(w) for w in weights]
    for t, grads in enumerate(grads_per_step, start=1):
        for layer, (w, g) in enumerate(zip(weights, grads, strict=True)):
            g = g.double().flatten().tolist()
            m[layer] = [beta1 * a + (1 - beta1) * b for a, b in zip(m[layer], g, strict=True)]
            v[layer] = [beta2 * a + (1 - beta2) * b * b for a, b in zip(v[layer], g, strict=True)]
            m_hat = [a / (1 - beta1**t) for a in m[layer]]
            v_hat = [a / (1 - beta2**t) for a in v[layer]]
            r = [a / (math.sqrt(b) + eps) for a, b in zip(m_hat, v_hat, strict=True)]
            u = [a + decay * x for a, x in zip(r, w, strict=True)]
            w_norm = math.sqrt(sum(x * x for x in w))
            u_norm = math.sqrt(sum(x * x for x in u))
            ratio = min(max(w_norm / u_norm, 0.0), clamp) if w_norm > 0 and u_norm > 0 else 1.0
            weights[layer] = [x - lr * ratio * a for x, a in zip(w, u, strict=True)]
    return weights


@pytest.mark.parametrize("clamp", [10.0, 0.05])
def test_lamb_follows_the_papers_update_rule(clamp: float) -> None:
    generator = torch.Generator().manual_seed(0)
    # A large layer, a small one, and a zero-initialized bias whose trust ratio falls back to 1.
    params = [
        torch.nn.Parameter(torch.randn(16, 8, generator=generator)),
        torch.nn.Parameter(torch.randn(5, generator=generator) * 0.01),
        torch.nn.Parameter(torch.zeros(7)),
    ]
    initial = [p.detach().clone() for p in params]
    lr, betas, eps, decay = 0.01, (0.9, 0.999), 1e-6, 0.01
    optimizer = Lamb(params, lr=lr, betas=betas, eps=eps, weight_decay=decay, max_trust_ratio=clamp)
    steps = [_grads(params, seed) for seed in range(4)]
    for grads in steps:
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        optimizer.step()

    expected = _paper_lamb(initial, steps, lr, *betas, eps, decay, clamp)
    for p, want in zip(params, expected, strict=True):
        torch.testing.assert_close(
            p.detach().double().flatten(), torch.tensor(want, dtype=torch.float64), rtol=1e-5, atol=1e-6
        )
    moved = [float((p.detach() - w).norm()) for p, w in zip(params, initial, strict=True)]
    assert all(d > 0 for d in moved)


def test_lamb_clamps_the_trust_ratio_of_a_layer_with_tiny_updates() -> None:
    weight = torch.nn.Parameter(torch.full((4,), 100.0))
    optimizer = Lamb([weight], lr=0.1, eps=1e-9, max_trust_ratio=2.0)
    weight.grad = torch.full((4,), 1e-3)
    optimizer.step()
    # The first Adam step is +-1 per coordinate: ||w|| / ||u|| = 100, clamped to 2, so each moves by 0.2.
    torch.testing.assert_close(weight.detach(), torch.full((4,), 99.8), rtol=0, atol=1e-4)


def test_lars_follows_its_layerwise_rate() -> None:
    generator = torch.Generator().manual_seed(1)
    weight = torch.nn.Parameter(torch.randn(6, 3, generator=generator))
    lr, momentum, decay, eta = 0.5, 0.9, 0.01, 0.001
    optimizer = Lars([weight], lr=lr, momentum=momentum, weight_decay=decay, trust_coefficient=eta)
    w = weight.detach().double().clone()
    buf = torch.zeros_like(w)
    for seed in range(3):
        g = _grads([weight], seed)[0]
        weight.grad = g.clone()
        optimizer.step()
        g = g.double()
        local = eta * w.norm() / (g.norm() + decay * w.norm())
        buf = momentum * buf + lr * local * (g + decay * w)
        w = w - buf
    torch.testing.assert_close(weight.detach().double(), w, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name", ["lamb", "lars"])
def test_early_state_steps_bit_for_bit_like_a_fresh_optimizer(name: str) -> None:
    config = OptimizerConfig(name=name, lr=1e-2, warmup_steps=0, total_steps=10)
    fresh, early = build_model("gpt", TINY, seed=0), build_model("gpt", TINY, seed=0)
    fresh_opt, early_opt = build_optimizer(fresh, config), build_optimizer(early, config)
    ensure_optimizer_state(early, early_opt)
    for model, opt in ((fresh, fresh_opt), (early, early_opt)):
        for p, g in zip(model.parameters(), _grads(list(model.parameters()), 3), strict=True):
            p.grad = g
        opt.step()
    assert state_hash(1, state_tensors(fresh, fresh_opt)) == state_hash(1, state_tensors(early, early_opt))


@pytest.mark.parametrize("name", ["lamb", "lars"])
def test_state_travels_to_a_late_peer_and_both_step_alike(name: str) -> None:
    config = OptimizerConfig(name=name, lr=1e-2, warmup_steps=0, total_steps=10)
    source = build_model("gpt", TINY, seed=0)
    source_opt = build_optimizer(source, config)
    for p, g in zip(source.parameters(), _grads(list(source.parameters()), 5), strict=True):
        p.grad = g
    source_opt.step()
    blob = encode_state(1, state_tensors(source, source_opt), {"run_id": "r"})
    late = build_model("gpt", TINY, seed=7)
    late_opt = build_optimizer(late, config)
    load_state_tensors(late, late_opt, decode_state(blob, max_bytes=1 << 26).tensors)
    for model, opt in ((source, source_opt), (late, late_opt)):
        for p, g in zip(model.parameters(), _grads(list(model.parameters()), 6), strict=True):
            p.grad = g
        opt.step()
    assert state_hash(2, state_tensors(source, source_opt)) == state_hash(2, state_tensors(late, late_opt))


def test_large_batch_recipe_parses_and_builds_lamb() -> None:
    run = RunConfig.from_toml(EXAMPLE)
    check_components(run)
    assert run.optimizer.name == "lamb" and run.training.target_batch_size >= 1024
    assert run.training.precision == "bf16"
    model = build_model(run.model.name, {**run.model.config, "n_layer": 1}, seed=0)
    assert isinstance(build_optimizer(model, run.optimizer), Lamb)
