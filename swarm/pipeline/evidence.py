"""Evidence that two replicas of one stage answered the same micro-batch differently, and its judge.

A trainer's check (swarm/pipeline/verify.py) that finds two signed replies to the same inputs differ
files ``StageMismatchEvidence``: the inputs (and targets, and for a backward the grad_outputs), both
replies with their state hashes and signatures. The coordinator checks that both
signatures name the same run, stage, step, trainer, micro-batch and inputs and that the replies differ
(``read_stage_evidence``); then it recomputes each reply from the state that reply names, with the real
``StageReplica``, and convicts a replica whose reply differs from what its own state computes
(``judge_recomputed``). Where those states come from (the coordinator's checkpoint, or the stage's
replicas, by hash) is ``coordinator.accusations.judge_stage``'s business. Evidence that does not hold
bans its accuser.

A signed reply that no honest replica signs (malformed, of the wrong shape, non-finite, ``grad_inputs``
over the norm bound, naming no state) needs no recomputation: ``StageAnswerEvidence`` holds the call and
the signed reply, and the judge repeats the trainer's check on the bytes (``judge_answer``). An honest
replica checks its own answer the same way before it signs (``swarm.pipeline.server``).
"""

from __future__ import annotations

from dataclasses import dataclass

from protocols import pipeline_pb2 as ppb
from protocols.codec import pack, unpack
from protocols.errors import ProtocolError, SwarmError
from swarm.averaging.compression import get_codec
from swarm.averaging.evidence import MAX_EVIDENCE_ITEMS
from swarm.config import RunConfig
from swarm.pipeline.verify import AnswerCheck, check_reply, replies_differ, seed_forward
from swarm.pipeline.wire import MAX_TENSOR_BYTES

KIND = "stage_mismatch"
ANSWER_KIND = "stage_bad_answer"
#: The judge convicts a norm over the bound only past this relative margin, and a trainer files only past
#: twice it: two machines' float sums of one norm differ by far less, so an honest replica that signed a
#: norm at the bound by its own sum is never convicted, nor an honest trainer's filing found false.
JUDGE_SLACK = 1e-3
FILE_SLACK = 2 * JUDGE_SLACK
#: Three tensors of inputs and two replies of two tensors each, at most.
MAX_STAGE_EVIDENCE_BYTES = 8 * MAX_TENSOR_BYTES


def _of_kind(body, kind: str) -> None:
    if body.get("kind") != kind:
        raise ProtocolError(f"{kind} evidence of kind {str(body.get('kind'))[:40]!r}")


@dataclass(frozen=True)
class StageReply:
    """One replica's signed reply, as evidence holds it."""

    replica: str
    attempt: int
    reply: ppb.ForwardReply | ppb.BackwardReply


@dataclass(frozen=True)
class StageMismatchEvidence:
    """Two replicas' signed replies to one micro-batch's call at one stage and step."""

    run_id: str
    stage: int
    trainer: str
    forward: ppb.ForwardRequest  # what the stage was sent forward (attempt and signature cleared)
    grad_outputs: ppb.Tensor | None  # a backward's gradient (None: the forward is what differs)
    replies: tuple[StageReply, StageReply]

    kind = KIND

    @property
    def accused(self) -> str:
        return self.replies[0].replica

    @property
    def step(self) -> int:
        return self.forward.step

    @classmethod
    def of(cls, run_id: str, stage: int, trainer: str, first: tuple, second: tuple) -> StageMismatchEvidence:
        """From two (replica, forward request, backward request or None, reply) of one micro-batch."""
        forward = ppb.ForwardRequest()
        forward.CopyFrom(first[1])
        forward.attempt, forward.attempt_signature = 0, b""
        backward = first[2]
        replies = tuple(
            StageReply(r, (b if b is not None else f).attempt, reply) for r, f, b, reply in (first, second)
        )
        return cls(run_id, stage, trainer, forward, backward.grad_outputs if backward else None, replies)

    def requests(self, attempt: int) -> tuple[ppb.ForwardRequest, ppb.BackwardRequest | None]:
        forward = ppb.ForwardRequest()
        forward.CopyFrom(self.forward)
        forward.attempt = attempt
        if self.grad_outputs is None:
            return forward, None
        backward = ppb.BackwardRequest(run_id=self.run_id, stage=self.stage, step=self.step, attempt=attempt,
                                       microbatch_id=self.forward.microbatch_id, grad_outputs=self.grad_outputs)  # fmt: skip
        return forward, backward

    def to_bytes(self) -> bytes:
        return pack({
            "kind": KIND, "run_id": self.run_id, "stage": self.stage, "trainer": self.trainer,
            "forward": self.forward.SerializeToString(),
            "grad_outputs": None if self.grad_outputs is None else self.grad_outputs.SerializeToString(),
            "replies": [[r.replica, r.attempt, r.reply.SerializeToString()] for r in self.replies],
        })  # fmt: skip

    @classmethod
    def from_bytes(cls, data: bytes) -> StageMismatchEvidence:
        body = unpack(data, what="stage evidence", max_bytes=MAX_STAGE_EVIDENCE_BYTES,
                      max_binary=2 * MAX_TENSOR_BYTES, max_items=MAX_EVIDENCE_ITEMS)  # fmt: skip
        try:
            _of_kind(body, KIND)
            backward = body["grad_outputs"] is not None
            reply_type = ppb.BackwardReply if backward else ppb.ForwardReply
            replies = tuple(
                StageReply(str(r), int(a), reply_type.FromString(bytes(raw))) for r, a, raw in body["replies"]
            )
            if len(replies) != 2:
                raise ProtocolError(f"stage evidence holds {len(replies)} replies, not 2")
            grad = ppb.Tensor.FromString(bytes(body["grad_outputs"])) if backward else None
            return cls(str(body["run_id"]), int(body["stage"]), str(body["trainer"]),
                       ppb.ForwardRequest.FromString(bytes(body["forward"])), grad, replies)  # fmt: skip
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ProtocolError(f"stage evidence is malformed: {e!r}") from None
        except Exception as e:  # protobuf's DecodeError
            raise ProtocolError(f"stage evidence holds a malformed message: {e!r}") from None

    def verify(self, run: RunConfig, accused: str, accuser: str) -> None:
        """Raise a ProtocolError unless the evidence is of this run, filed by its trainer against one of two
        distinct replicas, both signatures hold over the same inputs, and the replies differ."""
        a, b = self.replies
        if self.run_id != run.run_id or self.forward.run_id != run.run_id:
            raise ProtocolError(f"the evidence is of run {self.run_id[:80]!r}")
        if not 0 <= self.stage < run.pipeline.stages or self.forward.stage != self.stage:
            raise ProtocolError(f"the evidence names stage {self.stage}, which this run does not have")
        if self.trainer != accuser or a.replica == b.replica or accused not in (a.replica, b.replica):
            raise ProtocolError(
                "the evidence names another trainer, or not two replicas of which one is accused"
            )
        for r in self.replies:
            if r.reply.step != self.step or r.reply.code != ppb.OK:
                raise ProtocolError(f"the reply of {r.replica} is not an answer at step {self.step}")
            check_reply(r.replica, self.run_id, self.stage, self.trainer, r.reply, *self.requests(r.attempt))
        if not replies_differ(
            a.reply, b.reply, get_codec(run.training.compression), run.pipeline.verify_tolerance
        ):
            raise ProtocolError("the two replies agree")

    def recompute(self, run: RunConfig, tensors: dict) -> ppb.ForwardReply | ppb.BackwardReply:
        """The call, recomputed by a ``StageReplica`` loaded with the stage's state at the step."""
        from swarm.pipeline.replica import Refusal, StageReplica

        replica = StageReplica(run, self.stage)
        try:
            replica.load(self.step, tensors)
            forward, backward = self.requests(1)
            seed_forward(run.run_id, self.stage, forward, self.trainer)
            reply = replica.forward(forward, self.trainer)
            if backward is not None:
                reply = replica.backward(backward, self.trainer)
            return reply
        except Refusal as e:
            raise ProtocolError(f"the evidence's inputs are refused by the stage: {e.message}") from None
        finally:
            replica.close()


def read_stage_evidence(run: RunConfig, data: bytes, accused: str, accuser: str) -> StageMismatchEvidence:
    """The evidence in ``data``, checked by ``StageMismatchEvidence.verify``; a SwarmError says what is wrong."""
    evidence = StageMismatchEvidence.from_bytes(data)
    evidence.verify(run, accused, accuser)
    return evidence


def judge_recomputed(
    run: RunConfig, evidence: StageMismatchEvidence, accused: str, states: dict[str, dict]
) -> tuple[str, str | None]:
    """(what was found, who is guilty), recomputing each reply from the state it names: ``states`` maps a
    state hash to its tensors, verified against it (the coordinator's checkpoint, or the state downloaded
    from a replica). A replica is wrong only if its answer differs from what the state it signed computes:
    a replica whose state forked from its stage-mates' (a round it took alone) answers correctly for its
    own state and is not convicted. A reply whose state is not in ``states`` is not judged."""
    stage, step = evidence.stage, evidence.step
    codec = get_codec(run.training.compression)
    wrong, judged = [], 0
    for r in evidence.replies:
        tensors = states.get(r.reply.state_hash) if r.reply.state_hash else None
        if tensors is None:
            continue
        try:
            truth = evidence.recompute(run, tensors)
        except SwarmError as e:
            return f"cannot recompute stage {stage} at step {step}: {e}", None
        judged += 1
        if replies_differ(r.reply, truth, codec, run.pipeline.verify_tolerance):
            wrong.append(r.replica)
    if not judged:
        return (
            f"cannot recompute stage {stage} at step {step}: the coordinator holds neither reply's state",
            None,
        )
    if not wrong:
        return (
            f"the replies of stage {stage} at step {step} are what the states they name compute (checked "
            f"{judged} of 2)",
            None,
        )
    guilty = accused if accused in wrong else wrong[0]
    return (
        f"stage {stage} replica {guilty} answered micro-batch {evidence.forward.microbatch_id} at step {step} "
        "wrongly for the state it named",
        guilty,
    )


@dataclass(frozen=True)
class StageAnswerEvidence:
    """A replica's signed reply that no honest replica signs, with the call it answers.

    Example::

        evidence = StageAnswerEvidence(run_id, stage, trainer, replica, forward, backward, reply)
        found, guilty = judge_answer(run, evidence.to_bytes(), replica, trainer)
    """

    run_id: str
    stage: int
    trainer: str
    replica: str
    forward: ppb.ForwardRequest  # exactly as sent (attempt and signature kept: the reply signs them)
    backward: ppb.BackwardRequest | None  # the backward the reply answers (None: a forward's reply)
    reply: ppb.ForwardReply | ppb.BackwardReply

    kind = ANSWER_KIND

    @property
    def accused(self) -> str:
        return self.replica

    @property
    def step(self) -> int:
        return self.forward.step

    def to_bytes(self) -> bytes:
        return pack({
            "kind": ANSWER_KIND, "run_id": self.run_id, "stage": self.stage, "trainer": self.trainer,
            "replica": self.replica, "forward": self.forward.SerializeToString(),
            "backward": None if self.backward is None else self.backward.SerializeToString(),
            "reply": self.reply.SerializeToString(),
        })  # fmt: skip

    @classmethod
    def from_bytes(cls, data: bytes) -> StageAnswerEvidence:
        body = unpack(data, what="stage answer evidence", max_bytes=MAX_STAGE_EVIDENCE_BYTES,
                      max_binary=2 * MAX_TENSOR_BYTES, max_items=MAX_EVIDENCE_ITEMS)  # fmt: skip
        try:
            _of_kind(body, ANSWER_KIND)
            backward = (
                None if body["backward"] is None else ppb.BackwardRequest.FromString(bytes(body["backward"]))
            )
            reply_type = ppb.BackwardReply if backward is not None else ppb.ForwardReply
            return cls(str(body["run_id"]), int(body["stage"]), str(body["trainer"]), str(body["replica"]),
                       ppb.ForwardRequest.FromString(bytes(body["forward"])), backward,
                       reply_type.FromString(bytes(body["reply"])))  # fmt: skip
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ProtocolError(f"stage answer evidence is malformed: {e!r}") from None
        except Exception as e:  # protobuf's DecodeError
            raise ProtocolError(f"stage answer evidence holds a malformed message: {e!r}") from None

    def verify(self, run: RunConfig, accused: str, accuser: str) -> None:
        """Raise a ProtocolError unless the evidence is of this run, filed by the trainer that made the
        call, against the replica whose signature over that call and the reply holds."""
        if self.run_id != run.run_id or self.forward.run_id != run.run_id:
            raise ProtocolError(f"the evidence is of run {self.run_id[:80]!r}")
        if not 0 <= self.stage < run.pipeline.stages or self.forward.stage != self.stage:
            raise ProtocolError(f"the evidence names stage {self.stage}, which this run does not have")
        if self.backward is not None and (
            self.backward.stage != self.stage or self.backward.microbatch_id != self.forward.microbatch_id
        ):
            raise ProtocolError("the evidence's backward is of another stage or micro-batch than its forward")
        if self.trainer != accuser or self.replica != accused:
            raise ProtocolError("the evidence names another trainer or another replica than the accusation")
        if self.reply.code != ppb.OK:
            raise ProtocolError(f"the reply of {self.replica} is a refusal, not an answer")
        check_reply(
            self.replica, self.run_id, self.stage, self.trainer, self.reply, self.forward, self.backward
        )


def judge_answer(run: RunConfig, data: bytes, accused: str, accuser: str) -> tuple[str, str | None]:
    """(what was found, who is guilty) for ``StageAnswerEvidence``: the replica if the answer it signed
    fails the trainer's check (past ``JUDGE_SLACK`` on the norm), else the accuser."""
    try:
        evidence = StageAnswerEvidence.from_bytes(data)
        evidence.verify(run, accused, accuser)
    except SwarmError as e:
        return f"the evidence does not hold: {e}", accuser
    fault = AnswerCheck(run).fault(
        evidence.stage, evidence.reply, evidence.forward, evidence.backward, slack=JUDGE_SLACK
    )
    if fault is None:
        return f"the answer of stage {evidence.stage} replica {accused} passes the check", accuser
    return (
        f"stage {evidence.stage} replica {accused} signed an answer to micro-batch "
        f"{evidence.forward.microbatch_id} at step {evidence.step} that no honest replica signs: {fault}",
        accused,
    )
