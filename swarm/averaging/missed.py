"""Reducers that missed a round: avoided for searches, not seconds, and forgiven by rounds delivered.

A reducer that did not deliver its part of a round, or said it knows no such round once listed with its
own signed entry, may be a withholder, or an honest peer on a loaded machine that missed a deadline or
gave up on the round: nobody can prove which, and its part is repaired either way (``repair``). Only the
rate at which it misses tells them apart, so ``MissedRounds`` counts rounds, whatever a round lasts:

- a reducer that did not deliver is left out of this peer's next ``2 ** (strikes - 1)`` counted searches
  (at most ``MAX_AVOID_SEARCHES``; strikes stop at ``MAX_STRIKES``): the retry forms without it whether
  steps take a second or DiLoCo's outer rounds take minutes;
- a strike is forgiven only after ``FORGIVE_AFTER`` rounds in which the peer delivered its part to this
  peer, never by time alone: a withholder cannot wait for a clean slate, and each strike it sheds costs it
  that many rounds of honest work. So it breaks at most one round in ``FORGIVE_AFTER + 1`` of this
  peer's (each repaired), and an honest peer that misses fewer than that stays at one strike: it is left
  out of one search per miss;
- a reducer that said it knows no such round is left out of the next counted search only, and earns no
  strike: a leader can make an honest member say so (it can tell each follower its own group ID, or list
  a peer with the fresh entry that peer sent it in a join request: nothing a member signs names the group),
  so a denial is evidence against nobody. A peer that denies every round it is let into has its part
  repaired at once in every other round of this peer;
- a search counts once it ran a round or waited out the run's matchmaking window: a leader that breaks
  its group at once (an entry that does not open) makes a peer search again without moving the count, so
  nobody can run out a span faster than the run's windows pass; searches that formed no group still
  count, so peers that avoid each other meet again within a span's windows (an honest swarm does not lock
  itself out for longer). Only first-tier searches count (the second tier's averager does not,
  ``Averager.counts_searches``), so a representative's tier search spends nobody's span.

A second tier keeps a book of its own (``SecondTier.absent``): a peer whose records showed a step and that
joined none of the groups of a second-tier round this peer led after waiting its window out counts as a
miss there, and a step it took part in as a round delivered, so a representative's search stops waiting
for a peer that shows steps and joins no group.

A miss seen while the peer is still avoided (a leader listed it anyway: members do not refuse listed
members on suspicion) escalates nothing. At most ``MAX_TRACKED`` peers are remembered, the least recently
blamed forgotten first.

Example::

    missed = MissedRounds()
    missed.round(delivered=["a"], missed={"w": "did not deliver its part of a round"}, denied={})
    missed.search()                           # each counted search of this peer, once it ends
    missed.refusal("w")                       # None: it sat out one search
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

#: Rounds a peer must deliver its part in for one strike to be forgiven.
FORGIVE_AFTER = 32
#: The most searches a peer is avoided for at one miss.
MAX_AVOID_SEARCHES = 256
#: Strikes stop here (the one whose span reaches ``MAX_AVOID_SEARCHES``).
MAX_STRIKES = MAX_AVOID_SEARCHES.bit_length()
#: How many peers the book remembers at most.
MAX_TRACKED = 4096


@dataclass
class _Record:
    strikes: int
    until: int  # avoided while this peer's count of searches is below this
    delivered: int  # rounds delivered since the last strike or forgiveness
    reason: str


class MissedRounds:
    """The book of reducers that missed this peer's rounds (see the module docstring)."""

    def __init__(self, max_tracked: int = MAX_TRACKED):
        if max_tracked < 1:
            raise ValueError("need max_tracked >= 1")
        self.max_tracked = max_tracked
        self.searches = 0
        self._book: OrderedDict[str, _Record] = OrderedDict()

    def __len__(self) -> int:
        return len(self._book)

    def strikes(self, peer_id: str) -> int:
        record = self._book.get(peer_id)
        return 0 if record is None else record.strikes

    def search(self) -> None:
        """A counted search of this peer ended (see the module docstring for which count)."""
        self.searches += 1

    def round(
        self, *, delivered: Iterable[str], missed: Mapping[str, str], denied: Mapping[str, str]
    ) -> list[tuple[str, int, int]]:
        """Record one round of this peer, before its search is counted: the reducers that ``delivered``
        their parts, those that ``missed`` them and those that ``denied`` the round (peer -> why). Returns
        (peer, strikes, searches avoided) for each new avoidance."""
        for peer in delivered:
            record = self._book.get(peer)
            if record is None:
                continue
            record.delivered += 1
            if record.delivered >= FORGIVE_AFTER:
                record.strikes, record.delivered = max(0, record.strikes - 1), 0
                if record.strikes == 0 and record.until <= self.searches:
                    del self._book[peer]
        added = []
        for peer, reason in [*missed.items(), *((p, r) for p, r in denied.items() if p not in missed)]:
            record = self._book.get(peer)
            if record is not None and record.until > self.searches:  # still avoided: seen again
                if peer in missed:
                    record.delivered = 0
                continue
            strikes = record.strikes if record is not None else 0
            if peer in missed:
                strikes = min(strikes + 1, MAX_STRIKES)
                span = min(2 ** (strikes - 1), MAX_AVOID_SEARCHES)
            else:
                span = 1
            delivered_so_far = record.delivered if record is not None and peer not in missed else 0
            self._book[peer] = _Record(strikes, self.searches + 1 + span, delivered_so_far, reason)
            self._book.move_to_end(peer)
            while len(self._book) > self.max_tracked:
                self._book.popitem(last=False)
            added.append((peer, strikes, span))
        return added

    def refusal(self, peer_id: str) -> str | None:
        """Why ``peer_id`` is avoided in this search; None if it is not."""
        record = self._book.get(peer_id)
        if record is None or record.until <= self.searches:
            if record is not None and record.strikes == 0:  # a denial's one search is over: nothing left
                del self._book[peer_id]
            return None
        left = record.until - self.searches
        when = "in this search" if left == 1 else f"in this search and the next {left - 1}"
        return f"avoided {when}: {record.reason}"

    def avoided(self, limit: int) -> list[str]:
        """Up to ``limit`` peers avoided now, the latest miss first."""
        return [p for p, r in reversed(self._book.items()) if r.until > self.searches][:limit]


__all__ = ["FORGIVE_AFTER", "MAX_AVOID_SEARCHES", "MAX_STRIKES", "MAX_TRACKED", "MissedRounds"]
