"""How the coordinator reads an accusation's evidence and judges it.

The evidence follows the signed first part in pieces; each piece is charged to the coordinator's
``EvidenceBudget`` as it arrives (never the size the accuser declared up front), so a stream that
stalls holds only what it sent. The judge recomputes the aggregate from the signed inputs with the
run's own rule, codec and layout, and says who is guilty: the accused if the evidence proves it, else
the accuser (nobody when the evidence is of an averaging prefix the run does not use). Stage evidence
(``judge_stage``) is recomputed from the states its replies name: the coordinator's checkpoint of the
stage at that step, or that state downloaded from the stage's replicas by its hash
(``coordinator.stagestates``), within ``stage_state_timeout_s``. A state that no replica serves is
asked of the replica that signed for it; one that cannot show it (or named none) is convicted while
an honest replica would still hold it (``unshown_fault``). A signed stage answer that breaks the stage's
rules (``stage_bad_answer``) is judged on its bytes alone (``swarm.pipeline.evidence.judge_answer``).
A sender check (``wrong_contribution``) is recomputed from the state the accuser serves
(``coordinator.contributions``), within the same ``stage_state_timeout_s``.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator, Awaitable, Callable

from google.protobuf.message import DecodeError

from coordinator.contributions import ContributionStates, judge_contribution
from coordinator.limits import EvidenceBudget
from coordinator.roundinputs import RoundInputs, judge_unshown
from coordinator.stagestates import StageStates
from protocols import coordinator_pb2 as pb
from protocols.codec import top_level_str
from protocols.errors import ProtocolError, SwarmError
from protocols.messages import AccuseBody
from swarm.averaging.aggregators import get_aggregator
from swarm.averaging.evidence import MAX_EVIDENCE_BYTES, UnshownInputEvidence, parse_evidence
from swarm.averaging.tiers import round_codec
from swarm.config import RunConfig
from swarm.pipeline.evidence import ANSWER_KIND, judge_answer, judge_recomputed, read_stage_evidence
from swarm.pipeline.evidence import KIND as STAGE_KIND
from swarm.pipeline.records import StageRecord
from swarm.training.sendercheck import KIND as CONTRIBUTION_KIND


class EvidenceReader:
    """Reads the evidence one accusation signed for, charging ``budget`` under ``key`` (its caller's
    address) piece by piece; ``release`` gives back whatever it was charged, whenever it stopped."""

    def __init__(self, budget: EvidenceBudget, key: str):
        self.budget, self.key = budget, key
        self.charged = 0

    async def read(
        self, first: pb.AccusationPart, parts: AsyncIterator[bytes], body: AccuseBody, sender: str
    ) -> bytes:
        """Exactly ``body.evidence_bytes`` bytes, matching the signed hash, and then the stream's end;
        ProtocolError otherwise."""
        evidence = bytearray()
        piece: pb.AccusationPart | None = first
        too_much = (
            f"accusation from {sender} carried more than the {body.evidence_bytes} evidence bytes "
            "it signed for"
        )
        while piece is not None:
            if len(evidence) + len(piece.evidence) > body.evidence_bytes:
                raise ProtocolError(too_much)
            await self.budget.charge(self.key, len(piece.evidence))
            self.charged += len(piece.evidence)
            evidence += piece.evidence
            if len(evidence) == body.evidence_bytes:
                # A part past the signed evidence is refused like evidence past it, not judged without it.
                # An honest client ends its stream with its last part. (The read is not raced against a
                # timer: cancelling a read of gRPC's request stream broke the call with INTERNAL; the
                # accusation's own deadline bounds it.)
                if await next_part(parts, required=False) is not None:
                    raise ProtocolError(too_much + ", in parts after it")
                break
            piece = await next_part(parts, required=False)
        if len(evidence) != body.evidence_bytes:
            raise ProtocolError(
                f"accusation from {sender} carried {len(evidence)} evidence bytes, "
                f"not the {body.evidence_bytes} it signed for"
            )
        if hashlib.sha256(evidence).digest() != body.evidence_sha256:
            raise ProtocolError(f"accusation from {sender}: evidence does not match its signed hash")
        return bytes(evidence)

    def release(self) -> None:
        self.budget.release(self.key, self.charged)
        self.charged = 0


async def next_part(parts: AsyncIterator[bytes], *, required: bool = True) -> pb.AccusationPart | None:
    try:
        raw = await parts.__anext__()
    except StopAsyncIteration:
        if required:
            raise ProtocolError("accusation stream is empty") from None
        return None
    try:
        return pb.AccusationPart.FromString(raw)
    except (DecodeError, RuntimeWarning) as e:
        raise ProtocolError(f"malformed AccusationPart: {e}") from None


async def judge_accusation(
    run: RunConfig,
    layouts: Callable[[], dict[str, int]],
    data: bytes,
    accused: str,
    accuser: str,
    *,
    judging: asyncio.Lock,
    stage_checkpoint: Callable[[int], object | None] = lambda stage: None,
    stage_states: StageStates | None = None,
    stage_state_timeout_s: float = 60.0,
    round_inputs: RoundInputs | None = None,
    joined_at: Callable[[str], Awaitable[float | None]] | None = None,
    contribution_states: ContributionStates | None = None,
    banned: Callable[[str], Awaitable[str | None]] | None = None,
) -> tuple[str, str | None]:
    """(what was found, who is guilty) for any evidence; the recomputation runs on a thread under
    ``judging``. Stage evidence goes to ``judge_stage``, a sender check to ``judge_contribution``
    (``contribution_states`` downloads the state from the accuser), that of an unshown input to
    ``coordinator.roundinputs.judge_unshown`` (``round_inputs`` asks the reducer; ``joined_at`` says when
    an online peer's session joined; ``banned`` why the accused is convicted, so that a queued sender
    check of a peer convicted meanwhile is not replayed again)."""
    kind = evidence_kind(data)
    if kind == STAGE_KIND:
        return await judge_stage(
            run, data, accused, accuser, judging=judging, checkpoint=stage_checkpoint,
            states=stage_states or StageStates(), timeout_s=stage_state_timeout_s,
        )  # fmt: skip
    if kind == ANSWER_KIND:  # a signed answer that breaks the stage's rules: its bytes are the proof
        async with judging:
            return await asyncio.to_thread(judge_answer, run, data, accused, accuser)
    if kind == CONTRIBUTION_KIND:  # a sender check: recomputed from the state the accuser serves
        return await judge_contribution(
            run, layouts, data, accused, accuser, states=contribution_states or ContributionStates(),
            judging=judging, timeout_s=stage_state_timeout_s, banned=banned,
        )  # fmt: skip
    if kind == UnshownInputEvidence.kind:
        return await judge_unshown(
            run, layouts, data, accused, accuser, inputs=round_inputs or RoundInputs(),
            joined_at=joined_at or _never_online, judging=judging,
        )  # fmt: skip
    async with judging:
        return await asyncio.to_thread(judge, run, layouts, data, accused, accuser)


async def judge_stage(
    run: RunConfig,
    data: bytes,
    accused: str,
    accuser: str,
    *,
    judging: asyncio.Lock,
    checkpoint: Callable[[int], object | None],
    states: StageStates,
    timeout_s: float,
) -> tuple[str, str | None]:
    """(what was found, who is guilty) for stage evidence, which may convict either replica.

    Each reply is recomputed from the state it names (its signer committed to it): the coordinator's
    checkpoint of the stage (``checkpoint(stage)``: ``step``, ``state_hash``, ``tensors``) when it is that
    state, else that state downloaded by its hash from the stage's replicas (``states``), verified. A
    reply whose state no replica serves is asked of its signer: a signer that does not serve it (or named
    no state) is convicted if ``unshown_fault`` finds an honest replica would still hold it. Nobody is
    banned on a state the coordinator could not verify, nor when the time ran out before the signer
    was asked."""
    try:
        evidence = await asyncio.to_thread(read_stage_evidence, run, data, accused, accuser)
    except SwarmError as e:
        return f"the evidence does not hold: {e}", accuser
    stage, step = evidence.stage, evidence.step
    arrived = await states.members(stage)  # the stage's records when the evidence arrived
    held = checkpoint(stage)
    tensors: dict[str, dict] = {}
    if held is not None and held.step == step:
        tensors[held.state_hash] = held.tensors
    unshown: dict[str, str] = {}  # signer -> the state it named and did not show
    try:
        async with asyncio.timeout(timeout_s):
            for state_hash in dict.fromkeys(r.reply.state_hash for r in evidence.replies):
                if state_hash and state_hash not in tensors:
                    fetched = await states.fetch(stage, step, state_hash)
                    if fetched is not None:
                        tensors[state_hash] = fetched.tensors
            for r in evidence.replies:
                state_hash = r.reply.state_hash
                if state_hash in tensors:
                    continue
                fetched = await states.fetch_from(stage, step, state_hash, r.replica) if state_hash else None
                if fetched is None:
                    unshown[r.replica] = f"state {state_hash[:12]}" if state_hash else "no state"
                else:
                    tensors[state_hash] = fetched.tensors
    except TimeoutError:
        pass  # judge what arrived
    guilty, why_not = [], []
    if unshown:
        now = await states.members(stage)
        for signer, named in unshown.items():
            why = unshown_fault(step, signer, arrived, now, run.pipeline.kept_states)
            if why is None:
                guilty.append(signer)
            else:
                why_not.append(f"{signer} did not show {named} it signed for, but {why}")
        if guilty:
            signer = accused if accused in guilty else guilty[0]
            return (
                f"stage {stage} replica {signer} signed a reply at step {step} naming {unshown[signer]} and "
                "does not serve it, which an honest replica of the stage would still hold",
                signer,
            )
    async with judging:
        found, guilty_one = await asyncio.to_thread(judge_recomputed, run, evidence, accused, tensors)
    if guilty_one is None and why_not:
        found = f"{found}; {'; '.join(why_not)}"
    return found, guilty_one


def unshown_fault(
    step: int, signer: str, arrived: list[StageRecord], now: list[StageRecord], keep: int
) -> str | None:
    """Why ``signer`` is not at fault for not showing a state of ``step`` it signed for, or None if it is:
    an honest replica keeps the state of each of the stage's last ``keep`` steps
    (``swarm.pipeline.history``), so a current replica of the stage (its record in ``arrived``, the
    stage's records when the evidence came, and still in ``now``) can always show it while ``step`` is
    one of them. The stage's step is its furthest record's, so that a record lagging its replica's true
    step never takes an honest replica past its window."""
    if signer not in {r.peer_id for r in arrived} or signer not in {r.peer_id for r in now}:
        return "it is not a current replica of the stage, which must keep it"
    current = max(r.step for r in (*arrived, *now))
    if current - step >= keep:
        return (f"the stage is at step {current}, and its replicas keep the states of only the last {keep} "
                "steps")  # fmt: skip
    return None


def judge(
    run: RunConfig, layouts: Callable[[], dict[str, int]], data: bytes, accused: str, accuser: str
) -> tuple[str, str | None]:
    """(what was found, who is guilty) for averaging evidence: the accused if the evidence proves it, else
    the accuser; nobody when the evidence is of an averaging prefix this run does not use, whose layout
    the coordinator cannot know (so it cannot show that the accuser lied either). ``layouts``
    (``run_layouts``, which builds the model) is called only for evidence that parses, on the judging
    thread."""
    training = run.training
    try:
        evidence = parse_evidence(data)
    except SwarmError as e:
        return f"the evidence does not hold: {e}", accuser
    vector_numel = layouts().get(evidence.prefix)
    if vector_numel is None:
        return (
            f"the evidence is of averaging prefix {evidence.prefix[:80]!r}, which this run does not use",
            None,
        )
    try:
        if evidence.accused != accused or accuser not in evidence.members:
            raise ProtocolError("the evidence names another culprit, or a round the accuser was not in")
        aggregator = get_aggregator(training.aggregator, training.aggregator_options)
        codec = round_codec(run, evidence.prefix)
        verdict = evidence.judge(aggregator, codec, vector_numel=vector_numel)
    except SwarmError as e:
        return f"the evidence does not hold: {e}", accuser
    if verdict is None:
        return "the aggregate is exactly what the rule gives", accuser
    return verdict, accused


async def _never_online(peer_id: str) -> float | None:
    return None


def evidence_kind(data: bytes) -> str | None:
    """The evidence's ``kind``, read without decoding the rest on the event loop: the judge of that kind
    decodes the whole of it on a thread."""
    return top_level_str(data, "kind", max_bytes=MAX_EVIDENCE_BYTES)


def run_layouts(run: RunConfig) -> dict[str, int]:
    """Each averaging prefix of the run and the length of the vector averaged under it: the run's
    trainable parameters under the run's prefix and its second tier's, and each pipeline stage's under
    that stage's."""
    from swarm.averaging.tiers import tier_prefix
    from swarm.models import build_model
    from swarm.pipeline.layout import build_stage
    from swarm.records import stage_prefix

    def trainable(module) -> int:
        return sum(p.numel() for p in module.parameters() if p.requires_grad)

    # Averagers name their prefix with "." replaced by "_" (swarm.averaging.averager).
    numel = trainable(build_model(run.model.name, run.model.config))
    layouts = {run.run_id.replace(".", "_"): numel, tier_prefix(run.run_id).replace(".", "_"): numel}
    if run.pipeline.stages > 1:
        for index in range(run.pipeline.stages):
            prefix = stage_prefix(run.run_id, index).replace(".", "_")
            layouts[prefix] = trainable(build_stage(run, index))
    return layouts
