"""The second tier of a step's round: one result for every group of a step (docs/scale.md).

When a step has more peers than one group holds, matchmaking forms several first-tier groups. Each runs
the butterfly round as before, so its members hold the group's aggregate ``R_g`` bit for bit, and does not
apply it. Each group's ``representative`` (by a hash of the group ID and member, among the members that
can be dialed; every member computes the same) averages ``R_g`` with weight ``W_g`` (the members' signed
weights) in a second-tier round with the other groups' representatives: the same signed, robust, verified
round under its own prefix (``tier_prefix``), in ``TIER_COMPRESSION``. The representative then hands the
result to its group's members (``TierServicer``, ``fetch_tier_result``): the second tier's signed entries
and every aggregate chunk as its signer signed it. A member checks it (``TierCheck``) before applying it:

- every entry opens, under the second tier's prefix, and proves its member's admission;
- every chunk is signed by its part's reducer (or the substitute that repaired it) over that round, covers
  more than half of its members, and lists the representative's input, if at all, as exactly its group's
  ``R_g`` (which the member holds) at weight ``W_g``: a representative cannot pass off another input or
  weight for its group, nor another result, only withhold one (the group then applies nothing and tries
  again).

Every peer then decodes the same bytes, so every group of the step applies the same vector. A group that
the step's peers fit in whole needs no second tier: its representative says ``alone`` and its members apply
their own result, as one group always did.

Example::

    check = TierCheck(first, prefix=tier_averager.prefix, schema_hash=tier_averager.schema_hash,
                      numel=n, contribution=r_g, weight=w_g, max_age_s=60.0, certify=policy.certificate_refusal)
    for part, chunk in check.expected():
        check.take(part, chunk, next_answer.chunk)
    combined = check.output
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import AsyncIterator as TypingAsyncIterator  # noqa: UP035 - hivemind reads typing hints

import torch
from hivemind.p2p import P2P, P2PContext, PeerID

from protocols import averaging_pb2 as apb
from protocols.envelope import open_envelope
from protocols.errors import ProtocolError, SwarmError
from protocols.version import MAX_ENVELOPE_BYTES
from swarm.averaging.allreduce import SignedOutput, Traffic
from swarm.averaging.compression import Codec, get_codec
from swarm.averaging.evidence import (
    DEFAULT_CHUNK_VALUES,
    MAX_MEMBERS,
    chunk_bounds,
    layout_chunk_values,
    reducer_mask,
    round_digest,
    split_bounds,
)
from swarm.averaging.groups import GROUP_ENTRY, open_entry
from swarm.averaging.sender import check_answer
from swarm.config import RunConfig
from swarm.inbound import SMALL_REQUEST_BYTES, BoundedServicer, HandlerBound

logger = logging.getLogger(__name__)

#: The second tier's wire encoding: its inputs are first-tier results, which top-k or int8 would cut again.
TIER_COMPRESSION = "fp16"
#: First-tier groups whose second-tier outcome a representative keeps for its members.
KEPT_OUTCOMES = 8
#: The largest answer message: the header with every member's signed entry, or one fp16 aggregate chunk
#: with its signed list of inputs.
MAX_TIER_ANSWER_BYTES = max(
    MAX_ENVELOPE_BYTES * 2 + SMALL_REQUEST_BYTES,
    get_codec(TIER_COMPRESSION).max_bytes(DEFAULT_CHUNK_VALUES) + 44 * MAX_MEMBERS + 4096,
)
#: Entries a header may list (the second tier's group, at most the run's ``max_group_size``).
MAX_TIER_MEMBERS = 1024


def tier_prefix(prefix: str) -> str:
    """The averaging prefix of the second tier of ``prefix``'s rounds (a run ID)."""
    return f"{prefix}.tier2"


def round_codec(run: RunConfig, prefix: str) -> Codec:
    """The wire encoding of rounds under averaging ``prefix`` (as averagers name it, "." as "_") in ``run``:
    the second tier's own, else the run's (what the coordinator decodes evidence with)."""
    if prefix == tier_prefix(run.run_id).replace(".", "_"):
        return get_codec(TIER_COMPRESSION)
    return get_codec(run.training.compression, topk_density=run.training.topk_density)


def representative(group_id: bytes, members: Sequence[str], reducers: Sequence[bool] | None) -> int:
    """The index of a group's representative: the member whose SHA-256 of (group ID, peer ID) is smallest
    among those that can be dialed (all of them when none can), so every member names the same one and no
    member picks itself by its choice of key after seeing the group ID."""
    dialable = [i for i in range(len(members)) if reducers is None or reducers[i]]
    return min(
        dialable or range(len(members)), key=lambda i: hashlib.sha256(group_id + members[i].encode()).digest()
    )


@dataclass
class TierOutcome:
    """What a representative hands its group: ``alone``, or the second tier's signed output."""

    alone: bool
    group_id: bytes = b""
    entries: list[bytes] = field(default_factory=list)
    representative: int = 0
    signers: list[int] = field(default_factory=list)  # per part: who signed its aggregate
    chunks: list[list[apb.PartChunk]] = field(default_factory=list)  # per part, in chunk order

    def answers(self) -> Iterator[apb.TierAnswer]:
        if self.alone:
            yield apb.TierAnswer(alone=True)
            return
        yield apb.TierAnswer(
            tier_group_id=self.group_id, entries=self.entries, representative=self.representative,
            signers=self.signers,
        )  # fmt: skip
        for part in self.chunks:
            for message in part:
                yield apb.TierAnswer(chunk=message)


def signed_outcome(
    group_id: bytes, entries: Sequence[bytes], index: int, signed: SignedOutput
) -> TierOutcome:
    """What a representative hands its group from its complete second-tier round: the round's group ID and
    signed entries, its own index in it, and the round's signed output (``RoundResult.signed``)."""
    return TierOutcome(False, group_id, list(entries), index, list(signed.signers), list(signed.chunks))


@dataclass
class _RoundView:
    """What ``sender.check_answer`` reads of a round, for a member that was not in it."""

    key: object
    members: list[str]
    digest: bytes
    index: int
    weight: float


class TierCheck:
    """A member's check of its representative's second-tier answer (see the module docstring); raises
    ``ProtocolError`` naming what is wrong. ``contribution`` is the group's first-tier result and ``weight``
    its total signed weight; ``certify(peer, certificate)`` says why an entry proves no admission."""

    def __init__(
        self,
        first: apb.TierAnswer,
        *,
        prefix: str,
        schema_hash: bytes,
        numel: int,
        contribution: torch.Tensor,
        weight: float,
        max_age_s: float,
        certify: Callable[[str, bytes], str | None] | None,
    ):
        entries = list(first.entries)
        if not 2 <= len(entries) <= MAX_TIER_MEMBERS:
            raise ProtocolError(f"the second tier lists {len(entries)} members")
        members, bodies = [], []
        for i, data in enumerate(entries):
            try:
                sender = open_envelope(
                    data,
                    purpose=GROUP_ENTRY,
                    run_id=prefix,
                    max_age_s=max_age_s,
                    what=f"second-tier entry {i}",
                ).sender
                body = open_entry(
                    data,
                    peer_id=sender,
                    prefix=prefix,
                    schema_hash=schema_hash,
                    signed=True,
                    max_age_s=max_age_s,
                )
            except SwarmError as e:
                raise ProtocolError(str(e)) from None
            refusal = certify(sender, body.certificate) if certify is not None else None
            if refusal is not None:
                raise ProtocolError(f"second-tier member {sender} proves no admission: {refusal}")
            members.append(sender)
            bodies.append(body)
        if len(set(members)) != len(members):
            raise ProtocolError("the second tier lists a member twice")
        n = len(members)
        if first.representative >= n:
            raise ProtocolError(f"representative index {first.representative} is not one of {n} members")
        if len(first.signers) != n or any(s >= n for s in first.signers):
            raise ProtocolError(f"{len(first.signers)} part signers for {n} members")
        self.codec = get_codec(TIER_COMPRESSION)
        mask = reducer_mask([b.dialable for b in bodies])
        self.round = _RoundView(
            key=True, members=members,
            digest=round_digest(prefix, first.tier_group_id, members, [b.commit for b in bodies], mask),
            index=first.representative, weight=float(weight),
        )  # fmt: skip
        self.signers = list(first.signers)
        self.bounds = split_bounds(numel, n, mask)
        values = layout_chunk_values(n, self.codec.bytes_per_value)
        self.chunks = [
            chunk_bounds(hi - lo, values) if not mask or mask[p] else [0]
            for p, (lo, hi) in enumerate(zip(self.bounds[:-1], self.bounds[1:], strict=True))
        ]
        self.contribution = contribution.detach().to(torch.float32).flatten()
        if self.contribution.numel() != numel:
            raise ValueError(f"the group's result has {self.contribution.numel()} values, not {numel}")
        self.output = torch.empty(numel)

    def expected(self) -> Iterator[tuple[int, int]]:
        """(part, chunk) of every aggregate chunk the answer must carry, in order."""
        for part, bounds in enumerate(self.chunks):
            for chunk in range(len(bounds) - 1):
                yield part, chunk

    def take(self, part: int, chunk: int, message: apb.PartChunk) -> None:
        """Check one aggregate chunk and decode it into ``output``."""
        if message.part_index != part or message.chunk_index != chunk:
            raise ProtocolError(
                f"sent part {message.part_index} chunk {message.chunk_index}, not {part}/{chunk}"
            )
        base = self.bounds[part]
        lo, hi = base + self.chunks[part][chunk], base + self.chunks[part][chunk + 1]
        sent = hashlib.sha256(self.codec.encode_contribution(self.contribution[lo:hi])).digest()
        signer = self.signers[part]
        try:
            check_answer(self.round, part, chunk, message, sent, signer=None if signer == part else signer)
            self.output[lo:hi] = self.codec.decode(message.data, hi - lo, sender=self.round.members[signer])
        except SwarmError as e:
            raise ProtocolError(f"part {part} chunk {chunk}: {e}") from None
        except Exception as e:  # a signature that does not verify
            raise ProtocolError(f"part {part} chunk {chunk}: {e!r}") from None


@dataclass
class _Posted:
    members: frozenset[str]
    outcome: asyncio.Future


class TierBoard:
    """The outcomes a representative holds for its groups, by first-tier group ID (the last few)."""

    def __init__(self, kept: int = KEPT_OUTCOMES):
        self.kept = kept
        self._posted: OrderedDict[bytes, _Posted] = OrderedDict()
        self._changed = asyncio.Event()

    def open(self, group_id: bytes, members: Sequence[str]) -> None:
        """This peer represents ``group_id`` now: its members may ask, and wait for the outcome."""
        self._posted[group_id] = _Posted(frozenset(members), asyncio.get_running_loop().create_future())
        while len(self._posted) > self.kept:
            _, old = self._posted.popitem(last=False)
            old.outcome.cancel()
        self._changed.set()
        self._changed = asyncio.Event()

    def post(self, group_id: bytes, outcome: TierOutcome | None) -> None:
        """The outcome of ``group_id`` (None: the second tier failed; members apply nothing)."""
        posted = self._posted.get(group_id)
        if posted is not None and not posted.outcome.done():
            posted.outcome.set_result(outcome)

    async def wait(self, group_id: bytes, asker: str, timeout_s: float) -> TierOutcome | None:
        """The outcome for ``asker``; raises ``ProtocolError`` when it may not ask, or ``TimeoutError``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while group_id not in self._posted:  # a member may finish the first tier before its representative
            left = deadline - loop.time()
            if left <= 0:
                raise ProtocolError("this peer represents no such group")
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), min(left, 1.0))
        posted = self._posted[group_id]
        if asker not in posted.members:
            raise ProtocolError("not a member of this group")
        return await asyncio.wait_for(asyncio.shield(posted.outcome), max(0.0, deadline - loop.time()))


class TierServicer(BoundedServicer):
    """A representative's answers to its group's members (hivemind finds ``rpc_*`` by annotations)."""

    bounds = {"rpc_tier_result": lambda self: HandlerBound(SMALL_REQUEST_BYTES, 2)}
    reply_bytes = {"rpc_tier_result": MAX_TIER_ANSWER_BYTES}

    def __init__(
        self, board: TierBoard, *, wait_s: Callable[[], float], admission: Callable, traffic: Traffic
    ):
        self.board, self.wait_s, self._admission, self.traffic = board, wait_s, admission, traffic

    async def admission(self, peer_id: str) -> str | None:
        return await self._admission(peer_id)

    async def rpc_tier_result(
        self, request: apb.TierRequest, context: P2PContext
    ) -> TypingAsyncIterator[apb.TierAnswer]:
        try:
            outcome = await self.board.wait(
                bytes(request.group_id), context.remote_id.to_base58(), self.wait_s()
            )
        except ProtocolError as e:
            yield apb.TierAnswer(code=apb.NOT_IN_GROUP, error=str(e))
            return
        except (asyncio.TimeoutError, asyncio.CancelledError):
            yield apb.TierAnswer(code=apb.CANCELLED, error="the second tier has not finished here in time")
            return
        if outcome is None:
            yield apb.TierAnswer(code=apb.CANCELLED, error="the second tier formed no round for this step")
            return
        for answer in outcome.answers():
            self.traffic.sent += len(answer.chunk.data)
            yield answer


async def fetch_tier_result(
    p2p: P2P,
    representative: PeerID,
    namespace: str,
    group_id: bytes,
    *,
    timeout_s: float,
    check: Callable[[apb.TierAnswer], TierCheck],
    chunk_timeout_s: float,
    traffic: Traffic,
) -> TierCheck | None:
    """Ask ``representative`` for the second tier's outcome of ``group_id``: None when its group was the step's
    only one (``alone``), else the checked result (``TierCheck.output``). ``check`` builds the check from the
    header. Raises ``ProtocolError`` when what it sent does not hold (a proof against it), another
    ``SwarmError`` or ``TimeoutError`` when it sent nothing usable (which an honest one may do)."""
    stub = TierServicer.get_stub(p2p, representative, namespace=namespace)
    stream: AsyncIterator[apb.TierAnswer] = await asyncio.wait_for(
        stub.rpc_tier_result(apb.TierRequest(group_id=group_id)), chunk_timeout_s
    )
    try:
        first = await asyncio.wait_for(stream.__anext__(), timeout_s)
        if first.code != apb.OK:  # honest when its second tier failed: not a proof of anything
            raise SwarmError(f"representative answered {apb.Code.Name(first.code)}: {first.error[:200]}")
        if first.alone:
            return None
        checked = check(first)
        for part, chunk in checked.expected():
            answer = await asyncio.wait_for(stream.__anext__(), chunk_timeout_s)
            traffic.received += len(answer.chunk.data)
            checked.take(part, chunk, answer.chunk)
        return checked
    except StopAsyncIteration:
        raise SwarmError("representative ended its answer early") from None
    finally:
        if hasattr(stream, "aclose"):
            with contextlib.suppress(Exception):
                await stream.aclose()


__all__ = [
    "TIER_COMPRESSION",
    "TierBoard",
    "TierCheck",
    "TierOutcome",
    "TierServicer",
    "fetch_tier_result",
    "representative",
    "round_codec",
    "signed_outcome",
    "tier_prefix",
]
