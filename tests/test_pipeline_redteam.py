"""The SWARM pipeline read as an attacker with the code and one admitted identity: each way in found,
fixed, and held here, in process with the real replica, servicer, gate and trainer.

Each test says what the attack did before its fix; it fails on that code and passes now.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from hivemind.p2p import P2PContext, PeerID

from protocols import pipeline_pb2 as ppb
from protocols.keys import SigningKey
from swarm.averaging.compression import get_codec
from swarm.byzantine.attacks import make_attack
from swarm.config import RunConfig
from swarm.pipeline.gate import PeerGate
from swarm.pipeline.held import MAX_FORWARD_STATES, forwards_per_caller
from swarm.pipeline.hooks import PipelineHooks
from swarm.pipeline.records import PipelineView, StageRecord
from swarm.pipeline.replica import StageReplica
from swarm.pipeline.server import StageServicer
from swarm.pipeline.trainer import PipelineTrainer, StageFailure
from swarm.pipeline.wire import encode_floats, encode_ids, sign_attempt

pytestmark = pytest.mark.timeout(60)

BATCH = 2
HASH = "0" * 64


def redteam_run(**pipeline) -> RunConfig:
    return RunConfig(
        run_id="pipeline-redteam",
        model={"name": "gpt", "config": {"d_model": 32, "n_layer": 2, "n_head": 2, "seq_len": 32}},
        pipeline={"stages": 2, "request_timeout_s": 2.0, "announce_interval_s": 0.2, **pipeline},
        training={"target_batch_size": 4, "micro_batch_size": BATCH},
    )


def test_a_last_stage_answering_over_bound_grad_inputs_is_avoided_and_cannot_get_the_trainer_banned(
    monkeypatch,
):
    """Before the fix the trainer relayed a replica's signed answer unchecked: a last-stage replica that
    answered grad_inputs over the norm bound had them refused by the honest stage-0 replica as the
    *trainer's* bad request, the trainer avoided the honest replica, and after
    ``ban_after_bad_requests`` (3 here) the honest replica banned the honest trainer."""
    torch.set_num_threads(1)
    run = redteam_run(ban_after_bad_requests=3)
    trainer_key = SigningKey.generate()
    keys = [SigningKey.generate(), SigningKey.generate()]
    gates = [
        PeerGate(None, run.run_id, None, allowed={trainer_key.peer_id},
                 ban_after_bad_requests=run.pipeline.ban_after_bad_requests)
        for _ in keys
    ]  # fmt: skip
    poison = make_attack("stage_poison", {"grad_norm_share": 2.0}, group_size=2, attackers=1)
    servicers = {
        key.peer_id: StageServicer(StageReplica(run, k), gates[k], key=key, hooks=poison if k else None)
        for k, key in enumerate(keys)
    }

    class Transport:  # only libp2p is replaced: the call reaches the real servicer as from the trainer
        def __init__(self, peer: str):
            self.servicer, self.peer = servicers[peer], peer

        async def _call(self, method: str, request):
            context = P2PContext(
                method, PeerID.from_base58(self.peer), PeerID.from_base58(trainer_key.peer_id)
            )
            return await getattr(self.servicer, method)(request, context)

        async def rpc_forward(self, request, timeout):
            return await self._call("rpc_forward", request)

        async def rpc_backward(self, request, timeout):
            return await self._call("rpc_backward", request)

    monkeypatch.setattr(
        StageServicer, "get_stub", classmethod(lambda cls, p2p, peer, **k: Transport(peer.to_base58()))
    )
    trainer = PipelineTrainer(run, None, peer_id=trainer_key.peer_id, seed=0, signing_key=trainer_key)
    trainer.view = PipelineView(
        stages={k: [StageRecord(key.peer_id, k, 0, 1.0, 0.0, HASH, HASH, time.time())] for k, key in enumerate(keys)}
    )  # fmt: skip
    try:
        for servicer in servicers.values():
            asyncio.run(servicer.replica.commit())
        for _ in range(2 * run.pipeline.ban_after_bad_requests):
            with pytest.raises(StageFailure) as failure:
                asyncio.run(trainer._attempt(trainer._new_microbatch()))
            assert (failure.value.stage, failure.value.peer, failure.value.code) == (
                1, keys[1].peer_id, ppb.BAD_REQUEST
            ), f"the failure was put on {failure.value}"  # fmt: skip
            assert "grad_inputs has L2 norm" in str(failure.value)
        assert trainer_key.peer_id not in gates[0].banned, "the honest replica banned the honest trainer"
        assert gates[0].bad_requests[trainer_key.peer_id] == 0
        # Honest answers pass the same check: with the poisoner honest, the micro-batch completes.
        servicers[keys[1].peer_id].hooks = PipelineHooks()
        loss = asyncio.run(trainer._attempt(trainer._new_microbatch()))
        assert loss == loss and servicers[keys[0].peer_id].replica.samples == BATCH
    finally:
        for servicer in servicers.values():
            servicer.replica.close()


def stage0_forward(run: RunConfig, microbatch_id: int, seed: int = 0) -> ppb.ForwardRequest:
    ids = torch.randint(0, 256, (BATCH, 32), generator=torch.Generator().manual_seed(seed))
    return ppb.ForwardRequest(run_id=run.run_id, stage=0, step=0, microbatch_id=microbatch_id, attempt=1,
                              inputs=encode_ids(ids))  # fmt: skip


def last_forward(run: RunConfig, microbatch_id: int, seed: int, attempt: int = 1, signature: bytes = b""):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(BATCH, 32, 32, generator=generator)
    targets = torch.randint(0, 256, (BATCH, 32), generator=generator)
    return ppb.ForwardRequest(run_id=run.run_id, stage=1, step=0, microbatch_id=microbatch_id, attempt=attempt,
                              attempt_signature=signature, targets=encode_ids(targets),
                              inputs=encode_floats(hidden, get_codec(run.training.compression)))  # fmt: skip


def test_one_trainer_holding_forwards_without_backwards_leaves_room_for_every_other_trainer():
    """Before the fix the replica's 512 forward states were shared by all callers: one trainer that sent
    512 forwards and no backward got every other trainer refused BUSY for ``forward_state_ttl_s`` (60 s),
    holding 512 graphs of the honest replica's memory."""
    torch.set_num_threads(1)
    run = redteam_run()
    replica = StageReplica(run, 0)
    try:
        for microbatch_id in range(MAX_FORWARD_STATES):
            replica.forward(stage0_forward(run, microbatch_id), "attacker")
        limit = forwards_per_caller(run)
        assert sum(1 for k in replica.forwards if k[0] == "attacker") == limit
        assert replica.forward(stage0_forward(run, 1, seed=1), "honest").outputs.data
        # The caller's own newest forwards are the ones kept: a live micro-batch's backward still counts.
        newest = MAX_FORWARD_STATES - 1
        assert ("attacker", newest) in replica.forwards and ("attacker", 0) not in replica.forwards
        grads = encode_floats(torch.full((BATCH, 32, 32), 1e-3), get_codec(run.training.compression))
        backward = ppb.BackwardRequest(
            run_id=run.run_id, stage=0, step=0, microbatch_id=1, grad_outputs=grads
        )
        replica.backward(backward, "honest")
        assert replica.trainer_samples["honest"] == BATCH
    finally:
        replica.close()


def test_a_trainers_retry_elsewhere_replays_only_its_own_microbatches_at_the_replica_it_left():
    """Before the fix a replica dropping one superseded micro-batch rebuilt its whole gradient: an
    attacker that counted one micro-batch at replica A and sent its signed attempt 2 to replica B made A
    recompute the backward of every micro-batch every trainer had sent it at the step (8 here)."""
    torch.set_num_threads(1)
    run = redteam_run()
    attacker = SigningKey.generate()
    a, b, clean = StageReplica(run, 1), StageReplica(run, 1), StageReplica(run, 1)
    try:
        for microbatch_id in range(8):
            for replica in (a, clean):
                replica.forward(last_forward(run, microbatch_id, seed=microbatch_id), "honest-trainer")
        a.forward(last_forward(run, 99, seed=99), attacker.peer_id)
        a.forward(last_forward(run, 98, seed=98), attacker.peer_id)
        clean.forward(last_forward(run, 98, seed=98), attacker.peer_id)
        signature = sign_attempt(attacker, run.run_id, 1, 0, 99, 2)
        b.forward(last_forward(run, 99, seed=99, attempt=2, signature=signature), attacker.peer_id)
        recomputed = []
        replay = a._recompute
        a._recompute = lambda entry, grads: (
            recomputed.append(entry.request.microbatch_id),
            replay(entry, grads),
        )
        assert a.drop_superseded(a.superseding(b.retried())) == BATCH
        assert recomputed == [98], f"micro-batches recomputed: {recomputed}"
        # Bit for bit what a replica that never saw the dropped micro-batch holds, for every trainer.
        assert a.samples == clean.samples == 9 * BATCH
        for trainer in clean.by_trainer:
            assert torch.equal(a.by_trainer[trainer], clean.by_trainer[trainer]), trainer
        assert torch.equal(a.mean_gradient(), clean.mean_gradient())
    finally:
        for replica in (a, b, clean):
            replica.close()


def test_sybil_stage_records_do_not_move_a_stages_last_honest_replica_away():
    """Before the fix rebalancing counted every serving record of the replica's own stage: four Sybil
    identities announcing stage 0 at a typical rate (no server behind them; peer IDs ground above the
    honest one's) made stage 0 look the richest and its only honest replica the mover, which moved to
    stage 1 and left stage 0 to the Sybils. Its own stage now counts only the peers it completed its
    last round with."""
    from swarm.pipeline.worker import StageWorker

    torch.set_num_threads(1)
    run = redteam_run()
    keys = sorted((SigningKey.generate() for _ in range(7)), key=lambda k: k.peer_id)
    honest, sybils, stage1 = keys[0], keys[1:5], keys[5:]

    def record(peer_id: str, stage: int) -> StageRecord:
        return StageRecord(peer_id, stage, 0, 50.0, 0.5, HASH, HASH, time.time())

    worker = StageWorker(run, None, peer_id=honest.peer_id, stage=0, signing_key=honest)
    worker.replica = StageReplica(run, 0)
    try:
        worker.view = PipelineView(stages={0: [record(k.peer_id, 0) for k in (honest, *sybils)],
                                           1: [record(k.peer_id, 1) for k in stage1]})  # fmt: skip
        asyncio.run(worker._maybe_move())
        assert worker._leave_to is None, "Sybil records moved the stage's only honest replica away"
        # Stage-mates it averaged with are counted: a real surplus at stage 0 still moves it.
        worker._round_mates = {k.peer_id for k in sybils}
        asyncio.run(worker._maybe_move())
        assert worker._leave_to == 1
    finally:
        worker.replica.close()


def test_one_forward_without_backward_and_an_in_flight_claim_delay_a_step_by_one_timeout_not_two():
    """A trainer sends one forward to a stage-0 replica at each step, never its backward, and claims it in
    flight: the in-flight hold and the wait for backwards shared no deadline, so every step closed two
    request timeouts late; now one."""
    from swarm.pipeline.records import TrainerRecord
    from swarm.pipeline.worker import StageWorker

    torch.set_num_threads(1)
    timeout_s = 1.5
    run = redteam_run(request_timeout_s=timeout_s)
    key = SigningKey.generate()
    worker = StageWorker(run, None, peer_id=key.peer_id, stage=0, signing_key=key, rebalance=False)
    worker.replica = StageReplica(run, 0)
    try:
        worker.replica.forward(stage0_forward(run, 1), "attacker")
        stuck = make_attack("stuck_in_flight", group_size=2, attackers=1)
        worker._views = 1
        worker.view = PipelineView(trainers=[
            TrainerRecord("honest", 0, run.training.target_batch_size, 0, time.time()),
            stuck.announce(TrainerRecord("attacker", 0, 0, 0, time.time())),
        ])  # fmt: skip
        started = time.monotonic()
        while not worker._ready_to_step() and time.monotonic() - started < 10:
            time.sleep(0.05)
        asyncio.run(worker._await_backwards())
        waited = time.monotonic() - started
        assert timeout_s <= waited < 2 * timeout_s, f"the step closed after {waited:.2f}s"
    finally:
        worker.replica.close()


def test_one_replica_ahead_cannot_hand_its_state_to_a_replica_that_is_serving_a_long_step():
    """A stage replica's stall clock ran from its last commit, so one serving micro-batches for longer than a
    round's time counted as stalled, and a stalled replica followed any replica ahead: an admitted attacker
    announcing the next step with a state of its own was a majority of one, and the honest replica
    downloaded that state (its hash was all it checked). Now, for a replica that has averaged in its stage,
    the clock runs only while its rounds are failing, and then the mates of its last round decide, all of
    them, as in data parallel."""
    from swarm.pipeline.worker import StageWorker

    torch.set_num_threads(1)
    run = redteam_run()
    honest, mate, attacker = (SigningKey.generate() for _ in range(3))
    poison = "e" * 64

    def record(key: SigningKey, step: int, state_hash: str) -> StageRecord:
        return StageRecord(key.peer_id, 0, step, 50.0, 0.5, state_hash, state_hash, time.time())

    worker = StageWorker(run, None, peer_id=honest.peer_id, stage=0, signing_key=honest)
    worker.replica = StageReplica(run, 0)
    try:
        mine = worker.replica.state_hash
        worker.view = PipelineView(holders={0: [record(honest, 0, mine), record(mate, 0, mine),
                                                record(attacker, 1, poison)]})  # fmt: skip
        worker._anchors = {mate.peer_id, attacker.peer_id}
        worker._step_since = time.monotonic() - 10 * run.training.round_s  # a long step of micro-batches
        assert worker._ahead_or_apart() is None, "serving is not stalling: the attacker ahead is no majority"
        # Its rounds have failed for a round's time: only the mates of its last round may lead it, all of them.
        worker.replica.closing = True
        worker._step_since = time.monotonic() - 1.5 * run.training.round_s
        assert worker._ahead_or_apart() is None, "one of its two round mates ahead is no majority"
        worker.view.holders[0][1] = record(mate, 1, poison)  # both mates hold the next step's state: follow
        assert worker._ahead_or_apart() == (1, poison, sorted([mate.peer_id, attacker.peer_id]))
    finally:
        worker.replica.close()
