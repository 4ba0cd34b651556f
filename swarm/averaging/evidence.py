"""What members of an all-reduce round sign, and the proof that a reducer returned a wrong aggregate.

Every chunk a sender contributes is signed over the round (run prefix, group ID and the ordered member
list, hashed together), the part and chunk indices, the sender, its claimed weight and the SHA-256 of
the bytes. Every aggregate chunk a reducer returns is signed over the round, part, chunk, reducer, the
set of members it aggregated and the SHA-256 of the bytes. A replayed chunk from another round or run,
or one altered on the way, fails its signature.

The aggregate is a pure function of the signed inputs (``reduce_chunk``), so anyone holding the inputs
recomputes it bit for bit: a validator drawn by the group, and the coordinator judging an accusation.
``BadAggregateEvidence`` carries one chunk's signed inputs and the reducer's signed output; its
``judge`` says whether the reducer lied (the accused is guilty) or the evidence fails (the accuser is).
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from protocols.codec import pack, unpack
from protocols.errors import ProtocolError, SwarmError
from protocols.keys import SIGNATURE_BYTES, PublicKey
from protocols.version import SIGNATURE_DOMAIN
from swarm.averaging.aggregators import AggregatorFn
from swarm.averaging.compression import Codec
from swarm.averaging.validation import fair_weights

MAX_MEMBERS = 256
MAX_EVIDENCE_BYTES = 64 << 20


def round_digest(prefix: str, group_id: bytes, members: Sequence[str]) -> bytes:
    """Names one round: the run's averaging prefix, the group ID and who is in it, in order."""
    return hashlib.sha256(
        b"|".join([SIGNATURE_DOMAIN, b"round", prefix.encode(), group_id, *map(str.encode, members)])
    ).digest()


def contribution_message(
    digest: bytes, part: int, chunk: int, sender: str, weight: float, data: bytes
) -> bytes:
    return b"|".join(
        [
            SIGNATURE_DOMAIN,
            b"part",
            digest,
            struct.pack(">IId", part, chunk, weight),
            sender.encode(),
            hashlib.sha256(data).digest(),
        ]
    )


def aggregate_message(
    digest: bytes, part: int, chunk: int, reducer: str, included: bytes, data: bytes
) -> bytes:
    return b"|".join(
        [
            SIGNATURE_DOMAIN,
            b"aggregate",
            digest,
            struct.pack(">II", part, chunk),
            reducer.encode(),
            included,
            hashlib.sha256(data).digest(),
        ]
    )


def included_mask(indices: Sequence[int], members: int) -> bytes:
    mask = bytearray((members + 7) // 8)
    for i in indices:
        mask[i // 8] |= 1 << (i % 8)
    return bytes(mask)


def mask_indices(mask: bytes, members: int) -> list[int]:
    if len(mask) != (members + 7) // 8:
        raise ProtocolError(f"included-members mask is {len(mask)} bytes for {members} members")
    indices = [i for i in range(len(mask) * 8) if mask[i // 8] >> (i % 8) & 1]
    if indices and indices[-1] >= members:
        raise ProtocolError("included-members mask names a member beyond the group")
    return indices


def aggregation_seed(group_id: bytes, part: int, chunk: int) -> int:
    """The seed of a chunk's aggregation (bucketing): fixed by the round, so anyone can recompute it."""
    return (
        int.from_bytes(
            hashlib.sha256(b"seed|" + group_id + struct.pack(">II", part, chunk)).digest()[:8], "big"
        )
        >> 1
    )


def reduce_chunk(
    aggregator: AggregatorFn,
    codec: Codec,
    inputs: Sequence[torch.Tensor],
    weights: Sequence[float],
    seed: int,
) -> bytes:
    """The encoded aggregate of one chunk: what an honest reducer returns, bit for bit."""
    stacked = torch.stack(list(inputs))
    aggregated = aggregator(stacked, fair_weights(list(weights)), seed=seed)
    return codec.encode(aggregated)


@dataclass(frozen=True)
class SignedInput:
    sender_index: int
    data: bytes
    signature: bytes
    weight: float


@dataclass(frozen=True)
class BadAggregateEvidence:
    """One chunk of one part: the members' signed inputs and the reducer's signed aggregate of them."""

    prefix: str
    group_id: bytes
    members: tuple[str, ...]
    part: int
    chunk: int
    numel: int
    inputs: tuple[SignedInput, ...]
    output: bytes
    output_signature: bytes
    included: bytes

    @property
    def reducer(self) -> str:
        return self.members[self.part]

    def to_bytes(self) -> bytes:
        return pack(
            {
                "prefix": self.prefix, "group_id": self.group_id, "members": list(self.members),
                "part": self.part, "chunk": self.chunk, "numel": self.numel,
                "inputs": [[i.sender_index, i.data, i.signature, i.weight] for i in self.inputs],
                "output": self.output, "output_signature": self.output_signature, "included": self.included,
            }
        )  # fmt: skip

    @classmethod
    def from_bytes(cls, data: bytes) -> BadAggregateEvidence:
        body = unpack(
            data, what="accusation evidence", max_bytes=MAX_EVIDENCE_BYTES, max_binary=MAX_EVIDENCE_BYTES
        )
        try:
            members = tuple(body["members"])
            if not 2 <= len(members) <= MAX_MEMBERS or not all(
                isinstance(m, str) and len(m) < 128 for m in members
            ):
                raise ProtocolError(f"evidence names {len(members)} members")
            inputs = tuple(SignedInput(int(i), bytes(d), bytes(s), float(w)) for i, d, s, w in body["inputs"])
            evidence = cls(
                prefix=str(body["prefix"]), group_id=bytes(body["group_id"]), members=members,
                part=int(body["part"]), chunk=int(body["chunk"]), numel=int(body["numel"]), inputs=inputs,
                output=bytes(body["output"]), output_signature=bytes(body["output_signature"]),
                included=bytes(body["included"]),
            )  # fmt: skip
        except (KeyError, TypeError, ValueError) as e:
            raise ProtocolError(f"accusation evidence is malformed: {e!r}") from None
        if not 0 <= evidence.part < len(members) or evidence.numel <= 0:
            raise ProtocolError("accusation evidence names a part outside the group or an empty chunk")
        return evidence

    def judge(self, aggregator: AggregatorFn, codec: Codec) -> str | None:
        """What the reducer did wrong, or None if its aggregate is exactly right.

        Raises ProtocolError (or a SecurityError) when the evidence itself does not hold up: a signature
        that fails, inputs that do not match the members the reducer said it aggregated. Then the
        accusation is false and it is the accuser who misbehaved.
        """
        digest = round_digest(self.prefix, self.group_id, self.members)
        PublicKey.from_peer_id(self.reducer).verify(
            self.output_signature,
            aggregate_message(digest, self.part, self.chunk, self.reducer, self.included, self.output),
        )
        included = mask_indices(self.included, len(self.members))
        if [i.sender_index for i in self.inputs] != included:
            raise ProtocolError(
                f"evidence holds inputs of members {[i.sender_index for i in self.inputs]}, "
                f"but the reducer aggregated {included}"
            )
        decoded, weights = [], []
        for item in self.inputs:
            sender = self.members[item.sender_index]
            if len(item.signature) != SIGNATURE_BYTES:
                raise ProtocolError(f"the input of {sender} carries no signature")
            PublicKey.from_peer_id(sender).verify(
                item.signature,
                contribution_message(digest, self.part, self.chunk, sender, item.weight, item.data),
            )
            try:
                decoded.append(codec.decode(item.data, self.numel, sender=sender))
            except ProtocolError as e:
                # A valid signature on an invalid input: the reducer aggregated what it should have dropped.
                return f"aggregated an invalid contribution ({e})"
            weights.append(item.weight if math.isfinite(item.weight) else 0.0)
        if not decoded:
            return "returned an aggregate of no contributions"
        try:
            expected = reduce_chunk(
                aggregator, codec, decoded, weights, aggregation_seed(self.group_id, self.part, self.chunk)
            )
        except SwarmError as e:
            return f"aggregated inputs that the rule refuses ({e})"
        if expected == self.output:
            return None
        return f"returned an aggregate of part {self.part} chunk {self.chunk} that differs from the rule's result"
