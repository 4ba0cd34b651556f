"""Layer-wise adaptive optimizers for large global batches: LAMB and LARS.

A collaborative run's batch is the sum over all its peers, often thousands of samples. At that size one
learning rate for every layer either stalls the small layers or blows up the large ones; these
optimizers scale each parameter tensor's step by a *trust ratio* of its weight norm to its update norm.

- :class:`Lamb`: You et al. 2019, "Large Batch Optimization for Deep Learning: Training BERT in 76
  minutes" (arXiv:1904.00962), Algorithm 2: Adam moments with bias correction, decoupled weight decay,
  then ``w -= lr * clamp(||w|| / ||u||, 0, max_trust_ratio) * u``.
- :class:`Lars`: You et al. 2017 (arXiv:1708.03888): momentum SGD whose per-layer rate is
  ``trust_coefficient * ||w|| / (||g|| + weight_decay * ||w||)``.

Both run one tensor at a time with plain torch ops, so every peer given the same averaged gradient
takes the same step. Their per-parameter state is created by :meth:`initial_state`, which the first
step and :func:`swarm.training.state.ensure_optimizer_state` share, so a peer whose state was created
early steps exactly as one whose state was created by its first step.

Example::

    optimizer = Lamb(model.parameters(), lr=2e-3, betas=(0.9, 0.999), weight_decay=0.01)
    loss.backward()
    optimizer.step()
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["Lamb", "Lars", "trust_ratio"]


def trust_ratio(weight_norm: torch.Tensor, update_norm: torch.Tensor, max_ratio: float) -> torch.Tensor:
    """``||w|| / ||u||`` clamped to ``[0, max_ratio]``; 1 when either norm is zero (a fresh bias, a zero
    update), where the ratio says nothing about the layer's scale."""
    ratio = (weight_norm / update_norm).clamp(0.0, max_ratio)
    return torch.where((weight_norm > 0) & (update_norm > 0), ratio, torch.ones_like(ratio))


class Lamb(torch.optim.Optimizer):
    """LAMB: Adam's direction, each layer's step scaled by its trust ratio (arXiv:1904.00962, Alg. 2)."""

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        max_trust_ratio: float = 10.0,
    ) -> None:
        if not 0 <= betas[0] < 1 or not 0 <= betas[1] < 1:
            raise ValueError(f"betas must be in [0, 1), got {betas}")
        defaults = dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, max_trust_ratio=max_trust_ratio
        )
        super().__init__(params, defaults)

    @staticmethod
    def initial_state(p: torch.Tensor) -> dict[str, torch.Tensor]:
        return {
            "step": torch.tensor(0.0, dtype=torch.float32),
            "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
            "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
        }

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001, ANN201 - torch's signature
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state.update(self.initial_state(p))
                state["step"] += 1
                t = float(state["step"])
                grad = p.grad
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                m_hat = exp_avg / (1 - beta1**t)
                v_hat = exp_avg_sq / (1 - beta2**t)
                update = m_hat / (v_hat.sqrt() + group["eps"])
                if group["weight_decay"]:
                    update.add_(p, alpha=group["weight_decay"])
                ratio = trust_ratio(
                    torch.linalg.vector_norm(p), torch.linalg.vector_norm(update), group["max_trust_ratio"]
                )
                p.sub_(update * (group["lr"] * ratio))
        return loss


class Lars(torch.optim.Optimizer):
    """LARS: momentum SGD with a per-layer rate from the weight and gradient norms (arXiv:1708.03888)."""

    def __init__(
        self,
        params: Iterable,
        lr: float = 1.0,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        trust_coefficient: float = 0.001,
        max_trust_ratio: float = 10.0,
    ) -> None:
        defaults = dict(
            lr=lr,
            momentum=momentum,
            weight_decay=weight_decay,
            trust_coefficient=trust_coefficient,
            max_trust_ratio=max_trust_ratio,
        )
        super().__init__(params, defaults)

    @staticmethod
    def initial_state(p: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"momentum_buffer": torch.zeros_like(p, memory_format=torch.preserve_format)}

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001, ANN201 - torch's signature
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            decay = group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state.update(self.initial_state(p))
                w_norm = torch.linalg.vector_norm(p)
                g_norm = torch.linalg.vector_norm(p.grad)
                local = group["trust_coefficient"] * trust_ratio(
                    w_norm, g_norm + decay * w_norm, group["max_trust_ratio"] / group["trust_coefficient"]
                )
                update = p.grad.add(p, alpha=decay) if decay else p.grad.clone()
                buf = state["momentum_buffer"]
                buf.mul_(group["momentum"]).add_(update * (group["lr"] * local))
                p.sub_(buf)
        return loss
