"""Escrow of a reducer's own input: what makes a reducer that will not show it provably at fault.

A validator collects every input a reducer signed that it aggregated from that input's own sender; the
one input only the reducer held was its own contribution to its own part, so a reducer could lie, then
refuse to show its own input and end the check with no verdict. Now, before it aggregates a chunk with
its own input, the reducer of part ``p`` hands that signed input to an *escrow holder*: another member,
first the next one in group order, then (when that one sends no receipt within the silence deadline:
gone, silent, or refusing) the one after, and so on (``escrow_candidates``), within the round's deadline.
The escrow goes out on the holder's own part stream (``escrow`` messages, ahead of any aggregate). The
holder checks the reducer's signature, keeps the input for the round's validation window and at once
answers with a *receipt*: its member index and its signature over the round, part, chunk, itself,
weight and data hash (``receipt_message``, ``pack_receipt``). The reducer passes the receipt on with the
aggregate chunk, and every sender refuses an aggregate that lists the reducer's own input without a
receipt for exactly that input by a member other than the reducer (``check_receipt``). So whenever the
reducer's own input is in an aggregate that anyone applied, the member its receipt names holds it and
shows it to validators (``serve_inputs``), and the check ends with a verdict the coordinator can judge.

Any member may hold: a reducer and a colluding holder can hide the reducer's own input, as a reducer
and any colluding sender could always hide that sender's input, so a designated holder would add no
security, only a round that fails when that one member is gone. A reducer that gets no receipt from
any member in time leaves its own values out of the rest of its part: an honest reducer loses its own
input to its own part, nothing else, and nobody is accused for being gone. The holder learns nothing
of the validator draw, which comes after delivery.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import struct
from collections.abc import AsyncIterator

from protocols import averaging_pb2 as apb
from protocols.errors import ProtocolError
from protocols.keys import SIGNATURE_BYTES, PublicKey
from protocols.version import SIGNATURE_DOMAIN
from swarm.averaging.evidence import Entry, SignedInput, contribution_message

logger = logging.getLogger(__name__)

RECEIPT_BYTES = 4 + SIGNATURE_BYTES  # the holder's member index (u32, big-endian), then its signature


def escrow_candidates(part: int, members: int) -> list[int]:
    """The members that part ``part``'s reducer asks to hold its own input, in turn: the next ones in
    group order, every other member once."""
    return [(part + step) % members for step in range(1, members)]


def receipt_message(
    digest: bytes, part: int, chunk: int, holder: str, weight: float, data_hash: bytes
) -> bytes:
    """What an escrow holder signs: it holds the reducer's own input of this weight and data hash."""
    return b"|".join(
        [
            SIGNATURE_DOMAIN,
            b"escrow",
            digest,
            struct.pack(">IId", part, chunk, weight),
            holder.encode(),
            data_hash,
        ]
    )


def pack_receipt(holder: int, signature: bytes) -> bytes:
    """A receipt as it crosses the wire: the holder's member index, then its signature."""
    return holder.to_bytes(4, "big") + signature


def parse_receipt(receipt: bytes, members: int, part: int) -> tuple[int, bytes]:
    """(holder, signature) of a receipt for part ``part``'s reducer; ProtocolError unless it names a
    member of the group other than that reducer."""
    if len(receipt) != RECEIPT_BYTES:
        raise ProtocolError(f"sent an escrow receipt of {len(receipt)} bytes, not {RECEIPT_BYTES}")
    holder = int.from_bytes(receipt[:4], "big")
    if holder >= members or holder == part:
        raise ProtocolError(
            f"sent an escrow receipt naming member {holder} as holder of part {part}'s own input: "
            f"a holder is another member of the group of {members}"
        )
    return holder, receipt[4:]


def check_receipt(
    digest: bytes, members: list[str], part: int, chunk: int, entries: list[Entry], receipt: bytes
) -> int | None:
    """The member holding the own input that an aggregate of ``part`` lists (None: it lists none);
    ProtocolError (or SecurityError) unless the aggregate carries that member's receipt for exactly
    that input."""
    own = next((e for e in entries if e.sender_index == part), None)
    if own is None:
        return None
    if not receipt:
        raise ProtocolError("aggregated its own input without escrowing it with another member")
    holder, signature = parse_receipt(receipt, len(members), part)
    PublicKey.from_peer_id(members[holder]).verify(
        signature, receipt_message(digest, part, chunk, members[holder], own.weight, own.data_hash)
    )
    return holder


def receipt_holder(receipt: bytes, members: int, part: int) -> int | None:
    """The holder a receipt (already checked by ``check_receipt``) names; None when there is none."""
    try:
        return parse_receipt(receipt, members, part)[0]
    except ProtocolError:
        return None


class PartEscrow:
    """Both sides of the escrow in a round (a mixin of ``ButterflyAllReduce``, whose constructor holds
    the state: ``escrows``, the own inputs this peer holds for other reducers, and ``_receipts_out``,
    its receipts for them waiting to go out; as a reducer, ``_escrow_out`` and ``_escrow_wake``, the
    escrow messages for each member's stream, ``_escrowed_with``, the chunks escrowed with each member
    and not yet receipted by it, ``_receipts``, a receipt per chunk, and ``_escrow_progress``, set on
    every receipt and every dropped member)."""

    @property
    def escrows_own(self) -> bool:
        """Whether this reducer escrows its own input before aggregating it (in every signed round)."""
        return self.key is not None and self.reduces(self.index) and len(self.members) > 1

    # --- the reducer's side ----------------------------------------------------------------------------

    async def escrow_own(self) -> None:
        """Escrow this reducer's own input with one member after another until every chunk has a
        receipt, each holder given the silence deadline to make progress, all within the round's."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.round_timeout_s
        for holder in escrow_candidates(self.index, len(self.members)):
            missing = [c for c in range(len(self._results)) if c not in self._receipts]
            if not missing or self.index not in self._active:
                return
            if holder not in self._active:  # dropped: gone, silent, or it broke a rule
                continue
            self._escrowed_with[holder] = set(missing)
            self._escrow_out.setdefault(holder, []).extend(self.escrow_messages(missing))
            self._wake(holder).set()
            if await self._receipted_by(holder, deadline):
                return
            waiting = min(c for c in range(len(self._results)) if c not in self._receipts)
            if holder in self._active and holder not in self._inputs[waiting]:
                # The verdict the reducer's own wait would reach, but now: every receipt delivered from
                # here on restarts that wait, and senders would give up on this part first.
                self._drop(holder, f"sent nothing for {self.sender_timeout_s:.1f}s")
            logger.info(
                f"escrow holder {self.members[holder]} sent no receipt for {self.sender_timeout_s:.1f}s "
                f"in round {self.group_id.hex()[:8]}; asking the next member"
            )
            if loop.time() >= deadline:
                break
        if any(c not in self._receipts for c in range(len(self._results))):
            self.escrow_lost("no member sent a receipt for its escrow in time")

    async def _receipted_by(self, holder: int, deadline: float) -> bool:
        """Whether ``holder`` receipts every chunk still missing, never silent for the silence deadline."""
        loop = asyncio.get_running_loop()
        while any(c not in self._receipts for c in range(len(self._results))):
            if holder not in self._active or self.index not in self._active:
                return False
            left = min(self.sender_timeout_s, deadline - loop.time())
            if left <= 0:
                return False
            self._escrow_progress.clear()
            try:
                await asyncio.wait_for(self._escrow_progress.wait(), left)
            except asyncio.TimeoutError:
                return False
        return True

    def _wake(self, member: int) -> asyncio.Event:
        return self._escrow_wake.setdefault(member, asyncio.Event())

    def escrow_messages(self, chunks: list[int]) -> list[apb.PartChunk]:
        """This reducer's own signed input to ``chunks`` of its part, for an escrow holder."""
        messages = []
        for chunk in chunks:
            own = self.own_input(self.index, chunk)
            messages.append(
                apb.PartChunk(
                    part_index=self.index,
                    chunk_index=chunk,
                    data=own.data,
                    weight=own.weight,
                    signature=own.signature,
                    escrow=True,
                )  # fmt: skip
            )
        return messages

    async def escrow_until(self, member: int, done: asyncio.Event) -> AsyncIterator[apb.PartChunk]:
        """The escrow messages for ``member``'s stream, as the reducer hands them out, until ``done``."""
        outbox, wake = self._escrow_out.setdefault(member, []), self._wake(member)
        while True:
            while outbox:
                message = outbox.pop(0)
                await self._throttle(len(message.data))
                self._count(sent=len(message.data))
                yield message
            if done.is_set():
                return
            wake.clear()
            waiters = [asyncio.ensure_future(done.wait()), asyncio.ensure_future(wake.wait())]
            try:
                await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for waiter in waiters:
                    waiter.cancel()

    async def _next_input(
        self, sender: int, stream: AsyncIterator[apb.PartChunk], timeout_s: float
    ) -> apb.PartChunk:
        """``sender``'s next message that is not an escrow receipt; the receipts on the way are taken
        (at most one per chunk escrowed with it, so the wait stays bounded)."""
        while True:
            message = await self._next(stream, timeout_s)
            if not message.receipt:
                return message
            self.take_receipt(sender, message)

    def take_receipt(self, sender: int, message: apb.PartChunk) -> None:
        """A holder's receipt for this reducer's own input to a chunk: the input may now be aggregated.
        ProtocolError (or SecurityError) unless ``sender`` was asked for it and signed it."""
        chunk = message.chunk_index
        asked = self._escrowed_with.get(sender, set())
        if message.part_index != self.index or chunk not in asked:
            raise ProtocolError(
                f"sent a receipt for chunk {chunk} of part {message.part_index} it was not asked to hold"
            )
        asked.discard(chunk)
        holder, signature = parse_receipt(message.receipt, len(self.members), self.index)
        if holder != sender:
            raise ProtocolError(f"sent a receipt naming member {holder} as the holder")
        values, own = self._own_decoded(self.index, chunk)
        PublicKey.from_peer_id(self.members[holder]).verify(
            signature,
            receipt_message(
                self.digest, self.index, chunk, self.members[holder], own.weight,
                hashlib.sha256(own.data).digest(),
            ),
        )  # fmt: skip
        if chunk not in self._receipts:
            self._receipts[chunk] = message.receipt
            self._deliver(self.index, chunk, values, own)
        self._escrow_progress.set()

    def escrow_lost(self, reason: str) -> None:
        """No more receipts will come: this reducer leaves its own values out of the rest of its part."""
        if self.index in self._active:
            logger.warning(
                f"leaving this peer's own values out of the rest of its part in round "
                f"{self.group_id.hex()[:8]}: {reason}"
            )
            self._active.discard(self.index)
            self._changed.set()

    # --- the holder's side -----------------------------------------------------------------------------

    def take_escrow(self, part: int, message: apb.PartChunk) -> None:
        """Keep the signed own input the reducer of ``part`` escrowed with this peer and queue its
        receipt; ProtocolError if it is not one (the reducer's stream then fails like any that does
        not hold up)."""
        chunk = message.chunk_index
        if self.key is None or message.part_index != part or chunk >= len(self.part_chunks[part]) - 1:
            raise ProtocolError(
                f"escrowed chunk {chunk} of part {message.part_index}, which it does not reduce"
            )
        if (part, chunk) in self.escrows:
            raise ProtocolError(f"escrowed chunk {chunk} of its part twice")
        lo, hi = self._chunk(part, chunk)
        if len(message.data) > self.codec.max_bytes(hi - lo):
            raise ProtocolError("escrowed an input larger than its chunk")
        if not (math.isfinite(message.weight) and message.weight >= 0):
            raise ProtocolError(f"escrowed an input of weight {message.weight!r}")
        reducer = self.members[part]
        PublicKey.from_peer_id(reducer).verify(
            message.signature,
            contribution_message(self.digest, part, chunk, reducer, message.weight, message.data),
        )
        self.escrows[(part, chunk)] = SignedInput(part, message.data, message.signature, message.weight)
        me = self.members[self.index]
        signed = receipt_message(
            self.digest, part, chunk, me, message.weight, hashlib.sha256(message.data).digest()
        )
        receipt = pack_receipt(self.index, self._sign(signed))
        self._receipts_out.setdefault(part, asyncio.Queue()).put_nowait(
            apb.PartChunk(part_index=part, chunk_index=chunk, receipt=receipt)
        )

    async def with_receipts(
        self, part: int, messages: AsyncIterator[apb.PartChunk]
    ) -> AsyncIterator[apb.PartChunk]:
        """``messages`` (this peer's stream to the reducer of ``part``), with this peer's receipts for
        that reducer's escrows slipped in as soon as they are signed."""
        outbox = self._receipts_out.setdefault(part, asyncio.Queue())

        async def step() -> tuple[bool, apb.PartChunk | None]:
            try:
                return True, await messages.__anext__()
            except StopAsyncIteration:
                return False, None

        more, message = await step()  # the first message opens the stream: nothing comes before it
        if not more:
            return
        yield message
        pending, receipt = asyncio.ensure_future(step()), None
        try:
            while True:
                receipt = asyncio.ensure_future(outbox.get())
                await asyncio.wait({pending, receipt}, return_when=asyncio.FIRST_COMPLETED)
                if receipt.done():
                    yield receipt.result()
                else:
                    receipt.cancel()
                if pending.done():
                    more, message = pending.result()
                    if not more:
                        return
                    yield message
                    pending = asyncio.ensure_future(step())
        finally:
            if receipt is not None:
                receipt.cancel()
            if pending.done():
                with contextlib.suppress(Exception):
                    await messages.aclose()
            else:  # cancelling the step closes the generator it is running
                pending.cancel()
