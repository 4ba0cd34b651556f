"""Review 6 of witnessed credit and catch-up by credit (commit a15ae65: ``stepshares.CreditOf`` reads credit
by key; ``by_credit`` weighs the caller's own credit against a state ahead). Each test passes while its
defect was present (it asserted the bad outcome); here each asserts the fixed one. Each drives the real
Store in-process through the real
HeartbeatBody and witnessed_rounds (``witness_helpers``), the real ``coordinator.standing.Standing``, and
the real ``swarm.training.catchup`` (``catch_up_target``, ``PositionHistory``) and
``swarm.training.resync.CatchUp._vouched_for``.

Documented limitations are not reported: Sybils signing made-up rounds among themselves earn up to 2x a
step's average share per key (here 3 farm keys beside 4 honest members: 365.7 against 320 each after 20
steps, 2H/(H+k) = 1.14x), and Sybils that outnumber the honest members win credit-weighted votes. Every
attack below uses *fewer* farm keys than honest members.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

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

from coordinator.standing import Standing
from coordinator.stepshares import WITNESS_WINDOW_STEPS
from protocols.keys import SigningKey
from swarm.training.catchup import Position, PositionHistory, catch_up_target
from swarm.training.resync import CatchUp

pytestmark = pytest.mark.timeout(120)

W = WITNESS_WINDOW_STEPS
RESTARTED = Position(0, "3" * 64)  # a peer restarted from scratch (no local state)


# --- 1. a member back from an offline spell holds a standing without its own credit --------------------


async def offline_spell_scenario(b: Beats) -> dict:
    after = await farm_run(b, 4, 3, 20)
    honest, farm, last = after["honest"], after["farm"], after["last"]
    victim = honest[0]
    clock = [100.0]
    standing = Standing(b.store, clock=lambda: clock[0])
    _, before = await standing.current()  # the standing every peer holds now: the victim in it
    # The victim goes silent (a restart, a network blip) while the others heartbeat on; the coordinator node
    # marks it offline after ``offline_after_s`` (15 s by default), and the next standing refresh (every
    # 30 s, at any peer's heartbeat) is computed from the online peers only.
    for k in (*honest[1:], *farm):
        await b.beat(k, last if k in honest else 0, state(last) if k in honest else "")
    seen = (await b.store.get_peer(victim.peer_id)).last_seen
    assert await b.store.mark_offline(silent_since=seen + 1.0) == [victim.peer_id]
    clock[0] = 131.0
    _, refreshed = await standing.current()
    # The victim is back (it rejoins after a restart, or its next heartbeat lands): online again, and the
    # standing it is sent for up to 30 s is the one computed while it was offline.
    rejoined = record(victim)
    await b.store.admit(rejoined)
    await b.beat(victim, last, state(last))
    clock[0] = 150.0  # under 30 s later: the copy is not recomputed
    _, sent = await standing.current()
    return {
        "victim": victim.peer_id, "honest": [k.peer_id for k in honest], "farm": [k.peer_id for k in farm],
        "before": before, "refreshed": refreshed, "sent": sent, "last": last,
        "online": (await b.store.get_peer(victim.peer_id)).state,
    }  # fmt: skip


def test_a_member_back_from_an_offline_spell_stays_and_keeps_weighing_its_own_credit(tmp_path):
    """HIGH (review 6). Review 5's fix (the caller's own credit weighs against a state ahead) held only
    while the caller's own credit was in its copy of the standing, which lists online peers only: a member
    silent for ``offline_after_s`` while the standing refreshed was sent a copy without itself for up to
    30 s, and 3 farm keys beside 4 honest members (365.7 each against 320: the documented slack) moved it
    to their made-up state, whether in line or restarted; it then took the other honest members with it.
    Fixed twice over: a move by credit also needs a strict majority of the credited heads (3 farm keys of
    6 credited peers are none), and a peer's catch-up weighs its own credit at the most any standing it
    read held (``CatchUp._credit``)."""
    with credit_store(tmp_path, "spell") as b:
        after = run(offline_spell_scenario(b))
    victim, honest, farm, last = after["victim"], after["honest"], after["farm"], after["last"]
    before, sent = after["before"], after["sent"]
    assert after["online"] == "online"
    assert before[victim] == pytest.approx(TARGET / 4 * 20) and victim not in sent
    assert all(sent[k] > sent[h] for k in farm for h in honest if h != victim)  # the documented slack
    view = {**{k: Position(last, state(last)) for k in honest if k != victim},
            **{k: Position(last + 1, POISON) for k in farm}}  # fmt: skip
    for mine in (Position(last, state(last)), RESTARTED):  # in line (a blip), restarted
        for credit in (before, sent):
            target = catch_up_target(mine, view, credit=credit, me=victim)
            assert target is None or target.state_hash != POISON, target
    # The peer's own credit, as its catch-up reads the standing: kept from the copy that held it.
    held = SimpleNamespace(credit=before)
    catch_up = SimpleNamespace(standing=held, peer_id=victim, own_credit=0.0)
    assert CatchUp._credit(catch_up)[victim] == pytest.approx(before[victim])
    held.credit = sent
    assert CatchUp._credit(catch_up)[victim] == pytest.approx(before[victim]), "the copy without it"


# --- 2. a download holder offers a made-up newer state: the caller's own credit is not weighed ------------


async def vouched_newer(standing: dict, view: dict, history: PositionHistory, me: str, p: Position) -> bool:
    """The real ``CatchUp._vouched_for`` (what ``download_state``'s ``accept_newer`` calls when a holder
    offers a newer state than the one agreed) over this peer's view, history and standing."""
    stub = SimpleNamespace(
        config=SimpleNamespace(training=SimpleNamespace(progress_interval_s=0.001)),
        progress_view=SimpleNamespace(peers={**view, me: None}, positions=history, count=0),
        peer_id=me,
        _credit=lambda: standing,
    )
    return await CatchUp._vouched_for(stub, p.step, p.state_hash)


def test_a_farm_holder_cannot_pass_off_a_made_up_newer_state_to_a_member_catching_up(tmp_path):
    """HIGH (review 6). ``PositionHistory.agreed`` (``CatchUp._vouched_for``: a holder offers a newer
    state than the one agreed) weighed only the other peers' credit: 3 farm keys beside 4 honest members
    showed a made-up state 5 steps ahead for one progress interval, then copied the honest position, so
    they were holders of the state a restarted member chose, and a farm holder's made-up "newer" state
    was vouched for (1097 of the others' 2057). Fixed: the caller's own credit weighs in ``agreed``'s
    total (1097 of 2377)."""
    with credit_store(tmp_path, "newer") as b:
        after = run(farm_run(b, 4, 3, 20))
    standing, last = after["standing"], after["last"]
    honest = [k.peer_id for k in after["honest"]]
    farm = [k.peer_id for k in after["farm"]]
    victim = honest[0]
    made_up = Position(last + 5, POISON)
    history = PositionHistory()
    shown = {**{k: Position(last, state(last)) for k in honest[1:]}, **{k: made_up for k in farm}}
    history.observe(shown, keep=shown)
    assert catch_up_target(RESTARTED, shown, credit=standing, me=victim) is None
    copied = {**{k: Position(last, state(last)) for k in honest[1:]},
              **{k: Position(last, state(last)) for k in farm}}  # fmt: skip
    history.observe(copied, keep=copied)
    target = catch_up_target(RESTARTED, copied, credit=standing, me=victim)
    assert target is not None and target.state_hash == state(last)
    assert asyncio.run(vouched_newer(standing, copied, history, victim, made_up)) is False


# --- 3. liveness: the caller's own credit blocks a lagging member behind the honest majority ------------


def test_a_lagging_member_follows_the_honest_majority_while_two_farm_keys_sit_elsewhere_ahead(tmp_path):
    """MEDIUM (review 6; liveness, a regression of review 5's fix). ``by_credit`` added the caller's own
    credit to the pool of every state ahead, where counting counts the caller only when nobody but the
    candidate's holders is ahead of it: a member that restarted or fell behind could not follow the 3
    honest members ahead while 2 farm keys sat at other positions ahead (3 x 160 of 6 x 160), nor, with
    no attacker, 3 of 6 honest members caught mid-round (3 at the run's step, 2 at the next). Fixed: the
    caller's own vote counts under counting's condition (``own_vote``)."""
    with credit_store(tmp_path / "a", "lag") as b:
        after = run(farm_run(b, 4, 2, 10))
    standing, last = after["standing"], after["last"]
    honest = [k.peer_id for k in after["honest"]]
    farm = [k.peer_id for k in after["farm"]]
    me = honest[0]
    view = {**{k: Position(last, state(last)) for k in honest[1:]},
            **{k: Position(last + 1 + i, f"{i + 10:064x}") for i, k in enumerate(farm)}}  # fmt: skip
    for mine in (RESTARTED, Position(last - 3, state(last - 3))):
        assert catch_up_target(mine, view, credit=standing, me=me).state_hash == state(last)
        assert catch_up_target(mine, view).state_hash == state(last)  # as counting does
    with credit_store(tmp_path / "b", "spread") as b:
        after = run(farm_run(b, 6, 0, 10))
    standing, last = after["standing"], after["last"]
    honest = [k.peer_id for k in after["honest"]]
    me = honest[0]
    view = {**{k: Position(last, state(last)) for k in honest[1:4]},
            **{k: Position(last + 1, state(last + 1)) for k in honest[4:]}}  # fmt: skip
    assert catch_up_target(RESTARTED, view, credit=standing, me=me).state_hash == state(last)


# --- 4. per-key cost: a join, a Status call and a heartbeat at a new step each scan every peer row -------


async def scan_scenario(b: Beats, sizes: tuple[int, ...]) -> list[dict]:
    store = b.store
    await store._run(lambda db: db.execute("PRAGMA synchronous=OFF"))  # test speed only
    honest = [SigningKey.generate() for _ in range(4)]
    probes = [SigningKey.generate() for _ in range(2)]  # two attacker keys that share a made-up hash
    for k in (*honest, *probes):
        await store.admit(record(k))
    history: list = []
    for step in range(W + 3):
        await honest_step(b, honest, step, history)

    async def costs() -> dict:
        verified = await store.verified_step()
        ahead = verified + 1

        async def join() -> None:  # what the service's join handler runs against the store
            await store.prune(b.t, grace_s=600.0)
            await store.admit(record(SigningKey.generate()))

        async def status() -> None:  # the unauthenticated Status call's scan (its page of rows is bounded)
            await store.majority_hashes()

        await b.beat(probes[0], ahead, "f" * 64)
        probe = await vm_ops(store, lambda: b.beat(probes[1], ahead, "f" * 64))
        assert await store.verified_step() == verified  # 2 of 6 reporting a hash: it moves nothing
        return {
            "join": await vm_ops(store, join),
            "status": await vm_ops(store, status),
            "heartbeat": probe,
        }

    out = [await costs()]
    added = 0
    for size in sizes:
        for _ in range(size - added):  # throwaway keys: one join each, never a heartbeat
            await store.admit(record(SigningKey.generate()))
        added = size
        out.append(await costs())
    return out


def test_a_join_a_status_call_and_a_heartbeat_ahead_cost_the_same_however_many_keys_joined(tmp_path):
    """MEDIUM (review 6; availability of the coordinator's one store thread). Three paths read every row of
    ``peers``, throwaway keys included: every Join's ``Store.prune`` (``cert_expires_at + grace < now``
    and the peers that left, in one OR), every unauthenticated Status call's ``majority_hashes()``, and
    every heartbeat ahead of the verified step whose hash another peer shares (``verify_step``'s count of
    the online peers that report a hash). 1,000 keys that joined once made them 55x / 23x / 20x dearer
    (SQLite instructions), 4,000 keys 3.9x more again; with 100,000, a join took 27 ms. Fixed: a partial
    index of the online peers that report a hash (``peers_reporting``), one of the peers that left, one on
    the certificates' expiry, and a prune that reads each half by its index."""
    with credit_store(tmp_path, "scans") as b:
        base, small, large = run(scan_scenario(b, (1000, 4000)))
    for path in ("join", "status", "heartbeat"):
        for costs in (small, large):
            assert costs[path] <= 2 * base[path] + 100, (path, base, costs)
