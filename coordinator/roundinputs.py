"""The coordinator's demand for the inputs behind an aggregate that a validator could not collect.

A reducer signs the list of inputs it aggregated, with the time it signed, and holds every one of them:
once the round's reveal phase is over it copies them into its ``InputArchive``
(``swarm.averaging.archive``: the drawn chunk, or every chunk when its draw never completed). The part's
drawn validator, when it could get an input neither from its sender nor from the reducer, files
``unshown_input`` evidence (the reducer's signed aggregate, the inputs it did collect, and the round's
reveals, which fix the drawn chunk and its validator). The coordinator checks that evidence, then asks
the reducer itself for the missing inputs (``rpc_round_inputs``, which admits the coordinator's peer ID
outside the handler's stream caps), all of them within ``DEMAND_DEADLINE_S``:

- every one shown, signed by its sender and the one listed: the aggregate is recomputed like any
  ``bad_aggregate`` evidence, and the reducer is convicted if it differs;
- one not shown (refused, wrong, or no answer in time) by a reducer that was online when the evidence
  arrived, has not joined again since it signed, and signed within ``INPUT_DEMAND_WINDOW_S`` of the
  coordinator's clock: the reducer is convicted, since an honest one still holds it;
- otherwise nobody is banned.

Example::

    inputs = PeerRoundInputs(p2p)
    found, guilty = await judge_unshown(run, layouts, data, accused, accuser, inputs=inputs,
                                        joined_at=joined_at, judging=lock)
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from hivemind.p2p import P2P, PeerID

from protocols import averaging_pb2 as apb
from protocols.errors import ProtocolError, SwarmError
from swarm.averaging.aggregators import get_aggregator
from swarm.averaging.evidence import (
    INPUT_DEMAND_WINDOW_S,
    Entry,
    SignedInput,
    UnshownInputEvidence,
    parse_evidence,
)
from swarm.averaging.tiers import round_codec
from swarm.config import RunConfig

logger = logging.getLogger(__name__)

DEMAND_TIMEOUT_S = 20.0  # per try of one input asked of the reducer
DEMAND_ATTEMPTS = 3  # a stream that fails to open or answer is tried again
DEMAND_DEADLINE_S = 60.0  # for every input of one accusation together
DEMAND_CONCURRENCY = 8
JOIN_MARGIN_S = 5.0  # between a session's join and an aggregate it signed, both by the peer's clock


class RoundInputs:
    """Where the coordinator asks a reducer for an input it signed for: this base cannot ask anyone,
    so such evidence bans nobody."""

    can_ask = False

    async def fetch(self, evidence: UnshownInputEvidence, sender_index: int) -> SignedInput | None:
        """The reducer's signed input of member ``sender_index`` to the evidence's chunk; None if not shown."""
        return None


class PeerRoundInputs(RoundInputs):
    """Asks the reducer over the coordinator's libp2p node, under the round's averaging prefix."""

    can_ask = True

    def __init__(self, p2p: P2P, timeout_s: float = DEMAND_TIMEOUT_S):
        self.p2p, self.timeout_s = p2p, timeout_s

    async def fetch(self, evidence: UnshownInputEvidence, sender_index: int) -> SignedInput | None:
        from swarm.averaging.averager import AveragingServicer

        stub = AveragingServicer.get_stub(
            self.p2p, PeerID.from_base58(evidence.reducer), namespace=evidence.prefix
        )
        request = apb.InputsRequest(
            group_id=evidence.group_id, part_index=evidence.part, chunk_index=evidence.chunk,
            sender_index=sender_index,
        )  # fmt: skip

        async def first() -> apb.SignedInput | None:
            async for item in await stub.rpc_round_inputs(request):
                return item
            return None

        for attempt in range(DEMAND_ATTEMPTS):
            try:
                item = await asyncio.wait_for(first(), self.timeout_s)
                break
            except asyncio.CancelledError:
                raise
            except Exception as e:  # unreachable, a dead stream, or no answer in time
                logger.info(
                    f"{evidence.reducer} did not answer the demand for an input (try {attempt + 1}): {e!r}"
                )
        else:
            return None
        if item is None or item.code != apb.OK or item.sender_index != sender_index:
            return None
        return SignedInput(item.sender_index, item.data, item.signature, item.weight)


def _shows(evidence: UnshownInputEvidence, entry: Entry, item: SignedInput | None) -> bool:
    if item is None:
        return False
    try:
        evidence.verify_input(item)
    except SwarmError:
        return False
    return entry.matches(item)


async def judge_unshown(
    run: RunConfig,
    layouts: Callable[[], dict[str, int]],
    data: bytes,
    accused: str,
    accuser: str,
    *,
    inputs: RoundInputs,
    joined_at: Callable[[str], Awaitable[float | None]],
    judging: asyncio.Lock,
    now: Callable[[], float] = time.time,
) -> tuple[str, str | None]:
    """(what was found, who is guilty) for ``unshown_input`` evidence (see the module docstring).
    ``joined_at(peer)`` is when the peer's current session joined, by the peer's own clock, or None if it
    is not online: it is read when the evidence arrives, so leaving once asked saves nobody."""
    training = run.training
    arrived = now()
    joined = await joined_at(accused)  # before anything waits: leaving once accused saves nobody
    # Everything up to the demand runs as the evidence arrives, off the judging lock (recomputes may queue
    # there for long): only the recompute of the aggregate from what the reducer showed takes a turn.
    try:
        evidence = await asyncio.to_thread(parse_evidence, data)
        if not isinstance(evidence, UnshownInputEvidence):
            raise ProtocolError("the evidence is not of an unshown input")
        codec = round_codec(run, evidence.prefix)
        if evidence.accused != accused or accuser not in evidence.members:
            raise ProtocolError("the evidence names another culprit, or a round the accuser was not in")
        # The first call builds the model, so never on the event loop.
        vector_numel = (await asyncio.to_thread(layouts)).get(evidence.prefix)
        if vector_numel is None:
            return (
                f"the evidence is of averaging prefix {evidence.prefix[:80]!r}, which this run does not use",
                None,
            )
        missing = await asyncio.to_thread(evidence.check, codec, vector_numel=vector_numel, accuser=accuser)
    except SwarmError as e:
        return f"the evidence does not hold: {e}", accuser
    except Exception as e:  # whatever the accuser sent, it never escapes the judge
        return f"the evidence does not hold: {e!r}"[:300], accuser
    signed_s = evidence.signed_at_ms / 1000
    age_s = arrived - signed_s
    if not inputs.can_ask:
        return "this coordinator cannot ask peers for the inputs behind an aggregate", None
    if age_s > INPUT_DEMAND_WINDOW_S:
        return (f"the aggregate was signed {age_s:.0f}s ago, past the {INPUT_DEMAND_WINDOW_S:.0f}s in which its "
                "inputs may be demanded"), None  # fmt: skip
    if joined is None:
        return f"{accused} is not online to be asked for the inputs it signed for", None
    if joined > signed_s - JOIN_MARGIN_S:  # a peer that restarted since lost what it held in memory
        return f"{accused} joined again after it signed the aggregate; what it held is gone", None
    limit = asyncio.Semaphore(DEMAND_CONCURRENCY)

    async def demand(entry: Entry) -> SignedInput | None:
        async with limit:
            item = await inputs.fetch(evidence, entry.sender_index)
        return item if _shows(evidence, entry, item) else None

    tasks = [asyncio.ensure_future(demand(entry)) for entry in missing]
    _, pending = await asyncio.wait(tasks, timeout=DEMAND_DEADLINE_S) if tasks else (set(), set())
    for task in pending:
        task.cancel()
    for entry, task in zip(missing, tasks, strict=True):
        if task in pending or task.exception() is not None or task.result() is None:
            sender = evidence.members[entry.sender_index]
            return (
                f"did not show the coordinator the input of {sender} to part {evidence.part} chunk "
                f"{evidence.chunk} that it signed it had aggregated ({age_s:.0f}s earlier)",
                accused,
            )
    full = evidence.completed([task.result() for task in tasks])  # every one shown, checked above
    aggregator = get_aggregator(training.aggregator, training.aggregator_options)
    try:
        async with judging:
            verdict = await asyncio.to_thread(full.judge, aggregator, codec, vector_numel=vector_numel)
    except SwarmError as e:  # cannot happen with the inputs checked above; ban nobody on it
        return f"the inputs the reducer showed do not hold: {e}", None
    if verdict is None:
        return (
            "the reducer showed the coordinator every input, and its aggregate is what the rule gives",
            None,
        )
    return verdict, accused
