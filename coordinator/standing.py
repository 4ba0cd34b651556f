"""The run's standing that the coordinator signs into its heartbeat answers: each credited peer's samples.

Credit is what ``coordinator.credit`` grants: for a data-parallel peer, only the weights it signed into
rounds that other members witnessed. The standing names the online, unbanned peers with the most credit
(at most ``MAX_STANDING``), recomputed at most every ``STANDING_REFRESH_S``; a heartbeat whose copy is
older gets it back (``protocols.messages.RunStateBody.standing``), and the checkpoint keeper reads the
same one. Peers weigh catch-up votes by it (``swarm.training.catchup``), so identities that did no
witnessed work have no say in which state the run holds.

Example::

    standing = Standing(store)
    at, credit = await standing.current()
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import Callable

from coordinator.credit import UNBANNED
from coordinator.stepshares import CreditOf
from protocols.messages import MAX_STANDING

# How often the standing is recomputed: each peer receives it at most once per refresh.
STANDING_REFRESH_S = 30.0


def credited_peers(
    db: sqlite3.Connection, credit_of: CreditOf, limit: int = MAX_STANDING
) -> dict[str, float]:
    """The credited samples of the online, unbanned peers with the most (ties: the smaller peer ID), each
    peer's credit read by key (``coordinator.stepshares.CreditOf``)."""
    rows = db.execute(
        f"SELECT peer_id, samples FROM (SELECT p.peer_id AS peer_id, {credit_of.total('p.peer_id')} AS samples "
        f"FROM peers p WHERE p.state = 'online' AND {UNBANNED}) WHERE samples > 0 "
        "ORDER BY samples DESC, peer_id LIMIT ?",
        (limit,),
    )
    return {peer: float(samples) for peer, samples in rows}


class Standing:
    """The standing as last computed from ``store`` (``at``: this coordinator's clock then)."""

    def __init__(
        self, store, *, refresh_s: float = STANDING_REFRESH_S, clock: Callable[[], float] = time.time
    ):
        self.store, self.refresh_s, self.clock = store, refresh_s, clock
        self.at = 0.0
        self.credit: dict[str, float] = {}
        self._lock = asyncio.Lock()

    async def current(self) -> tuple[float, dict[str, float]]:
        """(when computed, credit by peer), recomputed if older than ``refresh_s``."""
        async with self._lock:
            now = self.clock()
            if now - self.at >= self.refresh_s:
                self.credit = await self.store.standing()
                self.at = max(now, self.at + 1e-3)  # strictly newer, so every peer takes it
            return self.at, self.credit
