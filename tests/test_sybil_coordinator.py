"""The coordinator under cheap Sybils (open admission: many identities per address), over real gRPC on
loopback with the real service, store and limits.

Stalled accusations cannot keep a true one out, a table of Sybils with long metric names cannot push
``Status`` past gRPC's cap or stop anyone joining, and self-banned Sybils cannot push a fresh
conviction off the published ban list. The standing the coordinator signs into heartbeat answers
names only peers with credit, so Sybils without witnessed work have no say in catch-up.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from helpers import relay_from
from test_accuse_abuse import admitted as abuse_admitted
from test_accuse_abuse import serving as abuse_serving
from test_byzantine import RUN, signed_round

from coordinator.limits import ServiceLimits
from coordinator.service import CoordinatorService
from protocols.errors import NetworkError, ProtocolError
from protocols.keys import SigningKey
from protocols.messages import MAX_METRICS
from swarm.bans import MAX_BANNED
from swarm.byzantine.abuse import stalled_accusation
from swarm.coordinator_client import CoordinatorClient
from swarm.standing import Standing
from swarm.training.catchup import Position, catch_up_target

pytestmark = pytest.mark.timeout(90)


def serving(tmp_path: Path, limits: ServiceLimits):
    return abuse_serving(tmp_path, limits, RUN)


async def admitted(address: str, count: int) -> list[SigningKey]:
    return await abuse_admitted(address, count, RUN)


async def true_accusation(address: str, service: CoordinatorService, accuser, cheater, third) -> object:
    """A member's true accusation: the cheater reduced part 1 and shifted it."""
    vector = service._layouts[RUN.replace(".", "_")]
    evidence = signed_round([accuser, cheater, third], shift=0.5, part=1, vector=vector).to_bytes()
    async with CoordinatorClient(address, timeout_s=30) as client:
        return await client.accuse(accuser, RUN, accused=cheater.peer_id, reason="shifted", evidence=evidence)


def test_stalled_accusations_neither_refuse_nor_outlast_a_true_one(tmp_path: Path):
    limits = ServiceLimits(evidence_budget_bytes=4 << 20, evidence_read_timeout_s=4.0)

    async def scenario() -> None:
        async with serving(tmp_path, limits) as (address, store, service):
            accuser, cheater, third, *stallers = await admitted(address, 3 + 8)
            assert service._layouts  # built now: the first judgement would otherwise build the model
            host, port = address.rsplit(":", 1)
            relay = await relay_from("127.0.0.2", (host, int(port)))
            stalled_at = f"127.0.0.1:{relay.sockets[0].getsockname()[1]}"
            try:
                # Four Sybils from another address each sign for 1 MiB and send 64 KiB: once, the four
                # declared sizes reserved the whole budget and the true accusation below was refused.
                stalls = [
                    asyncio.create_task(
                        stalled_accusation(
                            stalled_at, k, RUN, accused=third.peer_id, evidence_bytes=1 << 20, hold_s=30
                        )
                    )
                    for k in stallers[:4]
                ]
                await asyncio.sleep(1.0)
                assert not any(t.done() for t in stalls)
                assert service._evidence_budget.held <= 4 * (64 << 10)
                answer = await true_accusation(address, service, accuser, cheater, third)
                assert answer.banned_peer == cheater.peer_id and "differs" in answer.verdict
                for refusal in await asyncio.gather(*stalls):
                    assert isinstance(refusal, ProtocolError) and "did not arrive within 4s" in str(refusal)
                assert service._evidence_budget.held == 0
                # Four that send nearly all they signed for fill the budget: a true accusation waits its
                # turn (until their deadlines cut them off) instead of being refused.
                stalls = [
                    asyncio.create_task(
                        stalled_accusation(
                            stalled_at, k, RUN, accused=accuser.peer_id, evidence_bytes=1 << 20,
                            sent_bytes=1000 << 10, hold_s=30,
                        )
                    )
                    for k in stallers[4:]
                ]  # fmt: skip
                await asyncio.sleep(1.0)
                assert service._evidence_budget.held == 4 * (1000 << 10)
                second = await true_accusation(address, service, third, accuser, stallers[0])
                assert second.banned_peer == accuser.peer_id
                await asyncio.gather(*stalls)
                assert service._evidence_budget.held == 0
            finally:
                relay.close()
            assert {b.peer_id for b in await store.list_bans()} == {cheater.peer_id, accuser.peer_id}

    asyncio.run(scenario())


def test_sybils_queued_behind_a_long_recompute_cannot_put_a_victims_accusation_last(
    tmp_path: Path, monkeypatch
):
    """Recomputes ran first come first served behind one lock: twenty Sybils from one address convicting
    each other behind a long one (a DiLoCo window's replay) put a victim's true accusation from another
    address twenty-first. Now caller addresses take turns: the victim's is third."""
    import coordinator.accusations as accusations

    limits = ServiceLimits(challenge_burst_per_caller=1000, open_challenges_per_caller=1000)
    real, judged = accusations.judge, []

    def judge(run, layouts, data, accused, accuser):  # the recompute, on its thread, holding the lock
        judged.append(accused)
        if len(judged) == 1:
            time.sleep(4.0)  # a replay: the others queue meanwhile
        return real(run, layouts, data, accused, accuser)

    monkeypatch.setattr(accusations, "judge", judge)

    async def scenario() -> None:
        async with serving(tmp_path, limits) as (address, store, service):
            keys = await admitted(address, 6 + 3 * 20)
            (slow_accuser, slow_cheater, victim, cheater, third, fourth), sybils = keys[:6], keys[6:]
            assert service._layouts
            host, port = address.rsplit(":", 1)
            relay = await relay_from("127.0.0.2", (host, int(port)))
            sybil_at = f"127.0.0.1:{relay.sockets[0].getsockname()[1]}"
            try:
                slow = asyncio.create_task(
                    true_accusation(address, service, slow_accuser, slow_cheater, third)
                )
                deadline = time.monotonic() + 20
                while not judged and time.monotonic() < deadline:
                    await asyncio.sleep(0.02)
                trios = [sybils[i : i + 3] for i in range(0, len(sybils), 3)]
                queued = [asyncio.create_task(true_accusation(sybil_at, service, *trio)) for trio in trios]
                while service._judging.waiting < len(trios) and time.monotonic() < deadline:
                    await asyncio.sleep(0.02)
                assert service._judging.waiting == len(trios), "every Sybil accusation waits its turn"
                answer = await true_accusation(address, service, victim, cheater, fourth)
                assert answer.banned_peer == cheater.peer_id and "differs" in answer.verdict
                assert judged.index(cheater.peer_id) == 2, (
                    "the victim's address took the turn after one Sybil's"
                )
                assert (await slow).banned_peer == slow_cheater.peer_id
                answers = await asyncio.gather(*queued)
                assert {a.banned_peer for a in answers} == {trio[1].peer_id for trio in trios}
            finally:
                relay.close()
            assert service._evidence_budget.held == 0 and not service._judging.locked()

    asyncio.run(scenario())


def test_one_address_holds_at_most_its_share_of_the_evidence_budget(tmp_path: Path):
    limits = ServiceLimits(evidence_share_per_address_bytes=2 << 20, evidence_read_timeout_s=3.0)

    async def scenario() -> None:
        async with serving(tmp_path, limits) as (address, _store, service):
            target, *stallers = await admitted(address, 4)
            stalls = [
                asyncio.create_task(
                    stalled_accusation(
                        address, k, RUN, accused=target.peer_id, evidence_bytes=1 << 20, sent_bytes=1000 << 10,
                        hold_s=30,
                    )
                )
                for k in stallers
            ]  # fmt: skip
            refusals = await asyncio.gather(*stalls)
            over = [r for r in refusals if isinstance(r, NetworkError)]
            assert len(over) == 1 and "one address may hold" in str(over[0])
            assert service._evidence_budget.held == 0

    asyncio.run(scenario())


def test_sybils_with_long_metric_names_leave_status_bounded_and_joins_open(tmp_path: Path):
    sybils = 300
    limits = ServiceLimits(challenge_burst_per_caller=1000, open_challenges_per_caller=1000)
    metrics = {f"{i:02d}".ljust(64, "m"): 1.0 for i in range(MAX_METRICS)}

    async def scenario() -> None:
        async with serving(tmp_path, limits) as (address, store, service):
            keys = await admitted(address, sybils)
            async with CoordinatorClient(address) as client:
                for key in keys:
                    await client.heartbeat(key, RUN, service.key.public_key, metrics=metrics)
                await client.leave(keys[0], RUN)
                # Each Sybil row is ~5 KiB: 300 of them once made one Status answer past gRPC's 1 MiB.
                first = await client.status()
                assert first.total_peers == sybils and first.next_after_peer_id
                assert first.ByteSize() <= 512 << 10  # half of gRPC's cap
                # A volunteer with no run ID joins without reading the table (the challenge names the run).
                newcomer = SigningKey.generate()
                admission = await client.join(newcomer, "", name="newcomer", device="cpu")
                assert admission.run_spec["run_id"] == RUN
                # Every peer appears on exactly one page; the one that left was pruned at that join.
                seen: list[str] = []
                after = ""
                for _ in range(sybils):
                    page = await client.status(after_peer_id=after)
                    seen += [p.peer_id for p in page.peers]
                    after = page.next_after_peer_id
                    if not after:
                        break
                expected = {k.peer_id for k in keys[1:]} | {newcomer.peer_id}
                assert len(seen) == len(expected) and set(seen) == expected
                # `swarm-coordinator status` reads every page the same way.
                assert [p.peer_id for p in (await client.full_status()).peers] == seen
                with pytest.raises(ProtocolError, match="after_peer_id"):
                    await client.status(after_peer_id="x" * 200)

    asyncio.run(scenario())


def test_a_fresh_conviction_heads_a_ban_list_full_of_self_banned_sybils(tmp_path: Path):
    sybils = 20

    async def scenario() -> None:
        async with serving(tmp_path, ServiceLimits()) as (address, store, service):
            accuser, cheater, third, *keys = await admitted(address, 3 + sybils)
            async with CoordinatorClient(address) as client:
                for key in keys:  # each Sybil files a false accusation and bans itself
                    answer = await client.accuse(
                        key, RUN, accused=third.peer_id, reason="x", evidence=b"\x01" * 64
                    )
                    assert answer.banned_peer == key.peer_id
            answer = await true_accusation(address, service, accuser, cheater, third)
            assert answer.banned_peer == cheater.peer_id
            # The node publishes the first MAX_BANNED of this list; the conviction leads it however many
            # self-banned Sybils follow (once, the earliest bans came first and a new one fell off).
            enforced = await store.enforced_bans(time.time(), grace_s=600)
            assert enforced[0] == cheater.peer_id and len(enforced) == sybils + 1
            assert sybils < MAX_BANNED

    asyncio.run(scenario())


def test_a_conviction_of_a_key_that_never_joined_is_refused(tmp_path: Path):
    """Two Sybils could fabricate a round with a fresh key as its lying reducer: once, the conviction
    banned that key, which never held a certificate and so stayed on the ban list for good."""

    async def scenario() -> None:
        async with serving(tmp_path, ServiceLimits()) as (address, store, service):
            accuser, third = await admitted(address, 2)
            stranger = SigningKey.generate()
            with pytest.raises(ProtocolError, match="is not a peer of this run"):
                await true_accusation(address, service, accuser, stranger, third)
            assert await store.list_bans() == []

    asyncio.run(scenario())


def test_the_signed_standing_names_credited_peers_only_and_makes_catch_up_ignore_sybils(tmp_path: Path):
    """Issue 25 (catch-up that Sybils cannot steer), through the real service and client: the heartbeat
    answer carries the coordinator's signed standing (the credited samples of online, unbanned peers),
    only when newer than the peer's copy; a session keeps it and its catch-up weighs votes by it, so five
    Sybils announcing a made-up step beside three credited peers move nobody."""

    async def scenario() -> None:
        async with serving(tmp_path, ServiceLimits()) as (address, store, service):
            h1, h2, h3, convicted, *sybils = await admitted(address, 4 + 5)
            granted = {h1.peer_id: 300.0, h2.peer_id: 200.0, h3.peer_id: 100.0, convicted.peer_id: 500.0}

            def grant(db) -> None:  # as coordinator.credit grants it for witnessed rounds (test_store.py)
                for peer_id, samples in granted.items():
                    db.execute(
                        "INSERT INTO credit (peer_id, samples, step) VALUES (?, ?, 0)", (peer_id, samples)
                    )

            await store._run(grant)
            await store.ban(convicted.peer_id, "shifted a part it reduced")
            session = Standing()
            async with CoordinatorClient(address) as client:
                for key in sybils:
                    await client.heartbeat(key, RUN, service.key.public_key, step=6, param_hash="2" * 64)
                answer = await client.heartbeat(h1, RUN, service.key.public_key, standing_at=session.at)
                assert session.take(answer.standing_at, answer.standing)
                assert session.credit == {k: v for k, v in granted.items() if k != convicted.peer_id}
                again = await client.heartbeat(h1, RUN, service.key.public_key, standing_at=session.at)
                assert again.standing is None and not session.take(again.standing_at, again.standing)
                # Claiming to hold none gets it no second copy of the same standing (33 KiB each).
                assert (
                    await client.heartbeat(h1, RUN, service.key.public_key, standing_at=0)
                ).standing is None
            view = {**{k.peer_id: Position(5, "1" * 64) for k in (h1, h2, h3)},
                    **{k.peer_id: Position(6, "2" * 64) for k in sybils}}  # fmt: skip
            assert catch_up_target(Position(0, "3" * 64), view).state_hash == "2" * 64  # counting keys
            target = catch_up_target(Position(0, "3" * 64), view, credit=session.credit)
            assert target.state_hash == "1" * 64 and set(target.holders) == {
                h1.peer_id,
                h2.peer_id,
                h3.peer_id,
            }

    asyncio.run(scenario())
