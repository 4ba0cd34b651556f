"""The coordinator's unauthenticated and accusation endpoints under abuse, over real gRPC on loopback.

Each test serves the real ``CoordinatorService`` (real store, real limits) and mounts an attack from
``swarm.byzantine.abuse``: a stalled accuser must not hold up anyone else's accusation, accusations are
limited per peer, a false accusation leaves no evidence behind, and a challenge flood from one address
leaves joins from every other address working.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from pathlib import Path

import grpc
import pytest
from helpers import relay_from, serving_coordinator

from coordinator.limits import KeyedBuckets, RefusalLog, ServiceLimits, caller_key
from protocols import coordinator_pb2 as pb
from protocols.envelope import seal
from protocols.errors import NetworkError, ProtocolError
from protocols.keys import SigningKey
from protocols.messages import ACCUSE
from protocols.version import PROTOCOL_VERSION
from swarm.byzantine.abuse import challenge_flood, stalled_accusation
from swarm.byzantine.protocol_attacks import ProtocolTarget, make_protocol_attack
from swarm.coordinator_client import EVIDENCE_PIECE_BYTES as PIECE
from swarm.coordinator_client import SERVICE, CoordinatorClient
from swarm.rpc import CHANNEL_OPTIONS, error_from_rpc

pytestmark = pytest.mark.timeout(60)

RUN = "abuse-run"


def serving(tmp_path: Path, limits: ServiceLimits, run_id: str = RUN):
    """The real service, store and limits of a tiny run, served over gRPC on a loopback port."""
    return serving_coordinator(tmp_path, run_id, limits)


async def admitted(address: str, count: int, run_id: str = RUN) -> list[SigningKey]:
    keys = [SigningKey.generate() for _ in range(count)]
    async with CoordinatorClient(address) as client:
        for i, key in enumerate(keys):
            await client.join(key, run_id, name=f"peer{i}", device="cpu")
    return keys


async def accuse_raw(
    address: str,
    key: SigningKey,
    accused: str,
    evidence: bytes,
    *,
    signed_hash: bytes | None = None,
    run_id: str = RUN,
    gzip: bool = False,
) -> object:
    """An accusation whose signed hash (default: its evidence's) may differ from its evidence, in pieces
    as a volunteer sends them (gzip-compressed on the wire with ``gzip``); the answer or the refusal."""
    body = {
        "accused": accused,
        "reason": "test",
        "evidence_sha256": hashlib.sha256(evidence).digest() if signed_hash is None else signed_hash,
        "evidence_bytes": len(evidence),
    }
    header = pb.Header(protocol_version=PROTOCOL_VERSION, run_id=run_id)
    parts = [pb.AccusationPart(header=header, envelope=seal(key, ACCUSE, run_id, body))]
    parts += [
        pb.AccusationPart(evidence=evidence[i : i + PIECE]) for i in range(0, max(len(evidence), 1), PIECE)
    ]
    compression = grpc.Compression.Gzip if gzip else None
    async with grpc.aio.insecure_channel(
        address, options=CHANNEL_OPTIONS, compression=compression
    ) as channel:
        rpc = channel.stream_unary(
            SERVICE + "Accuse",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=pb.AccuseResponse.FromString,
        )
        try:
            return await rpc(iter(parts), timeout=60)
        except grpc.aio.AioRpcError as e:
            return error_from_rpc(e, address)


def test_a_stalled_accuser_holds_up_nobody_and_is_cut_off(tmp_path: Path):
    limits = ServiceLimits(evidence_read_timeout_s=3.0)

    async def scenario() -> None:
        async with serving(tmp_path, limits) as (address, store, service):
            staller, accuser, accused = await admitted(address, 3)
            started = time.monotonic()
            stalled = asyncio.create_task(
                stalled_accusation(address, staller, RUN, accused=accused.peer_id, hold_s=30)
            )
            await asyncio.sleep(0.5)  # the stalled stream is open and has sent its first parts
            assert not stalled.done()
            # Another peer's accusation is judged at once (garbage evidence: a false accusation).
            async with CoordinatorClient(address) as client:
                answer = await asyncio.wait_for(
                    client.accuse(accuser, RUN, accused=accused.peer_id, reason="x", evidence=b"\x01" * 4096),
                    timeout=5,
                )
            assert answer.banned_peer == accuser.peer_id and "false accusation" in answer.verdict
            assert time.monotonic() - started < 3.0, "judged while the stalled stream was still open"
            # The stall ends at the deadline with an error naming it, and holds nothing afterwards.
            refusal = await asyncio.wait_for(stalled, timeout=10)
            assert isinstance(refusal, ProtocolError) and "did not arrive within 3s" in str(refusal)
            assert service._evidence_budget.held == 0 and not service._accusing
            # Stalling cost the staller its remaining accusations.
            error = await accuse_raw(address, staller, accused.peer_id, b"x", signed_hash=bytes(32))
            assert isinstance(error, NetworkError) and "too many accusations" in str(error)
            # A false accusation's bytes prove nothing: they are not kept, and listing bans reads no blob.
            assert await store.ban_evidence(accuser.peer_id) is None
            bans = await store.list_bans()
            assert [(b.peer_id, b.evidence_bytes) for b in bans] == [(accuser.peer_id, 0)]
            assert await store.ban_reason(staller.peer_id) is None

    asyncio.run(scenario())


def test_accusations_are_limited_per_peer_and_wait_for_the_evidence_budget(tmp_path: Path):
    limits = ServiceLimits(
        accusation_burst_per_peer=2,
        accusation_refill_s=600,
        evidence_budget_bytes=1 << 20,
        evidence_read_timeout_s=5,
    )

    async def scenario() -> None:
        async with serving(tmp_path, limits) as (address, store, _service):
            spammer, other, target, staller = await admitted(address, 4)
            evidence = b"\x02" * 1000
            wrong = hashlib.sha256(b"not the evidence").digest()
            for _ in range(2):  # refused on their merits (hash mismatch), but each spends an accusation
                error = await accuse_raw(address, spammer, target.peer_id, evidence, signed_hash=wrong)
                assert isinstance(error, ProtocolError) and "signed hash" in str(error)
            error = await accuse_raw(address, spammer, target.peer_id, evidence, signed_hash=wrong)
            assert isinstance(error, NetworkError) and "too many accusations" in str(error)
            # The limit is the spammer's alone.
            error = await accuse_raw(address, other, target.peer_id, evidence, signed_hash=wrong)
            assert isinstance(error, ProtocolError) and "signed hash" in str(error)
            # While a stalled accusation holds the whole evidence budget, a new one waits its turn and
            # is judged once the stall's deadline frees the budget (here: a false one, so "other" is banned).
            stalled = asyncio.create_task(
                stalled_accusation(
                    address, staller, RUN, accused=target.peer_id, evidence_bytes=1 << 20,
                    sent_bytes=1000 << 10, hold_s=30,
                )
            )  # fmt: skip
            await asyncio.sleep(0.5)
            answer = await asyncio.wait_for(
                accuse_raw(
                    address, other, target.peer_id, evidence, signed_hash=hashlib.sha256(evidence).digest()
                ),
                timeout=10,
            )
            assert answer.banned_peer == other.peer_id
            assert isinstance(await asyncio.wait_for(stalled, timeout=10), ProtocolError)
            assert [b.peer_id for b in await store.list_bans()] == [other.peer_id]

    asyncio.run(scenario())


def test_a_challenge_flood_from_one_address_leaves_joins_open(tmp_path: Path):
    # A small global cap, so that the flood below would fill it if one caller could.
    limits = ServiceLimits(max_open_challenges=300)

    async def scenario() -> None:
        async with serving(tmp_path, limits) as (address, store, service):
            host, port = address.rsplit(":", 1)
            flood_relay = await relay_from("127.0.0.2", (host, int(port)))
            try:
                relay_address = f"127.0.0.1:{flood_relay.sockets[0].getsockname()[1]}"
                report = await challenge_flood(relay_address, RUN, calls=400, concurrency=16)
            finally:
                flood_relay.close()
            assert report.granted <= limits.challenge_burst_per_caller + 2
            assert report.refused >= 400 - limits.challenge_burst_per_caller - 2
            assert any("too many join challenges from 127.0.0.2" in r for r in report.refusals)
            assert set(service._open_by_caller) == {"127.0.0.2"}
            # Peers from another address join as if nothing happened.
            keys = await admitted(address, 3)
            assert {p.peer_id for p in await store.list_peers()} == {k.peer_id for k in keys}

    asyncio.run(scenario())


def test_cheap_identities_from_one_address_leave_the_coordinator_usable(tmp_path: Path):
    """Issue 25 item 6 as ``swarm-sim --protocol-attack coordinator_sybils`` mounts it: from another
    address, Sybils join with the longest names, heartbeat 64 long metrics, a huge ``contributed_samples``
    and every honest peer as a suspect, flood challenges, stall an accusation and ban themselves. The
    honest peers keep heartbeating, a new one still joins, ``Status`` still answers in pages, and every
    Sybil that accused itself is banned."""

    async def scenario() -> None:
        async with serving(tmp_path, ServiceLimits()) as (address, store, service):
            honest = await admitted(address, 2)
            host, port = address.rsplit(":", 1)
            relay = await relay_from("127.0.0.2", (host, int(port)))
            attack = make_protocol_attack(
                "coordinator_sybils", {"joins_per_mount": 6, "challenges_per_mount": 32}
            )
            target = ProtocolTarget(None, RUN, coordinator=f"127.0.0.1:{relay.sockets[0].getsockname()[1]}")
            try:
                sent = 0
                for _ in range(4):
                    sent += await asyncio.wait_for(attack.mount(target), 30)
                    await asyncio.sleep(1.1)  # the per-address join rate refills
            finally:
                await attack.close()
                relay.close()
            assert sent > 100 and attack.refused > 0 and attack.keys, (sent, attack.refused)
            async with CoordinatorClient(address) as client:
                for key in honest:
                    answer = await client.heartbeat(key, RUN, service.key.public_key, step=3)
                    assert answer.state == "online"
                newcomer = await admitted(address, 1)
                page = await client.status(RUN, max_peers=8)
                everyone = await client.full_status(RUN)
            assert len(page.peers) == 8 and page.next_after_peer_id and page.ByteSize() < 64 << 10
            rows = {p.peer_id: p for p in everyone.peers}
            assert {k.peer_id for k in [*honest, *newcomer]} <= rows.keys()
            banned = {p for p, row in rows.items() if row.state == "banned"}
            assert len(banned) == 4, "at each mount one Sybil accused itself and was banned"
            assert not banned & {k.peer_id for k in [*honest, *newcomer]}

    asyncio.run(scenario())


def test_a_flood_of_refused_requests_writes_a_bounded_number_of_log_lines():
    """Before, each refusal was a log line: the 400 refused challenges above wrote 400 lines, so a caller
    could fill the organizer's disk at the rate it was refused. Now at most 20 a minute per RPC and kind
    of error, then one line counting the rest; another kind of refusal is still logged."""
    lines: list[str] = []
    now = [0.0]
    log = RefusalLog(lines.append, per_window=20, window_s=60.0, clock=lambda: now[0])
    for i in range(10_000):
        now[0] = i * 0.005  # 10,000 refusals in 50 s
        log.refused("Challenge", "ipv4:127.0.0.2:1", NetworkError("too many join challenges from 127.0.0.2"))
    assert len(lines) == 20 and all(
        line.startswith("refused Challenge from ipv4:127.0.0.2:1") for line in lines
    )
    log.refused("Join", "ipv4:127.0.0.3:1", ProtocolError("field 'name': too long"))
    assert lines[-1] == "refused Join from ipv4:127.0.0.3:1: field 'name': too long"
    now[0] = 61.0
    log.refused("Challenge", "ipv4:127.0.0.2:1", NetworkError("too many join challenges from 127.0.0.2"))
    assert lines[-2] == "9980 more refusals of Challenge (NetworkError) from 127.0.0.2 in 61s were not logged"
    assert lines[-1].startswith("refused Challenge from") and len(lines) == 23
    # Another caller's refusals of the same kind are logged however much the first one floods, and a
    # flood that stops is summed up by the next refusal of any kind once its window has passed.
    log.refused("Challenge", "ipv4:203.0.113.7:1", NetworkError("too many join challenges from 203.0.113.7"))
    assert lines[-1].startswith("refused Challenge from ipv4:203.0.113.7:1")
    for i in range(100):
        now[0] = 62.0 + i * 0.01
        log.refused("Challenge", "ipv4:127.0.0.2:1", NetworkError("too many join challenges from 127.0.0.2"))
    now[0] = 3600.0
    log.refused("Join", "ipv4:127.0.0.4:1", ProtocolError("field 'name': too long"))
    assert "81 more refusals of Challenge (NetworkError) from 127.0.0.2" in "\n".join(lines[-3:])


def test_caller_keys_and_bounded_buckets():
    assert caller_key("ipv4:203.0.113.7:5555") == "203.0.113.7"
    assert caller_key("ipv6:[2001:db8:1:2:3:4:5:6]:5555") == "2001:db8:1:2::/64"
    # grpc percent-encodes the brackets; every port of one /64 is one caller
    assert caller_key("ipv6:%5B2001:db8:1:2:3:4:5:6%5D:5555") == "2001:db8:1:2::/64"
    assert caller_key("ipv6:%5B2001:db8:1:2:ffff::1%5D:1") == "2001:db8:1:2::/64"
    assert caller_key("ipv6:[::ffff:203.0.113.7]:1") == "203.0.113.7"
    assert caller_key("unix:/tmp/sock") == "unix:/tmp/sock"
    now = [0.0]
    buckets = KeyedBuckets(burst=2, refill_s=10.0, max_keys=4, clock=lambda: now[0])
    assert [buckets.take("a") for _ in range(3)] == [True, True, False]
    now[0] = 10.0
    assert buckets.take("a") and not buckets.take("a")
    for i in range(100):
        buckets.take(f"caller{i}")
    assert len(buckets) == 4
