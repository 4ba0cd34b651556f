"""Stage answers a trainer checks beyond training micro-batches: signed answers that break the stage's
rules, and validation answers.

In process with the real classes: last-stage ``StageReplica``s behind real ``StageServicer``s (one that
signs ``grad_inputs`` far over the run's norm bound, one that answers only inference calls wrongly), the
trainer's real call and validation paths (only the libp2p transport replaced), its ``StageCheck`` filing
the evidence, and the real ``CoordinatorService`` over gRPC on loopback judging it. A signed answer that
breaks the rules convicts its signer with no recomputation; an honest replica never signs one (it
refuses instead); a trainer that files an answer that passes is the one banned.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from test_stage_verification import (
    Held,
    Replica,
    accuse_at_coordinator,
    hidden_forward,
    run_config,
    trainer_key,
)

from protocols import pipeline_pb2 as ppb
from swarm.averaging.compression import get_codec
from swarm.pipeline.evidence import JUDGE_SLACK, StageAnswerEvidence, StageMismatchEvidence, judge_answer
from swarm.pipeline.records import PipelineView, StageRecord
from swarm.pipeline.server import StageServicer
from swarm.pipeline.trainer import PipelineTrainer, StageFailure
from swarm.pipeline.verify import check_reply, sign_reply
from swarm.pipeline.wire import decode_floats, encode_floats

pytestmark = pytest.mark.timeout(90)


def scaled(servicer_cls: type[StageServicer], factor: float) -> type[StageServicer]:
    """A servicer that signs its last stage's ``grad_inputs`` scaled by ``factor`` (past its own check)."""

    class Scaling(servicer_cls):
        def _answer(self, kind, request, caller):
            reply = super()._answer(kind, request, caller)
            codec = get_codec(self.replica.run.training.compression)
            grad = decode_floats(reply.grad_inputs, codec, list(reply.grad_inputs.shape), what="grad_inputs")
            reply.grad_inputs.CopyFrom(encode_floats(grad * factor, codec))
            sign_reply(self.key, self.replica.run.run_id, self.replica.index, caller, reply, request)
            return reply

    return Scaling


def norm_of(reply: ppb.ForwardReply, run) -> float:
    codec = get_codec(run.training.compression)
    return float(decode_floats(reply.grad_inputs, codec, list(reply.grad_inputs.shape), what="g").norm())


def test_a_replica_signing_grad_inputs_over_the_bound_is_filed_by_the_trainer_and_banned(
    tmp_path: Path, monkeypatch
):
    run = run_config()
    trainer = trainer_key()
    honest = Replica(run, 1)
    forward = hidden_forward(run, 1, 5, 5)
    honest_norm = norm_of(asyncio.run(honest.call(trainer, "rpc_forward", forward)), run)
    bound = run.pipeline.max_grad_output_norm
    liar = Replica(run, 1)
    liar.servicer = scaled(StageServicer, 10 * bound / honest_norm)(
        liar.replica, liar.servicer.gate, key=liar.key
    )
    filed = []

    async def accuse(accused, evidence, verdict):
        filed.append((accused, evidence))

    pipeline = PipelineTrainer(run, None, peer_id=trainer.peer_id, signing_key=trainer, accuse=accuse)

    class Transport:
        async def rpc_forward(self, request, timeout):
            return await liar.call(trainer, "rpc_forward", request)

    monkeypatch.setattr(StageServicer, "get_stub", classmethod(lambda cls, *a, **k: Transport()))

    async def scenario():
        for mb in (6, 7):  # the second bad answer of the same replica is refused, not filed again
            with pytest.raises(StageFailure, match="over the run's bound") as failure:
                await pipeline._call(1, liar.key.peer_id, "rpc_forward", hidden_forward(run, 1, mb, mb))
            assert failure.value.code == ppb.BAD_REQUEST  # refused and avoided, as before
            await asyncio.sleep(0)  # the filing runs in the background
        return await accuse_at_coordinator(
            tmp_path, run, None, trainer, [honest.key, liar.key], liar, filed[0][1]
        )

    answer, banned = asyncio.run(scenario())
    assert len(filed) == 1 and filed[0][0] == liar.key.peer_id
    assert isinstance(filed[0][1], StageAnswerEvidence)
    assert answer.banned_peer == liar.key.peer_id, answer.verdict
    assert "no honest replica signs" in answer.verdict and "over the run's bound" in answer.verdict
    assert banned == {liar.key.peer_id}


def test_filing_an_answer_that_passes_bans_the_trainer_and_a_norm_within_rounding_is_never_filed(
    tmp_path: Path,
):
    run = run_config()
    trainer = trainer_key()
    honest = Replica(run, 1)
    forward = hidden_forward(run, 1, 8, 8)
    reply = asyncio.run(honest.call(trainer, "rpc_forward", forward))
    check_reply(honest.key.peer_id, run.run_id, 1, trainer.peer_id, reply, forward)
    framing = StageAnswerEvidence(run.run_id, 1, trainer.peer_id, honest.key.peer_id, forward, None, reply)
    answer, banned = asyncio.run(
        accuse_at_coordinator(tmp_path, run, None, trainer, [honest.key], honest, framing)
    )
    assert answer.banned_peer == trainer.peer_id, answer.verdict
    assert banned == {trainer.peer_id}

    # Signed at the bound by the replica's own sum, a hair over it by the trainer's: refused, never filed.
    bound = run.pipeline.max_grad_output_norm
    near = Replica(run, 1)
    near.servicer = scaled(StageServicer, bound * (1 + JUDGE_SLACK / 4) / norm_of(reply, run))(
        near.replica, near.servicer.gate, key=near.key
    )
    close = asyncio.run(near.call(trainer, "rpc_forward", forward))
    pipeline = PipelineTrainer(run, None, peer_id=trainer.peer_id, signing_key=trainer)
    assert pipeline.answers.fault(1, close, forward) is not None  # the trainer refuses it
    assert pipeline.check.file_bad_answer(1, near.key.peer_id, forward, None, close) is None
    evidence = StageAnswerEvidence(run.run_id, 1, trainer.peer_id, near.key.peer_id, forward, None, close)
    found, guilty = judge_answer(run, evidence.to_bytes(), near.key.peer_id, trainer.peer_id)
    assert guilty == trainer.peer_id, found  # the judge would not convict it either


def test_an_honest_replica_whose_own_answer_is_over_the_bound_refuses_instead_of_signing():
    run = run_config()
    run = run.model_copy(update={"pipeline": run.pipeline.model_copy(update={"max_grad_output_norm": 1e-9})})
    trainer = trainer_key()
    replica = Replica(run, 1)
    reply = asyncio.run(replica.call(trainer, "rpc_forward", hidden_forward(run, 1, 3, 3)))
    assert reply.code == ppb.INTERNAL and not reply.signature
    assert "own answer fails the stage's check" in reply.error and "over the run's bound" in reply.error


class InferenceLiar(StageServicer):
    """Answers training calls honestly and inference calls with the loss halved, signed."""

    def _answer(self, kind, request, caller):
        reply = super()._answer(kind, request, caller)
        if request.inference:
            reply.loss = reply.loss / 2
            sign_reply(self.key, self.replica.run.run_id, self.replica.index, caller, reply, request)
        return reply


@pytest.mark.parametrize("liar_first", [True, False])
def test_a_replica_that_answers_only_validation_wrongly_is_caught_and_banned(
    tmp_path: Path, monkeypatch, liar_first
):
    """Before the fix, checks repeated training micro-batches only: a replica that lowered every
    validation loss it answered moved each trainer's reported loss, unseen. Each validation pass now
    repeats one drawn batch at a second replica, so whichever replica answered it first, the mismatch
    is filed and the coordinator, recomputing from its checkpoint, bans the liar."""
    run = run_config(verify_probability=0.05, stages=1)
    run = run.model_copy(update={"training": run.training.model_copy(update={"validation_batches": 1})})
    trainer = trainer_key()
    honest, liar = Replica(run, 0), Replica(run, 0)
    liar.servicer = InferenceLiar(liar.replica, liar.servicer.gate, key=liar.key)
    replicas = {r.key.peer_id: r for r in (honest, liar)}
    filed = []

    async def accuse(accused, evidence, verdict):
        filed.append((accused, evidence))

    pipeline = PipelineTrainer(run, None, peer_id=trainer.peer_id, signing_key=trainer, accuse=accuse)
    order = [liar, honest] if liar_first else [honest, liar]
    pipeline.view = PipelineView(stages={0: [
        StageRecord(r.key.peer_id, 0, 0, 50.0, 0.5, r.replica.state_hash, r.replica.state_hash, time.time())
        for r in order
    ]})  # fmt: skip
    picks = iter(order)
    monkeypatch.setattr(pipeline, "_choose", lambda stage, step: next(picks).key.peer_id)

    class Transport:
        def __init__(self, peer):
            self.replica = replicas[peer.to_base58()]

        async def rpc_forward(self, request, timeout):
            return await self.replica.call(trainer, "rpc_forward", request)

    monkeypatch.setattr(StageServicer, "get_stub", classmethod(lambda cls, p2p, peer, **k: Transport(peer)))

    async def scenario():
        loss = await pipeline.validate()
        assert len(filed) == 1, "the validation pass checked none of its batches"
        return loss, await accuse_at_coordinator(
            tmp_path, run, Held(honest.replica), trainer, [honest.key, liar.key], replicas[filed[0][0]],
            filed[0][1],
        )  # fmt: skip

    loss, (answer, banned) = asyncio.run(scenario())
    assert isinstance(filed[0][1], StageMismatchEvidence) and filed[0][1].forward.inference
    assert answer.banned_peer == liar.key.peer_id, answer.verdict
    assert banned == {liar.key.peer_id}
    assert pipeline.metrics()["stage_mismatches"] == 1 and loss > 0
