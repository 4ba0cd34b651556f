"""Validators: after a round, members drawn by the group's shared randomness recompute reducers' work.

The draw comes from nonces every member committed to in matchmaking and revealed in its first chunk
(``ButterflyAllReduce.shared_seed``), so no member picks who checks whom. For each part the draw names
one other member as its validator, which with probability ``probability`` asks the reducer for the
signed inputs of one drawn chunk and recomputes the aggregate (``BadAggregateEvidence.judge``). A
wrong aggregate becomes an accusation carrying that evidence, which the coordinator checks for itself.
A reducer that cannot show valid inputs is reported in the log only: that much cannot be proven.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from hivemind.p2p import P2P, PeerID, ServicerBase

from protocols import averaging_pb2 as apb
from protocols.errors import ProtocolError, SwarmError
from swarm.averaging.aggregators import AggregatorFn
from swarm.averaging.allreduce import ButterflyAllReduce
from swarm.averaging.compression import Codec
from swarm.averaging.evidence import BadAggregateEvidence, SignedInput

logger = logging.getLogger(__name__)

Accuser = Callable[[str, BadAggregateEvidence, str], Awaitable[None]]


@dataclass(frozen=True)
class Assignment:
    part: int
    chunk: int


def assignments(
    seed: bytes, members: int, me: int, probability: float, chunks: list[int]
) -> list[Assignment]:
    """The parts this member validates in a round, each with the chunk to check."""
    mine = []
    if members < 2 or probability <= 0:
        return mine
    for part in range(members):
        draw = hashlib.sha256(seed + part.to_bytes(4, "big")).digest()
        validator = (part + 1 + int.from_bytes(draw[:8], "big") % (members - 1)) % members
        chosen = int.from_bytes(draw[8:16], "big") / 2**64 < probability
        if validator == me and chosen and part != me and chunks[part] > 0:
            mine.append(Assignment(part, int.from_bytes(draw[16:24], "big") % chunks[part]))
    return mine


async def serve_inputs(
    runner: ButterflyAllReduce | None, request: apb.InputsRequest, sender: PeerID
) -> AsyncIterator[apb.SignedInput]:
    """A reducer's answer to a validator: the signed inputs it aggregated into one chunk of its part."""
    if runner is None:
        yield apb.SignedInput(code=apb.NO_EVIDENCE, error="no recent round with this group ID here")
        return
    if sender not in runner.peer_ids:
        yield apb.SignedInput(code=apb.NOT_IN_GROUP, error="only members of the round may ask for its inputs")
        return
    if not 0 <= request.chunk_index < len(runner.evidence) or not runner.evidence[request.chunk_index]:
        yield apb.SignedInput(code=apb.BAD_CHUNK, error=f"no chunk {request.chunk_index} in this part")
        return
    for item in runner.evidence[request.chunk_index]:
        yield apb.SignedInput(
            sender_index=item.sender_index, data=item.data, signature=item.signature, weight=item.weight
        )


async def check_reducer(
    runner: ButterflyAllReduce,
    assignment: Assignment,
    *,
    servicer_type: type[ServicerBase],
    p2p: P2P,
    aggregator: AggregatorFn,
    codec: Codec,
    timeout_s: float,
) -> tuple[str | None, BadAggregateEvidence | None]:
    """Recompute one chunk of a reducer's part: (what it did wrong, the evidence), or (None, None)."""
    part, chunk = assignment.part, assignment.chunk
    answer = runner.answers[part][chunk]
    lo, hi = runner._chunk(part, chunk)
    reducer = runner.peer_ids[part]
    stub = servicer_type.get_stub(p2p, reducer, namespace=runner.prefix)
    inputs: list[SignedInput] = []
    max_bytes = (hi - lo) * codec.bytes_per_value
    request = apb.InputsRequest(group_id=runner.group_id, chunk_index=chunk)

    async def collect() -> None:
        async for item in await stub.rpc_round_inputs(request):
            if item.code != apb.OK:
                raise ProtocolError(f"answered {apb.Code.Name(item.code)}: {item.error}")
            if len(inputs) >= len(runner.peer_ids) or len(item.data) > max_bytes:
                raise ProtocolError("sent more inputs, or larger ones, than the round had")
            if item.sender_index >= len(runner.peer_ids):
                raise ProtocolError(f"sent an input of member {item.sender_index} of {len(runner.peer_ids)}")
            inputs.append(SignedInput(item.sender_index, item.data, item.signature, item.weight))

    try:
        await asyncio.wait_for(collect(), timeout_s)
        evidence = BadAggregateEvidence(
            prefix=runner.prefix, group_id=runner.group_id, members=tuple(runner.members), part=part,
            chunk=chunk, numel=hi - lo, inputs=tuple(inputs), output=answer.data,
            output_signature=answer.signature, included=answer.included,
        )  # fmt: skip
        verdict = await asyncio.to_thread(evidence.judge, aggregator, codec)
    except (SwarmError, asyncio.TimeoutError) as e:
        logger.warning(
            f"reducer {reducer.to_base58()} could not show valid inputs of part {part} chunk {chunk} "
            f"in round {runner.group_id.hex()[:8]}: {e!r}"
        )
        return None, None
    except Exception as e:  # a dead or misbehaving stream
        logger.warning(f"asking reducer {reducer.to_base58()} for its inputs failed: {e!r}")
        return None, None
    if verdict is None:
        logger.debug(f"verified part {part} chunk {chunk} of round {runner.group_id.hex()[:8]}")
        return None, None
    logger.warning(f"reducer {reducer.to_base58()} {verdict} in round {runner.group_id.hex()[:8]}")
    return verdict, evidence
