"""Review 4 of the witness-window credit: the ``sharing`` high-water mark (commit bbca97f) and the pruning
of peers that left. Each test passed while its defect was present, asserting the bad outcome; here each
asserts the outcome of the fix, which replaced the window-wide denominator by one per step
(``coordinator.stepshares``: every member reported at a step has the same share of it, whenever it is
reported). Each drives the real Store in-process through the real HeartbeatBody and witnessed_rounds
(``witness_helpers``).
"""

from __future__ import annotations

import pytest
from witness_helpers import TARGET, Beats, credit_store, honest_step, nobody_follows, record, run, state

from coordinator.stepshares import WITNESS_WINDOW_STEPS
from protocols.keys import SigningKey

pytestmark = pytest.mark.timeout(120)

W = WITNESS_WINDOW_STEPS


# --- 1. the mark lasts 16 *verified* steps, a step stays creditable for 16: report it after the mark expired


LATE_WARM = 17  # honest-only steps first
LATE_CYCLES = 3  # 16 verified steps each
LATE_DILUTERS = 142  # d0 reports 3 rounds of [d0 + 47 others], once per cycle; the same keys every cycle
LATE_EPSILON = 1e-6  # a diluter's signed weight: > 0, so it is a member of the step (0 is not)


def _collection(farm: list[SigningKey], steps: range) -> list[list[tuple[SigningKey, list[int]]]]:
    """Passes of heartbeats (each sender at most once a pass: the service reads a sender's rounds at most
    every heartbeat_interval_s / 2) that report the round [farm] at every step of ``steps`` often enough
    that each farm key is credited at each step (a report credits every member but its sender)."""
    need = {(k.peer_id, s) for k in farm for s in steps}
    passes = []
    while need:
        beats = []
        for sender in farm:
            gain = {s: sum((k.peer_id, s) in need for k in farm if k is not sender) for s in steps}
            chosen = [s for s in sorted(steps, key=lambda s: -gain[s]) if gain[s]][:3]
            if chosen:
                beats.append((sender, chosen))
                need -= {(k.peer_id, s) for k in farm if k is not sender for s in chosen}
        passes.append(beats)
    return passes


async def late_report_scenario(b: Beats) -> dict:
    store = b.store
    honest = [SigningKey.generate() for _ in range(4)]
    mover = SigningKey.generate()  # copies the public honest (step, hash) to time the verified step's moves
    earners = [SigningKey.generate() for _ in range(3)]
    farm = [mover, *earners]  # as many keys as honest peers; every one of them earns
    diluters = [SigningKey.generate() for _ in range(LATE_DILUTERS)]
    for k in (*honest, *farm, *diluters):
        await store.admit(record(k))
    history: list = []
    for step in range(LATE_WARM + 1):  # an honest run, the mover online at the honest state beside it
        await honest_step(b, honest, step, history)
        await b.beat(mover, step, state(step))
    warm = [await b.credit(k) for k in honest]
    first = LATE_WARM + 1
    last = first + LATE_CYCLES * W
    heartbeats = 0
    for step in range(first, last + 1):
        history.append(b.round(honest, step - 1, TARGET / 4))
        for k in honest[:2]:  # not yet a majority of the 5 online peers that report a hash
            await b.beat(k, step, state(step), history[-3:])
        cycle = (step - first) % W == 0
        if cycle and step > first:
            # Collect: the mark set 16 verified steps ago leaves the ``sharing`` table at this move, and the
            # throwaway keys' rows expired long ago, so the 16 steps that mark diluted for everyone else
            # (all still in the window) are read against 4 honest + 4 farm keys: 2 * 64 / 8 = 16 each.
            late = {s: b.round(farm, s, TARGET) for s in range(step - W, step)}
            for n, beats in enumerate(_collection(farm, range(step - W, step))):
                for sender, steps in beats:
                    if sender is mover:  # its first heartbeat moves the verified step to ``step``
                        await b.beat(mover, step, state(step), [late[s] for s in steps])
                    else:
                        await b.beat(sender, 0, "", [late[s] for s in steps])
                    heartbeats += 1
                assert await store.verified_step() == step
                if n == 0:  # worst case for the farm: every honest peer heartbeats while the mark is low
                    for k in honest:
                        await b.beat(k, step, state(step), history[-3:])
        else:
            await b.beat(mover, step, state(step))  # moves the verified step to ``step``
        assert await store.verified_step() == step
        if cycle:
            # Dilute: the throwaway keys at the window's oldest step (their rows expire at the next move),
            # which sets this verified step's mark to 4 + 4 + 142 for the next 16 verified steps.
            d0 = diluters[0]
            dilute = [b.round([d0, *diluters[1 + i : 48 + i]], step - W, LATE_EPSILON) for i in (0, 47, 94)]
            await b.beat(d0, 0, "", dilute)
            heartbeats += 1
        for k in honest[2:]:
            await b.beat(k, step, state(step), history[-3:])
    honest_credit = [await b.credit(k) for k in honest]
    farm_credit = [await b.credit(k) for k in farm]
    return {
        "honest": [k.peer_id for k in honest], "farm": [k.peer_id for k in farm], "warm": warm,
        "honest_credit": honest_credit, "farm_credit": farm_credit, "standing": await store.standing(),
        "last": last, "steps": last - first, "heartbeats": heartbeats,
    }  # fmt: skip


def test_a_farm_that_reports_its_rounds_late_gets_no_more_a_step_than_an_honest_member(tmp_path):
    """HIGH (review 4). The ``sharing`` mark holds a count for the 16 newest *verified* steps, but a round at step s
    stays creditable until the verified step passes s + 16, and nothing stops a member from reporting it
    only then (honest peers report their last 3 rounds; a farm reports whenever it likes). So once per
    16 verified steps the farm sets the mark (one heartbeat of a throwaway key: 3 rounds of 48 throwaway
    keys at weight 1e-6 at the window's oldest step, so their rows expire at the next move and only the
    mark holds them), and every honest round of the next 16 steps is read against 4 + 4 + 142 members
    (0.85 a step each). At the move where that mark leaves the ``sharing`` table, and before diluting
    again, the 4 farm keys report their 16 rounds of those same steps ([mover + 3 earners], weight 64;
    11 heartbeats in 3 passes, each sender once a pass, as the service reads a sender's rounds at most
    every heartbeat_interval_s / 2 = 2.5 s): they are read against 8 members, 16 a step each, the whole
    2 * average share. Worst case for the farm, every honest peer heartbeats between its first and second
    pass and tops its last 3 rounds up to 16 at the low mark.

    Cost: 146 joins once (the throwaway keys are reused every cycle; they renew their certificates every
    half hour), 12 heartbeats per 16 steps. Measured over 48 attacked steps, 4 farm keys beside 4 honest
    peers (as many): each farm key gains 768 (16 a step, its full share with 8 members), each honest peer
    178.5 (3.7 a step, 23% of what it signed and would get without the farm); the farm keys hold the 4
    largest credits of the standing, and catch-up moves a fresh peer, the checkpoint keeper and an honest
    peer in line to the farm's made-up state. The fix's own claim (review 3, test 1: an earner gains no
    more a step than an honest peer) fails by 4.3x; without the honest top-ups, by 18x.

    Fixed: a step's share is divided among every member reported at it, whenever it is reported, so the
    farm's late reports (and its throwaway keys) lower its own keys' shares as much as the honest peers';
    neither earns more a step than an honest member's weight."""
    with credit_store(tmp_path, "late") as b:
        after = run(late_report_scenario(b))
    steps = after["steps"]
    gained_honest = [c - w for c, w in zip(after["honest_credit"], after["warm"], strict=True)]
    # An honest member signs 16 a step; no farm key earns more a step, however late it reports.
    assert max(after["farm_credit"]) <= TARGET / 4 * steps + 1e-6, after["farm_credit"]
    assert max(after["farm_credit"]) <= min(gained_honest) + 1e-6, (after["farm_credit"], gained_honest)
    nobody_follows(after["standing"], after["honest"], after["farm"], after["last"])


# --- 2. the mark outlives the window: peers gone silent hold the survivors' share down for 31 steps ---------

DROP_AT = 6  # the step at whose heartbeats 12 of 16 honest peers are gone (preempted: no leave message)
DROP_UNTIL = DROP_AT + 40


async def shrink_scenario(b: Beats) -> dict:
    store = b.store
    peers = [SigningKey.generate() for _ in range(16)]
    survivors = peers[:4]
    for k in peers:
        await store.admit(record(k))
    history: list = []
    per_step = {}
    for step in range(DROP_UNTIL + 1):
        active = peers if step < DROP_AT else survivors
        if step:
            # 16 peers sign a quarter of a 4-peer group's weight each; after the drop the 4 survivors
            # train the whole batch between them (16 each), as a shrinking swarm does.
            members = peers if step - 1 < DROP_AT - 1 else survivors
            history.append(b.round(members, step - 1, TARGET / len(members)))
        if step == DROP_AT:
            await store.mark_offline(silent_since=b.t + 1)  # the 12 silent peers show offline
        before = await b.credit(survivors[0])
        for k in active:
            await b.beat(k, step, state(step), history[-3:])
        per_step[step] = await b.credit(survivors[0]) - before
    return {"per_step": per_step, "verified": await store.verified_step()}


def test_peers_gone_offline_leave_the_survivors_their_whole_share(tmp_path):
    """LOW (review 4; honest peers, no attacker; a regression of the mark). A peer that stops without leaving
    (preempted, crashed) is 'offline' and counts in ``_sharing``'s live term while its last row is in the
    window (16 verified steps, as before the fix); the count a report took at the last of those verified
    steps is then kept by the ``sharing`` mark for 15 more. 16 honest peers (4 a step each), 12 of them
    gone at once: the 4 survivors, each signing 16 a step, are read at 2 * 64 / 16 = 8 at the heartbeats
    of 30 consecutive steps (6 to 35) and each loses 224 samples; the same scenario on the parent commit
    (bbca97f^) capped 15 (6 to 20) and lost 104. By the same token one heartbeat of an attacker's
    diluting keys (online or offline, with a row at the window's newest step) now dilutes for 31
    verified steps instead of 16 (everyone alike, so no relative gain by itself).

    Fixed: a step's share is divided among the members of that step only, so from the first step the
    survivors train alone they are credited their whole weight."""
    with credit_store(tmp_path, "shrink") as b:
        after = run(shrink_scenario(b))
    per_step = after["per_step"]
    assert all(per_step[s] == pytest.approx(TARGET / 4) for s in per_step if s > DROP_AT), per_step


# --- 3. 'left' peers are not kept 600 s: the next join anywhere prunes them before their round is reported ---


async def leave_then_join_scenario(b: Beats, *, someone_joins: bool) -> dict:
    """4 honest peers; after the round of step 9 one of them (the leaver) leaves cleanly, as an honest peer
    does at the end of its session, before its groupmates' heartbeats of step 10 report that round. With
    ``someone_joins``, one key joins in between: the service prunes on every join (``Store.prune`` with
    ``PRUNE_GRACE_S``), as ``coordinator.service`` does before issuing the certificate."""
    store = b.store
    honest = [SigningKey.generate() for _ in range(4)]
    leaver, rest = honest[0], honest[1:]
    for k in honest:
        await store.admit(record(k))
    history: list = []
    for step in range(10):
        if step:
            history.append(b.round(honest, step - 1, TARGET / 4))
        for k in honest:
            await b.beat(k, step, state(step), history[-3:])
    history.append(b.round(honest, 9, TARGET / 4))  # the leaver's last round
    before = await b.credit(leaver)
    await store.record_leave(leaver.peer_id, seq=10**9, seen_at=b.t)
    if someone_joins:
        joiner = SigningKey.generate()  # any key: open admission, one a second per address
        await store.prune(b.t, grace_s=600.0)  # what the service's join handler runs first
        await store.admit(record(joiner))
    for step in (10, 11, 12):
        for k in rest:
            await b.beat(k, step, state(step), history[-3:])
    assert await store.verified_step() == 12
    assert await store.get_peer(leaver.peer_id) is not None, "kept while a member of a window step"
    after = await b.credit(leaver)
    return {"last_round": after - before, "rest": [await b.credit(k) for k in rest]}


def test_a_join_no_longer_prunes_a_peer_that_left_before_its_last_round_is_credited(tmp_path):
    """LOW (review 4; predates bbca97f: d32e20b; the premise "peers in state 'left' are kept 600 s before pruning"
    of ``CREDITABLE`` is false). ``Store.prune`` deletes every peer in state 'left' at once (the grace
    ``grace_s`` applies only to expired certificates: ``state='left' OR cert_expires_at + grace < now``),
    and the service runs it on every join. So an honest peer that leaves right after its last round is
    no longer creditable as soon as any key joins before a groupmate reports that round: its last round
    (16 samples here, a full step's weight) is lost. Cost to an attacker who wants it: one join (open
    admission) after each leave it sees; in a churning swarm, honest joins do it anyway. Without the join
    the same leaver is credited its 16.

    Fixed: a peer that left is pruned only once it is a member of no step in the witness window."""
    with credit_store(tmp_path / "a", "kept") as b:
        kept = run(leave_then_join_scenario(b, someone_joins=False))
    with credit_store(tmp_path / "b", "pruned") as b:
        pruned = run(leave_then_join_scenario(b, someone_joins=True))
    assert kept["last_round"] == pytest.approx(TARGET / 4), kept
    assert pruned["last_round"] == pytest.approx(TARGET / 4), pruned
    assert pruned["rest"] == kept["rest"], (pruned, kept)


def test_a_store_written_before_step_members_opens_and_credits_no_step_twice(tmp_path):
    """A coordinator upgraded in place opens its old store: the steps its ``witnessed`` table held were
    credited when reported, so a later report of them credits nothing more; newer steps are credited."""
    import sqlite3

    run_id = "upgraded"
    with credit_store(tmp_path, run_id) as b:
        honest = [SigningKey.generate() for _ in range(4)]
        history: list = []

        async def before() -> None:
            for k in honest:
                await b.store.admit(record(k))
            for step in range(3):
                if step:
                    history.append(b.round(honest, step - 1, TARGET / 4))
                for k in honest:
                    await b.beat(k, step, state(step), history[-3:])

        run(before())
        credit = [run(b.credit(k)) for k in honest]
    # The old layout: shares credited at once into ``credit``, the window's rows in ``witnessed``.
    db = sqlite3.connect(tmp_path / "c.db")
    db.executescript(
        "DROP TABLE step_members; DROP TABLE step_counts;"
        "CREATE TABLE witnessed (peer_id TEXT NOT NULL, step INTEGER NOT NULL, samples REAL NOT NULL,"
        " PRIMARY KEY (peer_id, step));"
    )
    for k, samples in zip(honest, credit, strict=True):
        db.execute("INSERT INTO credit (peer_id, samples, step) VALUES (?, ?, 1)", (k.peer_id, samples))
        for step in (0, 1):  # the steps it credited: a quarter batch of each
            db.execute("INSERT INTO witnessed VALUES (?, ?, ?)", (k.peer_id, step, samples / 2))
    db.commit()
    db.close()
    with credit_store(tmp_path, run_id) as b:
        b.t, b.seq = 10_000.0, 10_000  # the clock and the peers' heartbeat numbers went on

        async def after() -> list[float]:
            for step in (3, 4):  # reports of steps 1, 2 and 3 again; 2 and 3 are new to the old store
                history.append(b.round(honest, step - 1, TARGET / 4))
                for k in honest:
                    await b.beat(k, step, state(step), history[-3:])
            return [await b.credit(k) for k in honest]

        assert run(after()) == [pytest.approx(c + 2 * TARGET / 4) for c in credit]
