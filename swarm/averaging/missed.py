"""Reducers that missed a round: avoided for searches, not seconds, and forgiven by rounds delivered.

A reducer that did not deliver its part of a round, or said it knows no such round once listed with its
own signed entry, may be a withholder, or an honest peer on a loaded machine that missed a deadline or
gave up on the round: nobody can prove which, and its part is repaired either way (``repair``). Only the
rate at which it misses tells them apart, so ``MissedRounds`` counts rounds, whatever a round lasts:

- a miss avoids the peer for this peer's next ``2 ** (strikes - 1)`` searches (at most
  ``MAX_AVOID_SEARCHES``): the retry forms without it whether steps take a second or DiLoCo's outer rounds
  take minutes, and a longer gap between rounds does not let it back in sooner;
- a strike is forgiven only after ``FORGIVE_AFTER`` rounds in which the peer delivered its part to this
  peer, never by time alone: a withholder cannot wait for a clean slate, and each strike it sheds costs it
  that many rounds of honest work. So it breaks at most about one round in ``FORGIVE_AFTER + 1`` of those
  it is let into (each repaired), and an honest peer that misses fewer than that stays at one strike: it
  is left out of one search per miss;
- every search counts, whether or not it formed a group, so peers that avoid each other meet again within
  a span's searches: an honest swarm does not lock itself out for longer, however slow its machines.

A miss seen while the peer is still avoided (a leader listed it anyway: members do not refuse listed
members on suspicion) escalates nothing. At most ``MAX_TRACKED`` peers are remembered, the least recently
blamed forgotten first.

Example::

    missed = MissedRounds()
    missed.search()                           # at each search of this peer
    missed.round(delivered=["a", "b"], missed={"w": "did not deliver its part of a round"})
    missed.refusal("w")                       # "avoided in this peer's next search: did not deliver ..."
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

#: Rounds a peer must deliver its part in for one strike to be forgiven.
FORGIVE_AFTER = 32
#: The most searches a peer is avoided for at one miss.
MAX_AVOID_SEARCHES = 256
#: How many peers the book remembers at most.
MAX_TRACKED = 4096


@dataclass
class _Record:
    strikes: int
    until: int  # avoided while this peer's search count is at most this
    delivered: int  # rounds delivered since the last strike or forgiveness
    reason: str


class MissedRounds:
    """The book of reducers that missed this peer's rounds (see the module docstring)."""

    def __init__(
        self,
        forgive_after: int = FORGIVE_AFTER,
        max_avoid_searches: int = MAX_AVOID_SEARCHES,
        max_tracked: int = MAX_TRACKED,
    ):
        if forgive_after < 1 or max_avoid_searches < 1 or max_tracked < 1:
            raise ValueError("need forgive_after, max_avoid_searches and max_tracked >= 1")
        self.forgive_after, self.max_avoid_searches, self.max_tracked = (
            forgive_after,
            max_avoid_searches,
            max_tracked,
        )
        self.searches = 0
        self._book: OrderedDict[str, _Record] = OrderedDict()

    def __len__(self) -> int:
        return len(self._book)

    def strikes(self, peer_id: str) -> int:
        record = self._book.get(peer_id)
        return 0 if record is None else record.strikes

    def search(self) -> None:
        """This peer starts a search (every one counts, formed or not)."""
        self.searches += 1

    def round(self, *, delivered: Iterable[str], missed: Mapping[str, str]) -> list[tuple[str, int, int]]:
        """Record one round of this peer: the reducers that ``delivered`` their parts, and those that
        ``missed`` (peer -> why). Returns (peer, strikes, searches avoided) for each new avoidance."""
        for peer in delivered:
            record = self._book.get(peer)
            if record is None:
                continue
            record.delivered += 1
            if record.delivered >= self.forgive_after:
                record.strikes, record.delivered = max(0, record.strikes - 1), 0
                if record.strikes == 0 and record.until < self.searches:
                    del self._book[peer]
        added = []
        for peer, reason in missed.items():
            record = self._book.get(peer)
            if record is not None and record.until >= self.searches:  # still avoided: seen again
                record.delivered = 0
                continue
            strikes = (record.strikes if record is not None else 0) + 1
            span = min(2 ** min(strikes - 1, 32), self.max_avoid_searches)
            self._book[peer] = _Record(strikes, self.searches + span, 0, reason)
            self._book.move_to_end(peer)
            while len(self._book) > self.max_tracked:
                self._book.popitem(last=False)
            added.append((peer, strikes, span))
        return added

    def refusal(self, peer_id: str) -> str | None:
        """Why ``peer_id`` is avoided in this search; None if it is not."""
        record = self._book.get(peer_id)
        if record is None or record.until < self.searches:
            return None
        left = record.until - self.searches
        when = {0: "in this search", 1: "in this peer's next search"}.get(
            left, f"in this peer's next {left} searches"
        )
        return f"avoided {when}: {record.reason}"

    def avoided(self, limit: int) -> list[str]:
        """Up to ``limit`` peers avoided now, the latest miss first."""
        return [p for p, r in reversed(self._book.items()) if r.until >= self.searches][:limit]


__all__ = ["FORGIVE_AFTER", "MAX_AVOID_SEARCHES", "MAX_TRACKED", "MissedRounds"]
