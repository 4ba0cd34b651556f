"""Where throughput is short: which stage a new peer takes, which server a trainer calls, who moves.

All three decisions read only the pipeline view from the DHT, so every peer reasons from the same facts.

- ``choose_stage``: a joining peer takes the stage with the least total throughput among those that fit
  in its memory (ties: fewer replicas, then the lower index).
- ``pick_server``: trainers wire micro-batches at random, weighted by the throughput the trainer itself
  measured of each replica (``Measured``), capped at ``MEASURED_CAP`` times the stage's median
  (stochastic wiring): a fast replica gets more traffic, a slow one still some. A replica's self-reported
  rate never routes a trainer's work: one that claims 1e12 samples/s gets a replica's share until it is
  measured.
- ``rebalance_move``: a peer moves from the stage with the most throughput to the bottleneck only when
  the move raises the pipeline's slowest stage by a margin, and only one peer of a stage moves at a time.

``choose_stage`` and ``rebalance_move`` can only read the rates replicas report, so each counts at most
the median reported rate of every serving replica in view (``stage_totals``): uncapped, a replica
claiming 1e12 samples/s made its stage look the richest, and its honest stage-mates moved away until it
served the stage alone; capped at twice the median, it still did so in a 2 x 2 pipeline (its stage
counted 3 replicas' worth against 2). Above the median, replicas count as equals.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Sequence

from swarm.pipeline.records import PipelineView, StageRecord

#: A replica's routing weight is at most this multiple of the median measured rate of its stage.
MEASURED_CAP = 2.0
#: A replica's reported rate counts, in stage choice and rebalancing, at most this multiple of the
#: median reported rate of every serving replica.
REPORTED_CAP = 1.0
_MIN_WEIGHT = 1e-9


class Measured:
    """Samples per second of the calls a trainer made to each replica (a moving average of its own timings).

    Example::

        measured.record(peer_id, samples=8, seconds=0.2)
        weights = measured.weights([a, b, c])   # unmeasured replicas weigh as the median one
    """

    def __init__(self) -> None:
        self.rates: dict[str, float] = {}

    def record(self, peer_id: str, samples: int, seconds: float) -> None:
        rate = samples / max(seconds, 1e-6)
        old = self.rates.get(peer_id)
        self.rates[peer_id] = rate if old is None else 0.8 * old + 0.2 * rate

    def weights(self, peer_ids: Sequence[str]) -> list[float]:
        known = [self.rates[p] for p in peer_ids if p in self.rates]
        median = statistics.median(known) if known else 1.0
        return [max(min(self.rates.get(p, median), MEASURED_CAP * median), _MIN_WEIGHT) for p in peer_ids]


class Avoidance:
    """The replicas a trainer avoids for a while: those that failed a call (``failed``), answered busy
    (``busy``, for a moment) or keep refusing a step as past while their record still serves it
    (``refused_ahead``). ``pick_server`` picks an avoided replica only when nothing else is left.

    Example::

        avoid = Avoidance(cooldown_s=30.0, busy_s=0.5)
        avoid.failed(peer_id)
        record = pick_server(replicas, rng, avoid=avoid.current())
    """

    #: Views after a replica's first "the step is past" during which its record may still lag its step.
    LAGGING_VIEWS = 2

    def __init__(self, cooldown_s: float, busy_s: float) -> None:
        self.cooldown_s, self.busy_s = cooldown_s, busy_s
        self.until: dict[str, float] = {}
        # replica -> (view of the first, view of the latest) "step is past" refusal of its current streak
        self.ahead: dict[str, tuple[int, int]] = {}

    def current(self) -> set[str]:
        now = time.monotonic()
        for peer in [p for p, t in self.until.items() if t <= now]:
            del self.until[peer]
        return set(self.until)

    def failed(self, peer: str) -> None:
        self.until[peer] = time.monotonic() + self.cooldown_s

    def busy(self, peer: str) -> None:
        self.until[peer] = max(self.until.get(peer, 0.0), time.monotonic() + self.busy_s)

    def refused_ahead(self, peer: str, views: int) -> bool:
        """``peer``, picked from a view that lists it at the call's step, answered that its step is past.
        An honest replica that moved on is listed at its new step within ``LAGGING_VIEWS`` views, so its
        refusals end within them. A streak of such refusals, each within ``LAGGING_VIEWS`` views of the
        last (served calls in between do not end it), that spans ``LAGGING_VIEWS`` views is refusing its
        listed step: the replica is avoided like a failed one (True)."""
        for p in [p for p, (_, last) in self.ahead.items() if views - last > self.LAGGING_VIEWS]:
            del self.ahead[p]  # streaks that ended: an honest replica's next race starts a new one
        first = self.ahead.get(peer, (views, views))[0]
        if views - first < self.LAGGING_VIEWS:
            self.ahead[peer] = (first, views)
            return False
        del self.ahead[peer]
        self.failed(peer)
        return True


def reported_cap(view: PipelineView, num_stages: int) -> float:
    """The most one replica's reported rate counts for: ``REPORTED_CAP`` times the median of all serving
    replicas' reports (with fewer than half of them lying, an honest replica's rate at most)."""
    rates = [r.samples_per_s for k in range(num_stages) for r in view.replicas(k)]
    return REPORTED_CAP * statistics.median(rates) if rates else 0.0


def stage_totals(view: PipelineView, num_stages: int) -> dict[int, float]:
    """Each stage's throughput: the sum of its serving replicas' reported rates, each capped."""
    cap = reported_cap(view, num_stages)
    return {k: sum(min(r.samples_per_s, cap) for r in view.replicas(k)) for k in range(num_stages)}


def choose_stage(view: PipelineView, num_stages: int, fits: Sequence[bool]) -> int | None:
    """The stage most short of throughput among those this peer can hold; None if none fits."""
    candidates = [k for k in range(num_stages) if fits[k]]
    if not candidates:
        return None
    totals = stage_totals(view, num_stages)
    return min(candidates, key=lambda k: (totals[k], len(view.replicas(k)), k))


def pick_server(
    replicas: Sequence[StageRecord],
    rng: random.Random,
    *,
    avoid: set[str] = frozenset(),
    measured: Measured | None = None,
) -> StageRecord | None:
    """One replica at random, weighted by the throughput the caller ``measured`` (equal weights without
    it); replicas in ``avoid`` only when nothing else is left."""
    usable = [r for r in replicas if r.peer_id not in avoid] or list(replicas)
    if not usable:
        return None
    weights = (measured or Measured()).weights([r.peer_id for r in usable])
    return rng.choices(usable, weights=weights, k=1)[0]


def rebalance_move(
    view: PipelineView, peer_id: str, stage: int, num_stages: int, margin: float
) -> int | None:
    """The stage ``peer_id`` (serving ``stage``) should move to now, or None to stay."""
    if num_stages < 2:
        return None
    mine = view.replicas(stage)
    me = next((r for r in mine if r.peer_id == peer_id), None)
    if me is None or len(mine) < 2 or min(r.peer_id for r in mine) != peer_id:
        return None  # a stage's only replica never leaves it; of the others, one mover per stage at a time
    cap = reported_cap(view, num_stages)
    totals = stage_totals(view, num_stages)
    if max(totals, key=lambda k: (totals[k], -k)) != stage:
        return None
    bottleneck = min(totals, key=lambda k: (totals[k], k))
    if bottleneck == stage:
        return None
    there = view.replicas(bottleneck)
    # What this peer would add there: the throughput of a typical replica of that stage, if it has any.
    gain = (totals[bottleneck] / len(there)) if there else min(me.samples_per_s, cap)
    after = dict(totals)
    after[stage] -= min(me.samples_per_s, cap)
    after[bottleneck] += gain
    return bottleneck if min(after.values()) > (1 + margin) * min(totals.values()) else None
