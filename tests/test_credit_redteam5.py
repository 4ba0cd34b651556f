"""Review 5 of witnessed credit: the per-step shares of ``coordinator.stepshares`` (commit 8f8963c), read
by an attacker. Each test passed while its defect was present (it asserted the bad outcome); here each
asserts the fixed one, or (test 2) the bound the module documents. Each drives the real Store in-process
through the real HeartbeatBody and witnessed_rounds (``witness_helpers``), and the real
``swarm.training.catchup.catch_up_target`` where catch-up is concerned.
"""

from __future__ import annotations

import sqlite3

import pytest
from witness_helpers import (
    POISON,
    TARGET,
    Beats,
    credit_store,
    farm_run,
    honest_step,
    record,
    run,
    state,
    vm_ops,
)

from coordinator.stepshares import WITNESS_WINDOW_STEPS
from protocols.keys import SigningKey
from swarm.training.catchup import Position, catch_up_target

pytestmark = pytest.mark.timeout(120)

W = WITNESS_WINDOW_STEPS


# --- 1. every peer lookup now aggregates all credit ever granted and every window member ---------------

DOS_KEYS = 2820  # 60 rounds of [reporter + 47 throwaway keys], 20 heartbeats of one reporter
# One peer's row as the store read it before 8f8963c: its credit by the ``credit`` table's primary key.
OLD_GET_PEER = (
    "SELECT p.peer_id, p.public_key, p.name, p.device, p.role,"
    " CASE WHEN b.peer_id IS NULL THEN p.state ELSE 'banned' END, p.joined_at, p.last_seen, p.last_seq,"
    " p.cert_serial, p.cert_expires_at, p.metrics, p.step, p.param_hash, COALESCE(b.reason, ''),"
    " COALESCE(b.banned_at, 0), COALESCE(c.samples, 0)"
    " FROM peers p LEFT JOIN bans b ON b.peer_id = p.peer_id LEFT JOIN credit c ON c.peer_id = p.peer_id"
    " WHERE p.peer_id = ?"
)


async def lookup_cost_scenario(b: Beats) -> dict:
    store = b.store
    await store._run(lambda db: db.execute("PRAGMA synchronous=OFF"))  # test speed only: no fsync per join
    honest = [SigningKey.generate() for _ in range(4)]
    for k in honest:
        await store.admit(record(k))
    history: list = []
    for step in range(W + 3):
        await honest_step(b, honest, step, history)
    me = honest[0].peer_id

    async def costs() -> dict:
        async def old_lookup() -> None:
            await store._run(lambda db: db.execute(OLD_GET_PEER, (me,)).fetchall())

        async def heartbeat() -> None:  # an honest peer's heartbeat, as it resends its last rounds
            await b.beat(honest[0], W + 2, state(W + 2), history[-3:])

        return {
            "get_peer": await vm_ops(store, lambda: store.get_peer(me)),  # twice per heartbeat (service)
            "status_page": await vm_ops(store, lambda: store.peer_page(limit=256)),  # unauthenticated
            "standing": await vm_ops(store, store.standing),
            "suspicions": await vm_ops(store, store.suspicion_counts),
            "heartbeat": await vm_ops(store, heartbeat),
            "old_get_peer": await vm_ops(store, old_lookup),
        }

    base = await costs()
    # The attack: throwaway keys (one join each), members of one window step at a weight of 1e-6, vouched
    # by one reporter's heartbeats (3 rounds of 48 entries each, the message's bounds).
    reporter = SigningKey.generate()
    farm = [SigningKey.generate() for _ in range(DOS_KEYS)]
    for k in (reporter, *farm):
        await store.admit(record(k))
    verified = await store.verified_step()
    rounds = [b.round([reporter, *farm[i : i + 47]], verified - 1, 1e-6) for i in range(0, DOS_KEYS, 47)]
    for i in range(0, len(rounds), 3):
        await b.beat(reporter, 0, "", rounds[i : i + 3])
    in_window = await costs()
    # The step leaves the window: its members' shares settle into ``credit``, where rows are never deleted.
    for step in range(W + 3, 2 * W + 5):
        await honest_step(b, honest, step, history)

    def rows(db) -> tuple[int, int]:
        (members,) = db.execute(
            "SELECT COUNT(*) FROM step_members WHERE step = ?", (verified - 1,)
        ).fetchone()
        (credited,) = db.execute("SELECT COUNT(*) FROM credit WHERE samples > 0").fetchone()
        return members, credited

    settled_rows = await store._run(rows)
    settled = await costs()
    return {
        "base": base, "in_window": in_window, "settled": settled, "settled_rows": settled_rows,
        "farm_credit": sum([await b.credit(k) for k in farm]),
    }  # fmt: skip


def test_a_peer_lookup_reads_its_credit_by_key_however_many_keys_were_credited(tmp_path):
    """HIGH (review 5; availability of the coordinator). Reading one peer's credit joined a grouped view
    of all credit ever granted and every window member: 2,820 throwaway keys, each a vouched member of one
    window step at weight 1e-6 (20 heartbeats of one reporter), made ``get_peer`` (twice per heartbeat)
    84 times dearer while in the window and 39 times for good once settled, a Status page 86 / 44 times,
    the standing 103 / 60 times, the suspicion counts 96 / 52 times; with 100,000 credited keys a lookup
    took 86 ms. Fixed: each peer's credit is read by key (``stepshares.CreditOf``: its ``credit`` row, its
    own window rows and each step's member count), so a lookup, a heartbeat and the suspicion counts cost
    what they did, a Status page what its rows cost, and the standing what scanning the online peers
    costs (SQLite instructions, deterministic)."""
    with credit_store(tmp_path, "lookups") as b:
        after = run(lookup_cost_scenario(b))
    base, in_window, settled = after["base"], after["in_window"], after["settled"]
    members, credited = after["settled_rows"]
    assert members == 0 and credited >= DOS_KEYS, after["settled_rows"]  # settled: only ``credit`` rows left
    assert after["farm_credit"] < 1e-2  # the farm earned nothing to speak of
    for costs in (in_window, settled):
        assert costs["get_peer"] <= 2 * base["get_peer"], (base, costs)
        assert costs["heartbeat"] <= 2 * base["heartbeat"], (base, costs)
        assert costs["suspicions"] <= 2 * base["suspicions"] + 100, (base, costs)
        # A page of 256 rows costs no more a row than the honest run's page of 4 did.
        assert costs["status_page"] / 256 <= base["status_page"] / 4, (base, costs)
        # The standing scans the online peers (4 honest, the reporter and the throwaway keys), no more a
        # peer than when there were 4.
        assert costs["standing"] / (DOS_KEYS + 5) <= base["standing"] / 4, (base, costs)


# --- 2. fewer farm keys than honest members earn more per key than each of them ----------------------


@pytest.mark.parametrize(("n_honest", "n_farm"), [(4, 2), (4, 3), (8, 2)])
def test_a_farm_smaller_than_the_honest_group_earns_per_key_at_most_the_documented_slack(
    tmp_path, n_honest, n_farm
):
    """MEDIUM (review 5: the documented bound was false). The module said Sybils earn an honest member's
    share per key. They do not: every member gets ``min(claim, cap)`` with ``cap = 2 * batch / members``,
    an honest member claims what it computed (about batch / H, half the cap) and a Sybil signs for as much
    as it likes, so with k keys beside H honest members each key earns 2H / (H + k) times an honest
    member's share (1.33x for 2 beside 4, 1.14x for 3 beside 4, 1.6x for 2 beside 8). That is the slack a
    faster honest member needs (``SHARE_SLACK``) and stays, now documented as the bound; the honest
    members lose nothing; and catch-up no longer lets that excess decide (tests 3 and 4)."""
    steps = 6
    with credit_store(tmp_path, f"farm{n_honest}{n_farm}") as b:
        after = run(farm_run(b, n_honest, n_farm, steps))
    honest_rate = TARGET / n_honest
    assert after["honest_credit"] == [pytest.approx(honest_rate * steps)] * n_honest, after
    ratio = max(after["farm_credit"]) / min(after["honest_credit"])
    assert ratio <= 2 * n_honest / (n_honest + n_farm) + 1e-9 and ratio < 2, ratio


# --- 3. ... and steer every honest member's catch-up, the caller's own credit not weighing -------------


def test_a_farm_with_fewer_keys_than_honest_members_moves_no_honest_member(tmp_path):
    """HIGH (review 5). For a state ahead of a caller that was not stalled, ``by_credit`` weighed only the
    peers in view other than the caller (counting counts the caller): 3 Sybil keys beside 4 honest members
    from the run's start, each holding 365.7 against 320 per honest member after 20 steps (test 2's
    slack), announced a made-up state one step ahead, and an honest member in line and one that restarted
    both chose it, with only farm keys as holders. Fixed: the caller's own credit weighs in the pool for a
    state ahead."""
    steps = 20
    with credit_store(tmp_path, "steer") as b:
        after = run(farm_run(b, 4, 3, steps))
    standing, last = after["standing"], after["last"]
    honest, farm = after["honest_ids"], after["farm_ids"]
    assert all(standing[k] == pytest.approx(TARGET / 4 * steps) for k in honest), standing
    me = honest[0]
    view = {**{k: Position(last, state(last)) for k in honest if k != me},
            **{k: Position(last + 1, POISON) for k in farm}}  # fmt: skip
    for mine in (Position(last, state(last)), Position(0, "3" * 64)):  # in line, restarted
        target = catch_up_target(mine, view, credit=standing, me=me)
        assert target is None or target.state_hash != POISON, target
    full = {**view, me: Position(last, state(last))}
    for mine in (Position(0, "3" * 64), None):  # a fresh non-member, the checkpoint keeper
        target = catch_up_target(mine, full, credit=standing)
        assert target is None or target.state_hash != POISON


def test_a_farm_as_large_as_the_honest_group_gets_equal_credit_and_moves_no_member_in_line(tmp_path):
    """HIGH (review 5, same gap as test 3). 4 farm keys beside 4 honest members get exactly their credit
    (cap 2 * 64 / 8 = 16, the honest claim); each honest member in line saw 3 honest peers against 4 farm
    keys and, its own credit not weighed, moved to the farm's state. Fixed as test 3: 4 against 4 is no
    majority. A farm that outnumbers the honest members still moves them (the documented limitation)."""
    steps = 20
    with credit_store(tmp_path, "steer4") as b:
        after = run(farm_run(b, 4, 4, steps))
    standing, last = after["standing"], after["last"]
    honest, farm = after["honest_ids"], after["farm_ids"]
    assert all(standing[k] == pytest.approx(TARGET / 4 * steps) for k in (*honest, *farm)), standing
    me = honest[0]
    view = {**{k: Position(last, state(last)) for k in honest if k != me},
            **{k: Position(last + 1, POISON) for k in farm}}  # fmt: skip
    target = catch_up_target(Position(last, state(last)), view, credit=standing, me=me)
    assert target is None or target.state_hash != POISON, target
    more = {**view, "sybil-5": Position(last + 1, POISON)}
    moved = catch_up_target(
        Position(last, state(last)), more, credit={**standing, "sybil-5": standing[me]}, me=me
    )
    assert moved is not None and moved.state_hash == POISON, "a farm that outnumbers them still decides"


# --- 4. the upgrade from ``witnessed`` drops the newest round of the member that reported it first -------


async def upgrade_scenario(b: Beats, honest: list[SigningKey], history: list, *, first: bool) -> list[float]:
    """The honest run of the old store's lifetime (``first``): steps 0-2 in full, then step 3's heartbeats
    of 3 of the 4 members (the third moves the verified step to 3 and reports step 2's round, crediting
    the others for it); then (``not first``) the fourth member's heartbeat of step 3 and step 4."""
    if first:
        for k in honest:
            await b.store.admit(record(k))
        for step in range(4):
            if step:
                history.append(b.round(honest, step - 1, TARGET / 4))
            for k in honest if step < 3 else honest[:3]:
                await b.beat(k, step, state(step), history[-3:])
        assert await b.store.verified_step() == 3
    else:
        await b.beat(honest[3], 3, state(3), history[-3:])  # would vouch for honest[2] at step 2
        history.append(b.round(honest, 3, TARGET / 4))
        for k in honest:
            await b.beat(k, 4, state(4), history[-3:])
    return [await b.credit(k) for k in honest]


def test_the_upgrade_keeps_the_newest_round_of_the_member_that_reported_it(tmp_path):
    """LOW (review 5; honest run, once per upgraded coordinator). The upgrade marked every step up to the
    newest old ``witnessed`` row as credited, but the old code wrote a 0-sample row for a round's
    reporter, credited only when a groupmate's later heartbeat reported it: a coordinator stopped between
    the two and upgraded never credited that reporter for the round (48 where its groupmates had 64).
    Fixed: the old rows are carried into ``step_members``, those with samples as members credited already,
    those without as members not yet vouched for."""
    honest = [SigningKey.generate() for _ in range(4)]
    history: list = []
    with credit_store(tmp_path / "plain", "up") as b:
        run(upgrade_scenario(b, honest, history, first=True))
        plain = run(upgrade_scenario(b, honest, history, first=False))
    assert plain == [pytest.approx(4 * TARGET / 4)] * 4, plain

    history = []
    with credit_store(tmp_path / "old", "up") as b:
        run(upgrade_scenario(b, honest, history, first=True))
        seq, t = b.seq, b.t
    # Rewrite it as bbca97f left it: shares credited at once into ``credit``, the window in ``witnessed``
    # (the reporter of step 2's round, honest[2], holding its 0-sample row).
    db = sqlite3.connect(tmp_path / "old" / "c.db")
    db.executescript(
        "DROP TABLE step_members; DROP TABLE step_counts;"
        "CREATE TABLE witnessed (peer_id TEXT NOT NULL, step INTEGER NOT NULL, samples REAL NOT NULL,"
        " PRIMARY KEY (peer_id, step)); DELETE FROM credit;"
    )
    for i, k in enumerate(honest):
        for step in range(3):
            samples = 0.0 if (i, step) == (2, 2) else TARGET / 4
            db.execute("INSERT INTO witnessed VALUES (?, ?, ?)", (k.peer_id, step, samples))
        db.execute(
            "INSERT INTO credit (peer_id, samples, step) VALUES (?, ?, 0)",
            (k.peer_id, 2 * TARGET / 4 if i == 2 else 3 * TARGET / 4),
        )
    db.commit()
    db.close()
    with credit_store(tmp_path / "old", "up") as b:
        b.seq, b.t = seq, t
        upgraded = run(upgrade_scenario(b, honest, history, first=False))
    assert upgraded == [pytest.approx(c) for c in plain], (upgraded, plain)
