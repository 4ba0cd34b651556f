"""Findings of an attacker's read of the coordinator's judging, now regression tests (each failed before
its fix): stage evidence against a replica banned meanwhile still convicts its guilty stage-mate, and a
junk accusation of millions of nested values neither stops the event loop nor is decoded whole.

Real service, store and limits over gRPC on loopback.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import msgpack
import pytest
from helpers import serving_coordinator
from test_accuse_abuse import accuse_raw, admitted

from coordinator.limits import ServiceLimits
from lab.localswarm import tiny_run
from protocols.codec import unpack
from protocols.errors import ProtocolError
from protocols.keys import SigningKey
from swarm.coordinator_client import CoordinatorClient

pytestmark = pytest.mark.timeout(120)

RUN = "judging-redteam"


def serving(tmp_path: Path, run, limits: ServiceLimits | None = None, **options):
    return serving_coordinator(tmp_path, run, limits, service_options=options)


async def accuse(
    address: str, key: SigningKey, accused: str, evidence: bytes, run_id: str = RUN, *, gzip: bool = False
) -> object:
    return await accuse_raw(address, key, accused, evidence, run_id=run_id, gzip=gzip)


async def admitted_keys(address: str, run_id: str, keys: list[SigningKey]) -> None:
    async with CoordinatorClient(address) as client:
        for i, key in enumerate(keys):
            await client.join(key, run_id, name=f"peer{i}", device="cpu")


def test_stage_evidence_against_a_replica_banned_meanwhile_still_convicts_its_guilty_stage_mate(
    tmp_path: Path,
):
    """Was MEDIUM. Stage evidence may convict the accused's stage-mate instead of the accused (a trainer
    accuses the replica it checked first; the recompute says which reply was wrong). An accusation against
    a peer already banned was answered "already banned" without being judged, so a poisoner whose second,
    honest-looking replica got itself banned (one junk accusation) went free when a trainer's check paired
    the two. Now only a sender check, which replays the accused's own work, is skipped once the accused
    is banned; other evidence is judged, and here convicts the poisoner."""
    from test_stage_verification import Held, Replica, checker, run_config, through, trainer_key

    from swarm.byzantine.attacks import make_attack

    run = run_config()
    trainer = trainer_key()
    sacrificed = Replica(run, 0)  # the poisoner's second replica: answers honestly, is checked first
    poison = Replica(run, 0, attack=make_attack("stage_poison", group_size=3, attackers=1))
    held = Held(sacrificed.replica)

    async def scenario() -> None:
        check = checker(run, trainer, {r.key.peer_id: r for r in (sacrificed, poison)})
        evidence = await check.check(
            0, poison.key.peer_id, 2, await through(sacrificed, trainer, run, 1, seed=1)
        )
        assert evidence is not None  # filed against the replica checked first: the honest-looking one
        async with serving(tmp_path, run, stage_checkpoint=lambda stage: held) as (address, store, service):
            await admitted_keys(address, run.run_id, [trainer, sacrificed.key, poison.key])
            junk = await accuse(address, sacrificed.key, poison.key.peer_id, b"junk", run.run_id)
            assert junk.banned_peer == sacrificed.key.peer_id  # it got itself banned
            answer = await accuse(address, trainer, sacrificed.key.peer_id, evidence.to_bytes(), run.run_id)
            assert answer.banned_peer == poison.key.peer_id, answer
            assert await store.ban_reason(poison.key.peer_id) is not None, "the poisoner is banned"

    asyncio.run(scenario())


@pytest.mark.timeout(90)
def test_a_junk_accusation_of_millions_of_nested_values_is_refused_without_stopping_the_event_loop(
    tmp_path: Path,
):
    """Was HIGH. The judge read the evidence's kind by decoding the whole of it on the event loop: msgpack
    bounds each container (4,096 items) and the nesting, not the values in all, and the structure check
    then walked every one in Python. 32 MiB of nested lists (about 100 KB gzip-compressed on the wire)
    stopped the event loop for seconds (15 s for 48 MiB), each for one cheap identity. Now the kind is
    read without decoding the rest, the evidence is decoded on a thread, and a decode counts the values
    before it builds any (``MAX_EVIDENCE_ITEMS``): the sender is banned as a false accuser at once."""
    nested = msgpack.packb({"kind": "junk", "items": [[[0] * 4096] * 4096] * 2})  # 32 Mi values
    assert len(nested) > 32 << 20
    limits = ServiceLimits(evidence_read_timeout_s=60.0)

    async def scenario() -> None:
        async with serving(tmp_path, tiny_run(RUN), limits) as (address, _store, service):
            sender, accused = await admitted(address, 2, RUN)
            assert service._layouts
            gaps, stop = [], asyncio.Event()

            async def ticker() -> None:
                loop = asyncio.get_running_loop()
                last = loop.time()
                while not stop.is_set():
                    await asyncio.sleep(0.05)
                    gaps.append(loop.time() - last)
                    last = loop.time()

            ticking = asyncio.create_task(ticker())
            try:
                answer = await accuse(address, sender, accused.peer_id, nested, gzip=True)
            finally:
                stop.set()
                await ticking
            assert answer.banned_peer == sender.peer_id and "values in all" in answer.verdict, answer
            assert max(gaps) < 1.0, f"the event loop stopped for {max(gaps):.1f}s at once"

    started = time.monotonic()
    asyncio.run(scenario())
    assert time.monotonic() - started < 60


def test_a_decode_with_a_bound_on_its_values_refuses_past_it_and_keeps_what_fits():
    fits = {"kind": "k", "inputs": [{"weight": 1.0, "data": b"x" * 1000} for _ in range(100)]}
    assert unpack(msgpack.packb(fits), max_items=1 + 4 + 100 * 5) == fits
    with pytest.raises(ProtocolError, match="holds more than 504 values in all"):
        unpack(msgpack.packb(fits), what="evidence", max_items=504)
    with pytest.raises(ProtocolError, match="malformed"):
        unpack(msgpack.packb(fits)[:-3], max_items=10_000)  # truncated: named by the decode
