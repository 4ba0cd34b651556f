"""Credit from witnessed rounds: each step's share divided among every member reported at it.

A data-parallel peer is credited only for rounds another member witnessed: a member of a round reports
the round's signed group entries in its heartbeat (``coordinator.witness``), and each signer that signed
for samples becomes a *member of that step* (table ``step_members``: the most weight any report of it
signed, and whether a member other than itself reported it; ``step_counts`` keeps each step's number of
members). Every member of a step has the same cap, ``SHARE_SLACK * batch / (members reported at the
step)`` and never more than one batch, so a step's members together earn at most ``SHARE_SLACK``
batches of it. A member vouched for is credited ``min(its signed weight, the cap)``; its own report only
makes it a member.

The cap is a function of the step's member count, not of the order in which reports arrive: it is
applied when credit is read (``CreditOf``, keyed by peer: the settled ``credit`` row and the peer's own
rows of the steps still in the witness window, ``WITNESS_WINDOW_STEPS`` below the verified step), and a
step's shares are settled into the ``credit`` table when it leaves the window (``settle``). So a member
added late lowers the share of every member of that step alike, a farm's own keys included: there is
no first reporter, nothing to win by timing reports against the window's edges, by reporting late or
after a jump of the verified step, and keys that never took part in a round count nowhere. A step's
witnessed credit can fall while it is in the window (more members reported at it); once settled it
never does.

What stays open: Sybils that sign entries for each other's made-up rounds are members like any other,
and they sign for as much as they like: each of their keys earns up to the cap, ``SHARE_SLACK`` times
the step's average share, where an honest member earns what it signed (with H honest members that sign
an even share and k Sybil keys, 2H/(H+k) times an honest member each). Together they earn less than
``SHARE_SLACK`` batches a step, and they lower honest shares once they outnumber the honest members of a
step; the coordinator recomputes no round.
"""

from __future__ import annotations

import math
import sqlite3

from coordinator.credit import CREDITABLE, DATA_ROLES, SHARE_SLACK

# Witnessed rounds are taken for steps in this window below the verified step; a step leaving it is
# settled and its members forgotten (a replayed old round then falls outside the window).
WITNESS_WINDOW_STEPS = 16

SCHEMA = """
CREATE TABLE IF NOT EXISTS step_members (
    peer_id TEXT NOT NULL,
    step INTEGER NOT NULL,
    claim REAL NOT NULL,
    vouched INTEGER NOT NULL,
    PRIMARY KEY (peer_id, step)
);
CREATE INDEX IF NOT EXISTS step_members_by_step ON step_members (step);
CREATE TABLE IF NOT EXISTS step_counts (
    step INTEGER PRIMARY KEY,
    members INTEGER NOT NULL
);
"""
# ``step_members.vouched``: 0, reported only by itself; 1, by another member (credited its share);
# 2, credited already by a coordinator that credited each report at once (a store upgraded in place).
VOUCHED, SETTLED_BEFORE = 1, 2


class CreditOf:
    """SQL for one peer's credit in a run whose batch is ``max_per_step``: its settled ``credit`` and its
    shares of the steps in the window, each read by key (the peer's own rows, each step's count)."""

    def __init__(self, max_per_step: float):
        # 9e999 is SQLite's infinity (a run without a target batch has no cap but the share).
        self.batch = "9e999" if math.isinf(max_per_step) else repr(float(max_per_step))

    def cap(self, count: str) -> str:
        """The cap of one member of a step whose member count is the SQL expression ``count``."""
        return f"MIN({self.batch}, {SHARE_SLACK!r} * {self.batch} / {count})"

    def window(self, peer: str) -> str:
        """The shares of the window's steps of the peer whose ID is the SQL expression ``peer``."""
        return (
            f"(SELECT COALESCE(SUM(MIN(m.claim, {self.cap('n.members')})), 0) FROM step_members m "
            f"JOIN step_counts n ON n.step = m.step WHERE m.peer_id = {peer} AND m.vouched = {VOUCHED})"
        )

    def total(self, peer: str) -> str:
        """Settled credit and window shares of the peer whose ID is the SQL expression ``peer``."""
        return (
            f"(COALESCE((SELECT c.samples FROM credit c WHERE c.peer_id = {peer}), 0) + {self.window(peer)})"
        )


def upgrade(db: sqlite3.Connection) -> None:
    """A store written before ``step_members`` credited each report at once into ``credit`` and kept a
    ``witnessed`` row per (member, step) in the window: a row with samples is a member credited already
    (``SETTLED_BEFORE``), one with none a member that only reported itself, whose groupmates may still
    report it. Their steps' counts are rebuilt, and the old table goes."""
    if db.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name='witnessed'").fetchone():
        db.execute(
            "INSERT OR IGNORE INTO step_members (peer_id, step, claim, vouched) "
            f"SELECT peer_id, step, samples, CASE WHEN samples > 0 THEN {SETTLED_BEFORE} ELSE 0 END FROM witnessed"
        )
        db.execute(
            "INSERT INTO step_counts (step, members) "
            "SELECT step, COUNT(*) FROM step_members WHERE claim > 0 GROUP BY step"
        )
        db.execute("DROP TABLE witnessed")


def credit_witnessed(
    db: sqlite3.Connection, reporter: str, rounds: list, *, verified: int, credit_of: CreditOf
) -> None:
    """Take the members of ``rounds`` (``coordinator.witness.WitnessedEntry`` lists) reported by
    ``reporter``: for a step below the ``verified`` step and within ``WITNESS_WINDOW_STEPS`` of it, each
    joined, unbanned data-parallel member (``CREDITABLE``) that signed for samples becomes a member of the
    step with the most weight any report of it signed, vouched for when ``reporter`` is another member.
    Then settle the steps that left the window."""
    for entries in rounds:
        step = entries[0].step
        if not verified - WITNESS_WINDOW_STEPS <= step < verified:
            continue
        for entry in entries:
            if not (math.isfinite(entry.weight) and entry.weight > 0):
                continue  # a member that signed for no samples is no member of the step
            creditable = db.execute(
                f"SELECT 1 FROM peers p WHERE p.peer_id=? AND {CREDITABLE}", (entry.peer_id, *DATA_ROLES)
            ).fetchone()
            if creditable is not None:
                _take(
                    db, entry.peer_id, step, float(entry.weight), VOUCHED if entry.peer_id != reporter else 0
                )
    settle(db, verified - WITNESS_WINDOW_STEPS, credit_of)


def _take(db: sqlite3.Connection, peer: str, step: int, claim: float, vouched: int) -> None:
    row = db.execute(
        "SELECT claim, vouched FROM step_members WHERE peer_id=? AND step=?", (peer, step)
    ).fetchone()
    if row is None:
        db.execute("INSERT INTO step_members VALUES (?, ?, ?, ?)", (peer, step, claim, vouched))
    elif claim > row[0] or vouched > row[1]:
        db.execute(
            "UPDATE step_members SET claim = ?, vouched = ? WHERE peer_id=? AND step=?",
            (max(claim, row[0]), max(vouched, row[1]), peer, step),
        )
    if row is None or row[0] <= 0:  # a new member of the step (claims only grow)
        db.execute(
            "INSERT INTO step_counts (step, members) VALUES (?, 1) "
            "ON CONFLICT(step) DO UPDATE SET members = members + 1",
            (step,),
        )


def settle(db: sqlite3.Connection, below: int, credit_of: CreditOf) -> None:
    """Add the shares of every step below ``below`` to its members' durable credit, and forget them."""
    if db.execute("SELECT 1 FROM step_counts WHERE step < ? LIMIT 1", (below,)).fetchone() is None:
        return
    cap = credit_of.cap("n.members")
    db.execute(
        f"INSERT INTO credit (peer_id, samples, step) SELECT m.peer_id, SUM(MIN(m.claim, {cap})), MAX(m.step) "
        f"FROM step_members m JOIN step_counts n ON n.step = m.step WHERE m.step < ? AND m.vouched = {VOUCHED} "
        "GROUP BY m.peer_id ON CONFLICT(peer_id) DO UPDATE SET samples = samples + excluded.samples",
        (below,),
    )
    db.execute("DELETE FROM step_members WHERE step < ?", (below,))
    db.execute("DELETE FROM step_counts WHERE step < ?", (below,))


__all__ = ["SCHEMA", "WITNESS_WINDOW_STEPS", "CreditOf", "credit_witnessed", "settle", "upgrade"]
