"""The rules a reducer applies to the contributions it receives for its part of the vector.

An aggregator is ``aggregate(contributions[n, d] float32, weights[n] float64, *, seed) -> [d] float32``:
the stacked contributions of the ``n`` senders for one chunk of the reducer's part, one weight per sender,
and the round's shared random seed (it drives bucketing's permutation). Rules are registered by name
with a typed options model, like models; organizers may add their own through the ``swarm.aggregators``
entry point group.

Every rule is **bit-reproducible**: a validator that runs the same rule on the same inputs gets the
same bits, whatever its thread count or CPU. Reductions over values are written as elementwise tensor
operations in a fixed order (a fixed pairwise tree for norms, a fixed row order for sums, comparator
networks or a sort for order statistics), never as a library reduction whose order depends on threads
or vector width; signed zeros are normalized. ``mean`` keeps its original formula.

Rules (details, defaults and costs in docs/robustness.md):

- ``mean``: the weighted average; not robust to a single bad sender. For comparison.
- ``centered_clip`` (the default of a run): start from the coordinate-wise median, then iterate
  ``v <- v + sum_i w_i clip(x_i - v, tau) / sum_i w_i``, where ``clip`` scales the whole difference
  vector down to norm ``tau``; stop early when a step is shorter than ``tolerance * tau``.
- ``trimmed_mean``: per coordinate, drop the ``trim`` largest and smallest values, average the rest.
- ``coordinate_median``: per coordinate, the median (the mean of the two middle values for even n).

Every rule takes ``bucket_size``: with ``s > 1`` the senders are shuffled with the round's seed, the
contributions of each bucket of ``s`` are averaged, and the rule is applied to the bucket averages.

Weights: ``mean`` uses them as given. The robust rules never let a claimed weight dominate: a sender
with a zero, negative or non-finite weight, or a non-finite value, is left out, and ``centered_clip``
caps every weight at the median weight of the senders (with fewer than half of the senders malicious,
that is at most an honest sender's weight). ``trimmed_mean`` and ``coordinate_median`` count every
remaining sender once.

Example::

    aggregate = get_aggregator("centered_clip", {"tau": 1.0, "iterations": 5})
    result = aggregate(torch.stack([a, b, c]), torch.tensor([1.0, 1.0, 1.0], dtype=torch.float64), seed=0)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from functools import cache
from typing import Any, Literal, Protocol

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from protocols.errors import InvalidContribution
from swarm.averaging.validation import fair_weights
from swarm.registry import Registry

# Above this many senders a sort is faster than a comparator network; both give the same values.
_NETWORK_MAX_ROWS = 64
# centered_clip's median projection needs this many senders (see _at_median_projection).
PROJECTION_MIN_SENDERS = 5


class AggregatorFn(Protocol):
    """A rule: one row of ``contributions`` per sender and one weight each in, the aggregate out; ``seed``
    fixes any randomness, so every reducer of the same inputs returns the same bits."""

    def __call__(self, contributions: torch.Tensor, weights: torch.Tensor, *, seed: int) -> torch.Tensor: ...


AggregatorFactory = Callable[[Any], AggregatorFn]

AGGREGATORS: Registry[AggregatorFactory] = Registry(kind="aggregator", group="swarm.aggregators")

DEFAULT_AGGREGATOR = "centered_clip"


class AggregatorOptions(BaseModel):
    """Options every rule accepts."""

    model_config = ConfigDict(extra="forbid")

    bucket_size: int = Field(
        1, ge=1, le=1024, description="average shuffled buckets of this many senders first; 1: off"
    )


# Kept for plugins written against the first version of this module.
NoOptions = AggregatorOptions


class CenteredClipOptions(AggregatorOptions):
    """CenteredClip: iterative clipping around a robust center."""

    tau: float = Field(
        1.0, gt=0, le=1e12, description="clipping radius; relative: a multiple of the median distance"
    )
    tau_mode: Literal["relative", "absolute"] = Field(
        "relative",
        description="relative: tau times the median distance of the senders to the coordinate-wise "
        "median of the chunk (scale-free); absolute: tau in the units of the values",
    )
    iterations: int = Field(5, ge=1, le=100, description="at most this many clipping iterations")
    tolerance: float = Field(
        0.01, ge=0, le=1, description="stop early once a step is shorter than tolerance * radius"
    )
    magnitude: Literal["clipped", "median_projection"] = Field(
        "median_projection",
        description="clipped: the clipped center as it is; median_projection: with 5 senders or more that "
        "agree (see agreement), the center's direction at the median of the senders' projections onto it if "
        "that is longer, so that senders pulling toward zero cannot shrink it (see docs/robustness.md)",
    )
    agreement: float = Field(
        0.8, ge=0, le=1,
        description="median_projection applies only while the median cosine of the senders to the center is "
        "at least this: DiLoCo pseudo-gradients agree (0.9 and above), every-step gradients do not",
    )  # fmt: skip


class TrimmedMeanOptions(AggregatorOptions):
    """Coordinate-wise trimmed mean; give ``trim`` (a count) or ``trim_fraction``, not both."""

    trim: int | None = Field(None, ge=0, le=511, description="values dropped at each end of every coordinate")
    trim_fraction: float | None = Field(
        None, ge=0, lt=0.5, description="fraction of senders dropped at each end (rounded down)"
    )

    @model_validator(mode="after")
    def _one_trim(self) -> TrimmedMeanOptions:
        if self.trim is not None and self.trim_fraction is not None:
            raise ValueError("give either trim or trim_fraction, not both")
        return self

    def trim_count(self, n: int) -> int:
        """Values dropped at each end for ``n`` rows: never so many that nothing is left."""
        if self.trim is not None:
            wanted = self.trim
        elif self.trim_fraction is not None:
            wanted = math.floor(self.trim_fraction * n)
        else:  # the default: as many as fewer than half of the senders can be, i.e. up to f < n/2
            wanted = (n - 1) // 2
        return min(wanted, (n - 1) // 2)


def register_aggregator(name: str, config_cls: type[BaseModel] = AggregatorOptions) -> Callable:
    """Register ``factory(options) -> aggregate(contributions, weights, *, seed)`` under ``name``."""
    return AGGREGATORS.register(name, config_cls)


def aggregator_config(name: str, config: Mapping[str, Any] | None = None) -> BaseModel:
    """The typed options of rule ``name``; a ConfigError names the bad field and the allowed values."""
    return AGGREGATORS.validate(name, config)


def get_aggregator(name: str, config: Mapping[str, Any] | None = None) -> AggregatorFn:
    return AGGREGATORS.get(name).factory(AGGREGATORS.validate(name, config))


# --- the rules ----------------------------------------------------------------------------------------


@register_aggregator("mean")
def weighted_mean(config: AggregatorOptions) -> AggregatorFn:
    """The weighted average: what plain data-parallel SGD computes. Not robust to a single bad sender."""

    def core(contributions: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        weights = weights.to(contributions.dtype)
        if float(weights.sum()) <= 0:
            weights = torch.ones_like(weights)
        return (weights[:, None] * contributions).sum(dim=0) / weights.sum()

    def aggregate(contributions: torch.Tensor, weights: torch.Tensor, *, seed: int) -> torch.Tensor:
        _check_inputs(contributions, weights, seed)
        if config.bucket_size > 1:
            contributions, weights = _buckets(contributions, weights, config.bucket_size, seed)
        return core(contributions, weights)

    return aggregate


@register_aggregator("centered_clip", CenteredClipOptions)
def centered_clip(config: CenteredClipOptions) -> AggregatorFn:
    """CenteredClip from the coordinate-wise median: robust to fewer than half bad senders."""

    def core(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        v = _median_rows(_sorted_rows(x))
        if x.shape[0] <= 2:
            # One sender: its values. Two: nothing tells the honest one apart; the midpoint is the median.
            return v
        weights = w / _ordered_sum(w)
        # Two scratch buffers of the contributions' size serve every iteration: no allocation per step.
        diff, scratch = torch.sub(x, v), torch.empty_like(x)
        norms = _row_norms(diff, scratch)
        if config.tau_mode == "absolute":
            radius = config.tau
        else:
            radius = config.tau * _median_of(norms)
            if radius <= 0:  # at least half the senders sent exactly the median
                return v
        for iteration in range(config.iterations):
            if iteration:
                torch.sub(x, v, out=diff)
                norms = _row_norms(diff, scratch)
            scale = torch.where(norms > radius, radius / norms, torch.ones_like(norms))
            step = _weighted_row_sum(diff, (weights * scale).to(torch.float32))
            v = v + step
            if float(_row_norms(step[None])[0]) <= config.tolerance * radius:
                break
        if config.magnitude == "median_projection" and x.shape[0] >= PROJECTION_MIN_SENDERS:
            v = _at_median_projection(x, v, config.agreement, diff, scratch)
        return v + 0.0

    return _robust(core, config, capped_weights=True)


def _at_median_projection(
    x: torch.Tensor, v: torch.Tensor, agreement: float, unit: torch.Tensor, scratch: torch.Tensor
) -> torch.Tensor:
    """``v``'s direction at the length of the median of the rows' projections onto it, when that is longer
    than ``v`` and the median of the rows' cosines to ``v`` is at least ``agreement``; else ``v``.

    Clipping bounds how far each sender pulls the center, not which way: senders that send zero, a
    scaled-down or a reversed gradient all pull it toward zero, and 2 of 5 shrank a DiLoCo outer step
    by 16-24%. A projection is one number per sender, so with fewer than half of the senders lying the
    median lies between two honest senders' projections, whatever the liars send. Only when the senders
    agree, though: among nearly orthogonal every-step gradients one sender of three could tilt ``v`` so
    far that an honest sender's own projection was 0 (the median, so the chunk's update) or steer a
    full-length step away from an honest sender's batch (``tests/test_projection_redteam.py``). The
    length never falls below the clipped center's, so the rule is never shorter than ``clipped``. The
    caller applies it only with ``PROJECTION_MIN_SENDERS`` or more: with 3 or 4, one attacker's own
    cosine opened the agreement and its projection above both honest ones chose the longer honest
    length for a direction it had tilted, 17-28% farther from the honest mean than the worst ``clipped``
    allows (``tests/test_projection_redteam2.py``); from 5 senders a search found nothing past that.

    Each row is first divided by its largest magnitude, so that no float32 sum can overflow (a row of
    +-3e38, which int8 accepts, once summed to inf - inf: NaN); ``unit`` and ``scratch`` are buffers shaped
    like ``x``, overwritten."""
    norm = float(_row_norms(v[None])[0])
    if not 0 < norm < math.inf:
        return v
    scales = torch.maximum(x.amax(dim=1), -x.amin(dim=1))  # exact in any order
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    torch.div(x, scales[:, None], out=unit)
    along = _row_sums(torch.mul(unit, v / norm, out=scratch))  # each |term| <= |v_j| / |v|: no overflow
    lengths = _row_norms(unit, scratch)
    cosines = torch.where(lengths > 0, along / lengths.clamp_min(1e-300), torch.zeros_like(along))
    length = _median_of(along * scales.to(torch.float64))
    if _median_of(cosines) < agreement or not norm < length < math.inf:
        return v
    return v * (length / norm)


@register_aggregator("trimmed_mean", TrimmedMeanOptions)
def trimmed_mean(config: TrimmedMeanOptions) -> AggregatorFn:
    """Per coordinate, the mean of the values left after dropping the ``trim`` largest and smallest."""

    def core(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        trim = config.trim_count(n)
        rows = _sorted_rows(x)[trim : n - trim]
        total = rows[0].clone()
        for row in rows[1:]:
            total.add_(row)
        return total / float(len(rows)) + 0.0

    return _robust(core, config, capped_weights=False)


@register_aggregator("coordinate_median", AggregatorOptions)
def coordinate_median(config: AggregatorOptions) -> AggregatorFn:
    """Per coordinate, the median of the senders' values."""

    def core(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return _median_rows(_sorted_rows(x))

    return _robust(core, config, capped_weights=False)


# --- shared machinery ---------------------------------------------------------------------------------


def _robust(
    core: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    config: AggregatorOptions,
    *,
    capped_weights: bool,
) -> AggregatorFn:
    """``core`` behind the checks every robust rule shares: usable senders, safe weights, bucketing."""

    def aggregate(contributions: torch.Tensor, weights: torch.Tensor, *, seed: int) -> torch.Tensor:
        _check_inputs(contributions, weights, seed)
        x, w = _usable(contributions, weights, capped=capped_weights)
        if config.bucket_size > 1 and x.shape[0] > 1:
            x, w = _buckets(x, w, config.bucket_size, seed)
        return core(x, w)

    return aggregate


def _check_inputs(contributions: torch.Tensor, weights: torch.Tensor, seed: int) -> None:
    if contributions.dim() != 2 or contributions.dtype != torch.float32:
        raise ValueError(
            f"contributions must be a [senders, values] float32 tensor, "
            f"got {tuple(contributions.shape)} {contributions.dtype}"
        )
    if weights.dim() != 1 or weights.shape[0] != contributions.shape[0]:
        raise ValueError(
            f"need one weight per sender: {contributions.shape[0]} senders, weights {tuple(weights.shape)}"
        )
    if contributions.shape[0] == 0:
        raise ValueError("no contributions to aggregate")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an int, got {type(seed).__name__}")


def _usable(
    contributions: torch.Tensor, weights: torch.Tensor, *, capped: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The senders a robust rule may use, with the weights it gives them (float64)."""
    weights = weights.to(torch.float64)
    # amax/amin propagate NaN and are exact in any order; much cheaper than isfinite(...).all(dim=1).
    finite = torch.isfinite(contributions.amax(dim=1)) & torch.isfinite(contributions.amin(dim=1))
    if not bool(finite.any()):
        raise InvalidContribution("every contribution to aggregate has a non-finite value")
    positive = torch.isfinite(weights) & (weights > 0)
    keep = finite & positive
    if not bool(keep.any()):
        # Like mean: when no sender claims a usable weight, every finite sender counts once.
        keep, weights = finite, torch.ones_like(weights)
    if not bool(keep.all()):
        index = keep.nonzero().flatten()
        contributions, weights = contributions[index], weights[index]
    return contributions, (fair_weights(weights) if capped else torch.ones_like(weights))


def _buckets(x: torch.Tensor, w: torch.Tensor, size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted averages of the senders in shuffled buckets of ``size``, and each bucket's total weight."""
    n = x.shape[0]
    generator = torch.Generator(device="cpu").manual_seed(seed % (1 << 63))
    order = torch.randperm(n, generator=generator)
    means, totals = [], []
    for start in range(0, n, size):
        members = order[start : start + size]
        bucket_w = w[members]
        total = _ordered_sum(bucket_w)
        if total <= 0:
            bucket_w, total = torch.ones_like(bucket_w), float(len(members))
        means.append(_weighted_row_sum(x[members], (bucket_w / total).to(torch.float32)))
        totals.append(total)
    return torch.stack(means), torch.tensor(totals, dtype=torch.float64)


def _weighted_row_sum(rows: torch.Tensor, coefficients: torch.Tensor) -> torch.Tensor:
    """``sum_i coefficients[i] * rows[i]``, row by row in a fixed order (no fused multiply-add)."""
    total = rows[0] * coefficients[0]
    product = torch.empty_like(total)
    for i in range(1, rows.shape[0]):
        total.add_(torch.mul(rows[i], coefficients[i], out=product))
    return total


def _ordered_sum(values: torch.Tensor) -> float:
    """The sum of a few float64 values, left to right."""
    return math.fsum(values.tolist())


def _row_norms(rows: torch.Tensor, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """Euclidean norm of each row (float64), summed in a fixed pairwise tree: the same bits anywhere.

    ``scratch``, a tensor shaped like ``rows``, is overwritten instead of allocating one.
    """
    squares = torch.mul(rows, rows, out=scratch) if scratch is not None else rows * rows
    return _row_sums(squares).sqrt()


def _row_sums(rows: torch.Tensor) -> torch.Tensor:
    """The sum of each row (float64), in the fixed pairwise tree of ``_row_norms``; ``rows`` is overwritten."""
    if rows.shape[1] == 0:
        return torch.zeros(rows.shape[0], dtype=torch.float64)
    width = rows.shape[1]
    while width > 1:
        half = width // 2
        rows[:, :half].add_(rows[:, half : 2 * half])
        if width % 2:
            rows[:, 0].add_(rows[:, 2 * half])
        width = half
    return rows[:, 0].to(torch.float64)


def _median_of(values: torch.Tensor) -> float:
    """The median of a few float64 values (the mean of the two middle ones for an even count)."""
    ordered = sorted(values.tolist())
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def _median_rows(rows: list[torch.Tensor]) -> torch.Tensor:
    """The coordinate-wise median of rows already sorted coordinate-wise."""
    n = len(rows)
    if n % 2:
        return rows[n // 2] + 0.0  # + 0.0 turns -0.0 into 0.0: which signed zero was picked may vary
    return (rows[n // 2 - 1] + rows[n // 2]) * 0.5 + 0.0


def _sorted_rows(x: torch.Tensor) -> list[torch.Tensor]:
    """The rows of ``x`` sorted coordinate-wise (each coordinate independently), smallest first."""
    n = x.shape[0]
    if n > _NETWORK_MAX_ROWS:
        return list(torch.sort(x, dim=0).values.unbind(0))
    rows = list(x.unbind(0))
    for i, j in _comparators(n):
        rows[i], rows[j] = torch.minimum(rows[i], rows[j]), torch.maximum(rows[i], rows[j])
    return rows


@cache
def _comparators(n: int) -> tuple[tuple[int, int], ...]:
    """Batcher's odd-even merge sorting network for ``n`` rows.

    Built for the next power of two; a comparator touching a row past ``n`` would compare against +inf
    padding and never swap, so it is dropped.
    """
    size = 1
    while size < n:
        size *= 2
    pairs: list[tuple[int, int]] = []

    def merge(lo: int, hi: int, r: int) -> None:
        step = 2 * r
        if step < hi - lo:
            merge(lo, hi, step)
            merge(lo + r, hi, step)
            pairs.extend((i, i + r) for i in range(lo + r, hi - r, step))
        else:
            pairs.append((lo, lo + r))

    def sort(lo: int, hi: int) -> None:
        if hi > lo:
            mid = lo + (hi - lo) // 2
            sort(lo, mid)
            sort(mid + 1, hi)
            merge(lo, hi, 1)

    sort(0, size - 1)
    return tuple((i, j) for i, j in pairs if j < n)
