"""Protocol-level attacks on the coordinator, for rehearsal: what a caller can try besides bad gradients.

- ``stalled_accusation``: an admitted peer opens an Accuse stream, sends its signed first part and a
  little evidence, then sends nothing and keeps the stream open (once, this held the coordinator's
  only judging lock, so no other accusation could be judged);
- ``challenge_flood``: anyone, without a key, asks for join challenges as fast as it can (once, 10,000
  of them a minute filled the table of open challenges and nobody could join).

Each returns what the coordinator answered, so a rehearsal can assert the attack achieved nothing:
the stall is cut off at the coordinator's deadline, the flood is refused past its caller's share.

Example::

    report = await challenge_flood("127.0.0.1:31330", "my-run", calls=2000)
    print(report.granted, report.refused)
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import grpc

from protocols import coordinator_pb2 as pb
from protocols.envelope import seal
from protocols.errors import SwarmError
from protocols.keys import SigningKey
from protocols.messages import ACCUSE
from protocols.version import PROTOCOL_VERSION
from swarm.rpc import CHANNEL_OPTIONS, error_from_rpc

SERVICE = "/swarm.coordinator.v1.Coordinator/"


async def stalled_accusation(
    address: str,
    key: SigningKey,
    run_id: str,
    *,
    accused: str,
    evidence_bytes: int = 1 << 20,
    sent_bytes: int = 64 << 10,
    hold_s: float = 600.0,
) -> SwarmError | pb.AccuseResponse:
    """Sign an accusation for ``evidence_bytes`` of evidence, send ``sent_bytes`` of it and stall for up
    to ``hold_s``; returns the coordinator's refusal (or, should it ever judge, its verdict)."""
    evidence = os.urandom(evidence_bytes)
    body = {
        "accused": accused,
        "reason": "stalled on purpose",
        "evidence_sha256": hashlib.sha256(evidence).digest(),
        "evidence_bytes": evidence_bytes,
    }
    header = pb.Header(protocol_version=PROTOCOL_VERSION, run_id=run_id)
    first = pb.AccusationPart(header=header, envelope=seal(key, ACCUSE, run_id, body))
    stall = asyncio.Event()

    async def parts() -> AsyncIterator[pb.AccusationPart]:
        yield first
        yield pb.AccusationPart(evidence=evidence[:sent_bytes])
        await asyncio.wait_for(stall.wait(), hold_s)

    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        rpc = channel.stream_unary(
            SERVICE + "Accuse",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=pb.AccuseResponse.FromString,
        )
        try:
            return await rpc(parts(), timeout=hold_s)
        except grpc.aio.AioRpcError as e:
            return error_from_rpc(e, address)


@dataclass(frozen=True)
class FloodReport:
    """What ``challenge_flood`` got back: how many join challenges were granted and refused, and the
    distinct reasons for the refusals."""

    granted: int
    refused: int
    refusals: tuple[str, ...]  # the distinct reasons given, first 8


async def challenge_flood(
    address: str, run_id: str, *, calls: int, concurrency: int = 32, timeout_s: float = 10.0
) -> FloodReport:
    """Ask for ``calls`` join challenges over one connection, ``concurrency`` at a time."""
    header = pb.Header(protocol_version=PROTOCOL_VERSION, run_id=run_id)
    request = pb.ChallengeRequest(header=header).SerializeToString()
    granted, reasons = 0, []
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        rpc = channel.unary_unary(SERVICE + "Challenge")

        async def one() -> None:
            nonlocal granted
            try:
                await rpc(request, timeout=timeout_s)
                granted += 1
            except grpc.aio.AioRpcError as e:
                reasons.append(str(error_from_rpc(e, address)))

        await _bounded(calls, concurrency, one)
    distinct = tuple(dict.fromkeys(reasons))[:8]
    return FloodReport(granted=granted, refused=len(reasons), refusals=distinct)


async def _bounded(calls: int, concurrency: int, one: Callable[[], Awaitable[None]]) -> None:
    remaining = iter(range(calls))

    async def worker() -> None:
        for _ in remaining:
            await one()

    await asyncio.gather(*(worker() for _ in range(max(1, min(concurrency, calls)))))


ABUSES = {"stalled_accuser": stalled_accusation, "challenge_flood": challenge_flood}
