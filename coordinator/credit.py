"""How the coordinator turns what peers report into durable credit, and the step it trusts them to be at.

All run inside the store's heartbeat transaction (``coordinator.store``), on its own connection. The
verified step bounds credit, so it is bounded itself: by a majority of the reporting peers, by how fast a
run can train, and by the newest checkpoint.

A data-parallel peer is credited only for rounds other members witnessed (``coordinator.stepshares``):
the weight its signed group entry claims, reported by another member of the round, for steps the run
has verified, at most an equal share of twice a batch among every member reported at that step. Its
own ``contributed_samples`` is shown, never credited. This module holds the rules both share:
``SHARE_SLACK``, ``DATA_ROLES`` and which peers may be credited (``CREDITABLE``).

Pipeline roles (stage servers and trainers) hold no such rounds yet, and are credited as follows.
What is checked, and what is not: a peer's ``contributed_samples`` is its own claim. The coordinator
credits it only for steps at or below the verified step, only while the parameter hash the peer reports
for its step is the one most online, unbanned peers at that step report, and at most one share of a
round per step it advanced: twice the run's target batch divided among the online, unbanned peers
that report that same state when the heartbeat arrives (``round_share``). A freeloader that copies
the public step and hash from ``Status`` is one more such peer, so it earns at most about twice an
average member's share, not the whole batch; an honest peer that computes more than twice the
average share of a round has the excess refused. The coordinator does not see the rounds themselves: it cannot tell a
freeloader's share from an honest one's, and each identity that copies the state dilutes the shares
of all (a round's samples are split among more peers, so Sybils earn credit at honest peers' cost).
"""

from __future__ import annotations

import math
import sqlite3

# With a checkpoint, the verified step stays within this many checkpoint periods of the newest one: the
# coordinator takes one every ``checkpoint_every_steps`` of agreed progress, so an honest run is about
# one period ahead of it (two leave room for a checkpoint still being downloaded).
CHECKPOINT_MARGIN_PERIODS = 2
# One peer's share of a round may be up to this many times the average share: members differ in
# speed, and a faster one computes more of the batch than a slower one.
SHARE_SLACK = 2.0
# Roles credited from witnessed rounds (``coordinator.stepshares``); the others report their own, bounded.
DATA_ROLES = ("data", "auto")
# A row of ``peers p`` whose peer is not banned.
UNBANNED = "NOT EXISTS (SELECT 1 FROM bans b WHERE b.peer_id = p.peer_id)"
# A row of ``peers p`` that witnessed rounds may credit: a data-parallel peer of the run (online,
# offline, or left: the store keeps a peer that left while it is a member of a step in the witness
# window, so one that leaves right after its round is credited for it when a groupmate reports it), not
# banned; two role parameters follow (``DATA_ROLES``).
CREDITABLE = f"p.state IN ('online', 'offline', 'left') AND p.role IN (?, ?) AND {UNBANNED}"


def meta_int(db: sqlite3.Connection, key: str) -> int:
    row = db.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
    return int(row[0]) if row else 0


def _set_meta(db: sqlite3.Connection, key: str, value: object) -> None:
    db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, str(value)))


def verify_step(
    db: sqlite3.Connection,
    step: int,
    param_hash: str,
    *,
    now: float,
    max_steps_per_s: float,
    max_step: int | None = None,
) -> int:
    """The run's verified step after a peer reported ``(step, param_hash)`` at ``now`` (the coordinator's
    clock, never the peer's). It advances towards a step at which at least two unbanned online peers, and
    more than half of those that report a hash, hold the same parameters, but by at most
    ``max_steps_per_s`` (the run's ``training.max_verified_steps_per_s``) per second since it last moved,
    and never past ``max_step`` (the newest checkpoint's step plus a margin, where there is one). It
    never falls (peers at it may later go offline)."""
    verified = meta_int(db, "verified_step")
    row = db.execute("SELECT value FROM meta WHERE key='verified_at'").fetchone()
    if row is None:  # the rate is counted from the first report the store ever takes
        _set_meta(db, "verified_at", now)
        return verified
    since = float(row[0])
    if step <= verified or not param_hash:
        return verified
    online = f"p.state='online' AND p.param_hash != '' AND {UNBANNED}"
    (agreeing,) = db.execute(
        f"SELECT COUNT(*) FROM peers p WHERE p.step=? AND p.param_hash=? AND {online}", (step, param_hash)
    ).fetchone()
    if agreeing < 2:
        return verified
    (reporting,) = db.execute(f"SELECT COUNT(*) FROM peers p WHERE {online}").fetchone()
    if 2 * agreeing <= reporting:
        return verified
    allowed = verified + math.floor(max(0.0, now - since) * max_steps_per_s)
    target = min(step, allowed, step if max_step is None else max_step)
    if target <= verified:
        return verified
    _set_meta(db, "verified_step", target)
    # Held back by the rate, it keeps the fraction of a step it had earned; otherwise the clock restarts
    # now, and what the run left unused is not kept for a later jump.
    held_back = target == allowed
    _set_meta(db, "verified_at", since + (target - verified) / max_steps_per_s if held_back else now)
    return target


def round_share(db: sqlite3.Connection, step: int, param_hash: str, max_per_step: float) -> float | None:
    """Samples one peer reporting ``(step, param_hash)`` may be credited per step it advanced:
    ``SHARE_SLACK`` times the run's target batch over the online, unbanned peers that report this
    state, or None (no credit now) when they are not more than half of those reporting at ``step``."""
    online = f"p.state='online' AND {UNBANNED}"
    (agreeing,) = db.execute(
        f"SELECT COUNT(*) FROM peers p WHERE p.step=? AND p.param_hash=? AND {online}", (step, param_hash)
    ).fetchone()
    (reporting,) = db.execute(
        f"SELECT COUNT(*) FROM peers p WHERE p.step=? AND p.param_hash != '' AND {online}", (step,)
    ).fetchone()
    if not param_hash or agreeing == 0 or 2 * agreeing <= reporting:
        return None
    return min(max_per_step, SHARE_SLACK * max_per_step / agreeing)


def merge_credit(
    db: sqlite3.Connection, peer_id: str, reported: float, step: int, max_per_step: float
) -> None:
    """Merge a peer's reported cumulative ``contributed_samples`` into its durable credit.

    The counter lives in the peer's trainer and starts again from 0 when the trainer restarts, so a
    report below the previous one is a restart: the whole new count is new work. Credit never falls.
    Growth is capped by progress: at most ``max_per_step`` samples (one peer's share of a round, see
    ``round_share``) per step the peer advanced since its credit last grew, so neither a counter that
    jumps nor one that keeps "restarting" earns more than real rounds could hold; the excess is kept
    as ``refused`` for the organizer to see. The caller merges only reports made at or below the run's verified step (see
    ``verify_step``), so a peer that claims a step nobody else reached earns nothing for it; a report
    made ahead of it waits, and the cumulative counter carries it into a later heartbeat.
    """
    if not math.isfinite(reported) or reported < 0:
        return
    row = db.execute("SELECT reported, step FROM credit WHERE peer_id=?", (peer_id,)).fetchone()
    if row is None:
        # The first report is the baseline: work before it was done where the coordinator saw no progress.
        db.execute(
            "INSERT INTO credit (peer_id, samples, reported, step, refused) VALUES (?, 0, ?, ?, 0)",
            (peer_id, reported, step),
        )
        return
    previous, credited_step = row
    claimed = reported - previous if reported >= previous else reported
    allowed = max(0, step - credited_step) * max_per_step
    granted = min(claimed, allowed)
    db.execute(
        "UPDATE credit SET samples = samples + ?, reported = ?, refused = refused + ?, step = ? WHERE peer_id=?",
        (granted, reported, claimed - granted, max(step, credited_step), peer_id),
    )
