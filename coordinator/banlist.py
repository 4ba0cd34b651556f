"""The run's bans in the coordinator's SQLite store: who, why, when, the evidence of a conviction, and
which bans the signed ban list in the DHT names.

A ban list holds at most ``swarm.bans.MAX_BANNED`` peers, and under open admission identities are
cheap: a Sybil that files a false accusation bans itself. So the published list names only bans whose
certificates may still be valid (a banned peer is never renewed, and re-admission of a banned key is
refused at join), convictions and operator bans before the bans of false accusers. Within each, a
conviction ranks by how many earlier ones its accuser's address brought (``enforced_bans_sync``), then
newest first: a conviction in a round that Sybils made up among themselves is as true as any, so it is
addresses, not keys, that can crowd the list; a fresh ban makes the list unless more addresses than the
list holds convicted someone while it is live.

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
    false_accuser INTEGER NOT NULL DEFAULT 0,
    accuser_address TEXT NOT NULL DEFAULT ''
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
    ``bans.evidence``, and bans once did not say whether they were a false accuser's, nor from which
    address the accusation came."""
    columns = {row[1] for row in db.execute("PRAGMA table_info(bans)")}
    if "false_accuser" not in columns:
        db.execute("ALTER TABLE bans ADD COLUMN false_accuser INTEGER NOT NULL DEFAULT 0")
    if "accuser_address" not in columns:
        db.execute("ALTER TABLE bans ADD COLUMN accuser_address TEXT NOT NULL DEFAULT ''")
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
    accuser_address: str = "",
) -> bool:
    """Ban ``peer_id``; its evidence is kept only while all kept evidence fits in
    ``max_stored_evidence_bytes``. ``accuser_address``: the address (``limits.caller_key``) whose
    accusation brought the ban; empty for an operator's. Returns whether the evidence was kept."""
    with transaction(db):
        # A ban keeps the time and address of its first conviction: a later accusation of a banned peer
        # (an accomplice filing the same evidence from a crowded address) must not move it down the list.
        # It is replaced only by a stronger kind: a conviction over a false accuser's ban, an operator's
        # ban over any.
        db.execute(
            "INSERT INTO bans (peer_id, reason, banned_at, evidence, false_accuser, accuser_address)"
            " VALUES (?, ?, ?, NULL, ?, ?) ON CONFLICT(peer_id) DO UPDATE SET reason=excluded.reason,"
            " banned_at=excluded.banned_at, false_accuser=excluded.false_accuser,"
            " accuser_address=excluded.accuser_address"
            " WHERE excluded.accuser_address = '' OR (bans.false_accuser = 1 AND excluded.false_accuser = 0)",
            (peer_id, reason, time.time(), int(false_accuser), accuser_address[:128]),
        )
        if not evidence:
            return False
        if db.execute("SELECT 1 FROM ban_evidence WHERE peer_id=?", (peer_id,)).fetchone():
            return True  # the first conviction's evidence stays
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
    """Banned peers that may still hold a valid certificate (or never held one from this store), in the
    order the signed list keeps them when it is full: the convictions and operator bans first, then false
    accusers. Within each, operator bans come first, then each accusing address's first conviction, then
    each one's second, and so on, the newest first among equals. Sybils that convict one another in
    rounds made up among themselves (every such conviction is a true one) push a conviction from
    another address off the list only with as many addresses as the list holds, not with as many keys."""
    return [
        row[0]
        for row in db.execute(
            "SELECT peer_id FROM (SELECT b.peer_id, b.false_accuser, b.banned_at, b.accuser_address,"
            " ROW_NUMBER() OVER (PARTITION BY b.accuser_address ORDER BY b.banned_at, b.peer_id) AS nth"
            " FROM bans b LEFT JOIN peers p ON p.peer_id = b.peer_id"
            " WHERE p.peer_id IS NULL OR p.cert_expires_at + ? > ?)"
            " ORDER BY false_accuser, CASE WHEN accuser_address = '' THEN 0 ELSE nth END, banned_at DESC,"
            " peer_id",
            (grace_s, now),
        )
    ]
