"""Regressions from an attacker's read of witnessed data-parallel credit and the code around it.

Each was first written to pass while its defect was present (the docstring's "Before"); each now asserts
the outcome after the fix. Each uses the real classes (Store, CoordinatorService over loopback gRPC,
witnessed_rounds, catch_up_target, RefusalLog, Trainer), in-process.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers import serving_coordinator

from coordinator.limits import RefusalLog
from coordinator.store import PeerRecord, Store
from coordinator.witness import witnessed_rounds
from lab.localswarm import tiny_run
from protocols.envelope import seal
from protocols.errors import ProtocolError
from protocols.keys import PublicKey, SigningKey
from protocols.messages import MAX_WITNESSED_ROUNDS, HeartbeatBody
from swarm.averaging.groups import GROUP_ENTRY
from swarm.coordinator_client import CoordinatorClient
from swarm.training.catchup import Groupmates, Position, catch_up_target
from swarm.training.trainer import Trainer
from swarm.training.witness import KEEP_WITNESSED_ROUNDS

pytestmark = pytest.mark.timeout(120)

TARGET = 64.0  # max_samples_per_step: the run's target batch


def run(coro):
    return asyncio.run(coro)


def record(key: SigningKey, role: str = "data") -> PeerRecord:
    p = key.peer_id
    return PeerRecord(p, key.public_key.raw, p[:8], "cpu", role, "online", 0.0, 0.0, 0, 1, 1e12)


def entry(key: SigningKey, step: int, weight: float, *, run_id: str, now: float, pad: int = 0) -> bytes:
    extra: dict = {"step": step, "state_hash": "0" * 64}
    if pad:
        extra["pad"] = "x" * pad
    body = {"schema_hash": b"s" * 32, "weight": weight, "commit": bytes(32), "extra": extra}
    return seal(key, GROUP_ENTRY, run_id, body, now=now)


def a_round(keys: list[SigningKey], step: int, weight: float, *, run_id: str, now: float) -> list[bytes]:
    return [entry(k, step, weight, run_id=run_id, now=now) for k in keys]


class Beats:
    """Heartbeats straight into a real Store, through the real HeartbeatBody and witnessed_rounds."""

    def __init__(self, store: Store, run_id: str):
        self.store, self.run_id, self.seq, self.t = store, run_id, 0, 1.0
        self.now = time.time()

    async def beat(
        self,
        key: SigningKey,
        step: int,
        param_hash: str,
        rounds: list[list[bytes]] | None = None,
        *,
        metrics: dict | None = None,
        state: str = "online",
    ) -> None:
        self.seq += 1
        self.t += 10.0  # ten coordinator seconds between beats: the verified step's rate never binds
        body = HeartbeatBody.model_validate(
            {"seq": self.seq, "state": state, "step": step, "param_hash": param_hash,
             "metrics": dict(metrics or {}), "rounds": list(rounds or [])}
        )  # fmt: skip
        kept, refused = witnessed_rounds(body.rounds, run_id=self.run_id, reporter=key.peer_id, now=self.now)
        assert not refused, refused
        await self.store.record_heartbeat(
            key.peer_id, seq=body.seq, seen_at=self.t, metrics=body.metrics, step=step,
            param_hash=param_hash, rounds=kept,
        )  # fmt: skip

    async def credit(self, key: SigningKey) -> float:
        return (await self.store.get_peer(key.peer_id)).contributed_samples


@contextlib.contextmanager
def credit_store(tmp_path: Path, run_id: str) -> Iterator[Beats]:
    """Heartbeats into a real Store of ``run_id`` (a target batch of ``TARGET``; the verified step's rate
    never binds), closed on exit."""
    store = Store.open_sync(
        tmp_path / "c.db", run_id, max_samples_per_step=TARGET, max_verified_steps_per_s=1000
    )
    try:
        yield Beats(store, run_id)
    finally:
        store.close()


def state(step: int) -> str:
    return f"{step:064x}"


async def honest_steps(b: Beats, honest: list[SigningKey], steps, history: dict, weight: float = 16.0):
    """Honest members average in one group per step and each reports its last 3 applied rounds."""
    for step in steps:
        if step:
            history.setdefault("rounds", []).append(
                a_round(honest, step - 1, weight, run_id=b.run_id, now=b.now)
            )
        for k in honest:
            await b.beat(k, step, state(step), history.get("rounds", [])[-3:])


# --- 1. the self-reported credit path is open to any peer that joins as "stage" ---------------------


def serving(tmp_path: Path, run_id: str):
    return serving_coordinator(tmp_path, run_id, max_samples_per_step=TARGET, max_verified_steps_per_s=1000)


def test_a_data_parallel_run_refuses_pipeline_roles_and_a_key_keeps_its_role(tmp_path: Path):
    """Before, Join took role "stage" or "trainer" in a run with no pipeline stages, and a key could join
    again under another role: a freeloader was then credited what it claimed on the pipeline roles'
    self-reported path (427 samples against an honest member's 176 in this test's first form), and a
    Sybil with a witnessed credit row claimed the whole run in one heartbeat. Now both are refused,
    naming the field."""
    run_id = "roles"

    async def scenario() -> None:
        async with serving(tmp_path, run_id) as (address, store, service):
            assert service.config.pipeline.stages < 2
            data, other = SigningKey.generate(), SigningKey.generate()
            async with CoordinatorClient(address) as client:
                for role in ("stage", "trainer"):
                    with pytest.raises(ProtocolError, match="'role'.*data-parallel"):
                        await client.join(other, run_id, name="f", device="cpu", role=role)
                await client.join(data, run_id, name="d", device="cpu", role="data")
            await store.admit(record(data, "stage"))  # the store keeps a rejoining key's first role too
            assert (await store.get_peer(data.peer_id)).role == "data"

    run(scenario())


# --- 2. a witnessed credit row has step 0: a role switch claims every step since 0 at once ------------


def test_a_sybil_credited_by_witness_gains_nothing_by_rejoining_as_stage(
    tmp_path: Path,
):
    """Before (critical): credit_witnessed created the credit row with step 0 and reported 0 (the table's
    defaults). merge_credit then treats that row as a baseline at step 0, so the first self-reported
    heartbeat after a rejoin with role "stage" (admit upserts the role) is granted
    (step - 0) x round_share: the whole run's history in one heartbeat. A fresh stage peer making the
    same claim gets 0 (its first report is a baseline)."""
    run_id = "r"

    async def scenario() -> dict[str, float]:
        with credit_store(tmp_path, run_id) as b:
            store = b.store
            h = [SigningKey.generate() for _ in range(3)]
            s1, s2, fresh = (SigningKey.generate() for _ in range(3))
            for k in (*h, s1, s2):
                await store.admit(record(k))
            await store.admit(record(fresh, "stage"))
            far = 1000
            for _ in range(2):  # the honest peers are at step 1000; the verified step follows
                for k in h:
                    await b.beat(k, far, state(far))
            # One made-up round of the Sybil pair: s2 is now a credited (witnessed) member.
            await b.beat(s1, 0, "", [a_round([s1, s2], far - 1, TARGET, run_id=run_id, now=b.now)])
            before = await b.credit(s2)
            # s2 joins again as "stage" (Join upserts the role) and claims a huge cumulative count.
            await store.admit(record(s2, "stage"))
            await b.beat(s2, far, state(far), metrics={"contributed_samples": 1e12})
            await b.beat(fresh, far, state(far), metrics={"contributed_samples": 1e12})
            return {"before": before, "s2": await b.credit(s2), "fresh": await b.credit(fresh),
                    "honest": await b.credit(h[0])}  # fmt: skip

    credit = run(scenario())
    assert credit["fresh"] == 0  # the same claim from a peer without a witnessed row is only a baseline
    assert credit["before"] <= TARGET
    # ~1000 steps x round_share (2*64/4 = 32): tens of thousands of samples for one heartbeat.
    assert credit["s2"] - credit["before"] == 0, credit  # the store kept its role: no self-reported path


# --- 3. Sybils stay out of `past`, so the made-up-round farm grows linearly with the Sybil count -------


def test_sybils_farming_made_up_rounds_earn_less_than_two_batches_a_step_however_many(tmp_path: Path):
    """HIGH. The cap per member is 2*target/max(len(round), past) with ``past`` the online peers whose
    *self-reported* step is past the round's step. Sybils heartbeat at step 0, so they never count in
    it: every pair of Sybils that signs made-up rounds for each other is credited 2*target/n_honest per
    member per step. With 8 Sybils against 4 honest peers, the Sybils take 4x what the honest run earns,
    and per step more than twice the target batch (the old round_share bounded everyone together)."""
    run_id = "r"
    steps = 12

    async def scenario() -> tuple[float, float]:
        with credit_store(tmp_path, run_id) as b:
            store = b.store
            honest = [SigningKey.generate() for _ in range(4)]
            sybils = [SigningKey.generate() for _ in range(8)]
            for k in (*honest, *sybils):
                await store.admit(record(k))
            history: dict = {}
            for step in range(steps + 1):
                await honest_steps(b, honest, [step], history)
                for i in range(0, len(sybils), 2):
                    a, c = sybils[i], sybils[i + 1]
                    made_up = [
                        a_round([a, c], s, TARGET, run_id=run_id, now=b.now)
                        for s in range(max(0, step - 3), step)
                    ]
                    await b.beat(a, 0, "", made_up)  # step 0, no hash: outside `past` and the verified step
                    made_up = [
                        a_round([c, a], s, TARGET, run_id=run_id, now=b.now)
                        for s in range(max(0, step - 3), step)
                    ]
                    await b.beat(c, 0, "", made_up)
            return (
                sum([await b.credit(k) for k in honest]),
                sum([await b.credit(k) for k in sybils]),
            )

    honest_total, sybil_total = run(scenario())
    assert honest_total > 0
    # Each share is over every online data-parallel peer, Sybils included: together they earn less than
    # twice a batch a step, however many they are (they lower the honest shares once they outnumber them).
    assert sybil_total < 2 * TARGET * steps, (honest_total, sybil_total)


# --- 4. Sybils with a huge self-reported step shrink every honest member's cap ------------------------


def test_a_first_report_padded_with_strangers_does_not_lower_an_honest_members_credit(
    tmp_path: Path,
):
    """MEDIUM. ``INSERT OR IGNORE`` keeps the first witness's amount, and the cap uses len(entries) of
    that report. A member of the round (or a leader that merely gathered the entries) reports it first,
    padded with 43 entries of keys that never joined (not credited, but counted): every honest member
    is credited 2*64/48 = 2.7 instead of 16 for that step, and the honest reports that follow change
    nothing."""
    run_id = "r"

    async def scenario() -> tuple[float, float]:
        with credit_store(tmp_path, run_id) as b:
            store = b.store
            honest = [SigningKey.generate() for _ in range(4)]
            attacker = SigningKey.generate()
            padding = [SigningKey.generate() for _ in range(43)]  # never joined
            for k in (*honest, attacker):
                await store.admit(record(k))
            s = 5
            for k in (*honest, attacker):  # everyone at step s+1: the verified step passes s
                await b.beat(k, s + 1, state(s + 1))
            real = a_round([*honest, attacker], s, 16.0, run_id=run_id, now=b.now)
            attacked = [real[-1], *real[:-1], *a_round(padding, s, 16.0, run_id=run_id, now=b.now)]
            assert len(attacked) == 48
            await b.beat(attacker, s + 1, state(s + 1), [attacked])  # first to report after verification
            for k in honest:
                await b.beat(k, s + 1, state(s + 1), [real])
            return await b.credit(honest[0]), await b.credit(honest[1])

    c0, c1 = run(scenario())
    assert c0 == 16 and c1 == 16, (c0, c1)  # padding with strangers' entries no longer lowers the share


# --- 6. credit lost for good when the verified step lags by more than 3 applied rounds -----------------


def test_a_peer_reports_each_of_its_last_16_rounds_in_turn_so_a_lagging_verified_step_loses_no_credit():
    """Before, a heartbeat carried only the last 3 applied rounds, and only rounds below the verified step
    are credited: with the verified step held back (Sybils reporting junk hashes, the rate limit, the
    checkpoint bound), 7 of 10 honest rounds were never credited. Now a peer keeps its last 16 rounds
    (the credit window) and its heartbeats carry 3 of them in turn."""
    key = SigningKey.generate()
    trainer = Trainer(tiny_run("rotation"), None, peer_id=key.peer_id, signing_key=key)
    for step in range(KEEP_WITNESSED_ROUNDS + 4):
        mine = entry(key, step, 16.0, run_id="rotation", now=time.time())
        trainer.peer.witness.record(
            SimpleNamespace(peer_ids=[key.peer_id, "other"], signed_entries=[mine, b"o" * 300])
        )
    seen = set()
    for _ in range(6):
        rounds = trainer.witnessed()
        assert len(rounds) == MAX_WITNESSED_ROUNDS
        seen |= {r[0] for r in rounds}
    assert len(seen) == KEEP_WITNESSED_ROUNDS, "every kept round was reported within 6 heartbeats"


# --- 7. long-stalled catch-up: one groupmate ahead plus Sybil records steer the victim -----------------


def test_a_long_stalled_victim_does_not_follow_its_one_attacker_groupmate_ahead():
    """Before (medium): the victim's last round had an honest majority (V, H1, H2 and attacker A). Stalled, it
    needs a strict majority of those groupmates, so A alone cannot move it. Stalled twice as long, only
    groupmates ahead vote (A alone), guarded only by "peers in view at my step <= peers ahead", which
    counts every certified key in view: two Sybil records ahead lift the guard, and the victim downloads
    A's made-up state from A. Now the groupmates ahead decide only what most peers in view ahead hold."""
    mates = Groupmates()
    mates.record(["H1", "H2", "A"], step=10)
    trusted = mates.recent(10)
    mine = Position(10, "h")
    honest_view = {"H1": Position(10, "h"), "H2": Position(10, "h"), "A": Position(11, "poison")}
    with_sybils = {**honest_view, "S1": Position(11, "x"), "S2": Position(12, "y")}
    # Stalled once: the honest majority of the last round holds; without Sybils the guard holds too.
    assert catch_up_target(mine, with_sybils, stalled=True, trusted=trusted) is None
    assert catch_up_target(mine, honest_view, stalled=True, trusted=trusted, long_stalled=True) is None
    assert catch_up_target(mine, with_sybils, stalled=True, trusted=trusted, long_stalled=True) is None
    # No Sybils needed when the run has moved on (the honest split the phase was made for): five honest
    # peers ahead agree on "good", but only groupmates vote, and A is the only one ahead.
    run_ahead = {**honest_view, **{f"G{i}": Position(11, "good") for i in range(5)}}
    assert catch_up_target(mine, run_ahead, stalled=True, trusted=trusted, long_stalled=True) is None


# --- 8. heartbeats: no rate limit, and up to 145 signature checks each on the event loop -----------------


def test_back_to_back_heartbeats_have_their_rounds_read_at_most_twice_an_interval(
    tmp_path: Path, monkeypatch
):
    """Before (medium): Heartbeat had no per-peer rate limit, and each may carry 3 rounds x 48 signed entries of
    up to 1 KiB that the coordinator opens synchronously in the handler (about 10 ms of CPU each here),
    where a heartbeat used to cost one signature check. Entries of keys that never joined are enough."""
    import coordinator.service

    run_id = "cpu-run"
    calls = {"n": 0, "reads": 0}
    verify, read = PublicKey.verify, coordinator.service.witnessed_rounds

    def counting(self, signature, data):
        calls["n"] += 1
        return verify(self, signature, data)

    def reading(*args, **kwargs):
        calls["reads"] += 1
        return read(*args, **kwargs)

    monkeypatch.setattr(coordinator.service, "witnessed_rounds", reading)

    async def scenario() -> tuple[int, float]:
        async with serving(tmp_path, run_id) as (address, store, service):
            attacker = SigningKey.generate()
            junk = [SigningKey.generate() for _ in range(47)]
            async with CoordinatorClient(address) as client:
                admission = await client.join(attacker, run_id, name="a", device="cpu", role="data")
                now = time.time()
                one = [entry(attacker, 3, 1.0, run_id=run_id, now=now, pad=600)]
                one += [entry(k, 3, 1.0, run_id=run_id, now=now, pad=600) for k in junk]
                monkeypatch.setattr(PublicKey, "verify", counting)
                accepted, started = 0, time.monotonic()
                for _ in range(30):
                    await client.heartbeat(
                        attacker, run_id, admission.coordinator_key, rounds=[one, one, one]
                    )
                    accepted += 1
                return accepted, time.monotonic() - started

    accepted, elapsed = run(scenario())
    assert accepted == 30  # heartbeats are never refused for it: a peer must not look offline
    # Its rounds are read at most twice a heartbeat interval (0.5 s here), however fast it beats: on a
    # busy machine the 30 heartbeats take longer, and so allow more reads.
    allowed = 1 + int(elapsed / 0.25)
    assert calls["reads"] <= min(allowed, 29), (calls["reads"], elapsed)
    # Each read is 145 signature checks; a heartbeat otherwise costs a few (envelope, answer).
    assert calls["n"] <= 145 * calls["reads"] + 3 * 30, calls


# --- 9. RefusalLog: the per-caller budget is evaded by cycling more callers than max_keys --------------


def test_refusal_log_has_a_budget_for_the_whole_process_too():
    """LOW. Keys are (RPC, error kind, caller /64). Cycling through max_keys + 1 IPv6 /64s evicts each
    caller's window before its next refusal, so every refusal starts a fresh window and is written out:
    40 refusals per caller in one minute are all logged, against a budget of 20."""
    lines: list[str] = []
    t = [0.0]
    log = RefusalLog(lines.append, per_window=20, window_s=60.0, max_keys=1024, clock=lambda: t[0])
    callers = [f"ipv6:%5B2001:db8:{i // 65536:x}:{i % 65536:x}::1%5D:443" for i in range(1025)]
    for _ in range(40):
        for c in callers:
            log.refused("Heartbeat", c, ValueError("junk"))
    written = [line for line in lines if line.startswith("refused ")]
    assert len(written) <= 200 + 2, len(written)  # a budget of lines for the whole process as well


# --- 10. a suspect rides into an honest member's round behind any leader that is not suspected ----------
