"""Butterfly all-reduce in which every peer of the group ends with the same bits.

The vector is cut into one contiguous part per peer. Every peer streams its chunks of part ``k`` to
peer ``k``, which aggregates them with the run's rule and streams back the *encoded* result: the same
bytes to every sender, and the reducer decodes those very bytes for itself. hivemind's runner instead
adds compressed deltas to each peer's own values, which leaves peers differing in the low bits.

Faults: a sender that is silent for ``sender_timeout_s`` or sends a chunk of the wrong part, order, size
or encoding is dropped from the aggregation with a log line naming it, and the round goes on without
it. A reducer that fails leaves its part incomplete; the caller sees ``complete=False`` and must not
apply the round (it retries, or resynchronizes from peers that completed it).

Signatures: given the peer's key, every contribution and every aggregate chunk is signed (see
``evidence``); a reducer drops a sender whose signature, weight or commitment reveal does not hold, and
a sender refuses an aggregate whose signature fails or that leaves out most of the group. The reducer
keeps the signed inputs of its part (``evidence``) so that a validator can recompute it.

Transport: a part stream goes over the reducer's announced TCP data address when it has one and answers
(see ``transport``), and over hivemind's libp2p streams otherwise; both carry the same ``PartChunk``
messages and reach the same ``serve``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import torch
from hivemind.p2p import P2P, PeerID, ServicerBase
from hivemind.utils.asyncio import aiter_with_timeout

from protocols import averaging_pb2 as apb
from protocols.errors import ProtocolError, SwarmError
from protocols.keys import PublicKey, SigningKey
from swarm.averaging.aggregators import AggregatorFn
from swarm.averaging.compression import Codec
from swarm.averaging.evidence import (
    SignedInput,
    aggregate_message,
    aggregation_seed,
    contribution_message,
    included_mask,
    mask_indices,
    reduce_chunk,
    round_digest,
)
from swarm.averaging.transport import DataPlane
from swarm.ratelimit import RateLimiter

logger = logging.getLogger(__name__)

DEFAULT_CHUNK_VALUES = 1 << 18


def split_bounds(numel: int, parts: int) -> list[int]:
    """Boundaries of ``parts`` nearly equal contiguous slices of ``range(numel)``."""
    return [numel * i // parts for i in range(parts + 1)]


def chunk_bounds(numel: int, chunk_values: int) -> list[int]:
    return [*range(0, numel, chunk_values), numel] if numel else [0, 0]


@dataclass
class Traffic:
    """Bytes of tensor data a peer sent and received, over all its rounds."""

    sent: int = 0
    received: int = 0


@dataclass
class RoundResult:
    """What one peer got from a round: the aggregated vector and whether every part of it arrived.

    The byte counts are those of the moment the vector was complete; a reducer may still be sending
    its part to slower groupmates then (``Traffic`` counts those bytes too).
    """

    vector: torch.Tensor
    complete: bool
    dropped: dict[str, str] = field(default_factory=dict)
    bytes_sent: int = 0
    bytes_received: int = 0


class ButterflyAllReduce:
    """One round among ``peer_ids`` (in the same order on every peer); ``run()`` returns a RoundResult."""

    def __init__(
        self,
        *,
        p2p: P2P,
        servicer_type: type[ServicerBase],
        prefix: str,
        group_id: bytes,
        peer_ids: Sequence[PeerID],
        weight: float,
        local: torch.Tensor,
        aggregator: AggregatorFn,
        codec: Codec,
        sender_timeout_s: float,
        chunk_values: int = DEFAULT_CHUNK_VALUES,
        data_plane: DataPlane | None = None,
        addresses: Sequence[str | None] | None = None,
        upload_limiter: RateLimiter | None = None,
        traffic: Traffic | None = None,
        key: SigningKey | None = None,
        nonce: bytes = b"",
        commitments: Sequence[bytes | None] | None = None,
        attack=None,
        out: torch.Tensor | None = None,
    ):
        self.p2p, self.servicer_type, self.prefix = p2p, servicer_type, prefix
        self.group_id, self.peer_ids = group_id, list(peer_ids)
        self.index = self.peer_ids.index(p2p.peer_id)
        self.weight = float(weight)
        self.key, self.nonce, self.attack = key, nonce, attack
        self.commitments = list(commitments) if commitments is not None else [None] * len(self.peer_ids)
        self.members = [p.to_base58() for p in self.peer_ids]
        self.digest = round_digest(prefix, group_id, self.members)
        self.reveals: dict[int, bytes] = {self.index: nonce}
        self.local = local.detach().to(torch.float32).flatten()
        self.aggregator, self.codec = aggregator, codec
        self.sender_timeout_s, self.chunk_values = sender_timeout_s, chunk_values
        self.data_plane, self.upload_limiter = data_plane, upload_limiter
        self.traffic = traffic if traffic is not None else Traffic()
        self.addresses = list(addresses) if addresses is not None else [None] * len(self.peer_ids)
        # Every value is written before a complete round returns; a caller's reused buffer spares a fresh
        # allocation (and its page faults) per round.
        self.output = out if out is not None else torch.empty_like(self.local)

        self.part_bounds = split_bounds(self.local.numel(), len(self.peer_ids))
        self.part_chunks = [
            chunk_bounds(hi - lo, chunk_values)
            for lo, hi in zip(self.part_bounds[:-1], self.part_bounds[1:], strict=True)
        ]
        self.received = [[False] * (len(c) - 1) for c in self.part_chunks]

        # Reducer state for this peer's own part.
        my_chunks = self.part_chunks[self.index]
        self._inputs: list[dict[int, tuple[torch.Tensor, SignedInput]]] = [
            {} for _ in range(len(my_chunks) - 1)
        ]
        self._weights: dict[int, float] = {}
        self._results: list[apb.PartChunk | None] = [None] * (len(my_chunks) - 1)
        # What a validator needs: the signed inputs of each chunk of our part, and the aggregates we got.
        self.evidence: list[list[SignedInput]] = [[] for _ in self._results]
        self.answers: list[dict[int, apb.PartChunk]] = [{} for _ in self.peer_ids]
        self._reduced = [asyncio.Event() for _ in self._results]
        self._active = set(range(len(self.peer_ids)))
        self._changed = asyncio.Event()
        self.dropped: dict[str, str] = {}
        self.bytes_sent = self.bytes_received = 0

    # --- helpers -------------------------------------------------------------------------------------

    def _chunk(self, part: int, chunk: int) -> tuple[int, int]:
        base, bounds = self.part_bounds[part], self.part_chunks[part]
        return base + bounds[chunk], base + bounds[chunk + 1]

    def _count(self, *, sent: int = 0, received: int = 0) -> None:
        self.bytes_sent += sent
        self.bytes_received += received
        self.traffic.sent += sent
        self.traffic.received += received

    async def _throttle(self, nbytes: int) -> None:
        if self.upload_limiter is not None:
            await self.upload_limiter.acquire(nbytes)

    def _drop(self, sender: int, reason: str) -> None:
        if sender in self._active and sender != self.index:
            self._active.discard(sender)
            peer = self.peer_ids[sender].to_base58()
            self.dropped[peer] = reason
            logger.warning(f"dropped {peer} from averaging round {self.group_id.hex()[:8]}: {reason}")
            self._changed.set()

    def _deliver(self, sender: int, chunk: int, values: torch.Tensor, signed: SignedInput) -> None:
        if sender in self._active:
            self._inputs[chunk][sender] = (values, signed)
            self._changed.set()

    def _sign(self, message: bytes) -> bytes:
        return self.key.sign(message) if self.key is not None else b""

    def _check_contribution(self, sender: int, message: apb.PartChunk, chunk: int) -> None:
        """Refuse a chunk whose signature, weight or (chunk 0) commitment reveal does not hold up."""
        peer = self.members[sender]
        if self.key is not None:
            PublicKey.from_peer_id(peer).verify(
                message.signature,
                contribution_message(self.digest, self.index, chunk, peer, message.weight, message.data),
            )
        weight = message.weight
        if not math.isfinite(weight) or weight < 0:
            raise ProtocolError(f"claims weight {weight!r}; a weight is a finite number >= 0")
        if chunk == 0:
            commitment = self.commitments[sender]
            if commitment is not None and hashlib.sha256(message.reveal).digest() != commitment:
                raise ProtocolError("revealed a nonce that does not match its matchmaking commitment")
            self.reveals[sender] = message.reveal
            self._weights[sender] = weight
        elif weight != self._weights.get(sender):
            raise ProtocolError(f"changed its weight from {self._weights.get(sender)} to {weight} mid-round")

    @property
    def shared_seed(self) -> bytes:
        """The group's random draw for this round: every member's revealed nonce, in member order."""
        reveals = b"".join(
            hashlib.sha256(self.reveals.get(i, b"")).digest() for i in range(len(self.members))
        )
        return hashlib.sha256(b"shared|" + self.digest + reveals).digest()

    # --- reducer -------------------------------------------------------------------------------------

    async def _reduce_own_part(self) -> None:
        try:
            for chunk in range(len(self._results)):
                lo, hi = self._chunk(self.index, chunk)
                message = self._contribution(self.index, chunk)
                own = self.codec.decode(message.data, hi - lo, sender="this peer")
                signed = SignedInput(self.index, message.data, message.signature, message.weight)
                self._deliver(self.index, chunk, own, signed)
        except ProtocolError as e:
            logger.warning(f"leaving this peer's own values out of round {self.group_id.hex()[:8]}: {e}")
            self._active.discard(self.index)
        for chunk in range(len(self._results)):
            while not self._active.issubset(self._inputs[chunk]):
                self._changed.clear()
                try:
                    await asyncio.wait_for(self._changed.wait(), timeout=self.sender_timeout_s)
                except asyncio.TimeoutError:
                    for sender in self._active - set(self._inputs[chunk]):
                        self._drop(sender, f"sent nothing for {self.sender_timeout_s:.1f}s")
            senders = sorted(self._active)
            if not senders:
                logger.warning(
                    f"no valid contribution for part {self.index} in round {self.group_id.hex()[:8]}"
                )
                return
            inputs = [self._inputs[chunk][s] for s in senders]
            # Claimed weights go in as signed; the rule clips them to a fair share (see reduce_chunk).
            weights = [signed.weight for _, signed in inputs]
            seed = aggregation_seed(self.group_id, self.index, chunk)
            encoded = await asyncio.to_thread(
                reduce_chunk, self.aggregator, self.codec, [v for v, _ in inputs], weights, seed
            )
            lo, hi = self._chunk(self.index, chunk)
            if self.attack is not None:  # a rehearsed bad reducer returns something else, signed as usual
                honest = self.codec.decode(encoded, hi - lo, sender="self")
                encoded = self.codec.encode(self.attack.reduce(honest))
            included = included_mask(senders, len(self.members))
            signature = self._sign(
                aggregate_message(self.digest, self.index, chunk, self.members[self.index], included, encoded)
            )
            self.output[lo:hi] = self.codec.decode(encoded, hi - lo, sender="self")
            self.received[self.index][chunk] = True
            self._results[chunk] = apb.PartChunk(
                part_index=self.index, chunk_index=chunk, data=encoded, signature=signature, included=included
            )
            self.evidence[chunk] = [signed for _, signed in inputs]
            self._inputs[chunk].clear()
            self._reduced[chunk].set()

    async def serve(
        self, first: apb.PartChunk, stream: AsyncIterator[apb.PartChunk], sender: PeerID
    ) -> AsyncIterator[apb.PartChunk]:
        """Take a groupmate's chunks of our part and stream the aggregated chunks back to it."""
        if sender not in self.peer_ids or sender == self.p2p.peer_id:
            yield apb.PartChunk(code=apb.NOT_IN_GROUP, error="not a member of this averaging group")
            return
        index = self.peer_ids.index(sender)
        consumer = asyncio.create_task(self._consume(index, first, stream))
        try:
            for chunk, event in enumerate(self._reduced):
                await event.wait()
                result = self._results[chunk]
                if result is None:
                    return
                await self._throttle(len(result.data))
                self._count(sent=len(result.data))
                yield result
        finally:
            consumer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await consumer

    async def _consume(self, sender: int, first: apb.PartChunk, stream: AsyncIterator[apb.PartChunk]) -> None:
        expected = 0
        try:
            message = first
            stream = aiter_with_timeout(stream, self.sender_timeout_s)
            while True:
                if message.part_index != self.index or message.chunk_index != expected:
                    raise ProtocolError(
                        f"sent part {message.part_index} chunk {message.chunk_index}, "
                        f"expected part {self.index} chunk {expected}"
                    )
                lo, hi = self._chunk(self.index, expected)
                peer = self.members[sender]
                self._count(received=len(message.data))
                self._check_contribution(sender, message, expected)
                values = self.codec.decode(message.data, hi - lo, sender=peer)
                signed = SignedInput(sender, message.data, message.signature, message.weight)
                self._deliver(sender, expected, values, signed)
                expected += 1
                if expected == len(self._results):
                    return
                message = await stream.__anext__()
        except ProtocolError as e:
            self._drop(sender, str(e).removeprefix(f"{self.peer_ids[sender].to_base58()} "))
        except (asyncio.TimeoutError, StopAsyncIteration):
            self._drop(sender, f"stopped after {expected} of {len(self._results)} chunks")
        except Exception as e:
            self._drop(sender, f"stream failed: {e!r}")

    # --- sender --------------------------------------------------------------------------------------

    def encode_contribution(self, part: int, chunk: int) -> bytes:
        """This peer's values for one chunk of another peer's part, as sent on the wire."""
        lo, hi = self._chunk(part, chunk)
        return self.codec.encode(self.local[lo:hi])

    def _contribution(self, part: int, chunk: int) -> apb.PartChunk:
        data = self.encode_contribution(part, chunk)
        me = self.members[self.index]
        return apb.PartChunk(
            group_id=self.group_id if chunk == 0 else b"",
            part_index=part,
            chunk_index=chunk,
            data=data,
            weight=self.weight,
            reveal=self.nonce if chunk == 0 else b"",
            signature=self._sign(contribution_message(self.digest, part, chunk, me, self.weight, data)),
        )

    def _check_answer(self, part: int, chunk: int, message: apb.PartChunk) -> None:
        """A reducer's aggregate must be signed by it and cover more than half of the group."""
        reducer = self.members[part]
        if self.key is not None:
            PublicKey.from_peer_id(reducer).verify(
                message.signature,
                aggregate_message(self.digest, part, chunk, reducer, message.included, message.data),
            )
            included = mask_indices(message.included, len(self.members))
            if 2 * len(included) <= len(self.members):
                raise ProtocolError(f"aggregated only {len(included)} of {len(self.members)} members")

    async def _exchange_with(self, part: int) -> None:
        peer = self.peer_ids[part]
        chunks = len(self.part_chunks[part]) - 1

        async def outgoing() -> AsyncIterator[apb.PartChunk]:
            for chunk in range(chunks):
                message = self._contribution(part, chunk)
                await self._throttle(len(message.data))
                self._count(sent=len(message.data))
                yield message

        try:
            stream = await self._open(part, outgoing())
            expected = 0
            async for message in aiter_with_timeout(stream, 2 * self.sender_timeout_s):
                if message.code != apb.OK:
                    raise ProtocolError(f"reducer answered {apb.Code.Name(message.code)}: {message.error}")
                if message.part_index != part or message.chunk_index != expected or expected >= chunks:
                    raise ProtocolError(f"reducer sent part {message.part_index} chunk {message.chunk_index}")
                lo, hi = self._chunk(part, expected)
                self._count(received=len(message.data))
                self._check_answer(part, expected, message)
                self.output[lo:hi] = self.codec.decode(message.data, hi - lo, sender=peer.to_base58())
                self.answers[part][expected] = message
                self.received[part][expected] = True
                expected += 1
            if expected < chunks:
                raise ProtocolError(f"reducer ended its stream after {expected} of {chunks} chunks")
        except Exception as e:
            logger.warning(
                f"reducer {peer.to_base58()} of part {part} failed in round {self.group_id.hex()[:8]}: {e!r}"
            )
            self.dropped.setdefault(peer.to_base58(), f"failed as reducer: {e!r}")

    async def _open(self, part: int, outgoing: AsyncIterator[apb.PartChunk]) -> AsyncIterator[apb.PartChunk]:
        """The reducer's answer stream: over its data address when it has one that answers, else libp2p."""
        peer, address = self.peer_ids[part], self.addresses[part]
        if self.data_plane is not None and address is not None:
            try:
                connection = await self.data_plane.connect(address, peer, timeout_s=self.sender_timeout_s / 2)
                return connection.exchange(outgoing)
            except SwarmError as e:
                logger.info(f"reaching {peer.to_base58()} through libp2p: {e}")
        stub = self.servicer_type.get_stub(self.p2p, peer, namespace=self.prefix)
        return await stub.rpc_aggregate_part(outgoing)

    async def run(self) -> RoundResult:
        tasks = [asyncio.create_task(self._reduce_own_part())]
        tasks += [
            asyncio.create_task(self._exchange_with(part))
            for part in range(len(self.peer_ids))
            if part != self.index
        ]
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
        complete = all(all(part) for part in self.received)
        return RoundResult(self.output, complete, dict(self.dropped), self.bytes_sent, self.bytes_received)
