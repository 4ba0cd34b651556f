"""Validators: after a round, members drawn by the group's shared randomness recompute reducers' work.

The draw comes from nonces every member committed to in matchmaking and revealed only after every part
had arrived or failed for it (``ButterflyAllReduce.revealed``), so no reducer knows who checks which of
its chunks before it has signed and delivered them. For each part the draw names one other member as
its validator, which with probability ``probability`` checks one drawn chunk. A member that did not
hear every reveal draws from its own randomness and checks every part with that probability instead,
so withholding a reveal only brings more checks (those checks of chunks nobody was drawn to show
hold no one at fault).

The validator takes the reducer's signed list of the inputs it aggregated and collects each input
from its own sender (a sender holds what it signed); only where a sender does not answer does it ask
the reducer. With every input in hand it recomputes the chunk (``BadAggregateEvidence.judge``): a wrong
aggregate becomes an accusation the coordinator checks for itself. A sender whose input differs from
the one the reducer shows, both signed, equivocated: that evidence convicts the sender. An input that
neither its sender nor the reducer shows gets both avoided in matchmaking for a while (``suspect``, the
averager's ``PeerPolicy.suspect``), and, once the draw is known, ``unshown_input`` evidence: the
coordinator demands the input of the reducer, which holds every input it signed for
(``swarm.averaging.archive``), and convicts it if it does not show it (``coordinator.roundinputs``).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from hivemind.p2p import P2P, PeerID, ServicerBase

from protocols import averaging_pb2 as apb
from protocols.errors import ProtocolError, SwarmError
from swarm.averaging.aggregators import AggregatorFn
from swarm.averaging.allreduce import ButterflyAllReduce, drawn_chunk
from swarm.averaging.archive import InputArchive
from swarm.averaging.compression import Codec
from swarm.averaging.evidence import (
    BadAggregateEvidence,
    Entry,
    EquivocationEvidence,
    Evidence,
    RoundEvidence,
    SignedInput,
    UnshownInputEvidence,
    drawn_validator,
    parse_entries,
)

logger = logging.getLogger(__name__)

Accuser = Callable[[str, Evidence, str], Awaitable[None]]


@dataclass(frozen=True)
class Assignment:
    """One check a validator was drawn for: the part and the chunk of it to recompute."""

    part: int
    chunk: int


def assignments(
    seed: bytes,
    members: int,
    me: int,
    probability: float,
    chunks: list[int],
    *,
    every_part: bool = False,
    reducers: Sequence[bool] = (),
) -> list[Assignment]:
    """The parts this member validates in a round, each with the chunk to check.

    ``every_part``: this member checks each other part with ``probability``, whoever the draw names.
    ``reducers``: the round's reducer mask; only members that reduce a part are drawn as validators.
    """
    mine = []
    if members < 2 or probability <= 0:
        return mine
    for part in range(members):
        draw = hashlib.sha256(seed + part.to_bytes(4, "big")).digest()
        validator = drawn_validator(seed, part, members, reducers)
        chosen = int.from_bytes(draw[8:16], "big") / 2**64 < probability
        if (validator == me or every_part) and chosen and part != me and chunks[part] > 0:
            mine.append(Assignment(part, drawn_chunk(seed, part, chunks[part])))
    return mine


def draw(runner: ButterflyAllReduce, probability: float) -> list[Assignment]:
    """This member's checks in a round whose reveals are over."""
    chunks = [len(c) - 1 for c in runner.part_chunks]
    seed = runner.shared_seed
    if seed is None:
        return assignments(
            os.urandom(32), len(runner.peer_ids), runner.index, probability, chunks, every_part=True
        )
    return assignments(
        seed, len(runner.peer_ids), runner.index, probability, chunks, reducers=runner.reducers
    )


async def serve_inputs(
    runner: ButterflyAllReduce | None,
    request: apb.InputsRequest,
    sender: PeerID,
    *,
    judge: str | None = None,
    archive: InputArchive | None = None,
) -> AsyncIterator[apb.SignedInput]:
    """One signed input of a recent round: this peer's own contribution, or one it aggregated (from
    ``archive`` once the round itself is gone). Members of the round may ask, and ``judge`` (the
    coordinator's peer ID), which demands the inputs behind an aggregate a validator could not collect."""
    kept = None
    if runner is None and archive is not None:
        kept = archive.lookup(request.group_id, request.part_index, request.chunk_index, request.sender_index)
    if runner is None and kept is None:
        yield apb.SignedInput(code=apb.NO_EVIDENCE, error="no recent round with this group ID here")
        return
    members = runner.members if runner is not None else kept[0]
    if sender.to_base58() not in members and (judge is None or sender.to_base58() != judge):
        yield apb.SignedInput(code=apb.NOT_IN_GROUP, error="only members of the round may ask for its inputs")
        return
    if kept is not None:
        yield _answer(kept[1], request.sender_index)
        return
    part, chunk, index = request.part_index, request.chunk_index, request.sender_index
    if not (part < len(runner.part_chunks) and chunk < len(runner.part_chunks[part]) - 1):
        yield apb.SignedInput(code=apb.BAD_CHUNK, error=f"no chunk {chunk} of part {part} in this round")
        return
    item: SignedInput | None = None
    if runner.hooks.refuses_inputs:  # a rehearsed reducer that shows nothing
        pass
    elif index == runner.index:
        item = await asyncio.to_thread(runner.own_input, part, chunk)
        if item is not None:  # a rehearsed equivocator shows validators another input
            item = runner.hooks.show(runner, part, chunk, item)
    else:  # one it aggregated: of its own part, or of one it re-reduced for a reducer that failed
        item = runner.held_input(part, chunk, index)
    yield _answer(item, index)


def _answer(item: SignedInput | None, index: int) -> apb.SignedInput:
    if item is None:
        return apb.SignedInput(code=apb.NO_EVIDENCE, error=f"holds no input of member {index} to that chunk")
    return apb.SignedInput(
        sender_index=item.sender_index, data=item.data, signature=item.signature, weight=item.weight
    )


@dataclass
class Outcome:
    """What a check found: a verdict with the evidence that proves it (or, with no verdict, the evidence
    that the reducer was right), and peers that showed nothing."""

    verdict: str | None = None
    evidence: Evidence | None = None
    unshown: list[str] = field(default_factory=list)


class _Check:
    """One validator's check of one chunk of one part."""

    def __init__(self, runner, assignment, answer, *, servicer_type, p2p, codec, timeout_s):
        self.runner, self.part, self.chunk, self.answer = runner, assignment.part, assignment.chunk, answer
        # Who signed the aggregate: the part's reducer, or the substitute that re-reduced it.
        signer = runner.signers.get(self.part)
        self.signer = self.part if signer is None else signer
        self.servicer_type, self.p2p, self.timeout_s, self.codec = servicer_type, p2p, timeout_s, codec
        lo, hi = runner.chunk_range(self.part, self.chunk)
        self.numel, self.max_bytes = hi - lo, codec.max_bytes(hi - lo)
        self.round = round_of(runner, self.part, self.chunk, signer)

    async def fetch(self, holder: int, sender: int) -> SignedInput:
        """The signed input of ``sender`` as member ``holder`` shows it; ProtocolError if it does not."""
        stub = self.servicer_type.get_stub(
            self.p2p, self.runner.peer_ids[holder], namespace=self.runner.prefix
        )
        request = apb.InputsRequest(
            group_id=self.runner.group_id, part_index=self.part, chunk_index=self.chunk, sender_index=sender
        )

        async def first() -> apb.SignedInput:
            async for item in await stub.rpc_round_inputs(request):
                return item
            raise ProtocolError("answered nothing")

        try:
            item = await asyncio.wait_for(first(), self.timeout_s)
        except SwarmError:
            raise
        except Exception as e:  # a dead or misbehaving stream, or no answer in time
            raise ProtocolError(f"did not answer: {e!r}") from None
        if item.code != apb.OK:
            raise ProtocolError(f"answered {apb.Code.Name(item.code)}: {item.error[:200]}")
        if item.sender_index != sender or len(item.data) > self.max_bytes:
            raise ProtocolError("sent another member's input, or a larger one than the chunk holds")
        signed = SignedInput(item.sender_index, item.data, item.signature, item.weight)
        # The sender's signature must hold, so a holder cannot pass off an input as someone else's.
        RoundEvidence(**self.round).verify_input(signed)
        return signed

    async def collect(self, entry: Entry, outcome: Outcome) -> SignedInput | Evidence | None:
        """The input behind ``entry``: from its sender, else from the reducer; or proof of equivocation."""
        runner, index, holder = self.runner, entry.sender_index, self.signer  # it holds what it signed for
        if index == runner.index:
            return runner.own_input(self.part, self.chunk)  # the drawn chunk's input is always kept
        shown = held = None
        if index != holder:
            shown = await self._try(index, index)
            if shown is not None and entry.matches(shown):
                return shown
        held = await self._try(holder, index)
        if held is not None and entry.matches(held):
            if shown is not None:  # the sender signed this one too: it shows validators another
                return EquivocationEvidence(**self.round, first=shown, second=held)
            return held
        if held is not None and index == holder:  # the reducer's own input contradicts its own list
            return EquivocationEvidence(
                **self.round, first=held, second=None, entries=self.answer.included, output=self.answer.data,
                output_signature=self.answer.signature, signed_at_ms=self.answer.signed_at_ms,
            )  # fmt: skip
        if shown is not None and held is not None and (shown.weight, shown.data) != (held.weight, held.data):
            return EquivocationEvidence(**self.round, first=shown, second=held)
        sender, reducer = runner.members[index], runner.members[holder]
        logger.warning(
            f"neither {sender} nor reducer {reducer} showed the input of {sender} that the reducer signed "
            f"for in part {self.part} chunk {self.chunk} of round {runner.group_id.hex()[:8]}"
        )
        outcome.unshown += [reducer] if index == holder else [sender, reducer]
        return None

    async def _try(self, holder: int, sender: int) -> SignedInput | None:
        try:
            return await self.fetch(holder, sender)
        except SwarmError as e:
            logger.info(f"{self.runner.members[holder]} did not show the input of member {sender}: {e}")
            return None


def round_of(runner: ButterflyAllReduce, part: int, chunk: int, signer: int | None = None) -> dict:
    """The round fields of evidence about one chunk of ``part`` (``signer``: a substitute that re-reduced
    it, or None for the part's own reducer)."""
    return dict(
        prefix=runner.prefix, group_id=runner.group_id, members=tuple(runner.members),
        commitments=tuple(c for c in runner.commitments if c), part=part, chunk=chunk,
        reducers=runner.reducers, signer=signer,
    )  # fmt: skip


def own_part_evidence(runner: ButterflyAllReduce, chunk: int) -> BadAggregateEvidence | None:
    """What this member signed as the reducer of ``chunk`` of its own part, with the signed inputs it
    aggregated (as a validator of that chunk would collect them), for scoring its senders; None if it
    holds no such aggregate (a part re-reduced by a substitute, a failed part, or a chunk trimmed away)."""
    part = runner.index
    if part in runner.signers or not 0 <= chunk < runner.chunk_count(part):
        return None
    result, inputs = runner.reducer.results[chunk], runner.reducer.evidence[chunk]
    if result is None or not inputs:
        return None
    lo, hi = runner.chunk_range(part, chunk)
    return BadAggregateEvidence(
        **round_of(runner, part, chunk), numel=hi - lo, inputs=tuple(inputs), output=result.data,
        output_signature=result.signature, entries=result.included, signed_at_ms=result.signed_at_ms,
    )  # fmt: skip


async def check_reducer(
    runner: ButterflyAllReduce,
    assignment: Assignment,
    *,
    servicer_type: type[ServicerBase],
    p2p: P2P,
    aggregator: AggregatorFn,
    codec: Codec,
    timeout_s: float,
) -> Outcome:
    """Recompute one chunk of a reducer's part from inputs collected from their senders."""
    part, chunk, outcome = assignment.part, assignment.chunk, Outcome()
    answer = runner.answers[part].get(chunk)
    if answer is None:
        return outcome
    check = _Check(
        runner, assignment, answer, servicer_type=servicer_type, p2p=p2p, codec=codec, timeout_s=timeout_s
    )
    if check.signer == runner.index:  # this peer re-reduced the part itself
        return outcome
    reducer = runner.members[check.signer]
    entries = parse_entries(answer.included, len(runner.members))  # checked when the answer came
    found = await asyncio.gather(*(check.collect(e, outcome) for e in entries))
    equivocations = [f for f in found if isinstance(f, EquivocationEvidence)]
    if equivocations:
        proof = equivocations[0]
        verdict = (
            f"signed two different contributions to part {part} chunk {chunk}"
            if proof.second is not None
            else f"signed a contribution to its own part {part} chunk {chunk} other than the one it aggregated"
        )
        logger.warning(f"{proof.accused} {verdict} in round {runner.group_id.hex()[:8]}")
        return Outcome(verdict, proof, outcome.unshown)
    if any(f is None for f in found):
        return _unshown(runner, check, answer, entries, found, outcome)
    evidence = BadAggregateEvidence(
        **check.round, numel=check.numel, inputs=tuple(found), output=answer.data,
        output_signature=answer.signature, entries=answer.included, signed_at_ms=answer.signed_at_ms,
    )  # fmt: skip
    try:
        verdict = await asyncio.to_thread(
            evidence.judge,
            aggregator,
            codec,
            vector_numel=runner.numel,
            chunk_values=runner.chunk_values,
        )
    except SwarmError as e:  # cannot happen with inputs checked above; never accuse on it
        logger.warning(f"the evidence of part {part} chunk {chunk} does not hold: {e}")
        return outcome
    if verdict is None:
        logger.debug(f"verified part {part} chunk {chunk} of round {runner.group_id.hex()[:8]}")
        return Outcome(None, evidence, outcome.unshown)
    logger.warning(f"reducer {reducer} {verdict} in round {runner.group_id.hex()[:8]}")
    return Outcome(verdict, evidence, outcome.unshown)


def _unshown(runner, check: _Check, answer, entries: list[Entry], found: list, outcome: Outcome) -> Outcome:
    """Inputs the reducer signed for that nobody showed: once the draw is known (this is the drawn chunk,
    which the reducer must keep), evidence the coordinator acts on by demanding them of the reducer."""
    seed, commitments = runner.shared_seed, runner.commitments
    if seed is None or not all(commitments):
        return outcome  # a chunk of this member's own draw: the reducer may rightly no longer hold it
    missing = tuple(e.sender_index for e, f in zip(entries, found, strict=True) if f is None)
    evidence = UnshownInputEvidence(
        **check.round, numel=check.numel, inputs=tuple(f for f in found if f is not None),
        output=answer.data, output_signature=answer.signature, entries=answer.included,
        signed_at_ms=answer.signed_at_ms, missing=missing,
        reveals=tuple(runner.reveals[i] for i in range(len(runner.members))),
    )  # fmt: skip
    try:  # what the coordinator will check first: evidence that does not hold would ban this member
        evidence.check(check.codec, vector_numel=runner.numel, accuser=runner.members[runner.index],
                       chunk_values=runner.chunk_values)  # fmt: skip
    except SwarmError as e:
        logger.warning(
            f"not filing the unshown inputs of part {check.part}: the evidence does not hold ({e})"
        )
        return outcome
    members = ", ".join(runner.members[i] for i in missing)
    verdict = f"did not show the inputs of {members} to part {check.part} chunk {check.chunk} it signed for"
    return Outcome(verdict, evidence, outcome.unshown)


async def validate_round(
    runner: ButterflyAllReduce,
    *,
    probability: float,
    servicer_type: type[ServicerBase],
    p2p: P2P,
    aggregator: AggregatorFn,
    codec: Codec,
    timeout_s: float,
    accuse: Accuser | None,
    suspect: Callable[[str, str], None] | None = None,
) -> list[Outcome]:
    """After the reveals: this member's drawn checks of a round, accusations filed, failures counted."""
    if runner.revealed is not None:
        await runner.revealed
    outcomes = []
    for assignment in draw(runner, probability):
        outcome = await check_reducer(
            runner, assignment, servicer_type=servicer_type, p2p=p2p, aggregator=aggregator, codec=codec,
            timeout_s=timeout_s,
        )  # fmt: skip
        if outcome.verdict is None and outcome.evidence is not None:
            framed = runner.hooks.frame(outcome.evidence, runner)  # None but from a rehearsed framer
            if framed is not None:
                outcome = Outcome("framed by a rehearsed attack", framed, outcome.unshown)
        outcomes.append(outcome)
        # Without the whole draw this member checks chunks that its groupmates rightly no longer hold.
        if suspect is not None and runner.shared_seed is not None:
            for peer in outcome.unshown:
                suspect(peer, "could not show an input behind a signed aggregate")
        if outcome.verdict is not None and accuse is not None:
            try:
                await accuse(outcome.evidence.accused, outcome.evidence, outcome.verdict)
            except Exception as e:
                logger.warning(f"could not file the accusation against {outcome.evidence.accused}: {e!r}")
    return outcomes
