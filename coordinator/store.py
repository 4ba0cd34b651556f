"""The coordinator's record of the run in SQLite: peers, their certificates and metrics, and bans.

One connection, used from one worker thread, so SQLite calls never block the event loop and never race.
The file survives restarts; a data directory belongs to one run ID and refuses to serve another.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from protocols.errors import ConfigError

T = TypeVar("T")

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS peers (
    peer_id TEXT PRIMARY KEY,
    public_key BLOB NOT NULL,
    name TEXT NOT NULL,
    device TEXT NOT NULL,
    role TEXT NOT NULL,
    state TEXT NOT NULL,
    joined_at REAL NOT NULL,
    last_seen REAL NOT NULL,
    last_seq INTEGER NOT NULL DEFAULT 0,
    cert_serial INTEGER NOT NULL,
    cert_expires_at REAL NOT NULL,
    metrics TEXT NOT NULL DEFAULT '{}',
    step INTEGER NOT NULL DEFAULT 0,
    param_hash TEXT NOT NULL DEFAULT ''
);
CREATE TABLE IF NOT EXISTS bans (
    peer_id TEXT PRIMARY KEY,
    reason TEXT NOT NULL,
    banned_at REAL NOT NULL,
    evidence BLOB
);
"""
SCHEMA_VERSION = "1"


@dataclass
class PeerRecord:
    peer_id: str
    public_key: bytes
    name: str
    device: str
    role: str
    state: str
    joined_at: float
    last_seen: float
    last_seq: int
    cert_serial: int
    cert_expires_at: float
    metrics: dict[str, float] = field(default_factory=dict)
    step: int = 0
    param_hash: str = ""
    ban_reason: str = ""


class Store:
    """Async facade over one SQLite file; every method runs on the store's own thread."""

    def __init__(self, path: Path, run_id: str):
        self.path = path
        self.run_id = run_id
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="swarm-store")
        self._db: sqlite3.Connection | None = None

    @classmethod
    def open_sync(cls, path: Path, run_id: str) -> Store:
        store = cls(path, run_id)
        store._executor.submit(store._open).result()
        return store

    def _open(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA busy_timeout=5000")
            db.executescript(SCHEMA)
        except sqlite3.Error as e:
            raise ConfigError(f"cannot open the coordinator store {self.path}: {e}") from None
        row = db.execute("SELECT value FROM meta WHERE key='run_id'").fetchone()
        if row is None:
            db.execute("INSERT INTO meta VALUES ('run_id', ?), ('schema', ?)", (self.run_id, SCHEMA_VERSION))
        elif row[0] != self.run_id:
            db.close()
            raise ConfigError(
                f"data dir {self.path.parent} holds run {row[0]!r}, not {self.run_id!r}; "
                "use another --data-dir for a new run"
            )
        self._db = db

    async def _run(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        assert self._db is not None, "store is closed"
        db = self._db
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, db)

    def close(self) -> None:
        if self._db is not None:
            self._executor.submit(self._db.close).result()
            self._db = None
        self._executor.shutdown(wait=True)

    async def next_serial(self) -> int:
        def op(db: sqlite3.Connection) -> int:
            with db:
                row = db.execute("SELECT value FROM meta WHERE key='serial'").fetchone()
                serial = int(row[0]) + 1 if row else 1
                db.execute("INSERT OR REPLACE INTO meta VALUES ('serial', ?)", (str(serial),))
            return serial

        return await self._run(op)

    async def get_peer(self, peer_id: str) -> PeerRecord | None:
        def op(db: sqlite3.Connection) -> PeerRecord | None:
            row = db.execute(_SELECT_PEERS + " WHERE p.peer_id = ?", (peer_id,)).fetchone()
            return _record(row) if row else None

        return await self._run(op)

    async def list_peers(self) -> list[PeerRecord]:
        return await self._run(
            lambda db: [_record(r) for r in db.execute(_SELECT_PEERS + " ORDER BY joined_at")]
        )

    async def admit(self, record: PeerRecord) -> None:
        """Insert or replace a peer on join; a rejoin keeps its first joined_at."""

        def op(db: sqlite3.Connection) -> None:
            with db:
                db.execute(
                    "INSERT INTO peers (peer_id, public_key, name, device, role, state, joined_at, last_seen,"
                    " last_seq, cert_serial, cert_expires_at, metrics) VALUES (?,?,?,?,?,?,?,?,?,?,?,?)"
                    " ON CONFLICT(peer_id) DO UPDATE SET name=excluded.name, device=excluded.device,"
                    " role=excluded.role, state=excluded.state, last_seen=excluded.last_seen,"
                    " cert_serial=excluded.cert_serial, cert_expires_at=excluded.cert_expires_at",
                    (
                        record.peer_id, record.public_key, record.name, record.device, record.role,
                        record.state, record.joined_at, record.last_seen, record.last_seq,
                        record.cert_serial, record.cert_expires_at, json.dumps(record.metrics),
                    ),
                )  # fmt: skip

        await self._run(op)

    async def record_heartbeat(
        self, peer_id: str, *, seq: int, seen_at: float, metrics: dict[str, float], step: int, param_hash: str
    ) -> bool:
        """Mark the peer online; returns False (and changes nothing) when ``seq`` is not new."""

        def op(db: sqlite3.Connection) -> bool:
            with db:
                cursor = db.execute(
                    "UPDATE peers SET state='online', last_seen=?, last_seq=?, metrics=?, step=?, param_hash=? "
                    "WHERE peer_id=? AND last_seq < ?",
                    (seen_at, seq, json.dumps(metrics), step, param_hash, peer_id, seq),
                )
            return cursor.rowcount == 1

        return await self._run(op)

    async def record_leave(self, peer_id: str, *, seq: int, seen_at: float) -> bool:
        def op(db: sqlite3.Connection) -> bool:
            with db:
                cursor = db.execute(
                    "UPDATE peers SET state='left', last_seen=?, last_seq=? WHERE peer_id=? AND last_seq < ?",
                    (seen_at, seq, peer_id, seq),
                )
            return cursor.rowcount == 1

        return await self._run(op)

    async def renew_certificate(self, peer_id: str, serial: int, expires_at: float) -> None:
        await self._run(
            lambda db: db.execute(
                "UPDATE peers SET cert_serial=?, cert_expires_at=? WHERE peer_id=?",
                (serial, expires_at, peer_id),
            )
        )

    async def mark_offline(self, silent_since: float) -> list[str]:
        """Turn online peers not heard from since ``silent_since`` offline; returns their IDs."""

        def op(db: sqlite3.Connection) -> list[str]:
            with db:
                rows = db.execute(
                    "SELECT peer_id FROM peers WHERE state='online' AND last_seen < ?", (silent_since,)
                ).fetchall()
                db.executemany("UPDATE peers SET state='offline' WHERE peer_id=?", rows)
            return [r[0] for r in rows]

        return await self._run(op)

    async def ban_reason(self, peer_id: str) -> str | None:
        def op(db: sqlite3.Connection) -> str | None:
            row = db.execute("SELECT reason FROM bans WHERE peer_id=?", (peer_id,)).fetchone()
            return row[0] if row else None

        return await self._run(op)

    async def ban(self, peer_id: str, reason: str, evidence: bytes | None = None) -> None:
        await self._run(lambda db: ban_sync(db, peer_id, reason, evidence))


def ban_sync(db: sqlite3.Connection, peer_id: str, reason: str, evidence: bytes | None = None) -> None:
    with db:
        db.execute(
            "INSERT OR REPLACE INTO bans (peer_id, reason, banned_at, evidence) VALUES (?, ?, ?, ?)",
            (peer_id, reason, time.time(), evidence),
        )


def unban_sync(db: sqlite3.Connection, peer_id: str) -> bool:
    with db:
        return db.execute("DELETE FROM bans WHERE peer_id=?", (peer_id,)).rowcount == 1


_SELECT_PEERS = (
    "SELECT p.peer_id, p.public_key, p.name, p.device, p.role,"
    " CASE WHEN b.peer_id IS NULL THEN p.state ELSE 'banned' END, p.joined_at, p.last_seen, p.last_seq,"
    " p.cert_serial, p.cert_expires_at, p.metrics, p.step, p.param_hash, COALESCE(b.reason, '')"
    " FROM peers p LEFT JOIN bans b ON b.peer_id = p.peer_id"
)


def _record(row: Any) -> PeerRecord:
    *head, metrics, step, param_hash, ban_reason = row
    return PeerRecord(
        *head, metrics=json.loads(metrics), step=step, param_hash=param_hash, ban_reason=ban_reason
    )


def diverged_peers(records: list[PeerRecord]) -> set[str]:
    """Online peers whose parameter hash differs from the one most online peers at their step report."""
    by_step: dict[int, Counter[str]] = {}
    for r in records:
        if r.state == "online" and r.param_hash:
            by_step.setdefault(r.step, Counter())[r.param_hash] += 1
    majority = {step: min(c.items(), key=lambda item: (-item[1], item[0]))[0] for step, c in by_step.items()}
    return {
        r.peer_id
        for r in records
        if r.state == "online" and r.param_hash and r.param_hash != majority[r.step]
    }
