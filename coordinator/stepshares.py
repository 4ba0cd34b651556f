"""Credit from witnessed rounds: each step's share divided equally among every member reported at it.

A data-parallel peer is credited only for rounds another member witnessed: a member of a round reports
the round's signed group entries in its heartbeat (``coordinator.witness``), and each entry's signer
becomes a *member of that step* (table ``step_members``: the most weight any report of it signed, and
whether a member other than itself reported it). A step's members together earn at most
``SHARE_SLACK`` batches of it, and every member the same cap: ``SHARE_SLACK * batch / (members reported
at the step)``, never more than one batch. A member is credited ``min(its signed weight, the cap)`` if
vouched for; its own report only makes it a member.

The cap is a function of the step's member set, not of the order in which reports arrive: it is
computed when credit is read (the views of ``views``), for every step still in the witness window
(``WITNESS_WINDOW_STEPS`` below the verified step), and a step's shares are settled into the durable
``credit`` table when it leaves the window (``settle``). So a member added late lowers the share of every
member of that step alike, a farm's own keys included: there is no first reporter, nothing to win by
timing reports against the window's edges or a jump of the verified step, and keys that never took
part in a round count nowhere. A step's witnessed credit can fall while it is in the window (more
members reported at it); once settled it never does.

What stays open: Sybils that sign entries for each other's made-up rounds are members like any other.
They earn the same share per key as an honest member (less than ``SHARE_SLACK`` batches a step
together) and lower the honest members' shares once they outnumber them at a step; the coordinator
recomputes no round.
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
"""


def views(max_per_step: float) -> str:
    """SQL that (re)creates the views of credit for a run whose batch is ``max_per_step``: ``step_caps``
    (each window step's cap per member), ``window_credit`` (each peer's shares of the steps in the window)
    and ``credit_total`` (settled credit and window shares: what every reader of credit reads)."""
    batch = "9e999" if math.isinf(max_per_step) else repr(float(max_per_step))  # 9e999: SQLite's infinity
    return f"""
DROP VIEW IF EXISTS credit_total;
DROP VIEW IF EXISTS window_credit;
DROP VIEW IF EXISTS step_caps;
CREATE VIEW step_caps AS
    SELECT step, MIN({batch}, {SHARE_SLACK!r} * {batch} / COUNT(*)) AS cap FROM step_members GROUP BY step;
CREATE VIEW window_credit AS
    SELECT m.peer_id AS peer_id, SUM(MIN(m.claim, s.cap)) AS samples, MAX(m.step) AS step
    FROM step_members m JOIN step_caps s ON s.step = m.step WHERE m.vouched = 1 GROUP BY m.peer_id;
CREATE VIEW credit_total AS
    SELECT peer_id, SUM(samples) AS samples FROM
    (SELECT peer_id, samples FROM credit UNION ALL SELECT peer_id, samples FROM window_credit)
    GROUP BY peer_id;
"""


def upgrade(db: sqlite3.Connection) -> None:
    """A store written before ``step_members`` credited each report at once into ``credit`` and kept
    ``witnessed`` rows for the window: those steps are credited already, so later reports of them are
    not taken (``meta.credited_through``), and the old table goes."""
    if db.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name='witnessed'").fetchone() is None:
        return
    (newest,) = db.execute("SELECT MAX(step) FROM witnessed").fetchone()
    if newest is not None:
        db.execute("INSERT OR REPLACE INTO meta VALUES ('credited_through', ?)", (str(int(newest)),))
    db.execute("DROP TABLE witnessed")
    db.execute("DROP TABLE IF EXISTS sharing")


def credit_witnessed(db: sqlite3.Connection, reporter: str, rounds: list, *, verified: int) -> None:
    """Take the members of ``rounds`` (``coordinator.witness.WitnessedEntry`` lists) reported by
    ``reporter``: for a step below the ``verified`` step and within ``WITNESS_WINDOW_STEPS`` of it, each
    joined, unbanned data-parallel member (``CREDITABLE``) that signed for samples becomes a member of the
    step with the most weight any report of it signed, vouched for when ``reporter`` is another member.
    Then settle the steps that left the window."""
    row = db.execute("SELECT value FROM meta WHERE key='credited_through'").fetchone()
    floor = max(verified - WITNESS_WINDOW_STEPS, int(row[0]) + 1 if row else 0)
    for entries in rounds:
        step = entries[0].step
        if not floor <= step < verified:
            continue
        for entry in entries:
            if not (math.isfinite(entry.weight) and entry.weight > 0):
                continue  # a member that signed for no samples is no member of the step
            creditable = db.execute(
                f"SELECT 1 FROM peers p WHERE p.peer_id=? AND {CREDITABLE}", (entry.peer_id, *DATA_ROLES)
            ).fetchone()
            if creditable is None:
                continue
            db.execute(
                "INSERT INTO step_members (peer_id, step, claim, vouched) VALUES (?, ?, ?, ?) "
                "ON CONFLICT(peer_id, step) DO UPDATE SET "
                "claim = MAX(claim, excluded.claim), vouched = MAX(vouched, excluded.vouched)",
                (entry.peer_id, step, float(entry.weight), int(entry.peer_id != reporter)),
            )
    settle(db, verified - WITNESS_WINDOW_STEPS)


def settle(db: sqlite3.Connection, below: int) -> None:
    """Add the shares of every step below ``below`` to its members' durable credit, and forget them."""
    db.execute(
        "INSERT INTO credit (peer_id, samples, step) "
        "SELECT m.peer_id, SUM(MIN(m.claim, s.cap)), MAX(m.step) FROM step_members m "
        "JOIN step_caps s ON s.step = m.step WHERE m.step < ? AND m.vouched = 1 GROUP BY m.peer_id "
        "ON CONFLICT(peer_id) DO UPDATE SET samples = samples + excluded.samples",
        (below,),
    )
    db.execute("DELETE FROM step_members WHERE step < ?", (below,))


__all__ = ["SCHEMA", "WITNESS_WINDOW_STEPS", "credit_witnessed", "settle", "upgrade", "views"]
