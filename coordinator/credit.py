"""How the coordinator turns what peers report into durable credit, and the step it trusts them to be at.

All run inside the store's heartbeat transaction (``coordinator.store``), on its own connection. The
verified step bounds credit, so it is bounded itself: by a majority of the reporting peers, by how fast a
run can train, and by the newest checkpoint.

A data-parallel peer is credited only for rounds other members witnessed (``credit_witnessed``): the
weight its signed group entry claims, reported by another member of the round
(``coordinator.witness``), once per step, for steps the run has verified, at most twice a batch over the
peers that did witnessed work lately (the members of the rounds reported for the last
``WITNESS_WINDOW_STEPS`` steps, and the round's own; never fewer than any report of the last
``WITNESS_WINDOW_STEPS`` verified steps counted). Its own ``contributed_samples`` is shown, never
credited.

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
# Roles credited from witnessed rounds (``credit_witnessed``); the others report their own, bounded.
DATA_ROLES = ("data", "auto")
# A row of ``peers p`` whose peer is not banned.
UNBANNED = "NOT EXISTS (SELECT 1 FROM bans b WHERE b.peer_id = p.peer_id)"
# A row of ``peers p`` that witnessed rounds may credit: a data-parallel peer of the run (online,
# offline, or left and not yet pruned: an honest peer that leaves right after its last round is credited
# for it when a groupmate reports it), not banned; two role parameters follow (``DATA_ROLES``).
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


# Witnessed rounds are credited for steps in this window below the verified step, and forgotten after it
# (a replayed old round then falls outside the window, so it cannot be credited twice).
WITNESS_WINDOW_STEPS = 16


def _sharing(db: sqlite3.Connection, step: int, members: set[str], verified: int) -> int:
    """How many peers a share of ``step`` is divided among: the members of the rounds reported for a step
    in the window below ``verified`` that are still in the run (online or offline), the members of
    ``step``'s rounds whatever became of them, and ``members`` (this round's); and never fewer than the
    most any report counted over the last ``WITNESS_WINDOW_STEPS`` verified steps (the ``sharing``
    table). Keys that joined and never took part in a round count nowhere; keys that left count only at
    the steps they took part in; and a count, once reached, holds for a window, so an attacker cannot
    time its reports to be read before its own keys dilute the others and after they expire, nor take
    whole steps after the verified step jumped past the window."""
    rows = db.execute(
        "SELECT w.peer_id FROM witnessed w JOIN peers p ON p.peer_id = w.peer_id WHERE w.step >= ? "
        f"AND p.state IN ('online', 'offline') AND p.role IN (?, ?) AND {UNBANNED} "
        "UNION SELECT peer_id FROM witnessed WHERE step = ?",
        (verified - WITNESS_WINDOW_STEPS, *DATA_ROLES, step),
    )
    count = len({peer for (peer,) in rows} | members)
    db.execute(
        "INSERT INTO sharing (verified, members) VALUES (?, ?) "
        "ON CONFLICT(verified) DO UPDATE SET members = MAX(members, excluded.members)",
        (verified, count),
    )
    db.execute(  # the counts of the newest WITNESS_WINDOW_STEPS verified steps, across any jump
        "DELETE FROM sharing WHERE verified NOT IN "
        "(SELECT verified FROM sharing ORDER BY verified DESC LIMIT ?)",
        (WITNESS_WINDOW_STEPS,),
    )
    (mark,) = db.execute("SELECT MAX(members) FROM sharing").fetchone()
    return max(count, mark or 0)


def credit_witnessed(
    db: sqlite3.Connection, reporter: str, rounds: list, *, verified: int, max_per_step: float
) -> float:
    """Credit each member of ``rounds`` (``coordinator.witness.WitnessedEntry`` lists) other than their
    ``reporter``: the weight it signed, for steps below the ``verified`` step and within
    ``WITNESS_WINDOW_STEPS`` of it, only to joined, unbanned data-parallel peers (``CREDITABLE``), and
    at most ``SHARE_SLACK`` times ``max_per_step`` over the peers that did witnessed work lately
    (``_sharing``). Keys that joined and never took part in a round dilute nobody's share (before, every
    key that ever joined counted for its certificate's lifetime: 1,000 keys that joined once cut each
    honest share 250-fold). A (member, step) is
    credited the most any report of it allows, the difference added when a later report allows more (so
    a first report padded with strangers' entries cannot hold an honest member's credit down). Sybils
    that sign entries for each other's made-up rounds earn at most that share each per step: together
    less than ``SHARE_SLACK`` batches a step, however many they are; they lower the honest peers'
    share only once they outnumber them in rounds. A member reported at a step counts in the
    denominator for the window after it left (or was banned), and all members of a step together earn at most ``SHARE_SLACK``
    batches of it (the ``witnessed`` rows hold what each earned): keys that leave once credited make no
    room for fresh ones at the same step. The budget goes to whoever is reported first, so a farm that
    outnumbers the honest peers and reports first can take a step's whole budget; without it, the
    same farm left them a share of 1/(keys at the step) each.
    Returns the samples credited."""
    credited = 0.0
    for entries in rounds:
        step = entries[0].step
        if not verified - WITNESS_WINDOW_STEPS <= step < verified:
            continue
        # The step's members together earn at most SHARE_SLACK batches, whoever stays or goes.
        (spent,) = db.execute(
            "SELECT COALESCE(SUM(samples), 0) FROM witnessed WHERE step = ?", (step,)
        ).fetchone()
        budget = SHARE_SLACK * max_per_step - spent
        members = {}
        for entry in entries:
            row = db.execute(
                f"SELECT 1 FROM peers p WHERE p.peer_id=? AND {CREDITABLE}", (entry.peer_id, *DATA_ROLES)
            ).fetchone()
            if row is not None:
                members[entry.peer_id] = entry
        # A share's denominator is the peers that did witnessed work lately (``_sharing``).
        sharing = _sharing(db, step, set(members), verified)
        cap = min(max_per_step, SHARE_SLACK * max_per_step / max(sharing, 1))
        for peer_id, entry in members.items():
            row = db.execute(
                "SELECT samples FROM witnessed WHERE peer_id=? AND step=?", (peer_id, step)
            ).fetchone()
            more = (
                0.0 if peer_id == reporter else min(min(entry.weight, cap) - (row[0] if row else 0.0), budget)
            )
            if more <= 0:
                # Its own report credits no member, and a spent budget credits nobody more, but a member
                # that signed for samples it is all the same (``_sharing``).
                if entry.weight > 0:
                    db.execute(
                        "INSERT OR IGNORE INTO witnessed (peer_id, step, samples) VALUES (?, ?, 0)",
                        (peer_id, step),
                    )
                continue
            budget -= more
            samples = more + (row[0] if row else 0.0)
            db.execute(
                "INSERT INTO witnessed (peer_id, step, samples) VALUES (?, ?, ?) "
                "ON CONFLICT(peer_id, step) DO UPDATE SET samples = excluded.samples",
                (peer_id, step, samples),
            )
            db.execute(  # a new row's baseline is this step, should its peer ever report for itself
                "INSERT INTO credit (peer_id, samples, step) VALUES (?, ?, ?) "
                "ON CONFLICT(peer_id) DO UPDATE SET samples = samples + excluded.samples",
                (peer_id, more, step),
            )
            credited += more
    db.execute("DELETE FROM witnessed WHERE step < ?", (verified - WITNESS_WINDOW_STEPS,))
    return credited
