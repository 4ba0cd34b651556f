"""Review 7 of catch-up by credit and the store's prune (commit 9bbca84: ``by_credit`` also needs a strict
majority of the credited heads, the caller's own vote counts under counting's condition (``own_vote``),
``CatchUp._credit`` remembers the caller's own credit, ``PositionHistory.agreed`` weighs it, ``prune`` reads
by index). Each test passed while its defect was present (it asserted the bad outcome); here each asserts
the fixed one (a sixth, self-banned keys whose certificates lapsed making each join read their rows,
stays open: the ban list needs their certificates' expiry). Each drives the real
Store in-process through the real HeartbeatBody and witnessed_rounds (``witness_helpers``) and calls the
real ``swarm.training.catchup`` (``catch_up_target``, ``PositionHistory``) and
``swarm.training.resync.CatchUp``.

Documented limitations are not reported for themselves: Sybils signing made-up rounds among themselves
earn up to 2x a step's average share per key, and Sybils that outnumber the honest members in heads and
credit win votes. Every steering attack below uses at most as many credited keys as there are honest
members (in heads).
"""

from __future__ import annotations

import asyncio
import dataclasses
import sqlite3
from types import SimpleNamespace

import pytest
from test_credit_redteam6 import farm_run
from witness_helpers import POISON, TARGET, Beats, credit_store, honest_step, record, run, state

from protocols.keys import SigningKey
from swarm.training.catchup import HOLDER_SHARE, Position, PositionHistory, catch_up_target, credit_weights
from swarm.training.resync import CatchUp

pytestmark = pytest.mark.timeout(120)

RESTARTED = Position(0, "3" * 64)  # a peer restarted from scratch (no local state)


def _moved_to(target, state_hash: str) -> bool:
    return target is not None and target.state_hash == state_hash


async def _vouched_newer(standing: dict, view: dict, history: PositionHistory, me: str, p: Position) -> bool:
    """The real ``CatchUp._vouched_for`` (``download_state``'s ``accept_newer``) over this peer's view,
    position history and standing, through the real ``CatchUp._credit`` (its own-credit memory)."""
    stub = SimpleNamespace(
        config=SimpleNamespace(training=SimpleNamespace(progress_interval_s=0.001)),
        progress_view=SimpleNamespace(peers={**view, me: None}, positions=history, count=0),
        peer_id=me,
        standing=SimpleNamespace(credit=standing),
        own_credit=0.0,
    )
    stub._credit = lambda: CatchUp._credit(stub)
    return await CatchUp._vouched_for(stub, p.step, p.state_hash)


# --- 1. agreed() has no heads condition: a farm outnumbered in heads passes off a made-up newer state ----


async def churn_run(b: Beats, *, n_old: int, n_farm: int, n_new: int, first: int, then: int) -> dict:
    """A farm present from the run's start (the documented case where it can outweigh the honest peers in
    view): ``n_old`` honest members and ``n_farm`` Sybil keys (made-up rounds of themselves at every step,
    for the whole batch each) for ``first`` steps; then the old members leave (churn) and ``n_new`` honest
    members train for ``then`` steps beside the farm."""
    store = b.store
    old = [SigningKey.generate() for _ in range(n_old)]
    farm = [SigningKey.generate() for _ in range(n_farm)]
    new = [SigningKey.generate() for _ in range(n_new)]
    for k in (*old, *farm):
        await store.admit(record(k))

    async def farm_step(step: int) -> None:
        made_up = b.round(farm, step - 1, TARGET)
        for i, k in enumerate(farm):
            await b.beat(k, 0, "", [made_up] if i < 2 else [])

    history: list = []
    for step in range(first + 1):
        await honest_step(b, old, step, history)
        if step:
            await farm_step(step)
    for k in old:
        b.seq += 1
        b.t += 10.0
        assert await store.record_leave(k.peer_id, seq=b.seq, seen_at=b.t)
    for k in new:
        await store.admit(record(k))
    history = []
    for step in range(first + 1, first + then + 1):
        await honest_step(b, new, step, history)
        await farm_step(step)
    return {
        "new": [k.peer_id for k in new], "farm": [k.peer_id for k in farm],
        "standing": await store.standing(), "last": first + then,
    }  # fmt: skip


def test_agreed_asks_the_heads_too_so_an_outnumbered_farm_cannot_pass_off_a_made_up_newer_state(tmp_path):
    """HIGH (review 7). 9bbca84 makes a move by credit also need a strict majority of the credited heads, because a
    farm's keys can hold more credit each than honest members; ``PositionHistory.agreed`` (what
    ``CatchUp._vouched_for`` asks when a download holder offers a newer state) still weighs credit only.
    Scenario: 3 farm keys present from the run's start (made-up rounds among themselves, the documented
    2x slack) beside 4 honest members for 20 steps; the old members leave and 5 new honest members train
    10 steps beside the farm (real Store: 525.7 credit per farm key, 128 per new member, every new member a
    head: 128 >= 0.1 x 525.7). The farm shows a made-up state 5 steps ahead for one progress interval,
    then copies the honest (step, hash), so it holds 3 of the 7 download holders of a restarted (or
    lagging) new member. ``by_credit`` refuses the made-up state outright (3 of the 7 other heads), but
    when the victim's download lands on a farm holder (3 in 7) that offers its "newer" made-up state,
    ``agreed`` vouches for it: 3 x 525.7 = 1577 of 2217 (the 4 other members, the 3 keys and the
    victim's own 128). Cost: 3 keys farming from the start, fewer than the 5 honest members (6 heads with
    the victim). Before 9bbca84 the same farm moved the victim directly (1577 of 2217 was a majority of
    the credit pool); counting refuses both (3 of 7). Fixed: ``agreed`` asks what ``by_credit`` asks of
    a state ahead, a strict majority of the credit and of the credited heads (``carried``)."""
    with credit_store(tmp_path, "churn") as b:
        after = run(churn_run(b, n_old=4, n_farm=3, n_new=5, first=20, then=10))
    standing, last, new, farm = after["standing"], after["last"], after["new"], after["farm"]
    victim = new[0]
    assert all(standing[k] == pytest.approx(TARGET / 5 * 10) for k in new), standing
    assert all(standing[k] == pytest.approx(525.7, abs=0.1) for k in farm), standing
    # Every honest member is a credited head; the farm is fewer keys.
    assert all(standing[k] >= HOLDER_SHARE * max(standing.values()) for k in new) and len(farm) < len(new)

    made_up = Position(last + 5, POISON)
    shown = {**{k: Position(last, state(last)) for k in new[1:]}, **{k: made_up for k in farm}}
    history = PositionHistory()
    history.observe(shown, keep=shown)
    for mine in (RESTARTED, Position(last - 3, state(last - 3))):
        assert catch_up_target(mine, shown, credit=standing, me=victim) is None  # the heads hold here
    # ... though the farm holds a strict majority of the credit, the victim's own included.
    weights = credit_weights([*shown, victim], standing)
    assert 2 * sum(weights[k] for k in farm) > sum(weights.values())
    assert sum(weights[k] for k in farm) == pytest.approx(1577.1, abs=0.5)
    assert sum(weights.values()) == pytest.approx(2217.1, abs=0.5)

    copied = {
        **{k: Position(last, state(last)) for k in new[1:]},
        **{k: Position(last, state(last)) for k in farm},
    }
    history.observe(copied, keep=copied)
    target = catch_up_target(RESTARTED, copied, credit=standing, me=victim)
    assert target is not None and target.state_hash == state(last)
    assert sum(h in farm for h in target.holders) == 3 and len(target.holders) == 7
    # The farm holder offers its made-up "newer" state: refused (3 of the 8 heads).
    assert asyncio.run(_vouched_newer(standing, copied, history, victim, made_up)) is False
    # Counting (credit=None) does not vouch for it: 3 of the 7 others.
    assert history.agreed(made_up.step, made_up.state_hash, list(copied)) is False


# --- 2. two apart sides: one holds the credit, the other the heads; neither ever moves ------------------


X = lambda s: f"{s:062x}aa"  # noqa: E731  (the long-lived peers' side)
Y = lambda s: f"{s:062x}bb"  # noqa: E731  (the newer peers' side)


async def split_run(b: Beats, *, alone: int, together: int, apart: int) -> dict:
    """3 long-lived honest peers train alone for ``alone`` steps; 5 newer honest peers join and all 8 train
    ``together`` steps; then a step's second tier fails (3 misses: each group applies its own result, or
    a representative says ``alone``) and the two groups stay apart, each training on its own state. At
    each step of the split, which peers does catch-up move (credit, as the trainer reads it)?"""
    store = b.store
    old = [SigningKey.generate() for _ in range(3)]
    new = [SigningKey.generate() for _ in range(5)]
    for k in old:
        await store.admit(record(k))
    history: list = []
    for step in range(alone + 1):
        await honest_step(b, old, step, history)
    for k in new:
        await store.admit(record(k))
    history = []
    for step in range(alone + 1, alone + together + 1):
        await honest_step(b, [*old, *new], step, history)
    split = alone + together
    h_old, h_new = list(history), list(history)
    steps: list[dict] = []
    for t in range(apart):
        step = split + t
        if t:
            h_old.append(b.round(old, step - 1, TARGET / 3))
            h_new.append(b.round(new, step - 1, TARGET / 5))
            for k in old:
                await b.beat(k, step, X(step), h_old[-3:])
            for k in new:
                await b.beat(k, step, Y(step), h_new[-3:])
        standing = await store.standing()
        view = {**{k.peer_id: Position(step, X(step)) for k in old},
                **{k.peer_id: Position(step, Y(step)) for k in new}}  # fmt: skip
        moves = {}
        for me, mine in view.items():
            others = {p: q for p, q in view.items() if p != me}
            moves[me] = catch_up_target(mine, others, credit=standing, me=me)
        steps.append({"standing": standing, "view": view, "moves": moves, "step": step})
        if any(m is not None for m in moves.values()):
            break
    return {"old": [k.peer_id for k in old], "new": [k.peer_id for k in new], "steps": steps}


def test_two_apart_sides_one_with_the_credit_the_other_with_the_heads_join_at_once(tmp_path):
    """MEDIUM (review 7; liveness of an honest run, a regression of 9bbca84). Two groups of a step that the second tier
    did not join (docs/scale.md: after 3 misses a group applies its own result, "which leaves states apart";
    protocol.md: a representative's unsigned ``alone`` does it at will) leave two states at one step, and the
    docs rely on catch-up to move the minority. With credit concentrated in 3 long-lived peers (10 steps
    alone, then 12 with 5 newer peers: 309.3 against 96 each, real Store), the long-lived side X holds the
    credit (928 against 480) and the newer side Y the heads (5 against 3). ``by_credit`` picks X by credit,
    then refuses it for want of heads (3 of the 7 others); on X's side the best is its own state. So no peer
    moves, nor does the checkpoint keeper (mine=None), and the two sides train apart: measured, 26 steps until
    Y's credit overtakes X's and X's peers throw their 26 steps away (longer the longer the long-lived peers'
    history). Before 9bbca84 every Y peer moved to X at once (credit majority); counting moves every X peer to
    Y (5 of 7). Fixed: the heads are asked of a state ahead only; at the caller's own step two sides go by
    credit, as before 9bbca84."""
    with credit_store(tmp_path, "split") as b:
        after = run(split_run(b, alone=10, together=12, apart=40))
    old, new, steps = after["old"], after["new"], after["steps"]
    first = steps[0]
    standing = first["standing"]
    assert standing[old[0]] == pytest.approx(309.3, abs=0.1) and standing[new[0]] == pytest.approx(96.0)
    # At the split every newer peer moves to the long-lived side's state (the credit), and none of those.
    assert all(_moved_to(first["moves"][k], X(first["step"])) for k in new), first["moves"]
    assert all(first["moves"][k] is None for k in old), first["moves"]
    assert len(steps) == 1


# --- 3. two keys with a tenth of the vote cap keep a restarted or lagging member out --------------------


async def sliver_run(b: Beats, *, steps: int, farm_steps: int) -> dict:
    """4 honest members train ``steps`` steps; 2 Sybil keys sign made-up rounds of themselves for the last
    ``farm_steps`` steps only."""
    store = b.store
    honest = [SigningKey.generate() for _ in range(4)]
    farm = [SigningKey.generate() for _ in range(2)]
    for k in (*honest, *farm):
        await store.admit(record(k))
    history: list = []
    for step in range(steps + 1):
        await honest_step(b, honest, step, history)
        if step > steps - farm_steps:
            made_up = b.round(farm, step - 1, TARGET)
            for k in farm:
                await b.beat(k, 0, "", [made_up])
    return {"honest": [k.peer_id for k in honest], "farm": [k.peer_id for k in farm],
            "standing": await store.standing(), "last": steps}  # fmt: skip


def test_two_keys_with_a_tenth_of_the_cap_keep_neither_a_restarted_nor_a_stalled_member_from_the_majority(
    tmp_path,
):
    """MEDIUM (availability; the heads floor made it 7.5x cheaper in credit). A key with ``HOLDER_SHARE`` (a
    tenth) of the vote cap is a full head. 2 Sybil keys that signed made-up rounds of themselves for only the
    last 2 of 20 steps hold 42.7 each (13% of an honest member's 320, a tenth of its tenure) and sit at the
    victim's step or behind (step 0 for a restarted member), which keeps its own vote on: a restarted member,
    or one 3 steps behind, of 4 honest members sees 3 holders of the honest state among 6 heads and never
    moves. The credit majority holds (960 of 1365); before 9bbca84 it moved: keeping it out took 640 of credit
    against it (15 such keys), 7.5x the 85.3 here. A lagging member with groupmates in view recovers once
    stalled (counting among them); a restarted one (no groupmates) or one more than a window behind waits for
    good, and ``_checkpoint_to_resume`` does not apply (3 of 5 past step 0). Counting is as weak (2 keys
    without credit), but credit had closed that. Keys that farmed 1 step (21.3, under the floor) do
    nothing. Fixed in part: a member restarted at step 0 holds no trained state, so its own vote does not
    count (``own_vote``) and it follows the 3 holders of 5 heads at once; one a few steps behind waits
    until it is stalled and then follows its groupmates (as with counting). Open: 2 keys with a tenth of
    the cap still hold a lagging member until it stalls."""
    with credit_store(tmp_path / "two", "sliver") as b:
        after = run(sliver_run(b, steps=20, farm_steps=2))
    standing, last, honest, farm = after["standing"], after["last"], after["honest"], after["farm"]
    assert [standing[k] for k in honest] == [pytest.approx(320.0)] * 4
    assert [standing[k] for k in farm] == [pytest.approx(42.7, abs=0.1)] * 2  # 13% of 320
    me = honest[0]
    view = {**{k: Position(last, state(last)) for k in honest[1:]},
            **{k: Position(0, "7" * 64) for k in farm}}  # fmt: skip
    assert _moved_to(catch_up_target(RESTARTED, view, credit=standing, me=me), state(last))
    lagging = Position(last - 3, state(last - 3))
    view = {**{k: Position(last, state(last)) for k in honest[1:]},
            **{k: Position(last - 3, "7" * 64) for k in farm}}  # fmt: skip
    assert catch_up_target(lagging, view, credit=standing, me=me) is None  # open: until it stalls
    stalled = catch_up_target(lagging, view, stalled=True, trusted=set(honest[1:]), credit=standing, me=me)
    assert _moved_to(stalled, state(last))

    with credit_store(tmp_path / "one", "sliver1") as b:
        after = run(sliver_run(b, steps=20, farm_steps=1))
    standing, honest, farm = after["standing"], after["honest"], after["farm"]
    view = {
        **{k: Position(last, state(last)) for k in honest[1:]},
        **{k: Position(0, "7" * 64) for k in farm},
    }
    assert _moved_to(catch_up_target(RESTARTED, view, credit=standing, me=honest[0]), state(last))


# --- 4. one key without credit ahead switches off the caller's own vote: an equal farm moves it ---------


def test_one_key_without_credit_ahead_no_longer_switches_off_own_vote(
    tmp_path,
):
    """MEDIUM (re-opens review 5's HIGH test 4 for one free key). ``own_vote`` drops the caller's own
    credit from the pool and from the heads whenever anyone but the candidate's holders is ahead of it.
    Under counting that key is a vote against (it costs its head); under credit a key without credit
    weighs nothing and is no head, so one fresh certified key announcing any position ahead switches the
    caller's own vote off for free. 4 farm keys beside 4 honest members (320 each, real Store, review 5's
    ``farm_scenario(4, 4)``) announce a made-up state one step ahead, and one key without credit announces
    another two steps ahead: each honest member in line now moves to the farm's state (1280 of the
    others' 2240; 4 of 7 heads), and takes the rest along. Without the extra key it does not (review 5
    test 4); before 9bbca84 it did not (the caller's own 320 always weighed: 1280 of 2560); counting does
    not (4 of the 8 others). Fixed: under credit ``own_vote`` looks at the credited heads in view only."""
    with credit_store(tmp_path, "toggle") as b:
        after = run(farm_run(b, 4, 4, 20))
    standing, last = after["standing"], after["last"]
    honest = [k.peer_id for k in after["honest"]]
    farm = [k.peer_id for k in after["farm"]]
    assert all(standing[k] == pytest.approx(320.0) for k in (*honest, *farm)), standing
    me, mine = honest[0], Position(last, state(last))
    view = {
        **{k: Position(last, state(last)) for k in honest[1:]},
        **{k: Position(last + 1, POISON) for k in farm},
    }
    assert catch_up_target(mine, view, credit=standing, me=me) is None  # review 5's fix, as it was
    toggled = {**view, SigningKey.generate().peer_id: Position(last + 2, "9" * 64)}  # no credit at all
    assert catch_up_target(mine, toggled, credit=standing, me=me) is None
    assert catch_up_target(mine, toggled) is None  # counting: 4 of 8


# --- 5. prune binds 1,000 parameters in one statement: every join fails on SQLite before 3.32 -----------


def test_prune_binds_under_a_thousand_parameters_so_joins_work_on_sqlite_before_3_32(tmp_path):
    """LOW-MEDIUM (review 7; availability of joins, platform-dependent). The rewritten ``Store.prune`` deletes the
    suspicions of each chunk of 500 peers with ``reporter IN (500 ?) OR suspect IN (500 ?)``: 1,000 bound
    parameters, over ``SQLITE_MAX_VARIABLE_NUMBER`` (999) of every SQLite before 3.32 (the one RHEL 8's
    python3.11 and Ubuntu 20.04's deadsnakes Pythons link; the code otherwise needs 3.25). Once 500 or
    more peers are prunable at one join (keys whose certificates were last renewed together and then
    lapse, keys that left while members of a window step once it leaves the window, or simply a
    coordinator back from a downtime longer than the certificate TTL in a run of 500 peers), every Join
    raises before admitting anyone, and since the transaction rolls back, every later Join too: new and
    restarted peers can no longer join. The old prune bound 4 parameters. Here SQLite's limit is set to
    999 (``Connection.setlimit``, Python 3.11 on) to stand for such a build. Fixed: chunks of 400 peers."""
    limited = hasattr(sqlite3, "SQLITE_LIMIT_VARIABLE_NUMBER")

    async def scenario(b: Beats) -> tuple[str, int, int]:
        store = b.store
        await store._run(lambda db: db.execute("PRAGMA synchronous=OFF"))  # test speed only
        for _ in range(500):
            await store.admit(dataclasses.replace(record(SigningKey.generate()), cert_expires_at=-1e9))
        if limited:
            await store._run(lambda db: db.setlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER, 999))
        errors = ""
        for _ in range(3):  # three joins in a row: each prunes first
            try:
                await store.prune(b.t, grace_s=600.0)
            except sqlite3.OperationalError as e:
                errors = str(e)
        left = len(await store.list_peers())
        return errors, left, 0

    with credit_store(tmp_path, "prune") as b:
        error, left, pruned = run(scenario(b))
    assert error == "" and left == 0 and pruned == 0, (error, left)
