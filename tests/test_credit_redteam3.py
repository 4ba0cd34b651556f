"""Ways into the witness-window denominator of ``coordinator.credit.credit_witnessed`` found by an attacker's
read of the change that made it the members of recently reported rounds (instead of every key that ever
joined). Each test passed while its defect was present, asserting the bad outcome; here each asserts the
fixed one. Each drives the real Store in-process through the real HeartbeatBody and witnessed_rounds
(``witness_helpers``).
"""

from __future__ import annotations

import pytest
from witness_helpers import TARGET, Beats, credit_store, honest_step, nobody_follows, record, run, state

from protocols.keys import SigningKey

pytestmark = pytest.mark.timeout(120)


# --- 1. the window's trailing edge: the farm's dilution expires exactly when its own report is read ---------

WARM = 17  # honest-only steps before the attack (the dilution rows need step - 16 >= 0)
ATTACK = 30  # attacked steps
DILUTERS = 94  # throwaway keys: 2 rounds of 47 beside the reporter, in the reporter's own heartbeat


async def sliding_edge_scenario(b: Beats) -> dict:
    store = b.store
    honest = [SigningKey.generate() for _ in range(4)]
    mover = SigningKey.generate()  # reports the farm's rounds; copies the public honest (step, hash)
    earners = [SigningKey.generate() for _ in range(3)]  # fewer than the honest peers
    diluters = [SigningKey.generate() for _ in range(DILUTERS)]
    for k in (*honest, mover, *earners):
        await store.admit(record(k))
    history: list = []
    for step in range(WARM + 1):  # an honest run, the mover online at the honest state beside it
        await honest_step(b, honest, step, history)
        await b.beat(mover, step, state(step))
    warm = [await b.credit(k) for k in honest]
    for k in diluters:  # the throwaway keys join only now (so "before" dilutes nobody during the warm-up)
        await store.admit(record(k))
    for step in range(WARM + 1, WARM + 1 + ATTACK):
        history.append(b.round(honest, step - 1, TARGET / 4))
        # Two honest peers reach ``step``: not yet a majority of the 5 online peers that report a hash.
        for k in honest[:2]:
            await b.beat(k, step, state(step), history[-3:])
        assert await store.verified_step() == step - 1
        # The mover (watching Status) heartbeats next with the honest (step, hash): its heartbeat moves the
        # verified step, which expires the throwaway keys' rows at step - 17, and in the same transaction
        # its farm round is read first (denominator: 4 honest + 4 farm keys), then the throwaway keys are
        # put back at step - 16, the oldest step of the new window, where they expire at the next move.
        rounds = [
            b.round([mover, *earners], step - 1, TARGET),
            b.round([mover, *diluters[:47]], step - 16, 0.0),
            b.round([mover, *diluters[47:]], step - 16, 0.0),
        ]
        await b.beat(mover, step, state(step), rounds)
        assert await store.verified_step() == step
        for k in honest[2:]:  # every honest report now sees 4 + 4 + 94 recent members
            await b.beat(k, step, state(step), history[-3:])
    honest_credit = [await b.credit(k) for k in honest]
    earner_credit = [await b.credit(k) for k in earners]
    return {
        "honest": [k.peer_id for k in honest], "earners": [k.peer_id for k in earners],
        "warm": warm, "honest_credit": honest_credit, "earner_credit": earner_credit,
        "standing": await store.standing(), "last": WARM + ATTACK,
    }  # fmt: skip


def test_a_farm_that_times_its_reports_on_the_window_edge_is_diluted_like_everyone_else(tmp_path):
    """HIGH (review 3). The denominator was every key with a ``witnessed`` row at a step in [verified - 16,
    verified), re-read for each round, and a member of a 0-weight entry got a 0-sample row that spent no
    budget. So an attacker decided *when* its dilution applied: each time the verified step moved, the
    rows it had put at the oldest step of the window expired. 3 earning keys, a mover and 94 throwaway
    keys (98 joins, one heartbeat per step): the mover's heartbeat moved the verified step, its made-up
    round [mover + 3 earners] was read first against 8 recent members (16 a step each), then two 0-weight
    rounds put the throwaway keys back at step - 16, and every honest report was read against 102 (1.25 a
    step). Over 30 steps each earner ended with 480 against 309.65 per honest peer, the 3 largest credits
    of the standing, and catch-up moved a fresh peer, the checkpoint keeper and an honest peer in line to
    the farm's made-up state. Fixed (``coordinator.stepshares``): every member reported at a step has the
    same share of it, whenever it is reported, and a 0-weight entry makes no member, so there is no edge
    to time and throwaway keys would dilute the farm's own keys as much as the honest peers'."""
    with credit_store(tmp_path, "edge") as b:
        after = run(sliding_edge_scenario(b))
    gained_honest = [c - w for c, w in zip(after["honest_credit"], after["warm"], strict=True)]
    # Every member of a step gets the same cap (2 * 64 / 8 = 16 here): an earner that signed for 64
    # gains no more a step than an honest peer that signed for 16.
    assert max(after["earner_credit"]) <= min(gained_honest) + 1e-6, (after["earner_credit"], gained_honest)
    assert max(after["earner_credit"]) < min(after["honest_credit"]), after
    nobody_follows(after["standing"], after["honest"], after["earners"], after["last"])


# --- 2. a verified step that jumps past the window leaves it empty: two keys take whole steps --------------


async def jump_scenario(b: Beats, checkpoint: list) -> dict:
    store = b.store
    honest = [SigningKey.generate() for _ in range(4)]
    mover, partner = SigningKey.generate(), SigningKey.generate()
    for k in (*honest, mover, partner):
        await store.admit(record(k))
    history: list = []
    top = 40
    for step in range(top + 1):  # the keeper lags: the verified step stays at checkpoint 0 + 2 * 4 = 8
        if step:
            history.append(b.round(honest, step - 1, TARGET / 4))
        for k in honest:
            await b.beat(k, step, state(step), history[-3:])
        await b.beat(mover, step, state(step))
    assert await store.verified_step() == 8
    pinned = [await b.credit(k) for k in honest]
    checkpoint[0] = 36  # a checkpoint lands: the ceiling is now 44, and the next heartbeat moves to 40
    # The attacker heartbeats first (it sees the checkpoint record): the window [24, 40) holds no row.
    await b.beat(mover, top, state(top), [b.round([mover, partner], s, TARGET) for s in (37, 38, 39)])
    assert await store.verified_step() == top
    await b.beat(partner, 0, "", [b.round([partner, mover], s, TARGET) for s in (37, 38, 39)])
    for k in honest:  # the honest peers report rounds 37, 38 and 39 a moment later
        await b.beat(k, top, state(top), history[-3:])
    for k in honest:
        await b.beat(k, top, state(top), history[-3:])
    honest_gain = [await b.credit(k) - p for k, p in zip(honest, pinned, strict=True)]
    farm = await b.credit(mover) + await b.credit(partner)
    return {"honest_gain": honest_gain, "farm": farm}


def test_after_the_verified_step_jumps_past_the_window_two_keys_take_only_their_share(tmp_path):
    """LOW-MEDIUM (review 3). When the verified step moved more than WITNESS_WINDOW_STEPS at once (the
    checkpoint ceiling released when a lagging checkpoint lands, or the first heartbeats after a
    coordinator restart), every ``witnessed`` row fell out of the window and the first report read after
    the jump was capped over its own members only: 2 keys (fewer than the 4 honest peers) took the whole
    budget of the 3 newest steps, 384 samples, and the honest peers got nothing for them. Fixed
    (``coordinator.stepshares``): a step's members share it equally whatever the window holds, so the
    pair and the 4 honest members of each step get 2 * 64 / 6 each at most, and the honest members their
    whole weight."""
    checkpoint = [0]
    with credit_store(tmp_path, "jump") as b:
        b.store.follow_checkpoints(lambda: checkpoint[0], 4)
        after = run(jump_scenario(b, checkpoint))
    assert after["farm"] <= 3 * 2 * (2 * TARGET / 6) + 1e-6, after
    assert after["honest_gain"] == [pytest.approx(3 * TARGET / 4)] * 4, after


# --- 3. honest churn: peers that left within the window shrink the active peers' share -----------------


async def churn_scenario(b: Beats, steps: int) -> dict:
    """4 peers train at a time; each step from step 2 the longest-serving one leaves cleanly (after its
    heartbeat) and a fresh key takes its place. Each peer reports its last 3 rounds. Returns the weight the
    reported rounds signed and the credit all the peers got."""
    store = b.store
    active = [SigningKey.generate() for _ in range(4)]
    everyone = list(active)
    for k in active:
        await store.admit(record(k))
    rounds: list = []  # (member IDs, signed entries)

    def mine(k: SigningKey) -> list:
        return [entries for ids, entries in rounds if k.peer_id in ids][-3:]

    for step in range(steps + 1):
        if step:
            rounds.append(({k.peer_id for k in active}, b.round(active, step - 1, TARGET / 4)))
        for k in active:
            await b.beat(k, step, state(step), mine(k))
        if step >= 2:
            gone = active.pop(0)
            await store.record_leave(gone.peer_id, seq=10**9 + step, seen_at=b.t)
            fresh = SigningKey.generate()
            await store.admit(record(fresh))
            active.append(fresh)
            everyone.append(fresh)
    for step in (steps + 1, steps + 2):  # the last rounds are reported
        for k in active:
            await b.beat(k, step, state(step), mine(k))
    verified = await store.verified_step()
    signed = TARGET * min(verified, steps)  # each verified step's round: 4 members x 16
    credited = sum([await b.credit(k) for k in everyone])
    return {"signed": signed, "credited": credited, "verified": verified}


def test_honest_churn_within_the_window_leaves_the_active_peers_their_credit(tmp_path):
    """LOW (review 3; honest peers, no attacker). Peers that left cleanly stayed in the denominator for 16
    steps, so in a run where more peers leave within 16 steps than train at once (preemptible machines,
    each a new identity) every active member was capped below its weight: 4 active peers, one replaced
    per step, 30 steps: 62% of the signed weight credited. Fixed: a peer that left counts only at the
    steps it took part in."""
    with credit_store(tmp_path, "churn") as b:
        after = run(churn_scenario(b, 30))
    assert after["credited"] / after["signed"] > 0.95, after
