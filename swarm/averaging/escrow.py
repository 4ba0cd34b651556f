"""Escrow of a reducer's own input: what makes a reducer that will not show it provably at fault.

A validator collects every input a reducer signed that it aggregated from that input's own sender; the
one input only the reducer held was its own contribution to its own part, so a reducer could lie, then
refuse to show its own input and end the check with no verdict. Now, before it aggregates a chunk with
its own input, the reducer of part ``p`` hands that signed input to ``p``'s *escrow holder* (the next
member in group order, ``escrow_holder``) on the holder's own part stream (``escrow`` messages, before
any aggregate). The holder checks the reducer's signature, keeps the input for the round's validation
window and answers with a *receipt*: its signature over the round, part, chunk, reducer, weight and
data hash (``receipt_message``), right after its own contribution to that chunk. The reducer passes the
receipt on with the aggregate chunk, and every sender refuses an aggregate that lists the reducer's own
input without a receipt by that holder for exactly that input (``check_receipt``). So whenever the
reducer's own input is in an aggregate that anyone applied, an honest holder holds it and shows it to
validators (``serve_inputs``), and the check ends with a verdict the coordinator can judge.

A reducer whose holder sends no receipt (gone, silent, or hostile) leaves its own values out of the
rest of its part: an honest reducer loses its own input to its own part, nothing else, and nobody is
accused for being gone. The holder learns nothing of the validator draw, which comes after delivery.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import struct

from protocols import averaging_pb2 as apb
from protocols.errors import ProtocolError
from protocols.keys import PublicKey
from protocols.version import SIGNATURE_DOMAIN
from swarm.averaging.evidence import Entry, SignedInput, contribution_message

logger = logging.getLogger(__name__)


def escrow_holder(part: int, members: int) -> int:
    """The member that holds the own input of part ``part``'s reducer: the next one in group order."""
    return (part + 1) % members


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


def check_receipt(
    digest: bytes, members: list[str], part: int, chunk: int, entries: list[Entry], receipt: bytes
) -> None:
    """ProtocolError (or SecurityError) unless an aggregate of ``part`` that lists its reducer's own
    input carries its escrow holder's receipt for exactly that input."""
    own = next((e for e in entries if e.sender_index == part), None)
    if own is None:
        return
    holder = members[escrow_holder(part, len(members))]
    if not receipt:
        raise ProtocolError("aggregated its own input without escrowing it with its escrow holder")
    PublicKey.from_peer_id(holder).verify(
        receipt, receipt_message(digest, part, chunk, holder, own.weight, own.data_hash)
    )


class PartEscrow:
    """Both sides of the escrow in a round (a mixin of ``ButterflyAllReduce``, whose constructor holds
    the state: ``escrows``, what this peer holds; ``_escrowed``, an event per chunk of the part it holds
    for; ``_receipts``, the receipts this peer got as a reducer)."""

    @property
    def escrows_own(self) -> bool:
        """Whether this reducer escrows its own input before aggregating it (in every signed round)."""
        return self.key is not None and self.reduces(self.index) and len(self.members) > 1

    @property
    def holds_for(self) -> int | None:
        """The part whose reducer escrows its own input with this peer (None in an unsigned round)."""
        if self.key is None:
            return None
        part = (self.index - 1) % len(self.members)
        return part if part != self.index and self.reduces(part) else None

    def escrow_messages(self) -> list[apb.PartChunk]:
        """This reducer's own signed input to each chunk of its part, for its escrow holder."""
        messages = []
        for chunk in range(len(self._results)):
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

    def take_escrow(self, part: int, message: apb.PartChunk) -> None:
        """Keep the signed own input the reducer of ``part`` escrowed with this peer; ProtocolError if it
        is not one (the reducer's stream then fails like any that does not hold up)."""
        chunk = message.chunk_index
        if part != self.holds_for or chunk >= len(self._escrowed) or self._escrowed[chunk].is_set():
            raise ProtocolError(f"escrowed chunk {chunk} of part {part} with a member that does not hold it")
        lo, hi = self._chunk(part, chunk)
        if len(message.data) > self.codec.max_bytes(hi - lo):
            raise ProtocolError("escrowed an input larger than its chunk")
        reducer = self.members[part]
        PublicKey.from_peer_id(reducer).verify(
            message.signature,
            contribution_message(self.digest, part, chunk, reducer, message.weight, message.data),
        )
        self.escrows[(part, chunk)] = SignedInput(part, message.data, message.signature, message.weight)
        self._escrowed[chunk].set()

    async def receipt(self, part: int, chunk: int) -> apb.PartChunk | None:
        """The receipt for the reducer's escrow of ``chunk``, once it has come (bounded by the silence
        deadline); None when it did not come."""
        try:
            await asyncio.wait_for(self._escrowed[chunk].wait(), self.sender_timeout_s)
        except asyncio.TimeoutError:
            logger.info(f"reducer {self.members[part]} escrowed no input of chunk {chunk} with this peer")
            return None
        held = self.escrows[(part, chunk)]
        message = receipt_message(
            self.digest,
            part,
            chunk,
            self.members[self.index],
            held.weight,
            hashlib.sha256(held.data).digest(),
        )
        return apb.PartChunk(part_index=part, chunk_index=chunk, receipt=self._sign(message))

    def take_receipt(self, chunk: int, message: apb.PartChunk) -> None:
        """The holder's receipt for this reducer's own input to ``chunk``: the input may now be aggregated."""
        values, own = self._own_decoded(self.index, chunk)
        holder = self.members[escrow_holder(self.index, len(self.members))]
        PublicKey.from_peer_id(holder).verify(
            message.receipt,
            receipt_message(
                self.digest, self.index, chunk, holder, own.weight, hashlib.sha256(own.data).digest()
            ),
        )
        self._receipts[chunk] = message.receipt
        self._deliver(self.index, chunk, values, own)

    def escrow_lost(self, reason: str) -> None:
        """No more receipts will come: this reducer leaves its own values out of the rest of its part."""
        if self.index in self._active:
            logger.warning(
                f"leaving this peer's own values out of the rest of its part in round "
                f"{self.group_id.hex()[:8]}: its escrow holder {reason}"
            )
            self._active.discard(self.index)
            self._changed.set()
