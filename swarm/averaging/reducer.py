"""The reducer side of a butterfly round (``ButterflyAllReduce``): this peer's own part.

Every groupmate streams its signed chunks of this peer's part to ``serve``; ``_consume`` checks each
chunk (the sender's signature over the round, part, chunk, weight and bytes; a finite weight that never
changes mid-round; the expected part, order, size and encoding) and drops a sender that breaks a rule or
falls silent, with a log line naming it. ``_reduce_chunks`` waits, chunk by chunk, for every sender still
active, aggregates them with the run's rule (``reduce_chunk``, the function validators rerun), signs the
encoded result over the exact inputs it used, and ``serve`` streams those same bytes to every sender,
then takes the sender's nonce reveal. The state these methods read and write (the round's members,
digest, inputs, results and events) is set up by ``ButterflyAllReduce.__init__``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import time
from collections.abc import AsyncIterator

import torch
from hivemind.p2p import PeerID

from protocols import averaging_pb2 as apb
from protocols.errors import ProtocolError
from protocols.keys import PublicKey
from swarm.averaging.evidence import (
    NONCE_BYTES,
    SignedInput,
    aggregate_message,
    aggregation_seed,
    contribution_message,
    input_entries,
    reduce_chunk,
)

logger = logging.getLogger(__name__)


class PartReducer:
    """Takes groupmates' chunks of this peer's part, aggregates, signs, and streams the result back
    (a mixin of ``ButterflyAllReduce``, whose constructor holds the round's state)."""

    def _drop(self, sender: int, reason: str) -> None:
        if sender in self._active and sender != self.index:
            self._active.discard(sender)
            peer = self.peer_ids[sender].to_base58()
            self.dropped[peer] = reason
            logger.warning(f"dropped {peer} from averaging round {self.group_id.hex()[:8]}: {reason}")
            self._changed.set()
            for repair in self.repairs.values():  # one input fewer to wait for
                repair.changed.set()

    def _deliver(self, sender: int, chunk: int, values: torch.Tensor, signed: SignedInput) -> None:
        if sender in self._active:
            self._inputs[chunk][sender] = (values, signed)
            self._changed.set()

    def _check_contribution(
        self, sender: int, message: apb.PartChunk, chunk: int, *, part: int | None = None,
        weights: dict[int, float] | None = None,
    ) -> None:  # fmt: skip
        """Refuse a chunk of our part (or of ``part``, which we stand in for) whose signature or weight
        does not hold up; ``weights`` holds each sender's weight from its first chunk."""
        part = self.index if part is None else part
        weights = self._weights if weights is None else weights
        peer = self.members[sender]
        if self.key is not None:
            PublicKey.from_peer_id(peer).verify(
                message.signature,
                contribution_message(self.digest, part, chunk, peer, message.weight, message.data),
            )
        weight = message.weight
        if not math.isfinite(weight) or weight < 0:
            raise ProtocolError(f"claims weight {weight!r}; a weight is a finite number >= 0")
        if chunk == 0:
            weights[sender] = weight
        elif weight != weights.get(sender):
            raise ProtocolError(f"changed its weight from {weights.get(sender)} to {weight} mid-round")

    def _check_reveal(self, sender: int, message: apb.PartChunk) -> None:
        if message.part_index != self.index or message.chunk_index != len(self._results) or message.data:
            raise ProtocolError("sent something other than its nonce reveal after its contributions")
        commitment = self.commitments[sender]
        if commitment is not None and len(message.reveal) != NONCE_BYTES:  # as evidence carries them
            raise ProtocolError(f"revealed a nonce of {len(message.reveal)} bytes, not {NONCE_BYTES}")
        if commitment is not None and hashlib.sha256(message.reveal).digest() != commitment:
            raise ProtocolError("revealed a nonce that does not match its matchmaking commitment")
        self.reveals[sender] = message.reveal

    async def _reduce_own_part(self) -> None:
        try:
            await self._reduce_chunks()
        except Exception as e:
            logger.warning(f"reducing part {self.index} of round {self.group_id.hex()[:8]} failed: {e!r}")
        finally:
            for event in self._reduced:
                event.set()  # a chunk with no result ends the groupmates' streams
            self._settle(self.index)

    async def _reduce_chunks(self) -> None:
        try:
            for chunk in range(len(self._results)):
                own, signed = self._own_decoded(self.index, chunk)
                if not (math.isfinite(signed.weight) and signed.weight >= 0):
                    raise ProtocolError(f"weight {signed.weight!r} is not a finite number >= 0")
                lo, hi = self._chunk(self.index, chunk)
                self.sent[lo:hi] = own
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
            result = await self._aggregate(self.index, chunk, inputs)
            lo, hi = self._chunk(self.index, chunk)
            self.output[lo:hi] = self.codec.decode(result.data, hi - lo, sender="self")
            self.received[self.index][chunk] = True
            self._results[chunk] = result
            self.evidence[chunk] = [signed for _, signed in inputs]
            self._inputs[chunk].clear()
            self._reduced[chunk].set()

    async def _aggregate(
        self, part: int, chunk: int, inputs: list[tuple[torch.Tensor, SignedInput]]
    ) -> apb.PartChunk:
        """One chunk of ``part`` aggregated from ``inputs`` (decoded values and signed input, in sender
        order) under the run's rule, and signed by this peer over exactly those inputs. Claimed weights go
        in as signed; the rule clips them to a fair share (see ``reduce_chunk``)."""
        encoded = await asyncio.to_thread(
            reduce_chunk, self.aggregator, self.codec, [v for v, _ in inputs],
            [signed.weight for _, signed in inputs], aggregation_seed(self.group_id, part, chunk),
        )  # fmt: skip
        if self.hooks.rewrites_aggregates:  # a rehearsed bad reducer returns something else, signed as usual
            lo, hi = self._chunk(part, chunk)
            encoded = self._attacked(part, chunk, encoded, hi - lo)
        entries = input_entries([(s.sender_index, s.weight, s.data) for _, s in inputs])
        me = self.members[self.index]
        signed_at_ms = int(time.time() * 1000)
        signature = self._sign(
            aggregate_message(self.digest, part, chunk, me, entries, encoded, signed_at_ms)
        )
        return apb.PartChunk(
            part_index=part, chunk_index=chunk, data=encoded, signature=signature, included=entries,
            signed_at_ms=signed_at_ms,
        )  # fmt: skip

    def _attacked(self, part: int, chunk: int, encoded: bytes, numel: int) -> bytes:
        """What a rehearsed bad reducer returns instead of ``encoded`` (``RoundHooks.aggregate``)."""
        honest = self.codec.decode(encoded, numel, sender="self")
        return self.codec.encode(self.hooks.aggregate(self, part, chunk, honest))

    async def serve(
        self, first: apb.PartChunk, stream: AsyncIterator[apb.PartChunk], sender: PeerID
    ) -> AsyncIterator[apb.PartChunk]:
        """Take a groupmate's chunks of our part, stream the aggregated chunks back, then take its reveal."""
        if sender not in self.peer_ids or sender == self.p2p.peer_id:
            yield apb.PartChunk(code=apb.NOT_IN_GROUP, error="not a member of this averaging group")
            return
        if not self.reduces(self.index):
            yield apb.PartChunk(code=apb.BAD_CHUNK, error="this member reduces no part in this round")
            return
        index = self.peer_ids.index(sender)
        if first.part_index != self.index:  # a part whose reducer failed this sender (see ``repair``)
            async for message in self._serve_repair(first, stream, index):
                yield message
            return
        if self.revealed is not None:  # this part was reduced without that sender
            yield apb.PartChunk(code=apb.BAD_GROUP, error="this round's first phase is over here")
            return
        consumer = asyncio.create_task(self._consume(index, first, stream))
        try:
            if self.hooks.withholds_aggregates:  # a rehearsed withholder returns nothing
                await consumer
                return
            for chunk, event in enumerate(self._reduced):
                await event.wait()
                result = self._results[chunk]
                if result is None:
                    return
                await self._throttle(len(result.data))
                self._count(sent=len(result.data))
                yield result
            await consumer  # it ends with the sender's reveal, or a bounded wait for it
        finally:
            consumer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await consumer
            self._heard.add(index)
            self._changed.set()

    async def _consume(self, sender: int, first: apb.PartChunk, stream: AsyncIterator[apb.PartChunk]) -> None:
        expected = 0
        try:
            message = first
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
                values = self.codec.decode_contribution(message.data, hi - lo, sender=peer)
                signed = SignedInput(sender, message.data, message.signature, message.weight)
                self._deliver(sender, expected, values, signed)
                expected += 1
                if expected == len(self._results):
                    break
                message = await self._next(stream, self.sender_timeout_s)
        except ProtocolError as e:
            self._drop(sender, str(e).removeprefix(f"{self.peer_ids[sender].to_base58()} "))
            return
        except (asyncio.TimeoutError, StopAsyncIteration):
            self._drop(sender, f"stopped after {expected} of {len(self._results)} chunks")
            return
        except Exception as e:
            self._drop(sender, f"stream failed: {e!r}")
            return
        peer = self.members[sender]
        try:
            self._check_reveal(sender, await self._next(stream, self.reveal_timeout_s))
        except (asyncio.TimeoutError, StopAsyncIteration):
            logger.info(f"{peer} revealed no nonce in round {self.group_id.hex()[:8]}")
        except Exception as e:
            logger.warning(f"{peer} sent a bad nonce reveal in round {self.group_id.hex()[:8]}: {e!r}")
