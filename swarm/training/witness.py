"""``WitnessedRounds``: the applied rounds a data-parallel peer shows the coordinator in its heartbeats.

The coordinator credits a member of a round only for the weight it signed into its group entry, and only
when another member reports that entry (``coordinator.witness``, ``coordinator.credit``). So each peer
keeps the signed entries of its last ``KEEP_WITNESSED_ROUNDS`` applied rounds (its own, and up to the
message's bound a random choice of the others'), and each heartbeat carries ``MAX_WITNESSED_ROUNDS`` of
them in turn: a round is resent until it drops out, and a verified step that lags by more than one
heartbeat's worth of rounds loses no credit (the coordinator credits each (member, step) once).

Example::

    witness = WitnessedRounds(peer_id)
    witness.record(group)                # after applying the round of ``group`` (a ``GroupRound``)
    rounds = witness.next()              # for the next heartbeat
"""

from __future__ import annotations

import random
from collections import deque

from protocols.messages import MAX_ENTRY_BYTES, MAX_ROUND_ENTRIES, MAX_WITNESSED_ROUNDS

# Applied rounds a peer keeps to report: the coordinator credits rounds up to 16 steps below its
# verified step (``coordinator.stepshares.WITNESS_WINDOW_STEPS``).
KEEP_WITNESSED_ROUNDS = 16


class WitnessedRounds:
    """This peer's last applied rounds, as their members' signed group entries, for its heartbeats."""

    def __init__(self, peer_id: str, keep: int = KEEP_WITNESSED_ROUNDS):
        self.peer_id = peer_id
        self._kept: deque[list[bytes]] = deque(maxlen=keep)
        self._turn = 0

    def record(self, group) -> None:
        """Keep an applied round's entries: this peer's own first, then a random choice of the others' up
        to the bound. A groupmate's entry over ``MAX_ENTRY_BYTES`` is left out, never sent: a heartbeat
        past the message's bounds is refused whole, and a peer whose heartbeats are refused looks offline."""
        entries = list(zip((str(p) for p in group.peer_ids), group.signed_entries, strict=False))
        mine = [e for peer, e in entries if peer == self.peer_id]
        others = [e for peer, e in entries if peer != self.peer_id and len(e) <= MAX_ENTRY_BYTES]
        if len(mine) != 1 or len(mine[0]) > MAX_ENTRY_BYTES or not others:
            return
        chosen = random.sample(others, min(len(others), MAX_ROUND_ENTRIES - 1))
        self._kept.append(mine + chosen)

    def next(self) -> list[list[bytes]]:
        """Up to ``MAX_WITNESSED_ROUNDS`` of the kept rounds, the next ones in turn at each call."""
        kept = list(self._kept)
        if len(kept) <= MAX_WITNESSED_ROUNDS:
            return kept
        start = self._turn % len(kept)
        self._turn = start + MAX_WITNESSED_ROUNDS
        return [kept[(start + i) % len(kept)] for i in range(MAX_WITNESSED_ROUNDS)]


__all__ = ["KEEP_WITNESSED_ROUNDS", "WitnessedRounds"]
