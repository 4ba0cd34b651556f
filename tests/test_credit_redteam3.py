"""Ways into the witness-window denominator of ``coordinator.credit.credit_witnessed`` (commits 52104e9 and
d32e20b: a share's denominator is the peers with a ``witnessed`` row in the last WITNESS_WINDOW_STEPS,
0-sample rows included, and peers that left are creditable), found by an attacker's read of the change.

Each test PASSES while its defect is present (it asserts the bad outcome). Each drives the real Store
in-process through the real HeartbeatBody and witnessed_rounds, as tests/test_standing_redteam.py does,
and where it says "before" it runs the same heartbeats against the pre-change ``credit_witnessed``
(``git show 94f7989:coordinator/credit.py``, skipped when git history is not at hand).
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import time
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

import coordinator.store as store_module
from coordinator.store import PeerRecord, Store
from coordinator.witness import witnessed_rounds
from protocols.envelope import seal
from protocols.keys import SigningKey
from protocols.messages import HeartbeatBody
from swarm.averaging.groups import GROUP_ENTRY
from swarm.training.catchup import Position, catch_up_target

pytestmark = pytest.mark.timeout(120)

TARGET = 64.0  # the run's target batch (max_samples_per_step)
POISON = "e" * 64  # the state the attacker wants peers to load
REPO = Path(__file__).resolve().parent.parent
BEFORE = "94f7989"  # the commit before the change under review


def run(coro):
    return asyncio.run(coro)


def state(step: int) -> str:
    return f"{step:064x}"


def record(key: SigningKey, role: str = "data") -> PeerRecord:
    p = key.peer_id
    return PeerRecord(p, key.public_key.raw, p[:8], "cpu", role, "online", 0.0, 0.0, 0, 1, 1e12)


def a_round(keys: list[SigningKey], step: int, weight: float, *, run_id: str, now: float) -> list[bytes]:
    """Signed group entries of ``keys`` at ``step`` (what a member of a round reports as witness)."""
    body = lambda: {"schema_hash": b"s" * 32, "weight": weight, "commit": bytes(32),  # noqa: E731
                    "extra": {"step": step, "state_hash": "0" * 64}}  # fmt: skip
    return [seal(k, GROUP_ENTRY, run_id, body(), now=now) for k in keys]


class Beats:
    """Heartbeats straight into a real Store, through the real HeartbeatBody and witnessed_rounds."""

    def __init__(self, store: Store, run_id: str):
        self.store, self.run_id, self.seq, self.t = store, run_id, 0, 1.0
        self.now = time.time()

    async def beat(self, key: SigningKey, step: int, param_hash: str, rounds=None) -> None:
        self.seq += 1
        self.t += 10.0  # ten coordinator seconds between beats: the verified step's rate never binds
        body = HeartbeatBody.model_validate(
            {"seq": self.seq, "state": "online", "step": step, "param_hash": param_hash,
             "rounds": list(rounds or [])}
        )  # fmt: skip
        kept, refused = witnessed_rounds(body.rounds, run_id=self.run_id, reporter=key.peer_id, now=self.now)
        assert not refused, refused
        await self.store.record_heartbeat(
            key.peer_id, seq=body.seq, seen_at=self.t, metrics={}, step=step, param_hash=param_hash,
            rounds=kept,
        )  # fmt: skip

    async def credit(self, key: SigningKey) -> float:
        return (await self.store.get_peer(key.peer_id)).contributed_samples

    def round(self, keys: list[SigningKey], step: int, weight: float) -> list[bytes]:
        return a_round(keys, step, weight, run_id=self.run_id, now=self.now)


@contextlib.contextmanager
def credit_store(tmp_path: Path, run_id: str, name: str = "c.db") -> Iterator[Beats]:
    store = Store.open_sync(
        tmp_path / name, run_id, max_samples_per_step=TARGET, max_verified_steps_per_s=1000
    )
    try:
        yield Beats(store, run_id)
    finally:
        store.close()


def credit_before_the_change():
    """``credit_witnessed`` as it was before 52104e9 (denominator: every data-parallel key in the run,
    online or offline, plus the departed members credited at the step; peers that left not creditable)."""
    try:
        src = subprocess.run(
            ["git", "show", f"{BEFORE}:coordinator/credit.py"], cwd=REPO, capture_output=True, text=True,
            check=True, timeout=30,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        pytest.skip("the pre-change coordinator/credit.py is not in this checkout's history")
    module = types.ModuleType("credit_before_52104e9")
    exec(compile(src, "credit_before_52104e9.py", "exec"), module.__dict__)
    return module.credit_witnessed


@contextlib.contextmanager
def old_credit(enabled: bool):
    """Run the Store with the pre-change ``credit_witnessed`` while ``enabled``."""
    if not enabled:
        yield
        return
    fn = credit_before_the_change()
    saved = store_module.credit_witnessed
    store_module.credit_witnessed = fn
    try:
        yield
    finally:
        store_module.credit_witnessed = saved


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
        if step:
            history.append(b.round(honest, step - 1, TARGET / 4))
        for k in honest:
            await b.beat(k, step, state(step), history[-3:])
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


def test_a_farm_times_its_reports_on_the_window_edge_so_its_throwaway_keys_dilute_only_the_honest(tmp_path):
    """HIGH. The denominator is every key with a ``witnessed`` row at a step in [verified - 16, verified),
    re-read for each round, and a member of a 0-weight entry gets a 0-sample row that spends no budget.
    So an attacker decides *when* its dilution applies: each time the verified step moves, the rows it put
    at the oldest step of the window expire. Attack: 3 earning keys + 1 mover + 94 throwaway keys (open
    admission; 98 joins, one heartbeat per step). The mover watches Status and heartbeats with the public
    honest (step, hash) right after the second of 4 honest peers, so its heartbeat moves the verified step
    (or, holding >= H keys online with another hash, it makes sure nobody else can). In that transaction
    its made-up round [mover + 3 earners] at step-1 is read first, against 8 recent members (cap
    2*64/8 = 16 each), then two 0-weight rounds put the 94 throwaway keys back at step-16. Every honest
    report is read against 102 recent members (cap 1.25 < the honest weight 16).
    Measured (4 honest, 30 attacked steps after 17 honest ones): each earner gains 16/step, each honest
    peer 1.25/step (12.8x less); the 3 earners end with 480 each vs 309.65 per honest peer, so they hold the
    3 largest credits in the signed standing and steer catch-up: a fresh peer, the checkpoint keeper and an
    honest peer in line all move to the farm's made-up state, announced by 3 keys beside 4 honest peers.
    Before the change the same heartbeats left the honest peers exactly as much (309.65: the farm's
    dilution of the honest is the documented limitation) but credited the earners the same 1.25 a step
    (37.65 each), so catch-up stayed with the honest state. An equivalent timing attack before needed the 94
    keys to leave and re-join (leave, challenge, join: ~280 rate-limited requests) every step. Requirement:
    the mover's heartbeat must be the one that moves the verified step (else the honest mover's own report
    of its 3 rounds sees the undiluted window once a step).
    Fix: a denominator that cannot shrink between two reports of the same step, e.g. the largest
    ``len(recent)`` seen over the last WITNESS_WINDOW_STEPS verified steps (a high-water mark kept in
    ``meta``, not lowered when rows expire), or, per step, the members of rounds at steps that can no longer
    be reported once the step is creditable (steps <= step - 16, keeping rows 2 windows); and no row (no
    denominator weight) for 0-weight entries."""
    with credit_store(tmp_path, "edge") as b:
        after = run(sliding_edge_scenario(b))
    with old_credit(True), credit_store(tmp_path, "edge", "before.db") as b:
        before = run(sliding_edge_scenario(b))

    # Now: the earners are credited 16 a step each, the honest 1.25 a step.
    gained_honest = [c - w for c, w in zip(after["honest_credit"], after["warm"], strict=True)]
    assert all(abs(c - 16 * ATTACK) < 1e-6 for c in after["earner_credit"]), after["earner_credit"]
    assert all(g < 1.4 * ATTACK for g in gained_honest), gained_honest
    assert min(after["earner_credit"]) > 1.5 * max(after["honest_credit"]), (after, before)
    # Before: the same heartbeats left every key the same share, the earners far below the honest.
    assert max(before["earner_credit"]) < 40 < min(before["honest_credit"]), before

    # The standing's three largest credits are the farm's; catch-up follows its made-up state.
    standing, last = after["standing"], after["last"]
    assert set(sorted(standing, key=standing.get, reverse=True)[:3]) == set(after["earners"]), standing
    view = {**{k: Position(last, state(last)) for k in after["honest"]},
            **{k: Position(last + 1, POISON) for k in after["earners"]}}  # fmt: skip
    fresh = catch_up_target(Position(0, "3" * 64), view, credit=standing)
    keeper = catch_up_target(None, view, credit=standing)
    me = after["honest"][0]
    in_line = catch_up_target(
        Position(last, state(last)), {k: p for k, p in view.items() if k != me}, credit=standing, me=me
    )
    assert fresh.state_hash == keeper.state_hash == in_line.state_hash == POISON
    # Before, the same standing-by-credit left everyone at the honest state.
    s0 = before["standing"]
    view0 = {**{k: Position(last, state(last)) for k in before["honest"]},
             **{k: Position(last + 1, POISON) for k in before["earners"]}}  # fmt: skip
    t0 = catch_up_target(Position(0, "3" * 64), view0, credit=s0)
    assert t0 is None or t0.state_hash != POISON


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


def test_after_the_verified_step_jumps_past_the_window_two_keys_take_whole_steps(tmp_path):
    """LOW-MEDIUM. When the verified step moves more than WITNESS_WINDOW_STEPS at once (the checkpoint
    ceiling released when a lagging checkpoint lands, or the first heartbeats after a coordinator restart,
    when the rate allowance has piled up), every ``witnessed`` row falls out of the window and the first
    report read after the jump is capped over its own members only. Attack: 2 keys (fewer than the 4
    honest peers). The mover heartbeats first with the public honest (step, hash) and made-up rounds
    [mover, partner] at the 3 newest steps: the partner is credited min(64, 2*64/2) = 64 at each; the
    partner reports the same rounds, the mover is credited 64 at each; each step's budget (2 batches) is
    spent, and the honest members of those steps get nothing. Measured: the pair earns 384 (3 x 128), the
    4 honest peers 0 for steps 37-39; before the change the same heartbeats credited the pair 2*64/6 =
    21.3 each a step (128 in all) and each honest peer its whole 16 a step (48). Documented: a farm takes a
    step's budget only once it outnumbers the honest peers. Fix: a denominator floor that does not depend
    on the window being populated: keep the high-water mark of finding 1 across a jump (it is about reports,
    not steps), or max(recent, the online unbanned data-parallel peers that report a hash)."""
    checkpoint = [0]

    def scenario(name: str):
        with credit_store(tmp_path, "jump", name) as b:
            b.store.follow_checkpoints(lambda: checkpoint[0], 4)
            checkpoint[0] = 0
            return run(jump_scenario(b, checkpoint))

    after = scenario("after.db")
    with old_credit(True):
        before = scenario("before.db")
    assert after["farm"] == pytest.approx(6 * TARGET), after  # 3 steps x the whole budget of 128
    assert after["honest_gain"] == [0.0] * 4, after
    assert before["farm"] == pytest.approx(6 * 2 * TARGET / 6), before
    assert before["honest_gain"] == [pytest.approx(3 * TARGET / 4)] * 4, before


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


def test_honest_churn_within_the_window_cuts_the_active_peers_credit(tmp_path):
    """LOW (honest peers, no attacker). Peers that left cleanly stay in the denominator for 16 steps (they
    did witnessed work lately); before the change a peer that left counted only at steps it had been
    credited at. In a run where more peers leave within 16 steps than train at once (preemptible/volunteer
    machines, each a new identity), every active member is capped below its weight. Measured: 4 active
    peers, one replaced per step, 30 steps: about 40% of the signed weight is credited now (cap 2*64/20 =
    6.4 vs weight 16) against about 95% before (before, the member that left right after its last round lost
    that round, the LOW that d32e20b fixed). Fix: count a departed member only at the steps it was
    credited at (as before), or weigh the recent set by steps present, not distinct IDs."""
    with credit_store(tmp_path, "churn") as b:
        after = run(churn_scenario(b, 30))
    with old_credit(True), credit_store(tmp_path, "churn", "before.db") as b:
        before = run(churn_scenario(b, 30))
    share_after = after["credited"] / after["signed"]
    share_before = before["credited"] / before["signed"]
    assert share_after < 0.65 and share_before > 0.95, (after, before)
