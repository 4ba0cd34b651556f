"""Contribution scores: which sender of a checked chunk stands out from the others enough to replay it.

A validator that checks a chunk of a round holds every sender's signed input to it (``BadAggregateEvidence``).
Each input is scored against the chunk's coordinate-wise median of all inputs, a centre that a minority of
senders cannot move outside the honest senders' range:

- ``cosine``: the cosine between the input and that centre. Honest gradients (or pseudo-gradients) of one
  state on different public batches point the same way as the centre; a reversed, random or made-up one
  does not.
- ``norm_ratio``: the input's L2 norm over the median norm of the inputs.

A sender is *flagged* when its cosine is below ``COSINE_RATIO`` of the group's median cosine (and below 0
whatever that median), or its norm is more than ``NORM_RATIO`` times the median norm, or its signed weight is
a claim the run's loop never signs (the caller's ``claim_ok``). At least ``MIN_SCORED`` inputs must decode to
finite values for any cosine or norm flag. A flag is not a verdict: it only picks a sender for a replay
(``swarm.training.sendercheck``), which convicts only a sender whose contribution is not what its public
batch seeds give. So an honest sender that stands out costs its validator one replay and nobody a ban.

Scores are pure functions of the signed bytes: the coordinator computes them again from the evidence and
accepts the replay of a flagged sender as it accepts a drawn one. It flags with ``lenient=True``, widening
each threshold by ``LENIENCY`` (relative), so an input that a validator flagged is flagged there too
despite the last bits of float64 sums on another machine.

A sender can also be picked for a replay because its input does not *fit its own batch* (``fits_poorly``):
a micro-batch of a sender's step (or its diloco window's first inner step, from the synced state with a
fresh inner optimizer) is a public fact, and so is its gradient there. An honest contribution holds that
gradient (every step: as one of its micro-batches; diloco: as the window's first inner step, whose Adam
update is its sign, and the moments that carry it). So the cosine of what a sender's input adds to the other
inputs' median with the sign of what that batch adds to the inputs' common centre (``fit``) is above the
median of the other inputs' cosines with it. A stale input (an older step's or window's, at an older state)
or a made-up one holds nothing of that batch, and is below that median. It costs one micro-batch's gradient
per scored sender, which is why a reducer scores only the senders its chunk's draw names
(``swarm.training.picks.fit_draw``, ``swarm.training.sendercheck``).

Example::

    claims, odd = flagged(decoded, weights, candidates=[0, 2, 3], claim_ok=lambda w: w <= 32)
    suspect = fits_poorly(decoded, 1, gradient_of_a_micro_batch_of_sender_1)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

#: A sender whose cosine with the chunk's median is below this share of the group's median cosine is flagged.
COSINE_RATIO = 0.5
#: A sender whose norm is above this multiple of the median norm is flagged.
NORM_RATIO = 4.0
#: Inputs that must decode to finite values for the cosine and norm flags (a median of 2 tells nobody apart).
MIN_SCORED = 3
#: How much wider the coordinator's thresholds are than a validator's (relative), for float64 rounding.
LENIENCY = 1e-6
#: How far above the other inputs' median fit the coordinator still accepts a sender's fit as poor: a
#: gradient recomputed on another device rounds differently, and coordinates near 0 may change sign.
FIT_LENIENCY = 0.02


@dataclass(frozen=True)
class Score:
    """One input's standing in its chunk: its cosine with the chunk's median and its norm over the median
    norm; ``finite`` is False for an input with a non-finite value (not scored)."""

    cosine: float
    norm_ratio: float
    finite: bool = True


def scores(values: Sequence[torch.Tensor]) -> list[Score]:
    """The score of each of ``values`` (decoded inputs of one chunk, all of one length), in order."""
    rows = [v.detach().to("cpu").reshape(-1) for v in values]
    finite = [bool(torch.isfinite(r).all()) for r in rows]
    kept = [r for r, ok in zip(rows, finite, strict=True) if ok]
    if not kept:
        return [Score(math.nan, math.nan, False) for _ in rows]
    # The median selects one of the values (the lower middle for an even count), so the decoded dtype
    # loses nothing; products and norms are taken in float64, one row at a time.
    centre = torch.stack(kept).median(dim=0).values.to(torch.float64)
    centre_norm = float(torch.linalg.vector_norm(centre))
    norms = [float(torch.linalg.vector_norm(r.to(torch.float64))) for r in kept]
    median_norm = sorted(norms)[(len(norms) - 1) // 2]
    out = []
    for row, ok in zip(rows, finite, strict=True):
        if not ok:
            out.append(Score(math.nan, math.nan, False))
            continue
        row = row.to(torch.float64)
        norm = float(torch.linalg.vector_norm(row))
        cosine = float(row @ centre) / (norm * centre_norm) if norm > 0 and centre_norm > 0 else 0.0
        out.append(Score(cosine, norm / median_norm if median_norm > 0 else 0.0))
    return out


def flagged(
    values: Sequence[torch.Tensor],
    weights: Sequence[float],
    *,
    candidates: Sequence[int],
    claim_ok: Callable[[float], bool] = lambda weight: True,
    lenient: bool = False,
) -> tuple[list[int], list[int]]:
    """The indices among ``candidates`` (into ``values``/``weights``) that stand out, in index order: those
    whose signed weight the loop never signs (a lie that needs no replay), and those whose values stand
    out by cosine or norm. Which of the latter to replay is for the round's draw to say, not a rank that
    the senders' own values set (a decoy that stands out more would shield a liar)."""
    if len(values) != len(weights):
        raise ValueError("one weight per input")
    found = scores(values)
    widen = 1.0 + LENIENCY if lenient else 1.0
    usable = [s for s in found if s.finite]
    cosine_below = norm_above = None
    if len(usable) >= MIN_SCORED:
        median_cosine = sorted(s.cosine for s in usable)[(len(usable) - 1) // 2]
        cosine_below = COSINE_RATIO * max(median_cosine, 0.0) * widen + (LENIENCY if lenient else 0.0)
        norm_above = NORM_RATIO / widen
    bad_claims, odd = [], []
    for i in candidates:
        if not 0 <= i < len(values):
            continue
        if not claim_ok(weights[i]):
            bad_claims.append(i)
        elif cosine_below is not None and found[i].finite:
            score = found[i]
            if score.cosine < cosine_below or score.norm_ratio > norm_above:
                odd.append(i)
    return sorted(bad_claims), sorted(odd)


def fit(values: Sequence[torch.Tensor], reference: torch.Tensor) -> list[float]:
    """How well each of ``values`` (decoded inputs of one chunk) fits ``reference`` (the same chunk of a
    sender's micro-batch gradient): the cosine, in float64, of its residual from the coordinate-wise
    median of the *other* finite inputs with the sign of what the batch adds, ``reference`` less its
    least-squares share of the median of all finite inputs; NaN for an input that is not finite (and for
    all with fewer than two finite inputs). Both sides leave out the direction every sender's input
    shares, so what is compared is what each sender's own batches put in: a stale input with a public
    direction added (the last round's average, its sign) gains nothing from it. A centre without the input
    itself scores every input alike (a median over all would put some inputs above it by construction)."""
    rows = [v.detach().to("cpu").reshape(-1) for v in values]
    gradient = reference.detach().to("cpu", torch.float64).reshape(-1)
    if any(r.shape != gradient.shape for r in rows):
        raise ValueError(f"inputs of other lengths than the gradient's {gradient.numel()} values")
    finite = [bool(torch.isfinite(r).all()) for r in rows]
    kept = [r for r, ok in zip(rows, finite, strict=True) if ok]
    if kept:  # what the batch adds: the gradient less its least-squares share of the inputs' common centre
        common = torch.stack(kept).median(dim=0).values.to(torch.float64)
        scale = float(common @ common)
        if scale > 0 and math.isfinite(scale):
            gradient = gradient - (float(gradient @ common) / scale) * common
    sign = torch.sign(gradient)
    sign_norm = float(torch.linalg.vector_norm(sign))
    out = []
    for k, (row, ok) in enumerate(zip(rows, finite, strict=True)):
        others = [r for j, (r, good) in enumerate(zip(rows, finite, strict=True)) if good and j != k]
        if not ok or not others:
            out.append(math.nan)
            continue
        # The median selects one of the values (the lower middle for an even count): nothing is lost to
        # the decoded dtype; the products are taken in float64.
        centre = torch.stack(others).median(dim=0).values.to(torch.float64)
        residual = row.to(torch.float64) - centre
        norm = float(torch.linalg.vector_norm(residual))
        out.append(float(residual @ sign) / (norm * sign_norm) if norm > 0 and sign_norm > 0 else 0.0)
    return out


def fits_poorly(
    values: Sequence[torch.Tensor], accused: int, reference: torch.Tensor, *, lenient: bool = False
) -> bool:
    """Whether ``values[accused]`` fits ``reference`` (the gradient of a micro-batch of the accused over the
    chunk) worse than the median of the other finite inputs do (``fit``): below that median (a validator),
    or, with ``lenient`` (the coordinator, which accepts what any validator finds), less than
    ``FIT_LENIENCY`` above it. False with fewer than ``MIN_SCORED`` finite inputs, the accused's included.
    An honest fit falls below the median now and then in small chunks (a replay clears it); a stale one
    is below it in most."""
    fits = fit(values, reference)
    mine = fits[accused]
    others = sorted(f for k, f in enumerate(fits) if k != accused and math.isfinite(f))
    if not math.isfinite(mine) or len(others) + 1 < MIN_SCORED:
        return False
    median = others[(len(others) - 1) // 2]
    return mine < median + (FIT_LENIENCY if lenient else 0.0)


__all__ = [
    "COSINE_RATIO",
    "FIT_LENIENCY",
    "LENIENCY",
    "MIN_SCORED",
    "NORM_RATIO",
    "Score",
    "fit",
    "fits_poorly",
    "flagged",
    "scores",
]
