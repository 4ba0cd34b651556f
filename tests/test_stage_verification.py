"""Stage servers are verified: signed replies, checks that look like retries, evidence, and a ban.

Everything runs in process with the real classes: two ``StageReplica`` of one stage behind real
``StageServicer`` handlers (one of them mounting the registry's ``stage_poison``), the trainer's real
``StageCheck``, and the real ``CoordinatorService`` served over gRPC on loopback, judging with a
checkpoint of the stage taken from an honest replica's state.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from hivemind.p2p import P2PContext, PeerID
from test_stage_accusations import serving

from protocols import pipeline_pb2 as ppb
from protocols.errors import ProtocolError
from protocols.keys import SigningKey
from swarm.averaging.compression import get_codec
from swarm.byzantine.attacks import make_attack
from swarm.config import RunConfig
from swarm.coordinator_client import CoordinatorClient
from swarm.pipeline.check import StageCall, StageCheck
from swarm.pipeline.evidence import StageMismatchEvidence
from swarm.pipeline.gate import PeerGate
from swarm.pipeline.replica import StageReplica
from swarm.pipeline.server import StageServicer
from swarm.pipeline.trainer import PipelineTrainer, StageFailure
from swarm.pipeline.verify import check_reply, sign_reply
from swarm.pipeline.wire import encode_floats, encode_ids
from swarm.training.state import state_hash, state_tensors

pytestmark = pytest.mark.timeout(90)

BATCH = 2
RUN = "verify-run"
#: The trainers the replicas admit (the real gate, with an allowed set instead of certificates).
TRAINERS: set[str] = set()


def trainer_key() -> SigningKey:
    key = SigningKey.generate()
    TRAINERS.add(key.peer_id)
    return key


def run_config(verify_probability: float = 1.0, stages: int = 2) -> RunConfig:
    return RunConfig(
        run_id=RUN,
        model={"name": "gpt", "config": {"d_model": 32, "n_layer": 3, "n_head": 2, "seq_len": 32, "dropout": 0.1}},
        pipeline={"stages": stages, "verify_probability": verify_probability},
        # Dropout on, which sender checks refuse in a run of one stage (they replay data-parallel senders).
        training={"target_batch_size": 4, "micro_batch_size": BATCH, "sender_check_probability": 0.0},
    )  # fmt: skip


class Replica:
    """One replica of ``stage`` behind its real servicer, called as libp2p would call it."""

    def __init__(self, run: RunConfig, stage: int, attack=None):
        gate = PeerGate(None, run.run_id, None, allowed=TRAINERS)
        self.key = SigningKey.generate()
        self.replica = StageReplica(run, stage)
        asyncio.run(self.replica.commit())
        self.servicer = StageServicer(self.replica, gate, key=self.key, hooks=attack)

    async def call(self, trainer: SigningKey, method: str, request):
        context = P2PContext(
            method, PeerID.from_base58(self.key.peer_id), PeerID.from_base58(trainer.peer_id)
        )
        return await getattr(self.servicer, method)(request, context)


def stage0_forward(run: RunConfig, microbatch_id: int, seed: int) -> ppb.ForwardRequest:
    ids = torch.randint(0, 256, (BATCH, 32), generator=torch.Generator().manual_seed(seed))
    return ppb.ForwardRequest(run_id=run.run_id, stage=0, step=0, microbatch_id=microbatch_id, attempt=1,
                              inputs=encode_ids(ids))  # fmt: skip


def grad_outputs(run: RunConfig, seed: int) -> ppb.Tensor:
    grad = torch.randn(BATCH, 32, 32, generator=torch.Generator().manual_seed(seed)) * 1e-3
    return encode_floats(grad, get_codec(run.training.compression))


async def through(replica: Replica, trainer: SigningKey, run: RunConfig, mb: int, seed: int) -> StageCall:
    """Micro-batch ``mb`` forward and backward at stage 0 of ``replica``, each reply checked as the trainer
    checks it."""
    forward = stage0_forward(run, mb, seed)
    reply = await replica.call(trainer, "rpc_forward", forward)
    assert reply.code == ppb.OK, reply.error
    check_reply(replica.key.peer_id, run.run_id, 0, trainer.peer_id, reply, forward)
    backward = ppb.BackwardRequest(run_id=run.run_id, stage=0, step=0, microbatch_id=mb, attempt=1,
                                   grad_outputs=grad_outputs(run, seed))  # fmt: skip
    back = await replica.call(trainer, "rpc_backward", backward)
    check_reply(replica.key.peer_id, run.run_id, 0, trainer.peer_id, back, forward, backward)
    return StageCall(replica.key.peer_id, forward, reply, backward, back)


def checker(run: RunConfig, trainer: SigningKey, replicas: dict[str, Replica], accuse=None) -> StageCheck:
    async def call(stage, peer, method, request, forward=None):
        reply = await replicas[peer].call(trainer, method, request)
        assert reply.code == ppb.OK, reply.error
        check_reply(
            peer,
            run.run_id,
            stage,
            trainer.peer_id,
            reply,
            *((request, None) if forward is None else (forward, request)),
        )
        return reply

    return StageCheck(run, trainer, get_codec(run.training.compression), call=call, choose=None, accuse=accuse)  # fmt: skip


def test_honest_replicas_of_a_stage_answer_every_checked_microbatch_bit_for_bit():
    """Dropout 0.1: the forward's random state is seeded from the micro-batch, so two replicas agree."""
    run = run_config()
    trainer = trainer_key()
    a, b = Replica(run, 0), Replica(run, 0)
    check = checker(run, trainer, {a.key.peer_id: a, b.key.peer_id: b})

    async def scenario() -> None:
        for mb in range(12):
            first = await through(a, trainer, run, mb, seed=mb)
            assert await check.check(0, b.key.peer_id, 2, first) is None
        assert check.stats == {"checks": 12, "mismatches": 0, "bad_answers": 0}
        # The check was a signed retry: the second replica counted every micro-batch at attempt 2.
        assert sorted(b.replica.claims.values()) == [2] * 12

    asyncio.run(scenario())


def test_an_unsigned_or_mis_signed_reply_is_refused_and_its_replica_avoided(monkeypatch):
    run = run_config()
    trainer = trainer_key()
    honest = Replica(run, 0)
    forward = stage0_forward(run, 7, 7)
    reply = asyncio.run(honest.call(trainer, "rpc_forward", forward))
    check_reply(honest.key.peer_id, run.run_id, 0, trainer.peer_id, reply, forward)  # signed: accepted
    unsigned = ppb.ForwardReply()
    unsigned.CopyFrom(reply)
    unsigned.signature = b""
    with pytest.raises(ProtocolError, match="unsigned reply"):
        check_reply(honest.key.peer_id, run.run_id, 0, trainer.peer_id, unsigned, forward)
    altered = ppb.ForwardReply()
    altered.CopyFrom(reply)
    altered.outputs.data = bytes([altered.outputs.data[0] ^ 1]) + altered.outputs.data[1:]
    with pytest.raises(ProtocolError, match="mis-signed"):
        check_reply(honest.key.peer_id, run.run_id, 0, trainer.peer_id, altered, forward)
    # Signed by another key than the replica's: mis-signed too.
    with pytest.raises(ProtocolError, match="mis-signed"):
        check_reply(SigningKey.generate().peer_id, run.run_id, 0, trainer.peer_id, reply, forward)

    # The trainer's own call path, answered by a real servicer that signs nothing (the transport is the
    # only thing replaced), turns the refusal into a failure that avoids the replica.
    pipeline = PipelineTrainer(run, None, peer_id=trainer.peer_id, signing_key=trainer)
    keyless = Replica(run, 0)
    keyless.servicer.key = None

    class Transport:
        async def rpc_forward(self, request, timeout):
            return await keyless.call(trainer, "rpc_forward", request)

    monkeypatch.setattr(StageServicer, "get_stub", classmethod(lambda cls, *a, **k: Transport()))
    with pytest.raises(StageFailure, match="unsigned reply") as failure:
        asyncio.run(pipeline._call(0, keyless.key.peer_id, "rpc_forward", forward))
    assert failure.value.code == ppb.BAD_REQUEST  # the code on which the trainer avoids the server


class Held:
    """The coordinator's checkpoint of stage 0 at step 0: the honest replicas' state."""

    def __init__(self, replica: StageReplica):
        self.step = replica.step
        self.tensors = {k: v.clone() for k, v in state_tensors(replica.model, replica.optimizer).items()}
        self.state_hash = state_hash(self.step, self.tensors)


async def accuse_at_coordinator(
    tmp_path: Path, run: RunConfig, checkpoint, trainer: SigningKey, peers: list, accused: Replica,
    evidence: StageMismatchEvidence, stage_states=None,
):  # fmt: skip
    """Join ``trainer`` and ``peers`` at the real coordinator service (holding ``checkpoint`` of the stage)
    and have ``trainer`` file ``evidence`` against ``accused``: (its answer, the peers banned)."""
    async with serving(tmp_path, run, lambda stage: checkpoint, stage_states) as (address, store), \
            CoordinatorClient(address) as client:  # fmt: skip
        for i, key in enumerate((trainer, *peers)):
            await client.join(key, RUN, name=f"peer{i}", device="cpu")
        answer = await client.accuse(trainer, RUN, accused=accused.key.peer_id, reason="mismatch",
                                     evidence=evidence.to_bytes())  # fmt: skip
        return answer, {b.peer_id for b in await store.list_bans()}


@pytest.mark.parametrize("poisoned_first", [True, False])
def test_a_poisoning_replica_is_caught_by_a_check_and_banned_by_the_coordinator(
    tmp_path: Path, poisoned_first
):
    run = run_config()
    trainer = trainer_key()
    honest, poison = (
        Replica(run, 0),
        Replica(run, 0, attack=make_attack("stage_poison", group_size=3, attackers=1)),
    )
    held = Held(honest.replica)
    assert held.state_hash == honest.replica.state_hash == poison.replica.state_hash
    first, second = (poison, honest) if poisoned_first else (honest, poison)
    filed = []

    async def accuse(accused, evidence, verdict):
        filed.append((accused, evidence))

    check = checker(run, trainer, {honest.key.peer_id: honest, poison.key.peer_id: poison}, accuse=accuse)

    async def scenario() -> None:
        call = await through(first, trainer, run, 1, seed=1)
        evidence = await check.check(0, second.key.peer_id, 2, call)
        assert evidence is not None and check.stats["mismatches"] == 1
        assert filed and filed[0][0] == first.key.peer_id  # the trainer accuses the replica it checked
        answer, banned = await accuse_at_coordinator(
            tmp_path / str(poisoned_first), run, held, trainer, [honest.key, poison.key], first, evidence
        )
        assert answer.banned_peer == poison.key.peer_id, answer.verdict
        assert "wrongly" in answer.verdict and "false accusation" not in answer.verdict  # convicted
        assert banned == {poison.key.peer_id}

    asyncio.run(scenario())


def test_forged_stage_evidence_bans_its_accuser_and_unrecomputable_evidence_bans_nobody(tmp_path: Path):
    run = run_config()
    trainer, framer = trainer_key(), trainer_key()
    a, b = Replica(run, 0), Replica(run, 0)
    poison = Replica(run, 0, attack=make_attack("stage_poison", group_size=3, attackers=1))
    held = Held(a.replica)

    async def scenario() -> None:
        honest_call = await through(a, trainer, run, 3, seed=3)
        # The trainer alters one byte of b's honest reply to make the two differ.
        second_reply = ppb.ForwardReply()
        call_b = await through(b, trainer, run, 3, seed=3)
        second_reply.CopyFrom(call_b.forward_reply)
        second_reply.outputs.data = bytes([second_reply.outputs.data[0] ^ 1]) + second_reply.outputs.data[1:]
        forged = StageMismatchEvidence.of(
            RUN, 0, trainer.peer_id, (a.key.peer_id, honest_call.forward, None, honest_call.forward_reply),
            (b.key.peer_id, call_b.forward, None, second_reply),
        )  # fmt: skip
        async with serving(tmp_path, run, lambda stage: held) as (address, store), \
                CoordinatorClient(address) as client:  # fmt: skip
            for i, key in enumerate((trainer, framer, a.key, b.key)):
                await client.join(key, RUN, name=f"peer{i}", device="cpu")
            answer = await client.accuse(trainer, RUN, accused=b.key.peer_id, reason="forged",
                                         evidence=forged.to_bytes())  # fmt: skip
            assert answer.banned_peer == trainer.peer_id and "mis-signed" in answer.verdict
        # Honest evidence the coordinator cannot recompute (it holds no state of that step) bans nobody.
        call_p = await through(poison, framer, run, 4, seed=4)
        call_h = await through(a, framer, run, 4, seed=4)
        real = StageMismatchEvidence.of(
            RUN, 0, framer.peer_id, (poison.key.peer_id, call_p.forward, None, call_p.forward_reply),
            (a.key.peer_id, call_h.forward, None, call_h.forward_reply),
        )  # fmt: skip
        async with serving(tmp_path / "none", run, lambda stage: None) as (address, store), \
                CoordinatorClient(address) as client:  # fmt: skip
            for i, key in enumerate((framer, a.key, poison.key)):
                await client.join(key, RUN, name=f"peer{i}", device="cpu")
            with pytest.raises(ProtocolError, match="nobody banned.*cannot recompute"):
                await client.accuse(framer, RUN, accused=poison.key.peer_id, reason="mismatch",
                                    evidence=real.to_bytes())  # fmt: skip
            assert await store.list_bans() == []

    asyncio.run(scenario())


def test_a_check_reaching_a_replica_that_already_counted_the_microbatch_finds_no_mismatch():
    """An earlier attempt counted the micro-batch at the second replica: its repeat must answer exactly
    what a fresh forward answers (it used to add the backward's result and a NaN loss), or the honest
    trainer would file evidence that convicts an honest replica."""
    run = run_config()
    trainer = trainer_key()
    a, b = Replica(run, 0), Replica(run, 0)

    async def scenario() -> None:
        check = checker(run, trainer, {a.key.peer_id: a, b.key.peer_id: b})
        await through(b, trainer, run, 9, seed=9)  # attempt 1 counted at b, then (say) failed downstream
        first = await through(a, trainer, run, 9, seed=9)
        assert await check.check(0, b.key.peer_id, 3, first) is None
        assert await check.check(0, a.key.peer_id, 3, first) is None  # never checked against itself
        assert check.stats == {"checks": 1, "mismatches": 0, "bad_answers": 0}

    asyncio.run(scenario())


def hidden_forward(run: RunConfig, stage: int, microbatch_id: int, seed: int, *, inference: bool = False):
    """A forward of activations to ``stage`` (with targets when it is the last)."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(BATCH, 32, 32, generator=generator)
    targets = torch.randint(0, 256, (BATCH, 32), generator=generator)
    request = ppb.ForwardRequest(run_id=run.run_id, stage=stage, step=0, microbatch_id=microbatch_id, attempt=1,
                                 inputs=encode_floats(hidden, get_codec(run.training.compression)), inference=inference)  # fmt: skip
    if stage == run.pipeline.stages - 1:
        request.targets.CopyFrom(encode_ids(targets))
    return request


def test_a_trainer_cannot_frame_an_honest_replica_with_an_inference_answer_or_a_repeat(tmp_path: Path):
    """Two honest answers that differ for a reason other than a wrong computation: an inference answer
    beside a training one, and a repeat (answered from the micro-batch's first inputs) beside an answer
    to other inputs. Each signature names what the reply really answered, so the framer is banned."""
    run = run_config(stages=3)
    framer = trainer_key()
    a, b = Replica(run, 2), Replica(run, 2)  # the last stage
    c, d = Replica(run, 1), Replica(run, 1)  # a middle stage: its backward answers grad_inputs
    held = {2: Held(a.replica), 1: Held(c.replica)}

    async def scenario() -> list[str]:
        training = hidden_forward(run, 2, 11, seed=11)
        inference = hidden_forward(run, 2, 11, seed=11, inference=True)
        answer_b = await b.call(framer, "rpc_forward", training)
        answer_a = await a.call(framer, "rpc_forward", inference)
        by_inference = StageMismatchEvidence.of(
            RUN, 2, framer.peer_id, (a.key.peer_id, training, None, answer_a), (b.key.peer_id, training, None, answer_b)
        )  # fmt: skip
        await a.call(framer, "rpc_forward", hidden_forward(run, 2, 12, seed=12))  # counted: its first inputs
        other = hidden_forward(run, 2, 12, seed=13)
        repeat_a = await a.call(framer, "rpc_forward", other)  # a repeat: the first answer again
        answer_b = await b.call(framer, "rpc_forward", other)
        by_repeat = StageMismatchEvidence.of(
            RUN, 2, framer.peer_id, (a.key.peer_id, other, None, repeat_a), (b.key.peer_id, other, None, answer_b)
        )  # fmt: skip
        # A backward repeated with another gradient at a middle stage: answered, and signed, as the first.
        forward = hidden_forward(run, 1, 13, seed=13)
        await c.call(framer, "rpc_forward", forward)
        backward = ppb.BackwardRequest(run_id=RUN, stage=1, step=0, microbatch_id=13, attempt=1,
                                       grad_outputs=grad_outputs(run, seed=13))  # fmt: skip
        first_c = await c.call(framer, "rpc_backward", backward)
        backward = ppb.BackwardRequest(run_id=RUN, stage=1, step=0, microbatch_id=13, attempt=1,
                                       grad_outputs=grad_outputs(run, seed=14))  # fmt: skip
        repeat_c = await c.call(framer, "rpc_backward", backward)
        assert repeat_c.grad_inputs == first_c.grad_inputs and repeat_c.grad_inputs.data
        await d.call(framer, "rpc_forward", forward)
        answer_d = await d.call(framer, "rpc_backward", backward)
        by_backward = StageMismatchEvidence.of(
            RUN, 1, framer.peer_id, (c.key.peer_id, forward, backward, repeat_c),
            (d.key.peer_id, forward, backward, answer_d),
        )  # fmt: skip
        verdicts = []
        for i, evidence in enumerate((by_inference, by_repeat, by_backward)):
            async with serving(tmp_path / str(i), run, lambda stage: held[stage]) as (
                address, store), \
                    CoordinatorClient(address) as client:  # fmt: skip
                for j, key in enumerate((framer, a.key, b.key, c.key, d.key)):
                    await client.join(key, RUN, name=f"peer{j}", device="cpu")
                answer = await client.accuse(framer, RUN, accused=evidence.accused, reason="framed",
                                             evidence=evidence.to_bytes())  # fmt: skip
                assert answer.banned_peer == framer.peer_id, answer.verdict
                verdicts.append(answer.verdict)
        return verdicts

    verdicts = asyncio.run(scenario())
    assert all("mis-signed" in v for v in verdicts), verdicts


def test_a_reply_naming_no_state_is_refused_and_an_honest_replica_never_sends_one(monkeypatch):
    """A poisoner that signs its replies with an empty ``state_hash`` could never be judged: the trainer
    refuses such a reply, correctly signed, as it refuses a mis-signed one (and avoids the replica). An
    honest replica asked between a step's update and its hashing hashes its state before it answers,
    and names it."""
    run = run_config()
    trainer = trainer_key()

    class NoState(StageServicer):
        def _answer(self, kind, request, caller):
            reply = super()._answer(kind, request, caller)
            reply.state_hash = ""
            sign_reply(self.key, run.run_id, self.replica.index, caller, reply, request)
            return reply

    liar = Replica(run, 0)
    liar.servicer = NoState(liar.replica, liar.servicer.gate, key=liar.key)
    pipeline = PipelineTrainer(run, None, peer_id=trainer.peer_id, signing_key=trainer)

    class Transport:
        async def rpc_forward(self, request, timeout):
            return await liar.call(trainer, "rpc_forward", request)

    monkeypatch.setattr(StageServicer, "get_stub", classmethod(lambda cls, *a, **k: Transport()))
    forward = stage0_forward(run, 9, 9)
    with pytest.raises(StageFailure, match="names no state") as failure:
        asyncio.run(pipeline._call(0, liar.key.peer_id, "rpc_forward", forward))
    assert failure.value.code == ppb.BAD_REQUEST  # the code on which the trainer avoids the server
    reply = asyncio.run(liar.call(trainer, "rpc_forward", stage0_forward(run, 10, 10)))
    check_reply(liar.key.peer_id, run.run_id, 0, trainer.peer_id, reply, stage0_forward(run, 10, 10))

    honest = Replica(run, 0)
    honest.replica.apply(torch.zeros(honest.replica.numel))  # updated to step 1, not hashed yet
    early = stage0_forward(run, 11, 11)
    early.step = 1
    answered = asyncio.run(honest.call(trainer, "rpc_forward", early))
    assert answered.code == ppb.OK and honest.replica.hashed_step == 1  # hashed before it answered
    assert answered.state_hash == state_hash(1, state_tensors(honest.replica.model, honest.replica.optimizer))
    check_reply(honest.key.peer_id, run.run_id, 0, trainer.peer_id, answered, early)
