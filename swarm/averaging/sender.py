"""The sender side of a butterfly round (``ButterflyAllReduce``): this peer's chunks of every other part.

For each other member that reduces a part, ``_exchange_with`` streams this peer's signed contribution to
each chunk of that part (``_contribution``), paced so that no stream runs far ahead of the others
(``_pace``), over the reducer's data address or libp2p (``_open``). It checks every aggregate chunk that
comes back (``_check_answer``: the reducer's signature, more than half of the group included, this
peer's own input listed as sent) and writes the decoded bytes into the round's output. A reducer that
fails turns the sender to the part's substitute (``repair``). Once every part has arrived or failed, the
sender's nonce reveal goes out on the same streams. What the whole round shares (its members, layout,
output and counters) it reads from its ``round``; its own state is the pacing of its streams and when
each direct stream ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING

import torch
from hivemind.utils.asyncio import aiter_with_timeout

from protocols import averaging_pb2 as apb
from protocols.envelope import MAX_CLOCK_SKEW_S
from protocols.errors import ProtocolError, StaleError, SwarmError
from protocols.keys import PublicKey
from swarm.averaging.evidence import SignedInput, aggregate_message, contribution_message, parse_entries

if TYPE_CHECKING:
    from swarm.averaging.allreduce import ButterflyAllReduce

logger = logging.getLogger(__name__)

#: How long past the round's silence deadline, counted from this peer's first chunk, a denial may come and
#: still count as one: latency and a loaded machine's delay. A later one counts as a reducer that did not
#: deliver.
DENIAL_SLACK_S = 1.0


def check_answer(
    round: ButterflyAllReduce,
    part: int,
    chunk: int,
    message: apb.PartChunk,
    sent: bytes,
    *,
    signer: int | None = None,
    skew_s: float = MAX_CLOCK_SKEW_S,
) -> None:
    """A reducer's aggregate must be signed by it (or by ``signer``, the part's substitute), dated within
    ``skew_s`` of this peer's clock, cover more than half of the group, and list this peer's input (if at
    all) as the one it sent, whose SHA-256 is ``sent``. Reads ``round``'s members, key, digest, index and
    weight."""
    if round.key is None:
        return
    reducer = round.members[part if signer is None else signer]
    PublicKey.from_peer_id(reducer).verify(
        message.signature,
        aggregate_message(
            round.digest, part, chunk, reducer, message.included, message.data, message.signed_at_ms
        ),
    )
    # Dated far off, it would leave the window in which the coordinator demands its inputs.
    off_s = message.signed_at_ms / 1000 - time.time()
    if abs(off_s) > skew_s:
        raise StaleError(
            f"dated its aggregate {off_s:+.0f}s from this peer's clock (the bound is {skew_s:.0f}s)"
        )
    entries = parse_entries(message.included, len(round.members))
    if 2 * len(entries) <= len(round.members):
        raise ProtocolError(f"aggregated only {len(entries)} of {len(round.members)} members")
    mine = next((e for e in entries if e.sender_index == round.index), None)
    if mine is not None and (mine.weight != round.weight or mine.data_hash != sent):
        raise ProtocolError("signed that it aggregated an input of this peer that this peer never sent")


class PartSender:
    """Streams this peer's contributions to the other reducers of ``round`` and takes their aggregates back."""

    def __init__(self, round: ButterflyAllReduce):
        self.round = round
        self.contributed_bytes = 0  # of this peer's own values, sent to other reducers
        # Chunks handed to each reducer's stream so far, for the parts still being sent (see _pace).
        self._handed: dict[int, int] = {}
        self._handed_more = asyncio.Event()
        # Set when this peer's own stream to a part's reducer ended, either way (a repair waits for it).
        self.direct_done = {p: asyncio.Event() for p in range(len(round.peer_ids))}

    def start(self, parts: Sequence[int]) -> list[asyncio.Task]:
        """Stream to the reducer of each of ``parts``: one task each."""
        self._handed = {p: 0 for p in parts if self.round.chunk_count(p) > 0}
        return [asyncio.create_task(self.exchange_with(part)) for part in parts]

    def encode_contribution(self, part: int, chunk: int) -> bytes:
        """This peer's values for one chunk of another peer's part, as sent on the wire."""
        lo, hi = self.round.chunk_range(part, chunk)
        return self.round.codec.encode_contribution(self.round.local[lo:hi])

    def contribution(self, part: int, chunk: int) -> apb.PartChunk:
        """This peer's signed contribution to one chunk of ``part``, as sent to its reducer or substitute."""
        r = self.round
        data = self.encode_contribution(part, chunk)
        return apb.PartChunk(
            group_id=r.group_id if chunk == 0 else b"",
            part_index=part,
            chunk_index=chunk,
            data=data,
            weight=r.weight,
            signature=r.sign(contribution_message(r.digest, part, chunk, r.members[r.index], r.weight, data)),
        )

    def own_decoded(self, part: int, chunk: int) -> tuple[torch.Tensor, SignedInput]:
        """This peer's values for one chunk of ``part`` as a reducer decodes them from the wire bytes,
        and its signed contribution: what it aggregates of its own, as reducer or as substitute."""
        message = self.contribution(part, chunk)
        lo, hi = self.round.chunk_range(part, chunk)
        values = self.round.codec.decode_contribution(message.data, hi - lo, sender="this peer")
        return values, SignedInput(self.round.index, message.data, message.signature, message.weight)

    def _prepare(self, part: int, chunk: int) -> tuple[apb.PartChunk, bytes]:
        """This peer's signed contribution to one chunk of ``part``, its SHA-256, and the values as they went
        out (``sent``), on a worker thread: encoding, hashing and signing run beside the event loop, which
        meanwhile reduces the chunks other peers send. On a busy machine a second thread in the round also
        takes a second share of the cores (``benchmarks/bench_allreduce_load.py``)."""
        r = self.round
        message = self.contribution(part, chunk)
        lo, hi = r.chunk_range(part, chunk)
        with contextlib.suppress(ProtocolError):  # a rehearsed bad sender's bytes stay unrecorded
            r.sent[lo:hi] = r.codec.decode_contribution(message.data, hi - lo, sender="self")
        return message, hashlib.sha256(message.data).digest()

    def reveals_to(self, part: int) -> bool:
        """Whether this peer reveals its nonce to the reducer of ``part`` (an honest one always does)."""
        return True

    def own_input(self, part: int, chunk: int) -> SignedInput | None:
        """This peer's signed contribution to one chunk of a part (Ed25519 signs the same bytes the same);
        None for a chunk that no validator drew once the round is trimmed."""
        if self.round.local is not None:
            try:
                message = self.contribution(part, chunk)
            except TypeError:
                if self.round.local is not None:
                    raise
            else:
                return SignedInput(self.round.index, message.data, message.signature, message.weight)
        # Trimmed, perhaps while the lines above ran (``serve_inputs`` calls this on a worker thread, and
        # ``_trim`` keeps the drawn chunks before it lets the vector go): what the round kept.
        return self.round.kept_inputs.get((part, chunk))

    async def _pace(self, part: int, chunk: int, lead: int = 2) -> None:
        """Hold the stream to reducer ``part`` until every other reducer's stream has been handed all but
        ``lead`` of the chunks before ``chunk``. Without it, TCP's share of the uplink lets one stream run
        ahead: its reducer finishes early and idles, while a reducer whose inputs lag still has every
        aggregate to send when the others are done (measured in the WAN lab: about 2 s of a 13 s round
        at 10 Mbit/s). The wait is bounded, so a stalled reducer never holds the others for long."""
        deadline = asyncio.get_running_loop().time() + self.round.sender_timeout_s / 4
        while self._handed and chunk > min(self._handed.values()) + lead:
            self._handed_more.clear()
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                return
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._handed_more.wait(), left)

    async def exchange_with(self, part: int) -> None:
        r = self.round
        peer = r.peer_ids[part]
        chunks = r.chunk_count(part)
        sent: list[bytes] = []
        first_at: list[float] = []  # when the first chunk went to the stream (after any upload limit)

        async def outgoing() -> AsyncIterator[apb.PartChunk]:
            for chunk in range(chunks):
                await self._pace(part, chunk)
                message, digest = await asyncio.to_thread(self._prepare, part, chunk)
                sent.append(digest)
                await r.throttle(len(message.data))
                r.count(sent=len(message.data))
                self.contributed_bytes += len(message.data)
                self._handed[part] = chunk + 1
                self._handed_more.set()
                if not first_at:
                    first_at.append(asyncio.get_running_loop().time())
                yield message
            self._handed.pop(part, None)
            self._handed_more.set()
            await r.delivered.wait()
            if self.reveals_to(part):
                yield apb.PartChunk(part_index=part, chunk_index=chunks, reveal=r.nonce)

        stream, expected, denied = None, 0, False
        try:
            stream = await self.open(part, outgoing())
            while expected < chunks:
                message = await r.next(stream, 2 * r.sender_timeout_s)
                if message.code != apb.OK:
                    # A denial is what a peer that knows no such round answers once our first chunk reached
                    # it: at once, or after its router's wait for the round (the run's ``sender_timeout_s``,
                    # within the round's silence deadline, which also allows a chunk's transfer). One that
                    # comes later is a reducer that held the stream first, as a withholder does: a miss
                    # like a timeout (``missed``).
                    now = asyncio.get_running_loop().time()
                    prompt = now - (first_at[0] if first_at else now) <= r.sender_timeout_s + DENIAL_SLACK_S
                    denied = prompt and expected == 0 and message.code in (apb.BAD_GROUP, apb.NOT_IN_GROUP)
                    raise ProtocolError(f"reducer answered {apb.Code.Name(message.code)}: {message.error}")
                if message.part_index != part or message.chunk_index != expected:
                    raise ProtocolError(f"reducer sent part {message.part_index} chunk {message.chunk_index}")
                r.count(received=len(message.data))
                await asyncio.to_thread(self._check_and_take, part, expected, message, sent[expected])
                expected += 1
        except Exception as e:
            self.direct_done[part].set()
            if isinstance(e, StopAsyncIteration):
                e = ProtocolError(f"reducer ended its stream after {expected} of {chunks} chunks")
            logger.warning(
                f"reducer {peer.to_base58()} of part {part} failed in round {r.group_id.hex()[:8]}: {e!r}"
            )
            if stream is not None and hasattr(stream, "aclose"):
                with contextlib.suppress(Exception):
                    await stream.aclose()
            r.dropped.setdefault(peer.to_base58(), f"failed as reducer: {e!r}")
            self._handed.pop(part, None)
            self._handed_more.set()
            # Nor wait for its contributions to our part: a peer that died mid-round may not have opened
            # its stream to us yet, and would otherwise hold our part for the whole silence deadline.
            r.reducer.drop(part, f"failed as reducer: {e!r}")
            (r.denied_by if denied else r.failed_reducers).append(peer.to_base58())
            # The part may still come, from its substitute, before this peer reveals (see ``repair``); a
            # denial too: the denier is listed with its own signed entry in a group every member checked.
            if await r.repairs.recover(part):
                logger.info(f"part {part} of round {r.group_id.hex()[:8]} came from its substitute")
            r.settle(part)
            return
        self.direct_done[part].set()
        r.settle(part)
        # Phase two: the stream stays open until our reveal has gone out and the reducer has its own.
        with contextlib.suppress(Exception):
            async for _ in aiter_with_timeout(stream, r.reveal_timeout_s + r.sender_timeout_s):
                pass

    def _check_and_take(self, part: int, chunk: int, message: apb.PartChunk, sent: bytes) -> None:
        """``check_answer``, then ``take``, on a worker thread (hashing, the signature and decoding run beside
        the event loop, as ``_prepare`` does for what goes out)."""
        check_answer(self.round, part, chunk, message, sent)
        self.take(part, chunk, message)

    def take(self, part: int, chunk: int, message: apb.PartChunk) -> None:
        """A checked aggregate chunk of ``part``: its decoded bytes into the output, kept for validators."""
        r = self.round
        lo, hi = r.chunk_range(part, chunk)
        r.output[lo:hi] = r.codec.decode(message.data, hi - lo, sender=r.members[part])
        r.answers[part][chunk] = message
        r.received[part][chunk] = True

    async def open(self, part: int, outgoing: AsyncIterator[apb.PartChunk]) -> AsyncIterator[apb.PartChunk]:
        """The reducer's answer stream: over its data address when it has one that answers, else libp2p."""
        r = self.round
        peer, address = r.peer_ids[part], r.addresses[part]
        if r.data_plane is not None and address is not None:
            try:
                connection = await r.data_plane.connect(address, peer, timeout_s=r.connect_timeout_s)
                return connection.exchange(outgoing)
            except SwarmError as e:
                logger.info(f"reaching {peer.to_base58()} through libp2p: {e}")
        stub = r.servicer_type.get_stub(r.p2p, peer, namespace=r.prefix)
        return await stub.rpc_aggregate_part(outgoing)
