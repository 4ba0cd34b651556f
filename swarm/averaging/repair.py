"""Rounds that finish despite a withholder: a part whose reducer did not deliver is re-reduced in the round.

When the reducer of part ``p`` fails a sender (silence, a broken stream, an answer that does not hold
up, or a first answer that it knows no such round: it is listed with its own signed entry, so a denial
is a withholding like any other), the sender turns to
``p``'s *substitute*: the next member after ``p``, in member order, that reduces
a part (``substitute``). It streams the substitute the same signed contributions to ``p`` it sent the
reducer (Ed25519 signs the same bytes the same), and takes back ``p``'s aggregate:

- **relayed**: when the substitute itself received the reducer's whole aggregate, it passes on those
  signed chunks, so members that got the part from its reducer and those that did not hold the same bits;
- **re-reduced**: otherwise the substitute waits until every other member still in the round (all but
  the reducer and those already dropped for silence) has sent its chunks of ``p``, aggregates them and
  its own with the run's rule and the same seed (``aggregation_seed`` names the part, not who reduces
  it), and signs the result over the exact inputs it used, as a reducer does. A member the reducer did
  serve never asks, so then the repair runs out of time and the part stays missing, as before: members
  never end with two versions of a part, and attackers that are a minority of the group are a minority
  of the inputs. Chunks are streamed back as they are signed; one repair stream per sender.

A re-reduced part is checked by validators like any other: its answers name the substitute as their
signer (``ButterflyAllReduce.signers``), the substitute shows the inputs it aggregated, and the evidence
names it (``RoundEvidence.signer``). Reveals wait for repairs (a sender's phase one ends only once every
part arrived, by either path, or failed), so the substitute, like a reducer, signs before it can know
the draw. The reducer that did not deliver is still reported and avoided (``failed_reducers``, or
``denied_by`` for a denial).

What a repair cannot do: any member (an attacker too) can veto it by not asking, and a reducer that
delivers to some members but not to the substitute leaves the rest with an incomplete round, to retry or
to catch up by download.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import torch

from protocols import averaging_pb2 as apb
from protocols.errors import ProtocolError
from swarm.averaging.evidence import SignedInput
from swarm.averaging.sender import check_answer

if TYPE_CHECKING:
    from swarm.averaging.allreduce import ButterflyAllReduce

logger = logging.getLogger(__name__)


class PartRepair:
    """The substitute's side of one part's repair in one round."""

    def __init__(self, round: ButterflyAllReduce, part: int):
        self.round, self.part = round, part
        chunks = round.chunk_count(part)
        self.inputs: list[dict[int, tuple[torch.Tensor, SignedInput]]] = [{} for _ in range(chunks)]
        self.weights: dict[int, float] = {}
        self.results: list[apb.PartChunk | None] = [None] * chunks
        self.ready = [asyncio.Event() for _ in range(chunks)]  # set once a chunk's result is known, or failed
        self.evidence: list[list[SignedInput]] = [[] for _ in range(chunks)]  # what a validator may ask for
        self.relayed = False
        self.streams: set[int] = set()  # senders that opened a repair stream: one each
        self.changed, self.done = asyncio.Event(), asyncio.Event()
        self.task = asyncio.create_task(self._run())

    @property
    def complete(self) -> bool:
        return all(r is not None for r in self.results)

    def senders(self) -> set[int]:
        """Whose inputs it waits for: every member still in the round here (not dropped from this peer's
        own part) but the part's reducer. A member the reducer served never comes, so the part is never
        re-reduced while an honest member holds the reducer's version, and attackers can never make up
        the majority of its inputs while they are a minority of the group."""
        return (self.round.reducer.active - {self.part}) | {self.round.index}

    def deliver(self, sender: int, chunk: int, values: torch.Tensor, signed: SignedInput) -> None:
        if not self.done.is_set():
            self.inputs[chunk][sender] = (values, signed)
            self.changed.set()

    async def _run(self) -> None:
        r, part = self.round, self.part
        loop = asyncio.get_running_loop()
        try:
            # This peer's own stream to the reducer must have ended (its deadlines bound it).
            await asyncio.wait_for(r.sender.direct_done[part].wait(), r.round_timeout_s)
            if all(r.received[part]):
                self.results = [r.answers[part].get(c) for c in range(len(self.results))]
                self.relayed = True
                return
            for chunk in range(len(self.results)):
                self.deliver(r.index, chunk, *r.sender.own_decoded(part, chunk))
            deadline = loop.time() + r.round_timeout_s
            for chunk in range(len(self.results)):
                await self._reduce(chunk, deadline)
                self.ready[chunk].set()  # streamed as soon as it is signed
        except Exception as e:
            logger.warning(f"repairing part {part} of round {r.group_id.hex()[:8]} failed: {e!r}")
            self.results = [None] * len(self.results)
        finally:
            for event in self.ready:
                event.set()
            self.done.set()

    async def _reduce(self, chunk: int, deadline: float) -> None:
        r, part = self.round, self.part
        loop = asyncio.get_running_loop()
        while not self.senders() <= set(self.inputs[chunk]):
            self.changed.clear()
            left = deadline - loop.time()
            if left <= 0:
                missing = [r.members[i] for i in sorted(self.senders() - set(self.inputs[chunk]))]
                raise ProtocolError(f"no input to chunk {chunk} from {missing}: they may hold the reducer's")
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.changed.wait(), left)
        senders = sorted(self.senders())
        if 2 * len(senders) <= len(r.members):
            raise ProtocolError(f"only {len(senders)} of {len(r.members)} members are left to aggregate")
        inputs = [self.inputs[chunk][s] for s in senders]
        self.results[chunk] = await r.reducer.aggregate(part, chunk, inputs)
        self.evidence[chunk] = [signed for _, signed in inputs]
        self.inputs[chunk].clear()

    async def consume(self, sender: int, first: apb.PartChunk, stream: AsyncIterator[apb.PartChunk]) -> None:
        """Take one sender's chunks of the part; a chunk that does not hold up ends its share."""
        r, expected, message = self.round, 0, first
        peer = r.members[sender]
        try:
            while True:
                if message.part_index != self.part or message.chunk_index != expected:
                    raise ProtocolError(f"sent part {message.part_index} chunk {message.chunk_index}")
                r.reducer.check_contribution(sender, message, expected, part=self.part, weights=self.weights)
                lo, hi = r.chunk_range(self.part, expected)
                r.count(received=len(message.data))
                values = r.codec.decode_contribution(message.data, hi - lo, sender=peer)
                self.deliver(
                    sender,
                    expected,
                    values,
                    SignedInput(sender, message.data, message.signature, message.weight),
                )
                expected += 1
                if expected == len(self.results):
                    return
                message = await r.next(stream, r.sender_timeout_s)
        except Exception as e:  # its input stays missing: the repair fails at its deadline
            logger.info(f"{peer} sent a bad repair stream for part {self.part}: {e!r}")

    def trim(self, drawn: int | None) -> None:
        self.evidence = [inputs if c == drawn else [] for c, inputs in enumerate(self.evidence)]


class PartRepairs:
    """The repairs of one round: the parts this peer stands in for (``by_part``), and a sender's turn to a
    part's substitute once its reducer failed it (``recover``)."""

    def __init__(self, round: ButterflyAllReduce):
        self.round = round
        self.by_part: dict[int, PartRepair] = {}

    def substitute(self, part: int) -> int | None:
        """The member that stands in for the reducer of ``part``: the next one after it that reduces."""
        count = len(self.round.members)
        return next((i % count for i in range(part + 1, part + count) if self.round.reduces(i % count)), None)

    def input_dropped(self) -> None:
        """A member left the round here: every repair has one input fewer to wait for."""
        for repair in self.by_part.values():
            repair.changed.set()

    def trim(self, drawn: list[int | None]) -> None:
        """Keep only the inputs of each repaired part's drawn chunk."""
        for part, repair in self.by_part.items():
            repair.trim(drawn[part])

    def _repair_for(self, part: int) -> PartRepair:
        repair = self.by_part.get(part)
        if repair is None:
            repair = self.by_part[part] = PartRepair(self.round, part)
            self.round.tasks.append(repair.task)
        return repair

    async def serve(
        self, first: apb.PartChunk, stream: AsyncIterator[apb.PartChunk], sender: int
    ) -> AsyncIterator[apb.PartChunk]:
        """Member ``sender``'s contributions to a part whose reducer failed it; that part's aggregate back."""
        r, part = self.round, first.part_index
        if (
            part >= len(r.members)
            or sender == part
            or not r.reduces(part)
            or self.substitute(part) != r.index
        ):
            yield apb.PartChunk(code=apb.BAD_CHUNK, error=f"this member does not stand in for part {part}")
            return
        if r.closed:
            yield apb.PartChunk(code=apb.BAD_GROUP, error="this round is over here")
            return
        repair = self._repair_for(part)
        if sender in repair.streams:
            yield apb.PartChunk(
                code=apb.BAD_CHUNK, error=f"already taking this member's inputs to part {part}"
            )
            return
        repair.streams.add(sender)
        consumer = asyncio.create_task(repair.consume(sender, first, stream))
        try:
            for chunk, ready in enumerate(repair.ready):
                await ready.wait()  # the repair's own deadline bounds this
                result = repair.results[chunk]
                if result is None or r.hooks.withholds_aggregates:  # a rehearsed withholder
                    return
                await r.throttle(len(result.data))
                r.count(sent=len(result.data))
                yield result
        finally:
            consumer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await consumer

    async def recover(self, part: int) -> bool:
        """After the reducer of ``part`` failed this peer: the part from its substitute; whether it came."""
        r = self.round
        substitute = self.substitute(part)
        if substitute is None or substitute == part:
            return False
        if substitute == r.index:
            repair = self._repair_for(part)
            await repair.done.wait()
            if not repair.complete or repair.relayed:
                return False
            for chunk, message in enumerate(repair.results):
                r.sender.take(part, chunk, message)
            r.signers[part] = r.index
            return True
        try:
            signer = await self._recover_from(part, substitute)
        except Exception as e:
            logger.warning(
                f"substitute {r.members[substitute]} of part {part} failed in round "
                f"{r.group_id.hex()[:8]}: {e!r}"
            )
            return False
        if signer != part:
            r.signers[part] = signer
        return True

    async def _recover_from(self, part: int, substitute: int) -> int:
        r = self.round
        chunks = r.chunk_count(part)
        messages = [r.sender.contribution(part, chunk) for chunk in range(chunks)]
        sent = [hashlib.sha256(m.data).digest() for m in messages]  # a relay may answer before we send

        async def outgoing() -> AsyncIterator[apb.PartChunk]:
            for message in messages:
                await r.throttle(len(message.data))
                r.count(sent=len(message.data))
                yield message

        stream = await r.sender.open(substitute, outgoing())
        signer = None
        try:
            for expected in range(chunks):
                # The substitute first waits out its own stream to the reducer and the other senders;
                # the round's own deadline bounds the whole wait.
                message = await r.next(stream, r.round_timeout_s)
                if message.code != apb.OK:
                    raise ProtocolError(f"answered {apb.Code.Name(message.code)}: {message.error[:200]}")
                if message.part_index != part or message.chunk_index != expected:
                    raise ProtocolError(f"sent part {message.part_index} chunk {message.chunk_index}")
                # A relayed aggregate is signed by the reducer; a re-reduced one by the substitute.
                candidates = [signer] if signer is not None else [part, substitute]
                signer = self._signed_by(part, expected, message, sent[expected], candidates)
                r.count(received=len(message.data))
                r.sender.take(part, expected, message)
        finally:
            if hasattr(stream, "aclose"):
                with contextlib.suppress(Exception):
                    await stream.aclose()
        return signer if signer is not None else part

    def _signed_by(
        self, part: int, chunk: int, message: apb.PartChunk, sent: bytes, candidates: list[int]
    ) -> int:
        error: Exception | None = None
        for signer in candidates:
            try:
                check_answer(self.round, part, chunk, message, sent, signer=signer)
                return signer
            except Exception as e:
                error = e
        raise ProtocolError(f"an answer of part {part} chunk {chunk} does not hold up: {error!r}")
