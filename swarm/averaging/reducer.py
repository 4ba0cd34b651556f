"""The reducer side of a butterfly round (``ButterflyAllReduce``): this peer's own part.

Every groupmate streams its signed chunks of this peer's part to ``serve``; ``_consume`` checks each
chunk (the sender's signature over the round, part, chunk, weight and bytes; a finite weight that never
changes mid-round; the expected part, order, size and encoding) and drops a sender that breaks a rule or
falls silent, with a log line naming it. ``_reduce_chunks`` waits, chunk by chunk, for every sender still
active, aggregates them with the run's rule (``reduce_chunk``, the function validators rerun), signs the
encoded result over the exact inputs it used, and ``serve`` streams those same bytes to every sender,
then takes the sender's nonce reveal. What the whole round shares (members, digest, layout, output) it
reads from its ``round``; its own state is the inputs, weights and results of this peer's part, and which
senders are still in.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import torch

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

if TYPE_CHECKING:
    from swarm.averaging.allreduce import ButterflyAllReduce

logger = logging.getLogger(__name__)


def check_reveal(round: ButterflyAllReduce, sender: int, message: apb.PartChunk) -> None:
    """``sender``'s nonce reveal after its contributions to this peer's part, checked against its
    matchmaking commitment; a reveal that holds up joins ``round.reveals``."""
    if (
        message.part_index != round.index
        or message.chunk_index != round.chunk_count(round.index)
        or message.data
    ):
        raise ProtocolError("sent something other than its nonce reveal after its contributions")
    commitment = round.commitments[sender]
    if commitment is not None and len(message.reveal) != NONCE_BYTES:  # as evidence carries them
        raise ProtocolError(f"revealed a nonce of {len(message.reveal)} bytes, not {NONCE_BYTES}")
    if commitment is not None and hashlib.sha256(message.reveal).digest() != commitment:
        raise ProtocolError("revealed a nonce that does not match its matchmaking commitment")
    round.reveals[sender] = message.reveal


class PartReducer:
    """Takes groupmates' chunks of this peer's part of ``round``, aggregates, signs, and streams the result
    back."""

    def __init__(self, round: ButterflyAllReduce):
        self.round = round
        chunks = round.chunk_count(round.index)
        self._inputs: list[dict[int, tuple[torch.Tensor, SignedInput]]] = [{} for _ in range(chunks)]
        self._weights: dict[int, float] = {}  # each sender's weight, from its first chunk
        self.results: list[apb.PartChunk | None] = [None] * chunks
        # What a validator needs: the signed inputs of each chunk of our part.
        self.evidence: list[list[SignedInput]] = [[] for _ in range(chunks)]
        # Each sender's first validly signed input to our part that did not decode (non-finite values, a
        # malformed encoding), by sender, with its chunk: no loop sends one, so it needs no draw to be
        # replayed and filed (``swarm.training.sendercheck``). At most one per member.
        self.undecodable: dict[int, tuple[int, SignedInput]] = {}
        self._reduced = [asyncio.Event() for _ in range(chunks)]
        # Members still in the round for this peer's part; a repair waits for the same ones.
        self.active = set(range(len(round.peer_ids)))

    def contributed(self, sender: int) -> bool:
        """Whether ``sender``'s signed contribution to this peer's part arrived in this round."""
        return sender in self._weights

    def drop(self, sender: int, reason: str) -> None:
        """Leave ``sender`` out of this peer's part (and of the parts it stands in for), naming why."""
        r = self.round
        if sender in self.active and sender != r.index:
            self.active.discard(sender)
            peer = r.peer_ids[sender].to_base58()
            r.dropped[peer] = reason
            logger.warning(f"dropped {peer} from averaging round {r.group_id.hex()[:8]}: {reason}")
            r.changed.set()
            r.repairs.input_dropped()

    def _deliver(self, sender: int, chunk: int, values: torch.Tensor, signed: SignedInput) -> None:
        if sender in self.active:
            self._inputs[chunk][sender] = (values, signed)
            self.round.changed.set()

    def check_contribution(
        self, sender: int, message: apb.PartChunk, chunk: int, *, part: int | None = None,
        weights: dict[int, float] | None = None,
    ) -> None:  # fmt: skip
        """Refuse a chunk of our part (or of ``part``, which we stand in for) whose signature or weight
        does not hold up; ``weights`` holds each sender's weight from its first chunk."""
        r = self.round
        part = r.index if part is None else part
        weights = self._weights if weights is None else weights
        peer = r.members[sender]
        if r.key is not None:
            PublicKey.from_peer_id(peer).verify(
                message.signature,
                contribution_message(r.digest, part, chunk, peer, message.weight, message.data),
            )
        weight = message.weight
        if not math.isfinite(weight) or weight < 0:
            raise ProtocolError(f"claims weight {weight!r}; a weight is a finite number >= 0")
        if chunk == 0 and sender not in weights:  # a second stream's chunk 0 changes nothing
            weights[sender] = weight
        elif weight != weights.get(sender):
            raise ProtocolError(f"changed its weight from {weights.get(sender)} to {weight} mid-round")

    async def reduce_own_part(self) -> None:
        r = self.round
        try:
            await self._reduce_chunks()
        except Exception as e:
            logger.warning(f"reducing part {r.index} of round {r.group_id.hex()[:8]} failed: {e!r}")
        finally:
            for event in self._reduced:
                event.set()  # a chunk with no result ends the groupmates' streams
            r.settle(r.index)

    async def _reduce_chunks(self) -> None:
        r = self.round
        try:
            for chunk in range(len(self.results)):
                own, signed = await asyncio.to_thread(r.sender.own_decoded, r.index, chunk)
                if not (math.isfinite(signed.weight) and signed.weight >= 0):
                    raise ProtocolError(f"weight {signed.weight!r} is not a finite number >= 0")
                lo, hi = r.chunk_range(r.index, chunk)
                r.sent[lo:hi] = own
                self._deliver(r.index, chunk, own, signed)
        except ProtocolError as e:
            logger.warning(f"leaving this peer's own values out of round {r.group_id.hex()[:8]}: {e}")
            self.active.discard(r.index)
        for chunk in range(len(self.results)):
            while not self.active.issubset(self._inputs[chunk]):
                r.changed.clear()
                try:
                    await asyncio.wait_for(r.changed.wait(), timeout=r.sender_timeout_s)
                except asyncio.TimeoutError:
                    for sender in self.active - set(self._inputs[chunk]):
                        self.drop(sender, f"sent nothing for {r.sender_timeout_s:.1f}s")
            senders = sorted(self.active)
            if not senders:
                logger.warning(f"no valid contribution for part {r.index} in round {r.group_id.hex()[:8]}")
                return
            inputs = [self._inputs[chunk][s] for s in senders]
            result = await self.aggregate(r.index, chunk, inputs)
            lo, hi = r.chunk_range(r.index, chunk)
            r.output[lo:hi] = await asyncio.to_thread(r.codec.decode, result.data, hi - lo, sender="self")
            r.received[r.index][chunk] = True
            self.results[chunk] = result
            self.evidence[chunk] = [signed for _, signed in inputs]
            self._inputs[chunk].clear()
            self._reduced[chunk].set()

    async def aggregate(
        self, part: int, chunk: int, inputs: list[tuple[torch.Tensor, SignedInput]]
    ) -> apb.PartChunk:
        """One chunk of ``part`` aggregated from ``inputs`` (decoded values and signed input, in sender
        order) under the run's rule, and signed by this peer over exactly those inputs. Claimed weights go
        in as signed; the rule clips them to a fair share (see ``reduce_chunk``). A substitute's repair
        aggregates through here too."""
        r = self.round
        encoded = await asyncio.to_thread(
            reduce_chunk, r.aggregator, r.codec, [v for v, _ in inputs],
            [signed.weight for _, signed in inputs], aggregation_seed(r.group_id, part, chunk),
        )  # fmt: skip
        if r.hooks.rewrites_aggregates:  # a rehearsed bad reducer returns something else, signed as usual
            lo, hi = r.chunk_range(part, chunk)
            honest = r.codec.decode(encoded, hi - lo, sender="self")
            encoded = r.codec.encode(r.hooks.aggregate(r, part, chunk, honest))
        entries = input_entries([(s.sender_index, s.weight, s.data) for _, s in inputs])
        signed_at_ms = int(time.time() * 1000)
        signature = r.sign(
            aggregate_message(r.digest, part, chunk, r.members[r.index], entries, encoded, signed_at_ms)
        )
        return apb.PartChunk(
            part_index=part, chunk_index=chunk, data=encoded, signature=signature, included=entries,
            signed_at_ms=signed_at_ms,
        )  # fmt: skip

    async def serve(
        self, first: apb.PartChunk, stream: AsyncIterator[apb.PartChunk], sender: int
    ) -> AsyncIterator[apb.PartChunk]:
        """Take member ``sender``'s chunks of our part, stream the aggregated chunks back, then take its
        reveal (the round has checked that ``sender`` is a member and that this peer reduces)."""
        r = self.round
        if r.revealed is not None:  # this part was reduced without that sender
            yield apb.PartChunk(code=apb.BAD_GROUP, error="this round's first phase is over here")
            return
        consumer = asyncio.create_task(self.consume(sender, first, stream))
        try:
            if r.hooks.withholds_aggregates:  # a rehearsed withholder returns nothing
                await consumer
                return
            for chunk, event in enumerate(self._reduced):
                await event.wait()
                result = self.results[chunk]
                if result is None:
                    return
                await r.throttle(len(result.data))
                r.count(sent=len(result.data))
                yield result
            await consumer  # it ends with the sender's reveal, or a bounded wait for it
        finally:
            consumer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await consumer
            r.heard.add(sender)
            r.changed.set()

    def _checked_values(self, sender: int, message: apb.PartChunk, chunk: int) -> torch.Tensor:
        """``sender``'s chunk of our part checked (``check_contribution``) and decoded, on a worker thread:
        hashing, the signature and decoding run beside the event loop."""
        lo, hi = self.round.chunk_range(self.round.index, chunk)
        self.check_contribution(sender, message, chunk)
        try:
            return self.round.codec.decode_contribution(
                message.data, hi - lo, sender=self.round.members[sender]
            )
        except ProtocolError:
            signed = SignedInput(sender, message.data, message.signature, message.weight)
            self.undecodable.setdefault(sender, (chunk, signed))
            raise

    async def consume(self, sender: int, first: apb.PartChunk, stream: AsyncIterator[apb.PartChunk]) -> None:
        """Take member ``sender``'s chunks of our part, then its reveal; a chunk that breaks a rule, or
        silence, drops it."""
        r = self.round
        expected, chunks = 0, len(self.results)
        peer = r.members[sender]
        try:
            message = first
            while True:
                if message.part_index != r.index or message.chunk_index != expected:
                    raise ProtocolError(
                        f"sent part {message.part_index} chunk {message.chunk_index}, "
                        f"expected part {r.index} chunk {expected}"
                    )
                r.count(received=len(message.data))
                values = await asyncio.to_thread(self._checked_values, sender, message, expected)
                signed = SignedInput(sender, message.data, message.signature, message.weight)
                self._deliver(sender, expected, values, signed)
                expected += 1
                if expected == chunks:
                    break
                message = await r.next(stream, r.sender_timeout_s)
        except ProtocolError as e:
            self.drop(sender, str(e).removeprefix(f"{peer} "))
            return
        except (asyncio.TimeoutError, StopAsyncIteration):
            self.drop(sender, f"stopped after {expected} of {chunks} chunks")
            return
        except Exception as e:
            self.drop(sender, f"stream failed: {e!r}")
            return
        try:
            check_reveal(r, sender, await r.next(stream, r.reveal_timeout_s))
        except (asyncio.TimeoutError, StopAsyncIteration):
            logger.info(f"{peer} revealed no nonce in round {r.group_id.hex()[:8]}")
        except Exception as e:
            logger.warning(f"{peer} sent a bad nonce reveal in round {r.group_id.hex()[:8]}: {e!r}")

    def trim(self, drawn: int | None) -> None:
        """Keep only the inputs of the chunk of this peer's part that validators drew."""
        self.evidence = [inputs if c == drawn else [] for c, inputs in enumerate(self.evidence)]
