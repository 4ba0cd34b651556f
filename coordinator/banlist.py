"""The run's bans in the coordinator's SQLite store: who, why, when, the evidence of a conviction, and
which bans the signed ban list in the DHT names.

A ban list holds at most ``swarm.bans.MAX_BANNED`` peers, and under open admission identities are
cheap: a Sybil that files a false accusation bans itself. So the published list names only bans whose
certificates may still be valid (a banned peer is never renewed, and re-admission of a banned key is
refused at join), convictions and operator bans before the bans of false accusers, and the newest
first within each: a fresh ban always makes the list unless more convictions than the list holds are
live, and each of those needed a round it was caught cheating in.

All functions take the store's connection and run on its thread (``coordinator.store``).
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

# Bytes of each conviction's evidence that listing the bans returns (the dashboard's preview).
EVIDENCE_PREVIEW_BYTES = 512

SCHEMA = """
CREATE TABLE IF NOT EXISTS bans (
    peer_id TEXT PRIMARY KEY,
    reason TEXT NOT NULL,
    banned_at REAL NOT NULL,
    evidence BLOB,
    false_accuser INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS ban_evidence (
    peer_id TEXT PRIMARY KEY,
    bytes INTEGER NOT NULL,
    preview BLOB NOT NULL,
    data BLOB NOT NULL
);
"""


@dataclass(frozen=True)
class Ban:
    """A ban on the run's list: whom, why, when, and the size and first bytes of the evidence."""

    peer_id: str
    reason: str
    banned_at: float
    evidence_bytes: int = 0
    evidence_preview: bytes = b""


@contextmanager
def transaction(db: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """All statements inside commit together or not at all (whatever the connection's isolation level)."""
    db.execute("BEGIN IMMEDIATE")
    try:
        yield db
    except BaseException:
        db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")


def upgrade(db: sqlite3.Connection) -> None:
    """Bring a store written by an older coordinator up to ``SCHEMA``: evidence once lived in
    ``bans.evidence``, and bans once did not say whether they were a false accuser's."""
    columns = {row[1] for row in db.execute("PRAGMA table_info(bans)")}
    if "false_accuser" not in columns:
        db.execute("ALTER TABLE bans ADD COLUMN false_accuser INTEGER NOT NULL DEFAULT 0")
    with transaction(db):
        db.execute(
            "INSERT OR IGNORE INTO ban_evidence (peer_id, bytes, preview, data) SELECT peer_id,"
            " length(evidence), substr(evidence, 1, ?), evidence FROM bans WHERE evidence IS NOT NULL",
            (EVIDENCE_PREVIEW_BYTES,),
        )
        db.execute("UPDATE bans SET evidence = NULL WHERE evidence IS NOT NULL")


def ban_sync(
    db: sqlite3.Connection,
    peer_id: str,
    reason: str,
    evidence: bytes | None = None,
    *,
    max_stored_evidence_bytes: int = 0,
    false_accuser: bool = False,
) -> bool:
    """Ban ``peer_id``; its evidence is kept only while all kept evidence fits in
    ``max_stored_evidence_bytes``. Returns whether the evidence was kept."""
    with transaction(db):
        db.execute(
            "INSERT OR REPLACE INTO bans (peer_id, reason, banned_at, evidence, false_accuser)"
            " VALUES (?, ?, ?, NULL, ?)",
            (peer_id, reason, time.time(), int(false_accuser)),
        )
        if not evidence:
            return False
        (stored,) = db.execute(
            "SELECT COALESCE(SUM(bytes), 0) FROM ban_evidence WHERE peer_id != ?", (peer_id,)
        ).fetchone()
        if stored + len(evidence) > max_stored_evidence_bytes:
            return False
        db.execute(
            "INSERT OR REPLACE INTO ban_evidence (peer_id, bytes, preview, data) VALUES (?, ?, ?, ?)",
            (peer_id, len(evidence), evidence[:EVIDENCE_PREVIEW_BYTES], evidence),
        )
        return True


def unban_sync(db: sqlite3.Connection, peer_id: str) -> bool:
    with transaction(db):
        # `swarm-coordinator unban` may open a store the coordinator has not upgraded yet.
        if db.execute("SELECT 1 FROM sqlite_master WHERE name='ban_evidence'").fetchone():
            db.execute("DELETE FROM ban_evidence WHERE peer_id=?", (peer_id,))
        return db.execute("DELETE FROM bans WHERE peer_id=?", (peer_id,)).rowcount == 1


def list_bans_sync(db: sqlite3.Connection) -> list[Ban]:
    return [
        Ban(*row)
        for row in db.execute(
            "SELECT b.peer_id, b.reason, b.banned_at, COALESCE(e.bytes, 0), COALESCE(e.preview, X'')"
            " FROM bans b LEFT JOIN ban_evidence e ON e.peer_id = b.peer_id ORDER BY b.banned_at"
        )
    ]


def enforced_bans_sync(db: sqlite3.Connection, now: float, grace_s: float) -> list[str]:
    """Banned peers that may still hold a valid certificate (or never held one from this store): the
    convictions and operator bans first, then false accusers, the newest first within each."""
    return [
        row[0]
        for row in db.execute(
            "SELECT b.peer_id FROM bans b LEFT JOIN peers p ON p.peer_id = b.peer_id"
            " WHERE p.peer_id IS NULL OR p.cert_expires_at + ? > ?"
            " ORDER BY b.false_accuser, b.banned_at DESC, b.peer_id",
            (grace_s, now),
        )
    ]
