"""Checks on what a groupmate sends before it is aggregated, and weights that no sender can inflate.

Every function here is pure: it looks at its arguments and either returns or raises
:class:`~protocols.errors.InvalidContribution` with a message naming the sender and what is wrong. The
caller drops the contribution and reports the sender.

Example::

    values = validate_contribution(decoded, expected_numel=1 << 18, max_norm=1e4, sender=peer)
    weights = fair_weights([1.0, 1.0, 1e6])   # -> [1.0, 1.0, 1.0]: no sender outweighs the median one
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from protocols.errors import InvalidContribution

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _who(sender: str | None) -> str:
    return f"contribution from {sender}" if sender else "contribution"


def check_shape(values: torch.Tensor, expected_numel: int, *, sender: str | None = None) -> None:
    """A flat floating-point tensor of exactly ``expected_numel`` values."""
    if not isinstance(values, torch.Tensor):
        raise InvalidContribution(f"{_who(sender)} is a {type(values).__name__}, not a tensor")
    if values.dtype not in FLOAT_DTYPES:
        raise InvalidContribution(f"{_who(sender)} has dtype {values.dtype}, expected a floating-point dtype")
    if values.dim() != 1:
        raise InvalidContribution(f"{_who(sender)} has shape {tuple(values.shape)}, expected a flat vector")
    if values.numel() != expected_numel:
        raise InvalidContribution(f"{_who(sender)} has {values.numel()} values, expected {expected_numel}")


def check_finite(values: torch.Tensor, *, sender: str | None = None) -> None:
    """No NaN and no infinity anywhere."""
    finite = torch.isfinite(values)
    if not bool(finite.all()):
        bad = int((~finite).sum())
        first = int((~finite).nonzero()[0, 0]) if values.dim() else 0
        raise InvalidContribution(
            f"{_who(sender)} has {bad} non-finite values (NaN or inf), the first at index {first}"
        )


def check_norm(values: torch.Tensor, max_norm: float, *, sender: str | None = None) -> float:
    """The Euclidean norm of ``values`` (float64), which must not exceed ``max_norm``."""
    norm = float(torch.linalg.vector_norm(values.to(torch.float64)))
    if not norm <= max_norm:
        raise InvalidContribution(f"{_who(sender)} has norm {norm:.6g}, above the bound {max_norm:.6g}")
    return norm


def validate_contribution(
    values: torch.Tensor,
    expected_numel: int,
    *,
    max_norm: float | None = None,
    sender: str | None = None,
) -> torch.Tensor:
    """``values`` as a flat float32 tensor, after checking size, dtype, finiteness and the norm bound.

    Raises :class:`InvalidContribution` naming ``sender`` and the first problem found.
    """
    if max_norm is not None and not (math.isfinite(max_norm) and max_norm > 0):
        raise ValueError(f"max_norm must be a positive finite number, got {max_norm!r}")
    check_shape(values, expected_numel, sender=sender)
    check_finite(values, sender=sender)
    if max_norm is not None:
        check_norm(values, max_norm, sender=sender)
    return values.to(torch.float32)


def validate_weight(claimed: float, *, max_weight: float | None = None, sender: str | None = None) -> float:
    """A sender's claimed weight (its sample count), which must be a finite number in ``[0, max_weight]``."""
    try:
        weight = float(claimed)
    except (TypeError, ValueError):
        raise InvalidContribution(
            f"{_who(sender)} claims a weight that is not a number: {claimed!r}"
        ) from None
    if not math.isfinite(weight) or weight < 0:
        raise InvalidContribution(f"{_who(sender)} claims weight {weight!r}, expected a finite number >= 0")
    if max_weight is not None and weight > max_weight:
        raise InvalidContribution(
            f"{_who(sender)} claims weight {weight:.6g}, above the limit {max_weight:.6g}"
        )
    return weight


def fair_weights(claimed: Sequence[float] | torch.Tensor, *, max_weight: float | None = None) -> torch.Tensor:
    """Weights clipped to a fair share: never what a sender claims beyond what most senders claim.

    A non-finite or negative claim counts as 0 (the sender contributes nothing). Every other claim is
    capped at the (lower) median of the positive claims, and at ``max_weight`` if given. With fewer than half of
    the senders lying, the median is at most an honest sender's claim, so a liar can weigh no more than
    an honest sender, however much it claims. Returns float64.
    """
    weights = torch.as_tensor(claimed, dtype=torch.float64).flatten().clone()
    weights[~torch.isfinite(weights) | (weights < 0)] = 0.0
    positive = sorted(w for w in weights.tolist() if w > 0)
    if positive:
        # The lower median: of two senders, neither may outweigh the other.
        weights.clamp_(max=positive[(len(positive) - 1) // 2])
    if max_weight is not None:
        weights.clamp_(max=max_weight)
    return weights
