"""The coordinator's store: writes are atomic, credit follows the run's verified step, evidence of a
conviction is kept apart from the ban list, and the published ban list leaves out expired peers."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from pathlib import Path

import pytest

from coordinator.credit import CHECKPOINT_MARGIN_PERIODS
from coordinator.limits import ServiceLimits
from coordinator.service import CoordinatorService
from coordinator.store import PeerRecord, Store, ban_sync, unban_sync
from coordinator.witness import witnessed_rounds
from lab.localswarm import tiny_run
from protocols.envelope import seal
from protocols.keys import SigningKey
from protocols.messages import HeartbeatBody
from swarm.averaging.groups import GROUP_ENTRY

pytestmark = pytest.mark.timeout(60)


def peer(peer_id: str, *, cert_expires_at: float = 1e12, role: str = "data") -> PeerRecord:
    return PeerRecord(peer_id, b"k", peer_id, "cpu", role, "online", 0.0, 0.0, 0, 1, cert_expires_at)


def signed_round(
    keys: list[SigningKey], step: int, weights: list[float], *, run_id: str, now: float
) -> list[bytes]:
    """The signed group entries of one round, as a member's heartbeat carries them."""
    return [
        seal(k, GROUP_ENTRY, run_id, {"schema_hash": b"s" * 32, "weight": w, "commit": bytes(32), "extra": {"step": step}}, now=now)
        for k, w in zip(keys, weights, strict=True)
    ]  # fmt: skip


def run(coro):
    return asyncio.run(coro)


def test_a_heartbeat_and_its_credit_commit_together(tmp_path: Path):
    async def scenario() -> None:
        store = Store.open_sync(tmp_path / "c.db", "atomic", max_samples_per_step=32)
        try:
            for p in ("p", "q"):
                await store.admit(peer(p, role="stage"))  # a pipeline role, credited by what it reports
            await store.record_heartbeat("p", seq=1, seen_at=1.0, metrics={}, step=0, param_hash="")
            # The credit write fails (as a full disk would make it) after the heartbeat's own update.
            with sqlite3.connect(tmp_path / "c.db") as db:
                db.execute(
                    "CREATE TRIGGER fail BEFORE INSERT ON credit BEGIN SELECT RAISE(ABORT, 'disk full'); END"
                )
            with pytest.raises(sqlite3.IntegrityError):
                await store.record_heartbeat(
                    "p", seq=2, seen_at=2.0, metrics={"contributed_samples": 5.0}, step=0, param_hash="a" * 64
                )
            record = await store.get_peer("p")
            assert (record.last_seq, record.last_seen) == (1, 1.0), (
                "the heartbeat was rolled back with its credit"
            )
        finally:
            store.close()

    run(scenario())


def test_credit_never_passes_the_verified_step(tmp_path: Path):
    """Two Sybils that agree on a far step earn nothing for it: the step the run is verified at is one
    more than half the reporting peers agree on. (Pipeline roles, credited by what they report.)"""

    async def scenario() -> None:
        store = Store.open_sync(tmp_path / "c.db", "verified", max_samples_per_step=32)
        seq, clock = iter(range(1, 1000)), iter(range(1000))

        async def beat(peer_id: str, step: int, reported: float, param_hash: str) -> float:
            metrics = {"contributed_samples": reported}
            seen_at = 10.0 * next(clock)  # far slower than the verified step's rate limit
            await store.record_heartbeat(
                peer_id, seq=next(seq), seen_at=seen_at, metrics=metrics, step=step, param_hash=param_hash
            )
            return (await store.get_peer(peer_id)).contributed_samples

        honest, fake = "a" * 64, "f" * 64
        try:
            for p in ("h1", "h2", "h3", "s1", "s2"):
                await store.admit(peer(p, role="stage"))
            for p in ("h1", "h2", "h3", "s1", "s2"):
                await beat(p, 0, 0, honest)  # baselines
            for _ in range(2):  # a report made before the step was verified is merged on the next beat
                for p in ("h1", "h2", "h3"):
                    await beat(p, 2, 20, honest)  # each its share of two 32-sample rounds among three
            assert await store.verified_step() == 2
            assert [(await store.get_peer(p)).contributed_samples for p in ("h1", "h2", "h3")] == [20, 20, 20]
            # Two Sybils claim step 1,000,000 with the same made-up hash and a huge count.
            for p in ("s1", "s2"):
                assert await beat(p, 1_000_000, 1e12, fake) == 0
            assert await store.verified_step() == 2
            assert (await store.credit_refused()) == {}, (
                "a report ahead of the verified step waits; it is not refused"
            )
            # The honest majority moves on; its credit follows.
            for _ in range(2):
                for p in ("h1", "h2", "h3"):
                    await beat(p, 3, 30, honest.replace("a", "b"))
            assert await store.verified_step() == 3
            assert [(await store.get_peer(p)).contributed_samples for p in ("h1", "h2", "h3")] == [30, 30, 30]
            assert (await store.get_peer("s1")).contributed_samples == 0
        finally:
            store.close()

    run(scenario())


def test_data_parallel_credit_is_what_other_members_witnessed_and_a_freeloader_earns_nothing(tmp_path: Path):
    """Issue 25 item 6. Four honest peers each compute a quarter of every 64-sample round and report the
    round's signed entries; a fifth copies the step and hash it reads from Status and claims the whole
    batch each step. Before, it was credited 4.5 times an honest peer, then (bounded) up to twice; now
    credit is the weight a member signed in a round another member reports, so it earns nothing. Two
    Sybils that make up rounds for each other earn at most twice the average share of a step; a round
    reported again, or by a member of it that is not its reporter, is credited once."""
    target, steps, run_id = 64, 12, "witness"
    keys = {name: SigningKey.generate() for name in ("h1", "h2", "h3", "h4", "free", "s1", "s2")}
    honest = ["h1", "h2", "h3", "h4"]

    async def scenario() -> dict[str, float]:
        store = Store.open_sync(tmp_path / "c.db", run_id, max_samples_per_step=target)
        seq = iter(range(1, 100_000))
        now = time.time()
        try:
            for key in keys.values():
                await store.admit(peer(key.peer_id))
            for step in range(steps + 1):
                state = f"{step:064x}"
                done = signed_round([keys[p] for p in honest], step - 1, [16.0] * 4, run_id=run_id, now=now)
                fake = signed_round([keys["s1"], keys["s2"]], step - 1, [64.0, 64.0], run_id=run_id, now=now)
                for name in [*honest, "free", "s1", "s2"] * 2:  # every peer beats twice at each step
                    key = keys[name]
                    rounds = (
                        [done] if name in honest and step else [fake] if name in ("s1", "s2") and step else []
                    )
                    body = {"seq": next(seq), "state": "online", "step": step, "param_hash": state,
                            "metrics": {"contributed_samples": step * target}, "rounds": rounds}  # fmt: skip
                    parsed = HeartbeatBody.model_validate(body)
                    witnessed, refused = witnessed_rounds(
                        parsed.rounds, run_id=run_id, reporter=key.peer_id, now=now
                    )
                    assert not refused, refused
                    await store.record_heartbeat(
                        key.peer_id, seq=parsed.seq, seen_at=10.0 * next(seq), metrics=parsed.metrics,
                        step=step, param_hash=state, rounds=witnessed,
                    )  # fmt: skip
            return {
                name: (await store.get_peer(key.peer_id)).contributed_samples for name, key in keys.items()
            }
        finally:
            store.close()

    credit = run(scenario())
    assert credit["free"] == 0, credit
    # Every honest round below the verified step is credited once, whoever reports it and how often.
    assert all(credit[p] == credit["h1"] for p in honest) and credit["h1"] >= 16 * (steps - 3), credit
    assert credit["h1"] <= 16 * steps
    # The Sybils' made-up rounds: at most twice the average share of the 6 peers that took part in rounds
    # (the freeloader took part in none, so it dilutes nobody).
    assert 0 < credit["s1"] <= 2 * target / 6 * steps + 1e-9, credit


def test_a_witnessed_round_that_does_not_hold_together_credits_nobody_and_names_why():
    keys = [SigningKey.generate() for _ in range(3)]
    now = time.time()
    good = signed_round(keys, 4, [8.0] * 3, run_id="r", now=now)
    cases = {
        "a round of 1 member(s)": [good[:1]],
        "lists a member twice": [[good[0], good[1], good[1]]],
        "was not a member of": [good[1:]],
        "several steps": [[good[0], *signed_round(keys[1:], 5, [8.0] * 2, run_id="r", now=now)]],
        "rounds[0][1]": [[good[0], b"junk"]],
        "is no step": [[good[0], seal(keys[1], GROUP_ENTRY, "r", {"schema_hash": b"s" * 32, "weight": 1.0,
                                                                  "commit": bytes(32), "extra": {"step": True}})]],
        "another-run": [[good[0], *signed_round(keys[1:2], 4, [8.0], run_id="another-run", now=now)]],
    }  # fmt: skip
    for reason, rounds in cases.items():
        kept, refused = witnessed_rounds(rounds, run_id="r", reporter=keys[0].peer_id, now=now)
        assert kept == [] and len(refused) == 1 and reason in refused[0], (reason, refused)
    old = signed_round(keys, 4, [8.0] * 3, run_id="r", now=now - 2 * 3600)
    assert witnessed_rounds([old], run_id="r", reporter=keys[0].peer_id, now=now)[0] == []
    kept, _ = witnessed_rounds([good], run_id="r", reporter=keys[0].peer_id, now=now)
    assert [(e.peer_id, e.step, e.weight) for e in kept[0]] == [(k.peer_id, 4, 8.0) for k in keys]


def test_sybils_that_outnumber_the_honest_move_the_verified_step_only_at_the_run_s_pace(tmp_path: Path):
    """Two Sybils beside one honest peer are a majority of the reporters: the step they claim together
    (2**62) is not verified; the verified step moves at most the run's max_verified_steps_per_s (here 1)
    per second of the coordinator's clock, and never past the newest checkpoint's step plus its margin."""

    async def scenario() -> None:
        store = Store.open_sync(
            tmp_path / "c.db", "sybils", max_samples_per_step=32, max_verified_steps_per_s=1.0
        )
        seq = iter(range(1, 1000))

        async def beat(peer_id: str, step: int, param_hash: str, at: float, reported: float = 0) -> None:
            await store.record_heartbeat(
                peer_id, seq=next(seq), seen_at=at, metrics={"contributed_samples": reported}, step=step,
                param_hash=param_hash,
            )  # fmt: skip

        huge, fake = 2**62, "f" * 64
        try:
            for p in ("honest", "s1", "s2"):
                await store.admit(peer(p))
                await beat(p, 0, "a" * 64, at=1000.0)  # baselines; the rate is counted from here
            for at in (1000.5, 1020.0):
                for p in ("s1", "s2"):
                    await beat(p, huge, fake, at=at, reported=1e12)
            assert await store.verified_step() == 20
            for t in range(1021, 1121):
                for p in ("s1", "s2"):
                    await beat(p, huge, fake, at=float(t), reported=1e12)
                assert await store.verified_step() <= t - 1000
            assert await store.verified_step() == 120
            # They claim a step above the verified one, so their huge count earns them nothing.
            assert (await store.get_peer("s1")).contributed_samples == 0
            # A checkpoint bounds it however long the clock runs.
            store.follow_checkpoints(lambda: 100, every_steps=10)
            for p in ("s1", "s2"):
                await beat(p, huge, fake, at=1e6, reported=1e12)
            assert await store.verified_step() == 100 + CHECKPOINT_MARGIN_PERIODS * 10
        finally:
            store.close()

    run(scenario())


def test_evidence_is_kept_apart_and_bounded(tmp_path: Path):
    async def scenario() -> None:
        store = Store.open_sync(tmp_path / "c.db", "evidence")
        try:
            blob = bytes(range(256)) * (4 << 10)  # 1 MiB
            assert await store.ban("convicted", "lied", blob, max_stored_evidence_bytes=3 << 19)
            assert not await store.ban("second", "lied too", blob, max_stored_evidence_bytes=3 << 19)
            bans = {b.peer_id: b for b in await store.list_bans()}
            assert bans["convicted"].evidence_bytes == len(blob)
            assert bans["convicted"].evidence_preview == blob[:512]
            assert bans["second"].evidence_bytes == 0 and bans["second"].reason == "lied too"
            assert await store.ban_evidence("convicted") == blob
        finally:
            store.close()

    run(scenario())


def test_the_published_ban_list_leaves_out_expired_certificates(tmp_path: Path):
    async def scenario() -> None:
        store = Store.open_sync(tmp_path / "c.db", "enforced")
        now = time.time()
        try:
            await store.admit(peer("expired", cert_expires_at=now - 3600))
            await store.admit(peer("valid", cert_expires_at=now + 3600))
            for p in ("expired", "valid", "never-joined"):
                await store.ban(p, "x")
            # The newest ban first, so a fresh ban always makes the list.
            assert await store.enforced_bans(now, grace_s=600) == ["never-joined", "valid"]
            assert len(await store.list_bans()) == 3
        finally:
            store.close()

    run(scenario())


def test_divergence_flags_are_bounded(tmp_path: Path):
    async def scenario() -> None:
        store = Store.open_sync(tmp_path / "c.db", "flags")
        service = CoordinatorService(
            tiny_run("flags"), SigningKey.generate(), store, [], ServiceLimits(max_tracked_callers=16)
        )
        try:
            for i in range(40):
                await store.admit(peer(f"p{i}"))
                await store.record_heartbeat(
                    f"p{i}", seq=1, seen_at=0.0, metrics={}, step=5, param_hash=f"{i:064x}"
                )
            for step in (5, 6):
                for i in range(40):
                    await service._flag_divergence(f"p{i}", step)
            assert len(service._flagged) == 16
        finally:
            store.close()

    run(scenario())


def test_the_cli_bans_and_unbans_on_its_own_connection(tmp_path: Path):
    """`swarm-coordinator ban/unban` write with a plain sqlite3 connection, beside a running store."""

    async def scenario() -> None:
        store = Store.open_sync(tmp_path / "c.db", "cli")
        try:
            await store.ban("convicted", "lied", b"evidence", max_stored_evidence_bytes=1 << 20)
            db = sqlite3.connect(tmp_path / "c.db", timeout=10)
            try:
                ban_sync(db, "other", "banned by the organizer")
                assert unban_sync(db, "convicted") and not unban_sync(db, "never-banned")
            finally:
                db.close()
            assert [b.peer_id for b in await store.list_bans()] == ["other"]
            assert await store.ban_evidence("convicted") is None
        finally:
            store.close()

    run(scenario())


def test_suspicions_count_distinct_online_unbanned_credited_reporters_and_each_keeps_only_its_latest_list(
    tmp_path: Path,
):
    sybils = [f"sybil{i}" for i in range(8)]

    async def scenario() -> dict[str, int]:
        store = Store.open_sync(tmp_path / "c.db", "suspicions", max_samples_per_step=32)
        try:
            for p in ("a", "b", "c", "liar", "w", *sybils):
                await store.admit(peer(p))
            with sqlite3.connect(
                tmp_path / "c.db"
            ) as db:  # credit earned in rounds, as merge_credit keeps it
                db.executemany(
                    "INSERT INTO credit (peer_id, samples) VALUES (?, 64)",
                    [(p,) for p in ("a", "b", "c", "liar")],
                )

            async def beat(reporter: str, seq: int, suspects: list[str]) -> None:
                await store.record_heartbeat(reporter, seq=seq, seen_at=float(seq), metrics={}, step=0,
                                             param_hash="", suspects=suspects)  # fmt: skip

            await beat("a", 1, ["w", "a", "nobody-known"])  # itself and unknown peers are dropped
            await beat("b", 1, ["w", "w"])  # a repeat counts once
            await beat("c", 1, ["w", "b"])
            await beat("c", 2, ["w"])  # its new list replaces the old: "b" is no longer avoided by "c"
            await beat("liar", 1, ["a", "b", "c"])
            await store.ban("liar", "rehearsal")  # a banned reporter's word stops counting
            for sybil in sybils:  # fresh identities with no verified work: their word counts for nothing
                await beat(sybil, 1, ["a", "b", "c"])
            return await store.suspicion_counts()
        finally:
            store.close()

    assert run(scenario()) == {"w": 3}


def test_one_step_s_majority_hash_is_the_whole_table_s_at_that_step(tmp_path: Path):
    """A heartbeat's divergence check asks one step's majority (through the (step, param_hash) index, not a
    scan of every peer on every heartbeat): the same answer as the whole table's at that step."""

    async def scenario() -> None:
        store = Store.open_sync(tmp_path / "c.db", "majority", max_samples_per_step=32)
        try:
            reports = {
                "a": (3, "x"),
                "b": (3, "x"),
                "c": (3, "y"),
                "d": (4, "z"),
                "e": (4, "w"),
                "f": (4, "w"),
            }
            for seq, (p, (step, param_hash)) in enumerate(reports.items(), start=1):
                await store.admit(peer(p))
                await store.record_heartbeat(p, seq=seq, seen_at=float(seq), metrics={}, step=step,
                                             param_hash=param_hash * 64)  # fmt: skip
            whole = await store.majority_hashes()
            assert whole == {3: "x" * 64, 4: "w" * 64}
            for step in (3, 4, 5):
                assert await store.majority_hashes(step) == ({step: whole[step]} if step in whole else {})
        finally:
            store.close()

    run(scenario())
