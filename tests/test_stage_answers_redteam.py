"""An attacker's read of stage_bad_answer evidence, checked validation answers and ``balance.Avoidance``:
each test was a demonstration that passed while its defect was present, and now checks the fix.

In process with the real classes, as in tests/test_stage_answer_checks.py: ``StageReplica``s behind real
``StageServicer``s, the trainer's real ``_call``/``_process``/``validate`` with only the libp2p transport
replaced, its ``StageCheck`` filing, and the real ``CoordinatorService`` (``accuse_at_coordinator``)
judging.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import time
from pathlib import Path

import pytest
import torch
from test_stage_answer_checks import norm_of, scaled
from test_stage_verification import (
    BATCH,
    Replica,
    hidden_forward,
    run_config,
    trainer_key,
)

from protocols import pipeline_pb2 as ppb
from protocols.keys import SigningKey
from protocols.version import PROTOCOL_VERSION
from swarm.averaging.compression import get_codec
from swarm.pipeline.balance import Avoidance
from swarm.pipeline.check import MAX_FILED_ANSWERS
from swarm.pipeline.evidence import StageAnswerEvidence, judge_answer
from swarm.pipeline.records import PipelineView, StageRecord
from swarm.pipeline.server import StageServicer
from swarm.pipeline.trainer import MicroBatch, PipelineTrainer, StageFailure
from swarm.pipeline.verify import sign_reply
from swarm.pipeline.wire import encode_floats, encode_ids

pytestmark = pytest.mark.timeout(90)


def with_bound(run, bound: float):
    return run.model_copy(
        update={"pipeline": run.pipeline.model_copy(update={"max_grad_output_norm": bound})}
    )


def steered_forward(run, microbatch_id: int, scale: float) -> ppb.ForwardRequest:
    """A last-stage (stage 1) forward whose activations a trainer chose: near-zero activations make the
    stage's LayerNorms amplify the gradient, so the honest ``grad_inputs`` norm is the trainer's to set."""
    generator = torch.Generator().manual_seed(microbatch_id)
    hidden = torch.randn(BATCH, 32, 32, generator=generator) * scale
    targets = torch.randint(0, 256, (BATCH, 32), generator=generator)
    return ppb.ForwardRequest(
        run_id=run.run_id, stage=1, step=0, microbatch_id=microbatch_id, attempt=1,
        inputs=encode_floats(hidden, get_codec(run.training.compression)), targets=encode_ids(targets),
    )  # fmt: skip


def transport_to(monkeypatch, replicas: dict[str, object], trainer: SigningKey) -> None:
    """The trainer's stub calls go to ``replicas`` (peer ID -> Replica or an async callable)."""

    class Transport:
        def __init__(self, peer):
            self.target = replicas[peer.to_base58()]

        async def _go(self, method, request):
            if callable(self.target):
                return await self.target(method, request)
            return await self.target.call(trainer, method, request)

        async def rpc_forward(self, request, timeout):
            return await self._go("rpc_forward", request)

        async def rpc_backward(self, request, timeout):
            return await self._go("rpc_backward", request)

    monkeypatch.setattr(StageServicer, "get_stub", classmethod(lambda cls, p2p, peer, **k: Transport(peer)))


# --- 1. framing an honest replica of the previous release ---------------------------------------------


def v1_digest(run_id, stage, trainer, reply, forward) -> bytes:
    """What a replica of the previous release signed for a forward's reply (no self-check promised)."""
    from swarm.pipeline.verify import _answer, sent_sha256

    head = f"swarm-pipeline-reply\0forward\0{run_id}\0{stage}\0{reply.step}\0{reply.state_hash}\0{trainer}\0"
    body = (
        f"{head}{forward.microbatch_id}\0{forward.attempt}\0".encode() + sent_sha256(forward) + _answer(reply)
    )
    return hashlib.sha256(body).digest()


def test_an_answer_a_trainer_steered_over_the_bound_cannot_frame_a_replica_of_the_previous_release(
    tmp_path: Path,
):
    """A replica of the previous release signed whatever it computed, and a trainer sets the honest
    ``grad_inputs`` norm through the activations it sends (near zero: the LayerNorms amplify). Before the
    fix such a replica still joined (``PROTOCOL_VERSION`` 3) and its signed over-bound answer was
    convicting evidence. Since protocol version 4 (the coordinator refuses the old release) the
    reply digest's domain changed, so an old signature verifies for nothing: the evidence bans its filer.
    A current replica refuses the steered answer instead of signing it."""
    run = with_bound(run_config(), 5.0)
    assert PROTOCOL_VERSION >= 4
    framer = trainer_key()
    current = Replica(run, 1)
    refused = asyncio.run(current.call(framer, "rpc_forward", steered_forward(run, 1, 1e-3)))
    assert refused.code == ppb.INTERNAL and "over the run's bound" in refused.error and not refused.signature

    previous = Replica(run, 1)
    previous.servicer.answers.check = lambda *a, **k: None  # the previous release's _answer: no check
    forward = steered_forward(run, 3, 1e-3)
    reply = asyncio.run(previous.call(framer, "rpc_forward", forward))
    assert reply.code == ppb.OK and norm_of(reply, run) > 5.0  # honest, and over the bound
    reply.signature = previous.key.sign(v1_digest(run.run_id, 1, framer.peer_id, reply, forward))
    evidence = StageAnswerEvidence(run.run_id, 1, framer.peer_id, previous.key.peer_id, forward, None, reply)
    found, guilty = judge_answer(run, evidence.to_bytes(), previous.key.peer_id, framer.peer_id)
    assert guilty == framer.peer_id and "mis-signed" in found


# --- 2. a signed non-finite or impossible loss is no rule break -----------------------------------------


class LossLiar(StageServicer):
    """A last stage that signs its training answers with ``loss`` replaced (grad_inputs honest)."""

    loss = math.inf

    def _answer(self, kind, request, caller):
        reply = super()._answer(kind, request, caller)
        if kind == "forward" and not request.inference:
            reply.loss = self.loss
            sign_reply(self.key, self.replica.run.run_id, self.replica.index, caller, reply, request)
        return reply


@pytest.mark.parametrize("lie", [math.inf, -1e30, math.nan])
def test_a_last_stage_signing_an_impossible_loss_is_refused_filed_and_banned(
    tmp_path: Path, monkeypatch, lie
):
    """``AnswerCheck`` checked ``outputs`` and ``grad_inputs`` but never ``loss``: a signed ``inf`` or
    negative cross-entropy passed the trainer, was not filed, and a filing of it banned the trainer; one
    such answer fixed the trainer's reported ``train_loss`` at ``inf`` for good, or near -1e30 for hundreds
    of micro-batches. Now a loss that is not a finite cross-entropy is refused, filed and convicting."""
    run = run_config(verify_probability=0.0, stages=1)
    key = trainer_key()
    liar = Replica(run, 0)
    liar.servicer = LossLiar(liar.replica, liar.servicer.gate, key=liar.key)
    liar.servicer.loss = lie
    filed = []

    async def accuse(accused, evidence, verdict):
        filed.append((accused, evidence))

    trainer = PipelineTrainer(run, None, peer_id=key.peer_id, signing_key=key, accuse=accuse)
    transport_to(monkeypatch, {liar.key.peer_id: liar}, key)
    forward = hidden_forward(run, 0, 40, 40)
    forward.inputs.CopyFrom(
        encode_ids(torch.randint(0, 256, (BATCH, 32), generator=torch.Generator().manual_seed(4)))
    )
    forward.targets.CopyFrom(
        encode_ids(torch.randint(0, 256, (BATCH, 32), generator=torch.Generator().manual_seed(5)))
    )

    async def scenario():
        with pytest.raises(StageFailure, match="not a finite cross-entropy"):
            await trainer._call(0, liar.key.peer_id, "rpc_forward", forward)
        await asyncio.sleep(0)

    asyncio.run(scenario())
    assert [a for a, _ in filed] == [liar.key.peer_id]
    assert math.isnan(trainer.metrics()["train_loss"])  # nothing counted from the lie
    found, guilty = judge_answer(run, filed[0][1].to_bytes(), liar.key.peer_id, key.peer_id)
    assert guilty == liar.key.peer_id, found


# --- 3. filings that are never made -------------------------------------------------------------------


def bad_replica(run, trainer: SigningKey) -> Replica:
    honest = Replica(run, 1)
    norm = norm_of(asyncio.run(honest.call(trainer, "rpc_forward", hidden_forward(run, 1, 5, 5))), run)
    liar = Replica(run, 1)
    liar.servicer = scaled(StageServicer, 10 * run.pipeline.max_grad_output_norm / norm)(
        liar.replica, liar.servicer.gate, key=liar.key
    )
    return liar


def test_a_filing_the_coordinator_did_not_take_is_made_again_at_the_replicas_next_bad_answer(monkeypatch):
    """``StageCheck.file_bad_answer`` marked the replica ``filed`` before the accusation was taken; when it
    was not taken (the coordinator down past ``accuse_until_taken``'s retries, about 2 minutes), the replica
    was never filed again by this trainer. Now a filing not taken is forgotten, and the next bad answer
    files again."""
    run = run_config()
    key = trainer_key()
    liar = bad_replica(run, key)
    attempts = []

    async def accuse(accused, evidence, verdict):
        attempts.append(accused)
        if len(attempts) == 1:
            raise ConnectionError("coordinator unreachable")  # what accuse_until_taken raises at last

    trainer = PipelineTrainer(run, None, peer_id=key.peer_id, signing_key=key, accuse=accuse)
    transport_to(monkeypatch, {liar.key.peer_id: liar}, key)

    async def scenario():
        for mb in range(6, 12):
            with pytest.raises(StageFailure, match="over the run's bound"):
                await trainer._call(1, liar.key.peer_id, "rpc_forward", hidden_forward(run, 1, mb, mb))
            for _ in range(3):
                await asyncio.sleep(0)

    asyncio.run(scenario())
    assert attempts == [liar.key.peer_id] * 2  # the first not taken, the second taken: no more after it


def test_after_max_filed_answers_sybil_replicas_a_trainer_still_files_the_next_bad_answer(monkeypatch):
    """``MAX_FILED_ANSWERS`` (256) capped the replicas a trainer ever filed against, for its lifetime: 256
    cheap sybil replicas each signing one bad answer left every later replica's bad answers unfiled. Now
    it bounds only what the trainer remembers (the oldest is forgotten), and filings in flight at once."""
    run = run_config()
    key = trainer_key()
    liar = bad_replica(run, key)
    forward = hidden_forward(run, 1, 6, 6)
    signed = asyncio.run(liar.call(key, "rpc_forward", forward))
    sybils = [SigningKey.generate() for _ in range(MAX_FILED_ANSWERS)]
    filed = []

    async def accuse(accused, evidence, verdict):
        filed.append(accused)

    def sybil(k):
        async def answer(method, request):
            reply = ppb.ForwardReply()
            reply.CopyFrom(signed)
            sign_reply(k, run.run_id, 1, key.peer_id, reply, request)  # a sybil signs the same bad answer
            return reply

        return answer

    routes = {k.peer_id: sybil(k) for k in sybils}
    routes[liar.key.peer_id] = liar
    trainer = PipelineTrainer(run, None, peer_id=key.peer_id, signing_key=key, accuse=accuse)
    transport_to(monkeypatch, routes, key)

    async def scenario():
        for k in sybils:
            with pytest.raises(StageFailure):
                await trainer._call(1, k.peer_id, "rpc_forward", forward)
            await asyncio.sleep(0)  # each filing completes
        for mb in range(7, 10):
            with pytest.raises(StageFailure, match="over the run's bound"):
                await trainer._call(1, liar.key.peer_id, "rpc_forward", hidden_forward(run, 1, mb, mb))
        for _ in range(5):
            await asyncio.sleep(0)

    asyncio.run(scenario())
    assert len(filed) == MAX_FILED_ANSWERS + 1 and filed[-1] == liar.key.peer_id
    assert len(trainer.check.filed) == MAX_FILED_ANSWERS


# --- 4. Avoidance -------------------------------------------------------------------------------------


def test_a_replica_refusing_as_past_is_avoided_even_if_it_serves_one_call_every_two_views(monkeypatch):
    """``Avoidance.served`` forgot a replica's "step is past" streak on any served call, so a replica that
    answered one call in three and refused the rest ``WRONG_STEP`` ahead of its listed step was never
    avoided: each refusal cost its micro-batch a view's wait. Served calls no longer end a streak."""
    run = run_config(verify_probability=0.0, stages=1)
    key = trainer_key()
    stage = Replica(run, 0)
    calls = []

    async def liar(method, request):
        calls.append(request.microbatch_id)
        if len(calls) % 3:
            return ppb.ForwardReply(code=ppb.WRONG_STEP, step=request.step + 1, error="at step 1")
        return await stage.call(key, method, request)

    trainer = PipelineTrainer(run, None, peer_id=key.peer_id, signing_key=key)
    trainer.view = PipelineView(stages={0: [
        StageRecord(stage.key.peer_id, 0, 0, 50.0, 0.5, stage.replica.state_hash, stage.replica.state_hash, time.time())
    ]})  # fmt: skip
    transport_to(monkeypatch, {stage.key.peer_id: liar}, key)
    avoided = []
    waited = []

    async def wait_for_views(count):  # each wait is a real view of the run (announce_interval_s)
        waited.append(count)
        trainer._views += count
        avoided.append(stage.key.peer_id in trainer.avoid.current())

    monkeypatch.setattr(trainer, "_wait_for_views", wait_for_views)
    generator = torch.Generator().manual_seed(0)

    async def scenario():
        for i in range(1, 11):
            ids = torch.randint(0, 256, (BATCH, 33), generator=generator)
            await trainer._process(MicroBatch(i, 0, ids[:, :-1], ids[:, 1:]))

    asyncio.run(scenario())
    assert trainer.completed == set(range(1, 11))
    assert any(avoided)


def test_an_honest_replica_racing_a_step_boundary_again_views_later_gets_its_grace_and_old_streaks_go():
    """``Avoidance.ahead`` kept the view of a replica's first "step is past" answer until it served this
    trainer again: an honest replica that raced one step boundary and was not called since was avoided at
    its next race, views later, without the ``LAGGING_VIEWS`` grace; the entries were never pruned. A
    streak now ends when its last refusal is more than ``LAGGING_VIEWS`` views old."""
    avoid = Avoidance(cooldown_s=30.0, busy_s=0.5)
    assert avoid.refused_ahead("honest", 3) is False
    assert avoid.refused_ahead("honest", 43) is False  # another boundary, 40 views later: a new streak
    assert avoid.refused_ahead("honest", 44) is False and "honest" not in avoid.current()
    assert avoid.refused_ahead("honest", 45) is True  # still refusing its listed step 2 views on
    for i in range(1000):
        avoid.refused_ahead(f"replica-{i}", 50)
    avoid.refused_ahead("late", 60)
    assert set(avoid.ahead) == {"late"}


# --- 5. validation: a short last batch -----------------------------------------------------------------


def test_a_validation_batch_shorter_than_the_micro_batch_is_answered_and_checked(monkeypatch):
    """``validation_batches`` may end with a smaller batch (swarm/data/corpus.py), and a replica accepts an
    inference batch of 1 to ``micro_batch_size`` rows, but ``AnswerCheck`` required exactly
    ``micro_batch_size``: every honest replica refused its own answer and validation was NaN. The answer's
    shape now follows the call's inputs."""
    run = run_config(verify_probability=0.05, stages=2)
    key = trainer_key()
    stage0 = Replica(run, 0)
    stage1 = Replica(run, 1)
    short = ppb.ForwardRequest(run_id=run.run_id, stage=0, step=0, inference=True,
                               inputs=encode_ids(torch.zeros(1, 32, dtype=torch.long)))  # fmt: skip
    reply = asyncio.run(stage0.call(key, "rpc_forward", short))
    assert reply.code == ppb.OK, reply.error

    trainer = PipelineTrainer(run, None, peer_id=key.peer_id, signing_key=key)
    trainer.view = PipelineView(stages={s: [
        StageRecord(r.key.peer_id, s, 0, 50.0, 0.5, r.replica.state_hash, r.replica.state_hash, time.time())
    ] for s, r in ((0, stage0), (1, stage1))})  # fmt: skip
    transport_to(monkeypatch, {stage0.key.peer_id: stage0, stage1.key.peer_id: stage1}, key)
    ids = torch.randint(0, 256, (3, 33), generator=torch.Generator().manual_seed(0))
    batches = [(ids[:2, :-1], ids[:2, 1:]), (ids[2:, :-1], ids[2:, 1:])]  # the split's last batch: 1 row
    monkeypatch.setattr(trainer.dataset, "validation_batches", lambda *a: batches)

    async def no_wait(count):
        trainer._views += count

    monkeypatch.setattr(trainer, "_wait_for_views", no_wait)
    assert math.isfinite(asyncio.run(trainer.validate()))
