"""Deadlines of the data path from measured throughput and the bytes being moved, not fixed constants.

A fixed timeout is wrong both ways: 30 s drops a volunteer on a 10 Mbit/s uplink whose part of a large
model takes minutes to send, and a timeout long enough for that peer leaves everyone waiting minutes
for a peer that died. So a deadline here is a floor (the configured ``sender_timeout_s`` or
``averaging_timeout_s``: what a round of tiny messages needs on a loaded machine) plus ``SLACK`` times
the time the bytes take at the rate the round can count on, capped at ``MAX_DEADLINE_S``:

- each peer measures its own upload throughput from the rounds it takes part in (``Throughput``: the
  contributions it sent over the time until every part had arrived, an estimate that errs low, by up to
  half for a reducer, so deadlines err long) and declares it in its signed group entry;
- a round runs at the pace of its slowest member: it counts on the lowest declared rate, and on
  ``ASSUMED_MBIT`` for a member that has measured nothing yet. No claim lowers it below ``MIN_MBIT``,
  so a member that claims a crawling link stretches a round's deadlines by a bounded amount only;
- between two messages of one stream, silence may last the floor plus the time one chunk takes on an
  uplink shared by the member's parallel streams (its contributions and its aggregates): a peer that
  died is dropped within seconds, however large the vector (a killed process resets its connections
  and is dropped at once);
- a whole round may take the floor plus the time its busiest member needs to send its bytes.

Example::

    link = Throughput()
    link.observe(nbytes=5_000_000, seconds=4.0)                  # 10 Mbit/s measured
    transfer_deadline_s(50_000_000, link.mbit, floor_s=30.0)     # 30 + 3 * 40 s = 150 s
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

ASSUMED_MBIT = 10.0  # a member that has measured nothing yet: a modest home uplink
MIN_MBIT = 1.0  # no claim lowers the rate a round counts on below this
SLACK = 3.0  # a transfer may take this many times its duration at the rate counted on
MAX_DEADLINE_S = 3600.0
MIN_SAMPLE_BYTES = 256 * 1024  # smaller transfers measure latency and framing, not the link
SMOOTHING = 0.5  # weight of the newest measurement


class Throughput:
    """A peer's measured upload throughput in Mbit/s (None until a transfer large enough was seen)."""

    def __init__(self, mbit: float | None = None):
        self.mbit = mbit

    def observe(self, nbytes: int, seconds: float) -> None:
        if nbytes < MIN_SAMPLE_BYTES or not math.isfinite(seconds) or seconds <= 0:
            return
        measured = nbytes * 8 / seconds / 1e6
        self.mbit = measured if self.mbit is None else (1 - SMOOTHING) * self.mbit + SMOOTHING * measured


def round_mbit(declared: Sequence[float | None]) -> float:
    """The rate a round counts on: its slowest member's declared rate, within [MIN_MBIT, ...]."""
    rates = [ASSUMED_MBIT if r is None or not r > 0 else r for r in declared] or [ASSUMED_MBIT]
    return max(MIN_MBIT, min(rates))


def transfer_deadline_s(nbytes: float, mbit: float | None, *, floor_s: float) -> float:
    """How long moving ``nbytes`` at ``mbit`` (None: not measured) may take, floor and slack included."""
    rate = max(MIN_MBIT, mbit if mbit is not None and mbit > 0 else ASSUMED_MBIT) * 1e6 / 8
    return min(max(MAX_DEADLINE_S, floor_s), floor_s + SLACK * nbytes / rate)


@dataclass(frozen=True)
class RoundDeadlines:
    """One round's deadlines: ``silence_s`` between two messages of a stream, ``round_s`` for all parts."""

    mbit: float | None
    silence_s: float
    round_s: float


def round_deadlines(
    part_values: Sequence[int],
    *,
    chunk_bytes: int,
    bytes_per_value: float,
    mbit: float | None,
    silence_floor_s: float,
    round_floor_s: float,
) -> RoundDeadlines:
    """Deadlines of a round whose parts hold ``part_values`` values (0 for a member that reduces none).

    Member ``i`` sends the rest of the vector to the other reducers and its own part back to the other
    ``n - 1`` members; the round lasts as long as its busiest member needs for that at ``mbit``.
    """
    members, total = len(part_values), sum(part_values)
    busiest = max(((total - p) + p * (members - 1)) * bytes_per_value for p in part_values)
    # A member's uplink carries up to n - 1 contribution streams and n - 1 aggregate streams at once:
    # each gets a share of it.
    silence = transfer_deadline_s(chunk_bytes * 2 * max(1, members - 1), mbit, floor_s=silence_floor_s)
    return RoundDeadlines(mbit, silence, transfer_deadline_s(busiest, mbit, floor_s=round_floor_s))
