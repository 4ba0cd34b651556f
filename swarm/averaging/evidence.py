"""What members of an all-reduce round sign, and the proof that a reducer (or a sender) cheated.

Every chunk a sender contributes is signed over the round (run prefix, group ID, the ordered member
list and the members' fresh nonce commitments, hashed together), the part and chunk indices, the
sender, its claimed weight and the SHA-256 of the bytes. Every aggregate chunk a reducer returns is
signed over the round, part, chunk, reducer, its list of the exact inputs it aggregated (``entries``:
sender, weight and data hash of each) and the SHA-256 of the bytes. A replayed chunk from another
round or run, or one altered on the way, fails its signature.

The aggregate is a pure function of the signed inputs (``reduce_chunk``), so anyone holding the inputs
recomputes it bit for bit: a validator drawn by the group, and the coordinator judging an accusation.
``BadAggregateEvidence`` carries one chunk's signed inputs and the reducer's signed list and output;
``EquivocationEvidence`` two different inputs one member signed for one chunk. Their ``judge`` takes
the chunk's size from the run's layout (``chunk_numel``), never from the evidence, and says whether
the accused cheated, or raises when the evidence fails (then the accuser is guilty).
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from protocols.codec import pack, unpack
from protocols.errors import InvalidContribution, ProtocolError, SwarmError
from protocols.keys import SIGNATURE_BYTES, PublicKey
from protocols.version import SIGNATURE_DOMAIN
from swarm.averaging.aggregators import AggregatorFn
from swarm.averaging.compression import Codec
from swarm.averaging.validation import fair_weights

# Evidence is judged for groups as large as a run allows (RunConfig.training.max_group_size).
MAX_MEMBERS = 1024
MAX_EVIDENCE_BYTES = 64 << 20
# Values in all in one piece of evidence (1,024 members' inputs and entries are a few thousand): 32 MiB of
# nested empty lists, decoded, cost the coordinator seconds and half a GiB.
MAX_EVIDENCE_ITEMS = 1 << 16
DEFAULT_CHUNK_VALUES = 1 << 16
# The inputs of one chunk stay under this many bytes, so that the evidence of any group fits its limit.
EVIDENCE_INPUT_BUDGET = 48 << 20
# The coordinator demands the inputs behind an aggregate signed at most this long before it judges
# (``coordinator.roundinputs``). Members refuse an aggregate whose signed time is further than the
# envelope's clock skew bound (120 s) from their own clock, so a reducer that dates its aggregate back
# still leaves its validator minutes to wait out the reveals, collect inputs and file; every peer keeps
# the inputs it aggregated for ``swarm.averaging.archive.KEEP_INPUTS_S``, longer than both together.
INPUT_DEMAND_WINDOW_S = 600.0
NONCE_BYTES = 32  # a member's round nonce; its SHA-256 is its matchmaking commitment
ENTRY = struct.Struct(">Id32s")  # one aggregated input: sender index, signed weight, SHA-256 of the data


def split_bounds(numel: int, parts: int, reducers: Sequence[bool] = ()) -> list[int]:
    """Boundaries of ``parts`` contiguous slices of ``range(numel)``, nearly equal among the members
    that reduce (``reducers``, one flag per part; empty: all of them), empty for those that do not: a
    member nobody can dial reduces no part (hivemind's client mode)."""
    if not reducers:
        return [numel * i // parts for i in range(parts + 1)]
    if len(reducers) != parts or not any(reducers):
        raise ProtocolError(f"a layout of {parts} parts needs {parts} reducer flags, at least one set")
    count, bounds, seen = sum(map(bool, reducers)), [0], 0
    for reduces in reducers:
        seen += bool(reduces)
        bounds.append(numel * seen // count)
    return bounds


def reducer_mask(flags: Sequence[bool]) -> tuple[bool, ...]:
    """The canonical form of a group's reducer flags: empty when every member reduces (the plain layout)."""
    return () if all(flags) else tuple(bool(f) for f in flags)


def chunk_bounds(numel: int, chunk_values: int) -> list[int]:
    return [*range(0, numel, chunk_values), numel] if numel else [0, 0]


def layout_chunk_values(members: int, bytes_per_value: int) -> int:
    """Values per chunk in a group of ``members``: the default, smaller in big groups (evidence size)."""
    return max(1024, min(DEFAULT_CHUNK_VALUES, EVIDENCE_INPUT_BUDGET // (members * bytes_per_value)))


def chunk_numel(
    vector_numel: int, members: int, part: int, chunk: int, chunk_values: int, reducers: Sequence[bool] = ()
) -> int:
    """How many values chunk ``chunk`` of part ``part`` holds in the run's layout (0 if there is none)."""
    bounds = split_bounds(vector_numel, members, reducers)
    chunks = chunk_bounds(bounds[part + 1] - bounds[part], chunk_values)
    return chunks[chunk + 1] - chunks[chunk] if 0 <= chunk < len(chunks) - 1 else 0


def draw_seed(digest: bytes, nonces: Sequence[bytes]) -> bytes:
    """The group's random draw from every member's revealed nonce, in member order.

    Each nonce is hashed under its own domain: its plain SHA-256 is the member's matchmaking commitment,
    which every member (and the round's digest) holds before any part is delivered, so a draw built from
    those hashes would be known to every reducer before it signs."""
    hashed = b"".join(hashlib.sha256(b"swarm/draw-nonce|" + nonce).digest() for nonce in nonces)
    return hashlib.sha256(b"shared|" + digest + hashed).digest()


def drawn_validator(seed: bytes, part: int, members: int, reducers: Sequence[bool] = ()) -> int:
    """The member that the group's draw ``seed`` names to check ``part`` (never the part's own reducer).

    With ``reducers`` (the round's ``reducer_mask``), only a member that reduces a part is drawn: one that
    reduces none receives no part streams, so no reveals, and never learns the draw it would check by."""
    draw = hashlib.sha256(seed + part.to_bytes(4, "big")).digest()
    if reducers:
        eligible = [i for i in range(members) if i != part and reducers[i]]
        if eligible:
            return eligible[int.from_bytes(draw[:8], "big") % len(eligible)]
    return (part + 1 + int.from_bytes(draw[:8], "big") % (members - 1)) % members


def drawn_chunk(seed: bytes, part: int, chunks: int) -> int | None:
    """The chunk of ``part`` that the group's draw ``seed`` names for checking (None: the part is empty)."""
    if chunks <= 0:
        return None
    return int.from_bytes(hashlib.sha256(seed + part.to_bytes(4, "big")).digest()[16:24], "big") % chunks


def round_digest(
    prefix: str,
    group_id: bytes,
    members: Sequence[str],
    commitments: Sequence[bytes] = (),
    reducers: Sequence[bool] = (),
) -> bytes:
    """Names one round: the run's averaging prefix, the group ID, who is in it (in order), the members'
    fresh nonce commitments, so a leader that reuses a group ID still names a new round, and which
    members reduce a part (``reducer_mask``; nothing when all do), so every signature of the round also
    fixes its layout and evidence cannot claim another one."""
    mask = [b"reducers", bytes(map(bool, reducers))] if reducers else []
    fields = [SIGNATURE_DOMAIN, b"round", prefix.encode(), group_id, *map(str.encode, members), *commitments]
    return hashlib.sha256(b"|".join(fields + mask)).digest()


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
    digest: bytes, part: int, chunk: int, reducer: str, entries: bytes, data: bytes, signed_at_ms: int
) -> bytes:
    """What a reducer signs: its output and ``entries``, the exact inputs it aggregated (see below), and
    when it signed (Unix milliseconds: how long it must still be able to show those inputs)."""
    return b"|".join(
        [
            SIGNATURE_DOMAIN,
            b"aggregate",
            digest,
            struct.pack(">IIQ", part, chunk, signed_at_ms),
            reducer.encode(),
            hashlib.sha256(entries).digest(),
            hashlib.sha256(data).digest(),
        ]
    )


@dataclass(frozen=True)
class Entry:
    """One input a reducer says it aggregated: whose, with which signed weight, and the hash of its data."""

    sender_index: int
    weight: float
    data_hash: bytes

    def matches(self, item: SignedInput) -> bool:
        """Whether ``item`` is this input: the same signed weight, and data of this hash."""
        return item.weight == self.weight and hashlib.sha256(item.data).digest() == self.data_hash


def input_entries(inputs: Sequence[tuple[int, float, bytes]]) -> bytes:
    """The reducer's commitment to its inputs, ``(sender index, weight, data)`` in sender order."""
    return b"".join(ENTRY.pack(i, w, hashlib.sha256(d).digest()) for i, w, d in inputs)


def parse_entries(entries: bytes, members: int) -> list[Entry]:
    """The inputs a reducer committed to; ProtocolError unless in strict sender order within the group."""
    if len(entries) % ENTRY.size or len(entries) // ENTRY.size > members:
        raise ProtocolError(f"an input commitment of {len(entries)} bytes does not fit {members} members")
    parsed = [Entry(*fields) for fields in ENTRY.iter_unpack(entries)]
    indices = [e.sender_index for e in parsed]
    if indices != sorted(set(indices)) or (indices and indices[-1] >= members):
        raise ProtocolError("an input commitment names members out of order, twice or beyond the group")
    if not all(math.isfinite(e.weight) and e.weight >= 0 for e in parsed):
        raise ProtocolError("an input commitment holds a weight that is not a finite number >= 0")
    return parsed


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
    """One sender's contribution to one chunk, as it was signed: what validators collect and evidence holds."""

    sender_index: int
    data: bytes
    signature: bytes
    weight: float


def round_fields(body: dict) -> dict:
    members = tuple(body["members"])
    if not 2 <= len(members) <= MAX_MEMBERS or not all(isinstance(m, str) and len(m) < 128 for m in members):
        raise ProtocolError(f"evidence names {len(members)} members; a group has 2 to {MAX_MEMBERS}")
    commitments = tuple(bytes_field(c, "a nonce commitment", 32) for c in body.get("commitments", ()))
    if commitments and len(commitments) != len(members):
        raise ProtocolError("evidence names a nonce commitment count other than its member count")
    part, chunk = int(body["part"]), int(body["chunk"])
    if not 0 <= part < len(members) or chunk < 0:
        raise ProtocolError("evidence names a part outside the group")
    reducers = body.get("reducers", ())
    if not isinstance(reducers, list | tuple) or not all(isinstance(r, bool) for r in reducers):
        raise ProtocolError("evidence names its reducers other than as a list of flags")
    if reducers and (len(reducers) != len(members) or all(reducers) or not any(reducers)):
        raise ProtocolError("evidence names reducer flags that do not fit its members")
    signer = body.get("signer")
    if signer is not None and (type(signer) is not int or not 0 <= signer < len(members) or signer == part):
        raise ProtocolError("evidence names as the part's substitute signer no other member of the group")
    return {
        "prefix": str(body["prefix"]), "group_id": bytes_field(body["group_id"], "the group ID", 64), "members": members,
        "commitments": commitments, "part": part, "chunk": chunk, "reducers": tuple(reducers),
        "signer": signer,
    }  # fmt: skip


def bytes_field(value: object, what: str, max_bytes: int) -> bytes:
    """``value`` if it is bytes of at most ``max_bytes`` (``bytes(n)`` of a number would allocate n)."""
    if not isinstance(value, bytes) or len(value) > max_bytes:
        raise ProtocolError(f"evidence holds {what} that is not bytes of at most {max_bytes}")
    return value


def _signed_at(body: dict) -> int:
    signed_at = body.get("signed_at_ms", 0)
    if type(signed_at) is not int or not 0 <= signed_at < 2**63:
        raise ProtocolError("evidence names a signing time outside 0 to 2^63 ms")
    return signed_at


def signed_input(item: list) -> SignedInput:
    index, data, signature, weight = item
    if type(index) is not int or not 0 <= index < MAX_MEMBERS:
        raise ProtocolError("evidence holds an input of no member index")
    data = bytes_field(data, "an input", MAX_EVIDENCE_BYTES)
    weight = float(weight)
    if not (math.isfinite(weight) and weight >= 0):
        raise ProtocolError("evidence holds an input whose weight is not a finite number >= 0")
    return SignedInput(index, data, bytes_field(signature, "a signature", SIGNATURE_BYTES), weight)


@dataclass(frozen=True)
class RoundEvidence:
    """What every piece of evidence names: the round (its digest) and one chunk of one part."""

    prefix: str
    group_id: bytes
    members: tuple[str, ...]
    commitments: tuple[bytes, ...]
    part: int
    chunk: int
    # Which members reduce a part (``reducer_mask``): the layout the judge computes, fixed by the digest.
    reducers: tuple[bool, ...] = field(default=(), kw_only=True)
    # The member that signed the part's aggregate when it is not the part's reducer: its substitute,
    # which re-reduced the part after the reducer failed to deliver it (see ``repair``).
    signer: int | None = field(default=None, kw_only=True)

    @property
    def reducer_index(self) -> int:
        """The member whose signed aggregate (and whose own input to it) the evidence is about."""
        return self.part if self.signer is None else self.signer

    @property
    def digest(self) -> bytes:
        return round_digest(self.prefix, self.group_id, self.members, self.commitments, self.reducers)

    def verify_input(self, item: SignedInput) -> str:
        """The sender of ``item`` if its signature holds for this round and chunk; else an error."""
        if not 0 <= item.sender_index < len(self.members):
            raise ProtocolError(
                f"evidence holds an input of member {item.sender_index} of {len(self.members)}"
            )
        sender = self.members[item.sender_index]
        if len(item.signature) != SIGNATURE_BYTES:
            raise ProtocolError(f"the input of {sender} carries no signature")
        PublicKey.from_peer_id(sender).verify(
            item.signature,
            contribution_message(self.digest, self.part, self.chunk, sender, item.weight, item.data),
        )
        return sender

    def _fields(self) -> dict:
        return {
            "prefix": self.prefix, "group_id": self.group_id, "members": list(self.members),
            "commitments": list(self.commitments), "part": self.part, "chunk": self.chunk,
            **({"reducers": list(self.reducers)} if self.reducers else {}),
            **({"signer": self.signer} if self.signer is not None else {}),
        }  # fmt: skip


@dataclass(frozen=True)
class BadAggregateEvidence(RoundEvidence):
    """One chunk of one part: the reducer's signed aggregate, its commitment to the inputs it aggregated
    (``entries``) and those inputs, each signed by its sender."""

    numel: int
    inputs: tuple[SignedInput, ...]
    output: bytes
    output_signature: bytes
    entries: bytes
    signed_at_ms: int

    kind = "bad_aggregate"

    @property
    def reducer(self) -> str:
        return self.members[self.reducer_index]

    @property
    def accused(self) -> str:
        return self.reducer

    def to_bytes(self) -> bytes:
        return pack(self._body())

    def _body(self) -> dict:
        return {
            "kind": self.kind, **self._fields(), "numel": self.numel,
            "inputs": [[i.sender_index, i.data, i.signature, i.weight] for i in self.inputs],
            "output": self.output, "output_signature": self.output_signature, "entries": self.entries,
            "signed_at_ms": self.signed_at_ms,
        }  # fmt: skip

    @classmethod
    def from_body(cls, body: dict) -> BadAggregateEvidence:
        return cls(
            **round_fields(body), numel=int(body["numel"]), inputs=tuple(signed_input(i) for i in body["inputs"]),
            output=bytes_field(body["output"], "the output", MAX_EVIDENCE_BYTES),
            output_signature=bytes_field(body["output_signature"], "the output's signature", SIGNATURE_BYTES),
            entries=bytes_field(body["entries"], "the entries", MAX_MEMBERS * ENTRY.size),
            signed_at_ms=_signed_at(body),
        )  # fmt: skip

    def verify_output(self) -> list[Entry]:
        """The entries the reducer signed it aggregated, if its signature over the output holds."""
        PublicKey.from_peer_id(self.reducer).verify(
            self.output_signature,
            aggregate_message(
                self.digest, self.part, self.chunk, self.reducer, self.entries, self.output, self.signed_at_ms
            ),
        )
        return parse_entries(self.entries, len(self.members))

    def check_layout(self, codec: Codec, vector_numel: int, chunk_values: int | None = None) -> None:
        """The chunk's size must be the run's layout's (``vector_numel`` values averaged in all)."""
        if chunk_values is None:
            chunk_values = layout_chunk_values(len(self.members), codec.bytes_per_value)
        expected = chunk_numel(
            vector_numel, len(self.members), self.part, self.chunk, chunk_values, self.reducers
        )
        if self.numel != expected or expected == 0:
            raise ProtocolError(
                f"evidence says chunk {self.chunk} of part {self.part} holds {self.numel} values; "
                f"the run's layout gives {expected}"
            )

    def checked_inputs(
        self, codec: Codec, vector_numel: int, chunk_values: int | None = None
    ) -> list[torch.Tensor]:
        """The inputs' decoded values, in order, once the evidence holds: the chunk's size is the run's
        layout's, the reducer signed the output over exactly these inputs, and each sender signed its
        own. ProtocolError (or a SecurityError) when it does not; ``InvalidContribution``
        when a validly signed input does not decode."""
        self.check_layout(codec, vector_numel, chunk_values)
        entries = self.verify_output()
        if [i.sender_index for i in self.inputs] != [e.sender_index for e in entries]:
            raise ProtocolError(
                f"evidence holds inputs of members {[i.sender_index for i in self.inputs]}, "
                f"but the reducer aggregated {[e.sender_index for e in entries]}"
            )
        decoded = []
        for item, entry in zip(self.inputs, entries, strict=True):
            sender = self.verify_input(item)
            if not entry.matches(item):
                raise ProtocolError(f"the input of {sender} is not the one the reducer aggregated")
            try:
                decoded.append(codec.decode_contribution(item.data, self.numel, sender=sender))
            except ProtocolError as e:
                raise InvalidContribution(str(e)) from None
        return decoded

    def judge(
        self, aggregator: AggregatorFn, codec: Codec, *, vector_numel: int, chunk_values: int | None = None
    ) -> str | None:
        """What the reducer did wrong, or None if its aggregate is exactly right.

        ``vector_numel`` is the length of the averaged vector in the run (its trainable parameters):
        the chunk's size comes from the run's layout, never from the accuser. Raises ProtocolError (or
        a SecurityError) when the evidence itself does not hold up: a size other than the layout's, a
        signature that fails, inputs other than those the reducer signed that it aggregated. Then the
        accusation is false and it is the accuser who misbehaved.
        """
        try:
            decoded = self.checked_inputs(codec, vector_numel, chunk_values)
        except InvalidContribution as e:
            # A valid signature on an invalid input: the reducer aggregated what it should have dropped.
            return f"aggregated an invalid contribution ({e})"
        weights = [item.weight for item in self.inputs]
        if not decoded:
            return "returned an aggregate of no contributions"
        try:
            expected_output = reduce_chunk(
                aggregator, codec, decoded, weights, aggregation_seed(self.group_id, self.part, self.chunk)
            )
        except SwarmError as e:
            return f"aggregated inputs that the rule refuses ({e})"
        if expected_output == self.output:
            return None
        return f"returned an aggregate of part {self.part} chunk {self.chunk} that differs from the rule's result"


@dataclass(frozen=True)
class EquivocationEvidence(RoundEvidence):
    """Two different contributions one sender signed for the same chunk of the same round.

    Or, for a reducer's own input to its own part, one contribution it signed (``first``) and its signed
    aggregate whose input list (``entries``) names another one of its own: ``second`` is then None.
    """

    first: SignedInput
    second: SignedInput | None
    entries: bytes = b""
    output: bytes = b""
    output_signature: bytes = b""
    signed_at_ms: int = 0

    kind = "equivocation"

    @property
    def accused(self) -> str:
        return self.members[self.first.sender_index]

    def to_bytes(self) -> bytes:
        inputs = [self.first] if self.second is None else [self.first, self.second]
        return pack(
            {
                "kind": self.kind, **self._fields(),
                "inputs": [[i.sender_index, i.data, i.signature, i.weight] for i in inputs],
                "entries": self.entries, "output": self.output, "output_signature": self.output_signature,
                "signed_at_ms": self.signed_at_ms,
            }
        )  # fmt: skip

    @classmethod
    def from_body(cls, body: dict) -> EquivocationEvidence:
        inputs = [signed_input(i) for i in body["inputs"]]
        if not 1 <= len(inputs) <= 2:
            raise ProtocolError("equivocation evidence holds one or two inputs")
        return cls(
            **round_fields(body), first=inputs[0], second=inputs[1] if len(inputs) == 2 else None,
            entries=bytes_field(body.get("entries", b""), "the entries", MAX_MEMBERS * ENTRY.size),
            output=bytes_field(body.get("output", b""), "the output", MAX_EVIDENCE_BYTES),
            output_signature=bytes_field(body.get("output_signature", b""), "the output's signature", SIGNATURE_BYTES),
            signed_at_ms=_signed_at(body),
        )  # fmt: skip

    def judge(self, aggregator: AggregatorFn, codec: Codec, *, vector_numel: int, **_: object) -> str | None:
        """What the sender did wrong; ProtocolError (or a SecurityError) if the inputs do not prove it."""
        sender = self.verify_input(self.first)
        if self.second is None:
            return self._judge_against_own_commitment(sender)
        if self.first.sender_index != self.second.sender_index:
            raise ProtocolError("equivocation evidence holds the inputs of two different members")
        if (self.first.weight, self.first.data) == (self.second.weight, self.second.data):
            raise ProtocolError("equivocation evidence holds the same contribution twice")
        self.verify_input(self.second)
        return f"{sender} signed two different contributions to part {self.part} chunk {self.chunk}"

    def _judge_against_own_commitment(self, reducer: str) -> str:
        if self.first.sender_index != self.reducer_index:
            raise ProtocolError("an input set against a commitment must be the reducer's own")
        PublicKey.from_peer_id(reducer).verify(
            self.output_signature,
            aggregate_message(
                self.digest, self.part, self.chunk, reducer, self.entries, self.output, self.signed_at_ms
            ),
        )
        entries = parse_entries(self.entries, len(self.members))
        own = next((e for e in entries if e.sender_index == self.reducer_index), None)
        if own is None:
            raise ProtocolError("the reducer's input list holds no input of its own")
        if own.matches(self.first):
            raise ProtocolError("the reducer's own input is the one it aggregated")
        return f"signed a contribution to its own part {self.part} chunk {self.chunk} other than the one it aggregated"


@dataclass(frozen=True)
class UnshownInputEvidence(BadAggregateEvidence):
    """A reducer's signed aggregate of the round's drawn chunk, with the inputs it signed for that the
    validator collected, and the ones nobody showed (``missing``, sender indices): the coordinator
    demands those of the reducer, which holds every input it aggregated, and convicts it if it does not
    show them (``coordinator.roundinputs``). ``reveals`` are the members' nonces, in member order: they
    must match the round's commitments and draw this chunk of the part, the only one an honest reducer
    must keep once the draw is known."""

    missing: tuple[int, ...] = ()
    reveals: tuple[bytes, ...] = ()

    kind = "unshown_input"

    def _body(self) -> dict:
        return {**super()._body(), "missing": list(self.missing), "reveals": list(self.reveals)}

    @classmethod
    def from_body(cls, body: dict) -> UnshownInputEvidence:
        base = BadAggregateEvidence.from_body(body)
        missing, reveals = body["missing"], body["reveals"]
        if not isinstance(missing, list) or not all(type(i) is int for i in missing):
            raise ProtocolError("evidence names its missing inputs other than as member indices")
        if not isinstance(reveals, list) or not all(
            isinstance(r, bytes) and len(r) == NONCE_BYTES for r in reveals
        ):
            raise ProtocolError(f"evidence names its reveals other than as nonces of {NONCE_BYTES} bytes")
        fields = {f: getattr(base, f) for f in base.__dataclass_fields__}
        return cls(**fields, missing=tuple(missing), reveals=tuple(reveals))

    def check(
        self, codec: Codec, *, vector_numel: int, accuser: str, chunk_values: int | None = None
    ) -> list[Entry]:
        """The entries of the inputs the reducer must show, if the evidence holds: the run's layout, the
        reducer's signature, the drawn chunk, ``accuser`` the part's drawn validator, and each shown input
        the one it aggregated. Raises ProtocolError (or a SecurityError) otherwise: then the accuser is
        at fault."""
        self.check_layout(codec, vector_numel, chunk_values)
        entries = self.verify_output()
        if len(self.commitments) != len(self.members) or len(self.reveals) != len(self.members):
            raise ProtocolError("evidence of an unshown input needs every member's commitment and reveal")
        if any(len(r) != NONCE_BYTES for r in self.reveals):
            raise ProtocolError(f"evidence holds a reveal of other than {NONCE_BYTES} bytes")
        if any(hashlib.sha256(r).digest() != c for r, c in zip(self.reveals, self.commitments, strict=True)):
            raise ProtocolError("evidence holds a reveal that does not match its member's commitment")
        if chunk_values is None:
            chunk_values = layout_chunk_values(len(self.members), codec.bytes_per_value)
        bounds = split_bounds(vector_numel, len(self.members), self.reducers)
        chunks = len(chunk_bounds(bounds[self.part + 1] - bounds[self.part], chunk_values)) - 1
        seed = draw_seed(self.digest, self.reveals)
        if drawn_chunk(seed, self.part, chunks) != self.chunk:
            raise ProtocolError(f"chunk {self.chunk} of part {self.part} is not the one the round drew")
        # Only the drawn validator checks a part once the draw is known; no other member may demand.
        if accuser not in self.members or self.members.index(accuser) != drawn_validator(
            seed, self.part, len(self.members), self.reducers
        ):
            raise ProtocolError(f"the accuser is not the member the round drew to check part {self.part}")
        shown = {i.sender_index for i in self.inputs}
        if (
            len(shown) != len(self.inputs)
            or set(self.missing) & shown
            or len(set(self.missing)) != len(self.missing)
        ):
            raise ProtocolError("evidence names an input twice, or one as both shown and missing")
        listed = {e.sender_index: e for e in entries}
        if not self.missing or set(self.missing) | shown != set(listed):
            raise ProtocolError("evidence's shown and missing inputs are not the ones the reducer aggregated")
        for item in self.inputs:
            sender = self.verify_input(item)
            entry = listed[item.sender_index]
            if not entry.matches(item):
                raise ProtocolError(f"the input of {sender} is not the one the reducer aggregated")
        return [listed[i] for i in self.missing]

    def completed(self, shown: list[SignedInput]) -> BadAggregateEvidence:
        """The full evidence once the reducer showed the missing inputs: every input in sender order."""
        inputs = sorted([*self.inputs, *shown], key=lambda i: i.sender_index)
        fields = {f: getattr(self, f) for f in BadAggregateEvidence.__dataclass_fields__}
        return BadAggregateEvidence(**{**fields, "inputs": tuple(inputs)})

    def judge(self, aggregator: AggregatorFn, codec: Codec, *, vector_numel: int, **_: object) -> str | None:
        raise ProtocolError("evidence of an unshown input is judged with the reducer's answer to a demand")


Evidence = BadAggregateEvidence | EquivocationEvidence | UnshownInputEvidence


def parse_evidence(data: bytes) -> Evidence:
    """Evidence from an accusation, of either kind; ProtocolError if it is malformed."""
    body = unpack(
        data, what="accusation evidence", max_bytes=MAX_EVIDENCE_BYTES, max_binary=MAX_EVIDENCE_BYTES,
        max_items=MAX_EVIDENCE_ITEMS,
    )  # fmt: skip
    try:
        kinds = {cls.kind: cls for cls in (BadAggregateEvidence, EquivocationEvidence, UnshownInputEvidence)}
        cls = kinds.get(body.get("kind"))
        if cls is None:
            raise ProtocolError(f"accusation evidence of unknown kind {str(body.get('kind'))[:40]!r}")
        return cls.from_body(body)
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as e:
        raise ProtocolError(f"accusation evidence is malformed: {e!r}"[:300]) from None
