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
from collections import Counter
from collections.abc import Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from coordinator import stepshares
from coordinator.banlist import (  # noqa: F401  (the CLI and metrics import them from here)
    EVIDENCE_PREVIEW_BYTES,
    Ban,
    ban_sync,
    enforced_bans_sync,
    list_bans_sync,
    transaction,
    unban_sync,
    upgrade,
)
from coordinator.banlist import SCHEMA as BANS_SCHEMA
from coordinator.credit import (
    CHECKPOINT_MARGIN_PERIODS,
    DATA_ROLES,
    UNBANNED,
    merge_credit,
    meta_int,
    round_share,
    verify_step,
)
from coordinator.standing import credited_peers
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
CREATE INDEX IF NOT EXISTS peers_by_progress ON peers (step, param_hash);
-- What a join's prune, a Status call and a heartbeat ahead of the verified step read, by index: keys
-- that joined and never reported a hash (or let their certificates lapse) cost none of them a row.
CREATE INDEX IF NOT EXISTS peers_reporting ON peers (step, param_hash) WHERE state = 'online' AND param_hash != '';
CREATE INDEX IF NOT EXISTS peers_left ON peers (peer_id) WHERE state = 'left';
CREATE INDEX IF NOT EXISTS peers_by_expiry ON peers (cert_expires_at);
"""
SCHEMA_VERSION = "1"
# The history keeps this many samples (a week at one sample per 5 s); older ones are dropped.
MAX_HISTORY_ROWS = 120_000
# The peer metric that carries its cumulative count of samples in applied rounds (see ``Credit``).
CONTRIBUTED = "contributed_samples"
DEFAULT_STEPS_PER_S = TrainingConfig.model_fields["max_verified_steps_per_s"].default


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
        self._credit_of = stepshares.CreditOf(max_samples_per_step)
        self._select_peers = _select_peers(self._credit_of)
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
            db.executescript(SCHEMA + BANS_SCHEMA + SUSPICIONS_SCHEMA + stepshares.SCHEMA)
            upgrade(db)
            stepshares.upgrade(db)
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
            row = db.execute(self._select_peers + " WHERE p.peer_id = ?", (peer_id,)).fetchone()
            return _record(row) if row else None

        return await self._run(op)

    async def peer_page(self, *, after: str = "", limit: int) -> tuple[list[PeerRecord], int]:
        """Up to ``limit`` peers with IDs after ``after``, in ID order, and how many the table holds."""

        def op(db: sqlite3.Connection) -> tuple[list[PeerRecord], int]:
            rows = db.execute(
                self._select_peers + " WHERE p.peer_id > ? ORDER BY p.peer_id LIMIT ?", (after, limit)
            )
            page = [_record(r) for r in rows]
            return page, db.execute("SELECT COUNT(*) FROM peers").fetchone()[0]

        return await self._run(op)

    async def majority_hashes(self, step: int | None = None) -> dict[int, str]:
        """Per step (only ``step`` when given: a heartbeat's check reads one step's rows through the
        ``peers_by_progress`` index, not the whole table), the parameter hash most online, unbanned peers
        at it report (ties: the least hash)."""
        where, args = ("AND p.step = ? ", (step,)) if step is not None else ("", ())

        def op(db: sqlite3.Connection) -> dict[int, str]:
            majority: dict[int, tuple[int, str]] = {}
            for step, param_hash, count in db.execute(
                "SELECT p.step, p.param_hash, COUNT(*) FROM peers p WHERE p.state='online' AND p.param_hash != ''"
                f" {where}AND {UNBANNED}"
                " GROUP BY p.step, p.param_hash",
                args,
            ):
                best = majority.get(step)
                if best is None or (-count, param_hash) < (-best[0], best[1]):
                    majority[step] = (count, param_hash)
            return {step: param_hash for step, (_, param_hash) in majority.items()}

        return await self._run(op)

    async def prune(self, now: float, *, grace_s: float) -> int:
        """Forget peers that left (once they are members of no step in the witness window) or whose
        certificates expired over ``grace_s`` ago (banned peers are kept: the ban list needs their
        certificates' expiry); returns how many. Their credit stays."""

        def op(db: sqlite3.Connection) -> int:
            # A peer that left stays while it is a member of a step in the witness window (its share of it
            # may still be reported: ``coordinator.stepshares``). Each half reads its own index.
            kept = "peer_id NOT IN (SELECT peer_id FROM bans)"
            left = db.execute(
                f"SELECT peer_id FROM peers WHERE state='left' AND {kept} "
                "AND peer_id NOT IN (SELECT peer_id FROM step_members)"
            )
            expired = db.execute(
                f"SELECT peer_id FROM peers WHERE cert_expires_at < ? AND {kept}", (now - grace_s,)
            )
            gone = sorted({peer for (peer,) in left} | {peer for (peer,) in expired})
            with transaction(db):
                for at in range(0, len(gone), 400):  # 800 bound at most: SQLite before 3.32 takes 999
                    chunk = gone[at : at + 400]
                    marks = ",".join("?" * len(chunk))
                    db.execute(
                        f"DELETE FROM suspicions WHERE reporter IN ({marks}) OR suspect IN ({marks})",
                        (*chunk, *chunk),
                    )
                    db.execute(f"DELETE FROM peers WHERE peer_id IN ({marks})", chunk)
            return len(gone)

        return await self._run(op)

    async def list_peers(self) -> list[PeerRecord]:
        return await self._run(
            lambda db: [_record(r) for r in db.execute(self._select_peers + " ORDER BY joined_at")]
        )

    async def admit(self, record: PeerRecord) -> None:
        """Insert or replace a peer on join; a rejoin keeps its first joined_at and its role (the
        service refuses a rejoin under another role: credit is counted by role)."""

        def op(db: sqlite3.Connection) -> None:
            with transaction(db):
                db.execute(
                    "INSERT INTO peers (peer_id, public_key, name, device, role, state, joined_at, last_seen,"
                    " last_seq, cert_serial, cert_expires_at, metrics) VALUES (?,?,?,?,?,?,?,?,?,?,?,?)"
                    " ON CONFLICT(peer_id) DO UPDATE SET name=excluded.name, device=excluded.device,"
                    " state=excluded.state, last_seen=excluded.last_seen,"
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
        rounds: list | None = None,
    ) -> bool:
        """Mark the peer online, credit the members of the ``rounds`` it witnessed (data-parallel peers,
        ``coordinator.witness``) or its own reported contribution (pipeline roles), and take its list of
        suspects, in one transaction; returns False (and changes nothing) when ``seq`` is not new."""

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
                    (role,) = db.execute("SELECT role FROM peers WHERE peer_id=?", (peer_id,)).fetchone()
                    if role in DATA_ROLES:
                        stepshares.credit_witnessed(
                            db, peer_id, rounds or [], verified=verified, credit_of=self._credit_of
                        )
                    else:
                        share = round_share(db, step, param_hash, self.max_samples_per_step)
                        if CONTRIBUTED in metrics and step <= verified and share is not None:
                            merge_credit(db, peer_id, metrics[CONTRIBUTED], step, share)
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

    async def conviction(self, peer_id: str) -> str | None:
        """The reason ``peer_id`` is banned for its own fault (convicted, or by the operator), or None:
        a ban for a false accusation alone leaves its work to be judged, and convicted over it."""

        def op(db: sqlite3.Connection) -> str | None:
            row = db.execute(
                "SELECT reason FROM bans WHERE peer_id=? AND false_accuser=0", (peer_id,)
            ).fetchone()
            return row[0] if row else None

        return await self._run(op)

    async def ban(
        self,
        peer_id: str,
        reason: str,
        evidence: bytes | None = None,
        *,
        max_stored_evidence_bytes: int = 0,
        false_accuser: bool = False,
        accuser_address: str = "",
    ) -> bool:
        """Ban ``peer_id`` (``coordinator.banlist.ban_sync``); returns whether its evidence was kept."""
        return await self._run(
            lambda db: ban_sync(
                db,
                peer_id,
                reason,
                evidence,
                max_stored_evidence_bytes=max_stored_evidence_bytes,
                false_accuser=false_accuser,
                accuser_address=accuser_address,
            )
        )

    async def list_bans(self) -> list[Ban]:
        """Every ban with the size and first bytes of its evidence (never the evidence itself)."""
        return await self._run(list_bans_sync)

    async def ban_evidence(self, peer_id: str) -> bytes | None:
        def op(db: sqlite3.Connection) -> bytes | None:
            row = db.execute("SELECT data FROM ban_evidence WHERE peer_id=?", (peer_id,)).fetchone()
            return bytes(row[0]) if row else None

        return await self._run(op)

    async def enforced_bans(self, now: float, *, grace_s: float) -> list[str]:
        """Banned peers that may still hold a valid certificate, in the order the ban list keeps them
        (``coordinator.banlist``). A banned peer is never renewed, so once its certificate has expired
        (plus ``grace_s`` of clock skew) no peer accepts it anyway and the published list leaves it out."""
        return await self._run(lambda db: enforced_bans_sync(db, now, grace_s))

    async def verified_step(self) -> int:
        return await self._run(lambda db: meta_int(db, "verified_step"))

    async def suspicion_counts(self) -> dict[str, int]:
        """Per peer, how many online, unbanned peers avoid it now (``coordinator.suspicions``)."""
        return await self._run(lambda db: suspicion_counts(db, self._credit_of))

    async def standing(self) -> dict[str, float]:
        """The credited samples of the online, unbanned peers with the most (``coordinator.standing``)."""
        return await self._run(lambda db: credited_peers(db, self._credit_of))

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


def _select_peers(credit_of: stepshares.CreditOf) -> str:
    """The peers' rows as ``_record`` reads them, each peer's credit read by key (``CreditOf``)."""
    return (
        "SELECT p.peer_id, p.public_key, p.name, p.device, p.role,"
        " CASE WHEN b.peer_id IS NULL THEN p.state ELSE 'banned' END, p.joined_at, p.last_seen, p.last_seq,"
        " p.cert_serial, p.cert_expires_at, p.metrics, p.step, p.param_hash, COALESCE(b.reason, ''),"
        f" COALESCE(b.banned_at, 0), {credit_of.total('p.peer_id')}"
        " FROM peers p LEFT JOIN bans b ON b.peer_id = p.peer_id"
    )


def _record(row: Any) -> PeerRecord:
    *head, metrics, step, param_hash, ban_reason, banned_at, contributed = row
    return PeerRecord(
        *head, metrics=json.loads(metrics), step=step, param_hash=param_hash, ban_reason=ban_reason,
        banned_at=banned_at, contributed_samples=contributed,
    )  # fmt: skip


def diverged_peers(records: list[PeerRecord], outside: Collection[str] = ()) -> set[str]:
    """Online peers whose parameter hash differs from the one most online peers at their step report,
    and those in ``outside`` (a swarm split from the coordinator's DHT)."""
    by_step: dict[int, Counter[str]] = {}
    for r in records:
        if r.state == "online" and r.param_hash:
            by_step.setdefault(r.step, Counter())[r.param_hash] += 1
    majority = {step: min(c.items(), key=lambda item: (-item[1], item[0]))[0] for step, c in by_step.items()}
    return {
        r.peer_id
        for r in records
        if r.state == "online" and r.param_hash and r.param_hash != majority[r.step]
    } | (set(outside) & {r.peer_id for r in records if r.state == "online"})
