"""Time-coupled attacks: a small perturbation that is the same at every step, so that the run's own memory
(DiLoCo's outer momentum, error feedback) adds it up.

``orthogonal_bias`` is the core of the ROP attack on CenteredClip with momentum (Özfatura et al.,
arXiv:2208.09894): each step the colluders send the honest vector (their own, or with ``omniscient`` the
honest peers' exact mean from the public seeds) plus a perturbation orthogonal to it, of ``scale`` times
its norm, along one direction all colluders share and keep. One step's perturbation is within what a
robust rule keeps (it neither shortens nor reverses the honest direction); the outer optimizer's momentum
(0.9 by default: about 10 steps' worth) and the run's memory of past steps pile it up in one direction
the honest gradients never take. Registered with the other attacks.

Example::

    attack = make_attack("orthogonal_bias", {"scale": 0.5}, group_size=5, attackers=2)
    sent = attack.contribution(honest, step)
"""

from __future__ import annotations

import torch
from pydantic import Field

from swarm.byzantine.attacks import Attack, AttackOptions, register_attack


class OrthogonalBiasOptions(AttackOptions):
    """Options of ``orthogonal_bias``."""

    scale: float = Field(1.0, gt=0, le=1e3, description="the perturbation's norm, times the honest vector's")
    direction_seed: int = Field(7, ge=0, description="seeds the one direction every colluder pushes along")
    omniscient: bool = Field(False, description="aim at the honest peers' exact mean (public seeds)")


@register_attack("orthogonal_bias", OrthogonalBiasOptions)
class OrthogonalBias(Attack):
    """The honest vector plus a fixed direction, made orthogonal to it, at ``scale`` times its norm."""

    def contribution(
        self, honest: torch.Tensor, step: int, *, peers: torch.Tensor | None = None
    ) -> torch.Tensor:
        flat = honest.detach().flatten().to(torch.float32)
        reference = (
            peers.to(torch.float32).reshape(-1, flat.numel()).mean(dim=0) if peers is not None else flat
        )
        norm = float(torch.linalg.vector_norm(reference))
        if norm == 0.0:
            return honest
        unit = reference / norm
        generator = torch.Generator(device="cpu").manual_seed(self.options.direction_seed)
        direction = torch.randn(flat.numel(), generator=generator)
        direction -= torch.dot(direction, unit) * unit
        direction /= torch.linalg.vector_norm(direction).clamp_min(1e-30)
        push = self.options.scale * norm * direction
        return (flat + push).reshape(honest.shape).to(honest.dtype)


__all__ = ["OrthogonalBias", "OrthogonalBiasOptions"]
