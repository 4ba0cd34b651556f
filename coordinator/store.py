"""The coordinator's record of the run in SQLite: peers, their certificates and metrics, bans, each peer's
credit (contributed samples) and a history of the run's metrics for the dashboard.

One connection, used from one worker thread, so SQLite calls never block the event loop and never race.
Every write that touches more than one row runs in one ``BEGIN IMMEDIATE`` transaction (the connection
is in autocommit mode, where ``with db:`` alone would commit each statement on its own). Evidence of
a conviction lives in its own table, so listing bans never reads it. The file survives restarts; a
data directory belongs to one run ID and refuses to serve another.
"""

from __future__ import annotations

import asyncio
import json
import math
import sqlite3
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from coordinator.credit import CHECKPOINT_MARGIN_PERIODS, merge_credit, meta_int, verify_step
from coordinator.suspicions import SCHEMA as SUSPICIONS_SCHEMA
from coordinator.suspicions import record_suspicions, suspicion_counts
from protocols.errors import ConfigError
from swarm.config import TrainingConfig

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
CREATE TABLE IF NOT EXISTS credit (
    peer_id TEXT PRIMARY KEY,
    samples REAL NOT NULL DEFAULT 0,
    reported REAL NOT NULL DEFAULT 0,
    step INTEGER NOT NULL DEFAULT 0,
    refused REAL NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS history (
    t REAL NOT NULL,
    step INTEGER NOT NULL,
    train_loss REAL,
    val_loss REAL,
    samples_per_s REAL NOT NULL,
    peers_online INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS history_by_time ON history (t);
CREATE TABLE IF NOT EXISTS ban_evidence (
    peer_id TEXT PRIMARY KEY,
    bytes INTEGER NOT NULL,
    preview BLOB NOT NULL,
    data BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS peers_by_progress ON peers (step, param_hash);
"""
SCHEMA_VERSION = "1"
# The history keeps this many samples (a week at one sample per 5 s); older ones are dropped.
MAX_HISTORY_ROWS = 120_000
# The peer metric that carries its cumulative count of samples in applied rounds (see ``Credit``).
CONTRIBUTED = "contributed_samples"
DEFAULT_STEPS_PER_S = TrainingConfig.model_fields["max_verified_steps_per_s"].default
# Bytes of each conviction's evidence that listing the bans returns (the dashboard's preview).
EVIDENCE_PREVIEW_BYTES = 512


@dataclass
class PeerRecord:
    """One peer as the coordinator records it: identity, state, certificate, last report and credit."""

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
    banned_at: float = 0.0
    contributed_samples: float = 0.0


@dataclass(frozen=True)
class HistoryPoint:
    """The run at one moment, sampled from the latest heartbeats of the peers online then."""

    t: float
    step: int
    train_loss: float | None
    val_loss: float | None
    samples_per_s: float
    peers_online: int


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


class Store:
    """Async facade over one SQLite file; every method runs on the store's own thread."""

    def __init__(
        self,
        path: Path,
        run_id: str,
        *,
        max_samples_per_step: float = math.inf,
        max_verified_steps_per_s: float = DEFAULT_STEPS_PER_S,
    ):
        self.path = path
        self.run_id = run_id
        self.max_samples_per_step = max_samples_per_step
        self.max_verified_steps_per_s = max_verified_steps_per_s
        self._newest_checkpoint_step: Callable[[], int | None] = lambda: None
        self._checkpoint_margin_steps = 0
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="swarm-store")
        self._db: sqlite3.Connection | None = None

    @classmethod
    def open_sync(
        cls,
        path: Path,
        run_id: str,
        *,
        max_samples_per_step: float = math.inf,
        max_verified_steps_per_s: float = DEFAULT_STEPS_PER_S,
    ) -> Store:
        store = cls(
            path,
            run_id,
            max_samples_per_step=max_samples_per_step,
            max_verified_steps_per_s=max_verified_steps_per_s,
        )
        store._executor.submit(store._open).result()
        return store

    def _open(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA busy_timeout=5000")
            db.executescript(SCHEMA + SUSPICIONS_SCHEMA)
            _move_old_evidence(db)
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

    def follow_checkpoints(self, newest_step: Callable[[], int | None], every_steps: int) -> None:
        """Hold the verified step within ``CHECKPOINT_MARGIN_PERIODS`` checkpoint periods of the step of
        the newest checkpoint, as ``newest_step`` gives it (None while there is none)."""
        self._newest_checkpoint_step = newest_step
        self._checkpoint_margin_steps = CHECKPOINT_MARGIN_PERIODS * every_steps

    async def next_serial(self) -> int:
        def op(db: sqlite3.Connection) -> int:
            with transaction(db):
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
            with transaction(db):
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
        self,
        peer_id: str,
        *,
        seq: int,
        seen_at: float,
        metrics: dict[str, float],
        step: int,
        param_hash: str,
        suspects: list[str] | None = None,
    ) -> bool:
        """Mark the peer online, credit its contribution and take its list of suspects, in one transaction;
        returns False (and changes nothing) when ``seq`` is not new."""

        def op(db: sqlite3.Connection) -> bool:
            with transaction(db):
                cursor = db.execute(
                    "UPDATE peers SET state='online', last_seen=?, last_seq=?, metrics=?, step=?, param_hash=? "
                    "WHERE peer_id=? AND last_seq < ?",
                    (seen_at, seq, json.dumps(metrics), step, param_hash, peer_id, seq),
                )
                if cursor.rowcount == 1:
                    checkpoint = self._newest_checkpoint_step()
                    ceiling = None if checkpoint is None else checkpoint + self._checkpoint_margin_steps
                    verified = verify_step(
                        db,
                        step,
                        param_hash,
                        now=seen_at,
                        max_steps_per_s=self.max_verified_steps_per_s,
                        max_step=ceiling,
                    )
                    if CONTRIBUTED in metrics and step <= verified:
                        merge_credit(db, peer_id, metrics[CONTRIBUTED], step, self.max_samples_per_step)
                    record_suspicions(db, peer_id, suspects or (), seen_at)
            return cursor.rowcount == 1

        return await self._run(op)

    async def record_leave(self, peer_id: str, *, seq: int, seen_at: float) -> bool:
        def op(db: sqlite3.Connection) -> bool:
            with transaction(db):
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

    async def mark_offline(self, silent_since: float, *, seen_since: float = 0.0) -> list[str]:
        """Turn online peers last heard from in [``seen_since``, ``silent_since``) offline; their IDs."""

        def op(db: sqlite3.Connection) -> list[str]:
            with transaction(db):
                rows = db.execute(
                    "SELECT peer_id FROM peers WHERE state='online' AND last_seen < ? AND last_seen >= ?",
                    (silent_since, seen_since),
                ).fetchall()
                db.executemany("UPDATE peers SET state='offline' WHERE peer_id=?", rows)
            return [r[0] for r in rows]

        return await self._run(op)

    async def ban_reason(self, peer_id: str) -> str | None:
        def op(db: sqlite3.Connection) -> str | None:
            row = db.execute("SELECT reason FROM bans WHERE peer_id=?", (peer_id,)).fetchone()
            return row[0] if row else None

        return await self._run(op)

    async def ban(
        self, peer_id: str, reason: str, evidence: bytes | None = None, *, max_stored_evidence_bytes: int = 0
    ) -> bool:
        """Ban ``peer_id``; its evidence is kept only while all kept evidence fits in
        ``max_stored_evidence_bytes``. Returns whether the evidence was kept."""
        return await self._run(
            lambda db: ban_sync(
                db, peer_id, reason, evidence, max_stored_evidence_bytes=max_stored_evidence_bytes
            )
        )

    async def list_bans(self) -> list[Ban]:
        """Every ban with the size and first bytes of its evidence (never the evidence itself)."""
        return await self._run(
            lambda db: [
                Ban(*row)
                for row in db.execute(
                    "SELECT b.peer_id, b.reason, b.banned_at, COALESCE(e.bytes, 0), COALESCE(e.preview, X'')"
                    " FROM bans b LEFT JOIN ban_evidence e ON e.peer_id = b.peer_id ORDER BY b.banned_at"
                )
            ]
        )

    async def ban_evidence(self, peer_id: str) -> bytes | None:
        def op(db: sqlite3.Connection) -> bytes | None:
            row = db.execute("SELECT data FROM ban_evidence WHERE peer_id=?", (peer_id,)).fetchone()
            return bytes(row[0]) if row else None

        return await self._run(op)

    async def enforced_bans(self, now: float, *, grace_s: float) -> list[str]:
        """Banned peers that may still hold a valid certificate (or never held one from this store), earliest
        ban first. A banned peer is never renewed, so once its certificate has expired (plus ``grace_s``
        of clock skew) no peer accepts it anyway and the published list can leave it out."""
        return await self._run(
            lambda db: [
                row[0]
                for row in db.execute(
                    "SELECT b.peer_id FROM bans b LEFT JOIN peers p ON p.peer_id = b.peer_id"
                    " WHERE p.peer_id IS NULL OR p.cert_expires_at + ? > ? ORDER BY b.banned_at",
                    (grace_s, now),
                )
            ]
        )

    async def verified_step(self) -> int:
        return await self._run(lambda db: meta_int(db, "verified_step"))

    async def suspicion_counts(self) -> dict[str, int]:
        """Per peer, how many online, unbanned peers avoid it now (``coordinator.suspicions``)."""
        return await self._run(suspicion_counts)

    async def credit_refused(self) -> dict[str, float]:
        """Samples each peer claimed beyond what its progress allows (only peers with such claims)."""
        return await self._run(
            lambda db: dict(db.execute("SELECT peer_id, refused FROM credit WHERE refused > 0").fetchall())
        )

    async def append_history(self, point: HistoryPoint) -> None:
        def op(db: sqlite3.Connection) -> None:
            with transaction(db):
                db.execute(
                    "INSERT INTO history VALUES (?, ?, ?, ?, ?, ?)",
                    (point.t, point.step, point.train_loss, point.val_loss, point.samples_per_s,
                     point.peers_online),
                )  # fmt: skip
                db.execute(
                    "DELETE FROM history WHERE rowid <= (SELECT MAX(rowid) FROM history) - ?",
                    (MAX_HISTORY_ROWS,),
                )

        await self._run(op)

    async def history(self, *, since: float = 0.0, max_points: int = 500) -> list[HistoryPoint]:
        """Samples taken after ``since``, oldest first, thinned evenly to at most ``max_points`` (the
        latest sample is always kept)."""

        def op(db: sqlite3.Connection) -> list[HistoryPoint]:
            rows = db.execute(
                "SELECT rowid, t, step, train_loss, val_loss, samples_per_s, peers_online FROM history"
                " WHERE t > ? ORDER BY rowid",
                (since,),
            ).fetchall()
            if len(rows) > max_points:
                stride = math.ceil(len(rows) / max_points)
                rows = rows[len(rows) - 1 :: -stride][::-1]
            return [HistoryPoint(*row[1:]) for row in rows]

        return await self._run(op)


def ban_sync(
    db: sqlite3.Connection,
    peer_id: str,
    reason: str,
    evidence: bytes | None = None,
    *,
    max_stored_evidence_bytes: int = 0,
) -> bool:
    with transaction(db):
        db.execute(
            "INSERT OR REPLACE INTO bans (peer_id, reason, banned_at, evidence) VALUES (?, ?, ?, NULL)",
            (peer_id, reason, time.time()),
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


def _move_old_evidence(db: sqlite3.Connection) -> None:
    """Stores written before evidence had its own table kept it in ``bans.evidence``."""
    with transaction(db):
        db.execute(
            "INSERT OR IGNORE INTO ban_evidence (peer_id, bytes, preview, data) SELECT peer_id,"
            " length(evidence), substr(evidence, 1, ?), evidence FROM bans WHERE evidence IS NOT NULL",
            (EVIDENCE_PREVIEW_BYTES,),
        )
        db.execute("UPDATE bans SET evidence = NULL WHERE evidence IS NOT NULL")


def unban_sync(db: sqlite3.Connection, peer_id: str) -> bool:
    with transaction(db):
        # `swarm-coordinator unban` may open a store the coordinator has not upgraded yet.
        if db.execute("SELECT 1 FROM sqlite_master WHERE name='ban_evidence'").fetchone():
            db.execute("DELETE FROM ban_evidence WHERE peer_id=?", (peer_id,))
        return db.execute("DELETE FROM bans WHERE peer_id=?", (peer_id,)).rowcount == 1


_SELECT_PEERS = (
    "SELECT p.peer_id, p.public_key, p.name, p.device, p.role,"
    " CASE WHEN b.peer_id IS NULL THEN p.state ELSE 'banned' END, p.joined_at, p.last_seen, p.last_seq,"
    " p.cert_serial, p.cert_expires_at, p.metrics, p.step, p.param_hash, COALESCE(b.reason, ''),"
    " COALESCE(b.banned_at, 0), COALESCE(c.samples, 0)"
    " FROM peers p LEFT JOIN bans b ON b.peer_id = p.peer_id LEFT JOIN credit c ON c.peer_id = p.peer_id"
)


def _record(row: Any) -> PeerRecord:
    *head, metrics, step, param_hash, ban_reason, banned_at, contributed = row
    return PeerRecord(
        *head, metrics=json.loads(metrics), step=step, param_hash=param_hash, ban_reason=ban_reason,
        banned_at=banned_at, contributed_samples=contributed,
    )  # fmt: skip


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
