"""What peers tell the coordinator about groupmates that break their rounds, and how it is counted.

Withholding a part of a round (taking it as reducer and never delivering) or denying a round proves
nothing to a third party, so it is never grounds for a ban (``coordinator.service`` bans only on
evidence). Each peer avoids such groupmates itself (``swarm.averaging.policy``) and names the ones it
avoids now in every heartbeat; the coordinator keeps each reporter's latest list only (at most
``MAX_SUSPECT_REPORTS`` known peers, its own ID dropped) and shows, per peer, how many distinct online,
unbanned peers with credit (samples in rounds the coordinator credited, ``coordinator.credit``) avoid
it. Identities are cheap under open admission, so one without credit counts for nothing: a flock of
fresh Sybils cannot raise an honest peer's count. One liar with credit moves it by one; a withholder
that breaks the rounds of many peers shows up in all their counts.

Both functions run inside the store's heartbeat transaction or on its connection.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable
from typing import TYPE_CHECKING

from protocols.messages import MAX_SUSPECT_REPORTS

if TYPE_CHECKING:
    from coordinator.stepshares import CreditOf

SCHEMA = """
CREATE TABLE IF NOT EXISTS suspicions (
    suspect TEXT NOT NULL,
    reporter TEXT NOT NULL,
    reported_at REAL NOT NULL,
    PRIMARY KEY (reporter, suspect)
);
"""


def record_suspicions(db: sqlite3.Connection, reporter: str, suspects: Iterable[str], now: float) -> None:
    """Replace ``reporter``'s list with ``suspects`` (known peers other than itself, at most the limit)."""
    db.execute("DELETE FROM suspicions WHERE reporter=?", (reporter,))
    named = [s for s in dict.fromkeys(suspects) if s != reporter][:MAX_SUSPECT_REPORTS]
    for suspect in named:
        db.execute(
            "INSERT INTO suspicions (suspect, reporter, reported_at) SELECT ?, ?, ? "
            "WHERE EXISTS (SELECT 1 FROM peers WHERE peer_id=?)",
            (suspect, reporter, now, suspect),
        )


def suspicion_counts(db: sqlite3.Connection, credit_of: CreditOf) -> dict[str, int]:
    """Per suspect, the distinct reporters that avoid it now: online, not banned, and credited with
    samples themselves (each reporter's credit read by key, ``coordinator.stepshares.CreditOf``)."""
    rows = db.execute(
        "SELECT s.suspect, COUNT(DISTINCT s.reporter) FROM suspicions s CROSS JOIN peers p ON p.peer_id = s.reporter "
        f"WHERE p.state='online' AND {credit_of.total('s.reporter')} > 0 "
        "AND NOT EXISTS (SELECT 1 FROM bans b WHERE b.peer_id = s.reporter) "
        "GROUP BY s.suspect"
    )
    return {suspect: count for suspect, count in rows}
