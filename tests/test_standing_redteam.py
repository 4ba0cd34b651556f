"""Ways into catch-up by credit (issue 25) and the signed standing, found by an attacker's read of the
change; each test failed on that change (it was written to pass while the defect was present) and
passes on its fix. Each uses the real code in-process: Store (credit_witnessed, verify_step,
credited_peers), CoordinatorService over loopback gRPC, CoordinatorClient, swarm.standing.Standing and
swarm.training.catchup.catch_up_target.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import serving_coordinator
from witness_helpers import POISON, TARGET, a_round, credit_store, honest_step, record, run, state

from protocols.keys import SigningKey
from swarm.coordinator_client import CoordinatorClient
from swarm.standing import Standing
from swarm.training.catchup import Position, catch_up_target

pytestmark = pytest.mark.timeout(120)


# --- 1. offline members: the farm's credit grows with its key count, unbounded --------------------------


def test_offline_sybil_keys_share_the_two_batch_bound_and_cannot_steer_once_back_online(tmp_path: Path):
    """HIGH. ``credit_witnessed`` caps each member at 2*target/max(len(round), online) where ``online``
    counts only *online* data-parallel peers, but a member need only have a peers row (any state). A
    farm of 48 keys joins, goes silent (the node marks them offline after ``offline_after_s``), and
    one online reporter reports made-up rounds of itself + 4 farm keys: each key is credited
    2*64/5 = 25.6 samples a step, 16x the honest run's whole batch per step together, against the
    documented bound "together less than twice a batch a step, however many they are" (credit.py,
    protocol.md HeartbeatBody.rounds, dashboard.md). Each farm key out-earns every honest member
    (25.6 vs 16 a step). The keys then heartbeat once (back online, so ``credited_peers`` lists them
    in the signed standing) and announce a made-up state: 3 of them in view move a fresh peer, the
    checkpoint keeper and an honest peer in line at the honest state, beside 4 honest peers.
    A farm that starts late catches up with the honest credit at ~K/H times the honest rate.
    Fixed then: every data-parallel peer of the run, online or offline, counted in each share's
    denominator; now (``coordinator.stepshares``) every member of a step counts in that step's, so the
    silent keys count wherever they are members."""
    run_id = "farm"
    steps = 10

    async def scenario():
        with credit_store(tmp_path, run_id) as b:
            store = b.store
            honest = [SigningKey.generate() for _ in range(4)]
            reporter = SigningKey.generate()
            farm = [SigningKey.generate() for _ in range(48)]
            for k in (*honest, reporter, *farm):
                await store.admit(record(k))
            await b.beat(reporter, 0, "")  # online, reporting no hash: it never moves the verified step
            history: list = []
            await honest_step(b, honest, 0, history)
            # The farm keys stay silent: the coordinator node turns them offline (coordinator/node.py).
            assert set(await store.mark_offline(0.5)) == {k.peer_id for k in farm}
            chunks = [farm[i : i + 4] for i in range(0, len(farm), 4)]
            for step in range(1, steps + 1):
                await honest_step(b, honest, step, history)
                for j in range(0, len(chunks), 3):  # 3 rounds per heartbeat (MAX_WITNESSED_ROUNDS)
                    rounds = [a_round([reporter, *c], step - 1, TARGET, run_id=run_id, now=b.now)
                              for c in chunks[j : j + 3]]  # fmt: skip
                    await b.beat(reporter, 0, "", rounds)
            honest_credit = [await b.credit(k) for k in honest]
            farm_credit = [await b.credit(k) for k in farm]
            for k in farm[:3]:  # three keys come back online before the standing is next computed
                await b.beat(k, 0, "")
            return honest_credit, farm_credit, await store.standing()

    honest_credit, farm_credit, standing = run(scenario())
    # The documented bound holds: the farm together earns less than twice a batch a step ...
    assert sum(farm_credit) <= 2 * TARGET * steps, sum(farm_credit)
    # ... and (as documented) it lowers each honest member's share to the same cap as its own keys.
    assert all(0 < c <= max(honest_credit) for c in farm_credit)
    honest_ids = [k for k in standing if standing[k] in honest_credit][:4]
    sybil_ids = [k for k in standing if k not in honest_ids]
    view = {**{k: Position(steps, state(steps)) for k in honest_ids},
            **{k: Position(steps + 1, POISON) for k in sybil_ids}}  # fmt: skip
    for mine in (Position(0, "3" * 64), None, Position(steps, state(steps))):  # fresh, keeper, in line
        target = catch_up_target(mine, view, credit=standing)
        assert target is None or target.state_hash != POISON


# --- review 2: farm keys that leave once credited make room for fresh keys at the same step ---------------


def test_farm_keys_that_leave_once_credited_keep_the_farm_within_two_batches_a_step(tmp_path: Path):
    """HIGH (review 2). A member's cap was 2*target over the round's members or the run's eligible
    data-parallel peers, whichever are more, and ``left`` peers are not eligible: ``left`` is the peer's
    own choice. A farm credited at a step left, and a fresh batch of keys was credited at the same step
    with the same cap, again and again: 4 batches of 12 keys earned 4 times what one batch may. Fixed: a
    member credited at a step still counts in that step's denominator after it leaves, and the members of
    a step together earn at most twice a batch of it; honest members of a run without a farm are
    credited their whole weight. Now every member of a step, gone or not, has the same share of it, and a
    key that joins the step later lowers the shares of those that left as much as its own."""
    run_id = "leavers"
    steps = 6

    async def scenario():
        with credit_store(tmp_path, run_id) as b:
            store = b.store
            honest = [SigningKey.generate() for _ in range(4)]
            reporter = SigningKey.generate()
            for k in (*honest, reporter):
                await store.admit(record(k))
            await b.beat(reporter, 0, "")
            history: list = []
            await honest_step(b, honest, 0, history)
            await honest_step(b, honest, 1, history)
            alone = [await b.credit(k) for k in honest]  # a step of honest rounds, no farm yet
            farm: list[SigningKey] = []
            for step in range(2, steps + 1):
                await honest_step(b, honest, step, history)
                for _ in range(
                    4
                ):  # 4 batches of 12 fresh keys at each step, each batch leaving once credited
                    batch = [SigningKey.generate() for _ in range(12)]
                    for k in batch:
                        await store.admit(record(k))
                    chunks = [batch[i : i + 4] for i in range(0, 12, 4)]
                    rounds = [
                        a_round([reporter, *c], step - 1, TARGET, run_id=run_id, now=b.now) for c in chunks
                    ]
                    await b.beat(reporter, 0, "", rounds)
                    for k in batch:
                        assert await b.credit(k) > 0, "credited"
                        await store.record_leave(k.peer_id, seq=10**6, seen_at=b.t)
                    farm += batch
            # What the keys that left keep (a step's shares are final once it leaves the witness window).
            return alone, sum([await b.credit(k) for k in farm])

    alone, farm_credit = run(scenario())
    assert alone == [TARGET / 4] * 4, "honest members of honest rounds earn their whole weight"
    farm_steps = steps - 1
    assert farm_credit <= 2 * TARGET * farm_steps + 1e-6, (farm_credit, 2 * TARGET * farm_steps)


def test_a_thousand_keys_that_joined_once_do_not_dilute_the_honest_members_share(tmp_path: Path):
    """MEDIUM (review 2). A share's denominator counted every data-parallel key of the run that had not
    left, online or offline: 1,000 keys that join once and fall silent, never in any round, cut each
    honest member's share of a step from its whole weight (16 samples) to 2 * 64 / 1,004 = 0.13, for
    their certificates' lifetime and at no further cost. Fixed: a step's share is divided among the
    members reported at that step (``coordinator.stepshares``)."""
    run_id = "idle-keys"

    async def scenario():
        with credit_store(tmp_path, run_id) as b:
            store = b.store
            honest = [SigningKey.generate() for _ in range(4)]
            idle = [SigningKey.generate() for _ in range(1000)]
            for k in (*honest, *idle):
                await store.admit(record(k))
            assert len(await store.mark_offline(0.5)) == len(honest) + len(idle)
            history: list = []
            for step in range(4):
                await honest_step(b, honest, step, history)
            return [await b.credit(k) for k in honest]

    credit = run(scenario())
    # Steps 0, 1 and 2 were verified and reported; each honest member earns its whole weight of each.
    assert credit == [3 * TARGET / 4] * 4, credit


def test_an_honest_member_that_leaves_right_after_its_round_is_credited_for_it(tmp_path: Path):
    """LOW (review 2). Only peers that had not left could be credited, so a member that left cleanly
    right after its last round, before a groupmate's heartbeat reported it, lost that round's credit.
    Now a member that left is credited while the coordinator still holds its row (``PRUNE_GRACE_S``)."""
    run_id = "leaving"

    async def scenario():
        with credit_store(tmp_path, run_id) as b:
            store = b.store
            honest = [SigningKey.generate() for _ in range(4)]
            for k in honest:
                await store.admit(record(k))
            history: list = []
            for step in range(3):
                await honest_step(b, honest, step, history)
            leaver = honest[0]
            before = await b.credit(leaver)
            # Its last round (step 2) is reported at step 3, after it left.
            await store.record_leave(leaver.peer_id, seq=10**6, seen_at=b.t)
            history.append(a_round(honest, 2, TARGET / 4, run_id=run_id, now=b.now))
            for k in honest[1:]:
                await b.beat(k, 3, state(3), history[-3:])
            for k in honest[1:]:
                await b.beat(k, 4, state(4), history[-3:])
            return before, await b.credit(leaver)

    before, after = run(scenario())
    assert after == before + TARGET / 4, (before, after)


# --- 4. a restarted peer (or one whose answer was lost) holds no standing: counting decides -------------


def test_a_restarted_peer_that_joins_again_is_sent_the_standing_and_sybil_keys_do_not_move_it(tmp_path: Path):
    """MEDIUM. The service sends each standing version to a peer ID once (``_standing_sent``), whatever
    ``standing_at`` the heartbeat says it holds. A peer whose process restarts (same identity file, a
    new Session whose Standing is empty) and joins again is refused the current standing until the
    next 30 s refresh; so is a peer whose one answer carrying it was lost. Its catch-up then reads an
    empty credit map, fewer than CREDIT_QUORUM credited peers, and counts keys: five Sybils beside
    three credited honest peers move the restarted (fresh) peer to their state, exactly what issue 25
    closed. An on-path attacker (the endpoint is plaintext, in the documented threat model) can drop
    the single ~33 KiB answer per refresh that carries a new standing, so that the victim never
    holds one and always counts keys. Fixed: a join forgets which standing the peer was sent, so a
    restarted peer's first heartbeat gets it (an on-path attacker that drops answers can drop every
    heartbeat anyway)."""
    run_id = "restart-run"

    async def scenario() -> tuple[dict | None, Standing]:
        async with serving_coordinator(tmp_path, run_id) as (address, store, service):
            keys = [SigningKey.generate() for _ in range(3 + 5)]
            async with CoordinatorClient(address) as client:
                for i, k in enumerate(keys):
                    await client.join(k, run_id, name=f"p{i}", device="cpu")
            honest, sybils = keys[:3], keys[3:]

            def grant(db) -> None:
                for k, samples in zip(honest, (300.0, 200.0, 100.0), strict=True):
                    db.execute(
                        "INSERT INTO credit (peer_id, samples, step) VALUES (?, ?, 0)", (k.peer_id, samples)
                    )

            await store._run(grant)
            coordinator_key = service.key.public_key
            async with CoordinatorClient(address) as client:
                before = Standing()
                first = await client.heartbeat(honest[0], run_id, coordinator_key, standing_at=before.at)
                assert before.take(first.standing_at, first.standing) and len(before.credit) == 3
                # The peer's process restarts: same key, a new session holding no standing; it joins again.
                await client.join(honest[0], run_id, name="p0", device="cpu")
                after = Standing()
                again = await client.heartbeat(honest[0], run_id, coordinator_key, standing_at=after.at)
                after.take(again.standing_at, again.standing)
                return {"honest": [k.peer_id for k in honest], "sybils": [k.peer_id for k in sybils]}, after

    ids, restarted = run(scenario())
    assert len(restarted.credit) == 3 and restarted.at > 0
    view = {
        **{k: Position(5, "1" * 64) for k in ids["honest"]},
        **{k: Position(6, POISON) for k in ids["sybils"]},
    }
    assert catch_up_target(Position(0, "3" * 64), view, credit=restarted.credit).state_hash == "1" * 64


# --- 5. rule 4 is gone under credit: two equal apart sides swap states ---------------------------------


def test_two_equal_apart_sides_at_one_step_do_not_swap_states_under_credit():
    """MEDIUM (liveness of an honest run). Rule 4 (catchup.py): at the caller's own step the majority must
    beat the caller's own side, the caller counted; equal sides go to the smaller hash "so two apart
    peers never swap". ``by_credit`` drops the caller's own vote: its pool is the other voters only.
    Two honest groups of two at step 5 that averaged apart (hashes X and Y, equal credit): each peer
    sees the other side hold 2/3 of the others' credit, so all four move, A's to Y and B's to X, and
    after downloading they are apart again; a credited attacker needs only to split a round in two to
    start it. Counting keys, only the larger-hash side moves and the run converges. Fixed: the caller's
    own credit weighs for its side, and equal sides go to the smaller hash."""
    x, y = "a" * 64, "b" * 64
    credit = {p: 100.0 for p in ("A1", "A2", "B1", "B2")}
    sides = {"A1": x, "A2": x, "B1": y, "B2": y}
    moves = {}
    for me, mine in sides.items():
        others = {p: Position(5, h) for p, h in sides.items() if p != me}
        moves[me] = catch_up_target(Position(5, mine), others, credit=credit, me=me)
        counted = catch_up_target(Position(5, mine), others)
        assert (counted is None) == (mine == x)  # counting: only the larger hash moves
    assert {me: t.state_hash if t else None for me, t in moves.items()} == {
        "A1": None,
        "A2": None,
        "B1": x,
        "B2": x,
    }


# --- 7. keys without credit still hold the download ---------------------------------------------------


def test_keys_without_credit_that_copy_the_honest_position_are_no_download_holders():
    """LOW-MEDIUM (liveness of a fresh peer). The credit rule decides *which* position, but the holders
    it returns are every key in view at that position, credited or not. 30 Sybil keys that copy the
    public honest (step, hash) are 30 of 33 holders; ``from_any_holder`` tries them in random order
    and each may stall the transfer up to ``transfer_deadline_s`` (or offer a newer state), so a
    fresh peer's download goes to a Sybil ~91% of the time and is held for minutes per attempt.
    Fixed: when credit decides, only credited peers are holders."""
    honest = {f"h{i}": 500.0 for i in range(3)}
    view = {
        **{k: Position(7, "1" * 64) for k in honest},
        **{f"s{i}": Position(7, "1" * 64) for i in range(30)},
    }
    target = catch_up_target(Position(0, "3" * 64), view, credit=honest)
    assert target.state_hash == "1" * 64
    assert sorted(target.holders) == sorted(honest)
    # Review 2 (LOW-MEDIUM): keys with a sliver of farmed credit were holders again. Now a holder needs a
    # tenth of the vote cap (the third most credit in view).
    slivers = {**honest, **{f"s{i}": 1.0 for i in range(30)}}
    target = catch_up_target(Position(0, "3" * 64), view, credit=slivers)
    assert target.state_hash == "1" * 64 and sorted(target.holders) == sorted(honest)
