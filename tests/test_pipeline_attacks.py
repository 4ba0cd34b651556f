"""The SWARM pipeline against one admitted attacker, with the real replica, server, worker and trainer.

Each test mounts a named attack from ``swarm.byzantine.pipeline_attacks`` and asserts what the honest
trainers and replicas care about: their own micro-batches counted and answered, their counts kept,
their steps closed, their work routed by what they measured.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from hivemind.p2p import P2PContext, PeerID

from protocols import pipeline_pb2 as ppb
from protocols.keys import SigningKey
from protocols.messages import StageRecordBody
from swarm.averaging.compression import get_codec
from swarm.byzantine.attacks import make_attack
from swarm.config import RunConfig
from swarm.pipeline.gate import PeerGate
from swarm.pipeline.records import PipelineView, StageRecord, TrainerRecord
from swarm.pipeline.replica import Refusal, StageReplica
from swarm.pipeline.server import StageServicer
from swarm.pipeline.wire import encode_floats, encode_ids, sign_attempt

pytestmark = pytest.mark.timeout(60)

BATCH = 2
HASH = "0" * 64


def attack_run() -> RunConfig:
    return RunConfig(
        run_id="pipeline-attacks",
        model={"name": "gpt", "config": {"d_model": 32, "n_layer": 2, "n_head": 2, "seq_len": 32}},
        pipeline={"stages": 2, "request_timeout_s": 2.0, "announce_interval_s": 0.2},
        training={"target_batch_size": 4, "micro_batch_size": BATCH},
    )


def last_stage_request(run: RunConfig, microbatch_id: int, seed: int, attempt: int = 0) -> ppb.ForwardRequest:
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(BATCH, 32, 32, generator=generator)
    targets = torch.randint(0, 256, (BATCH, 32), generator=generator)
    return ppb.ForwardRequest(run_id=run.run_id, stage=1, step=0, microbatch_id=microbatch_id, attempt=attempt,
                              inputs=encode_floats(hidden, get_codec(run.training.compression)),
                              targets=encode_ids(targets))  # fmt: skip


def serve(servicer: StageServicer, key: SigningKey, request: ppb.ForwardRequest) -> ppb.ForwardReply:
    """The request as the server's handler sees it from ``key``'s peer (libp2p authenticates the caller)."""
    me = PeerID.from_base58(SigningKey.generate().peer_id)
    context = P2PContext("forward", me, PeerID.from_base58(key.peer_id))
    torch.manual_seed(0)  # the same dropout draws for the honest call and its reference
    return asyncio.run(servicer.rpc_forward(request, context))


def test_front_runner_under_an_honest_trainers_id_gets_neither_its_count_nor_its_answer():
    """Micro-batch IDs are public seeds. Before the fix, an attacker that called first under an honest
    trainer's ID was counted instead of it, and the honest trainer got the attacker's grad_inputs back."""
    torch.set_num_threads(1)
    run = attack_run()
    honest, attacker = SigningKey.generate(), SigningKey.generate()
    gate = PeerGate(None, run.run_id, None, allowed={honest.peer_id, attacker.peer_id})
    replica, reference = StageReplica(run, 1), StageReplica(run, 1)
    victim_id = 12345
    mine = last_stage_request(run, victim_id, seed=1)
    stolen = make_attack("front_runner", group_size=2, attackers=1).request_as(
        last_stage_request(run, 999, seed=2), victim_id
    )
    try:
        servicer = StageServicer(replica, gate)
        assert serve(servicer, attacker, stolen).code == ppb.OK
        answer = serve(servicer, honest, mine)
        expected = serve(StageServicer(reference, gate), honest, mine)
        assert answer.code == ppb.OK and answer.grad_inputs.data == expected.grad_inputs.data, (
            "the honest trainer got another caller's grad_inputs for its micro-batch"
        )
        assert answer.loss == expected.loss
        assert replica.samples == 2 * BATCH, "the honest micro-batch was not counted"
        assert replica.stats["repeats"] == 0
    finally:
        replica.close()
        reference.close()


def settle(worker, claims: list[StageRecord]) -> int:
    worker.view = PipelineView(holders={1: claims})
    asyncio.run(worker._settle_duplicates())
    return worker.replica.samples


def stage_worker(run: RunConfig, replica: StageReplica):
    from swarm.pipeline.worker import StageWorker

    key = SigningKey.generate()
    worker = StageWorker(run, None, peer_id=key.peer_id, stage=1, signing_key=key, rebalance=False)
    worker.replica = replica
    return worker


def test_forged_retried_claims_drop_nothing_and_only_the_trainers_own_retry_does():
    """Before the fix, a stage record claiming a later attempt of every honest micro-batch made the honest
    replica drop all it counted (it then entered the stage round with weight 0)."""
    torch.set_num_threads(1)
    run = attack_run()
    trainer = SigningKey.generate()
    replica = StageReplica(run, 1)
    gate = PeerGate(None, run.run_id, None, allowed={trainer.peer_id})
    try:
        servicer = StageServicer(replica, gate)
        for microbatch_id in (1, 2):
            assert (
                serve(servicer, trainer, last_stage_request(run, microbatch_id, seed=microbatch_id)).code
                == ppb.OK
            )
        assert replica.samples == 2 * BATCH
        attack = make_attack("forged_retried", group_size=3, attackers=1)
        attack.victims = [(trainer.peer_id, 1), (trainer.peer_id, 2)]
        liar = StageRecord(
            SigningKey.generate().peer_id, 1, 0, 1.0, 0.0, HASH, HASH, time.time(), closing=True
        )
        forged = attack.announce(liar)
        body = {"role": "stage", "stage": 1, "step": 0, "samples_per_s": 1.0, "load": 0.0, "state_hash": HASH,
                "param_hash": HASH, "closing": True, "retried": [list(c) for c in forged.retried],
                "expires_at": time.time() + 60}  # fmt: skip
        StageRecordBody.model_validate(body)  # the forged record passes the schema: only signatures stop it
        worker = stage_worker(run, replica)
        assert settle(worker, [forged]) == 2 * BATCH, "a forged retry claim dropped honest samples"
        # The trainer's own retry of micro-batch 2, counted elsewhere at attempt 2, does drop it here.
        signature = sign_attempt(trainer, run.run_id, 1, 0, 2, 2)
        genuine = StageRecord(liar.peer_id, 1, 0, 1.0, 0.0, HASH, HASH, time.time(), closing=True,
                              retried=((trainer.peer_id, 2, 2, signature),))  # fmt: skip
        assert settle(worker, [genuine]) == BATCH
        over = StageRecord(liar.peer_id, 1, 0, 1.0, 0.0, HASH, HASH, time.time(), closing=True,
                           retried=((trainer.peer_id, 1, 2, signature),))  # fmt: skip
        assert settle(worker, [over]) == BATCH, "a signature of one micro-batch's attempt retired another"
    finally:
        replica.close()


def test_a_retry_without_its_trainers_signature_is_refused_by_name():
    torch.set_num_threads(1)
    run = attack_run()
    trainer, attacker = SigningKey.generate(), SigningKey.generate()
    replica = StageReplica(run, 1)
    gate = PeerGate(None, run.run_id, None, allowed={trainer.peer_id, attacker.peer_id})
    try:
        request = last_stage_request(run, 7, seed=7, attempt=3)
        request.attempt_signature = sign_attempt(attacker, run.run_id, 1, 0, 7, 3)
        reply = serve(StageServicer(replica, gate), trainer, request)
        assert reply.code == ppb.BAD_REQUEST and "not signed by its trainer" in reply.error
        request.attempt_signature = sign_attempt(trainer, run.run_id, 1, 0, 7, 3)
        assert serve(StageServicer(replica, gate), trainer, request).code == ppb.OK
        assert replica.retried() == [(trainer.peer_id, 7, 3, request.attempt_signature)]
    finally:
        replica.close()


def test_stuck_in_flight_holds_a_done_step_only_for_a_served_trainer_and_only_for_a_timeout():
    """Before the fix, one trainer record claiming a micro-batch in flight kept every stage from closing
    its step, forever."""
    torch.set_num_threads(1)
    run = attack_run()
    replica = StageReplica(run, 1)
    try:
        worker = stage_worker(run, replica)
        worker._views = 1
        honest = TrainerRecord(
            SigningKey.generate().peer_id, 0, run.training.target_batch_size, 0, time.time()
        )
        attacker = SigningKey.generate().peer_id
        stuck = make_attack("stuck_in_flight", group_size=2, attackers=1).announce(
            TrainerRecord(attacker, 0, 0, 0, time.time())
        )
        assert stuck.in_flight == 1
        worker.view = PipelineView(trainers=[honest, stuck])
        assert worker._ready_to_step(), "a trainer this stage never served held its step"
        replica.served.add(attacker)  # it did send a micro-batch here: its claim holds the step, bounded
        started = time.monotonic()
        assert not worker._ready_to_step()
        limit_s = run.pipeline.request_timeout_s
        while not worker._ready_to_step() and time.monotonic() - started < 3 * limit_s:
            time.sleep(0.05)
        held = time.monotonic() - started
        assert limit_s <= held < 2 * limit_s, f"the claim held the step for {held:.1f}s"
    finally:
        replica.close()


def test_a_replica_claiming_1e12_samples_per_s_gets_only_what_the_trainer_measured():
    """Before the fix, a replica announcing 1e12 samples/s got every micro-batch (share 1.0 of 2,000)."""
    from swarm.pipeline.trainer import PipelineTrainer

    key = SigningKey.generate()
    trainer = PipelineTrainer(attack_run(), None, peer_id=key.peer_id, seed=0, signing_key=key)
    honest = [
        StageRecord(SigningKey.generate().peer_id, 0, 0, 50.0, 0.5, HASH, HASH, time.time()) for _ in range(2)
    ]
    liar = make_attack("stage_throughput_lie", group_size=3, attackers=1).announce(
        StageRecord(SigningKey.generate().peer_id, 0, 0, 50.0, 0.5, HASH, HASH, time.time())
    )
    assert liar.samples_per_s == 1e12
    trainer.view = PipelineView(stages={0: [*honest, liar]})

    def share(picks: int = 2000) -> float:
        return sum(trainer._choose(0, 0) == liar.peer_id for _ in range(picks)) / picks

    assert share() < 0.45, "the self-reported rate routed the trainer's work"
    for record in honest:  # measured: honest replicas at 50 samples/s, the liar 1,000x faster
        trainer.measured.record(record.peer_id, BATCH, BATCH / 50.0)
    trainer.measured.record(liar.peer_id, BATCH, BATCH / 50_000.0)
    assert share() < 0.55, "a replica got more than twice the median replica's share"


def test_a_replica_that_refuses_every_call_busy_or_as_past_its_listed_step_is_routed_around():
    """Before the fix a replica answering every call BUSY, or WRONG_STEP with a later step while its record
    still served the step, was never avoided: each pick of it cost a view's wait and it was picked again at
    its routing weight. An honest replica that moved on is listed at its new step within two views."""
    from swarm.pipeline.balance import Avoidance, pick_server
    from swarm.pipeline.trainer import PipelineTrainer

    key = SigningKey.generate()
    trainer = PipelineTrainer(attack_run(), None, peer_id=key.peer_id, seed=0, signing_key=key)
    honest, liar = (StageRecord(SigningKey.generate().peer_id, 0, 0, 50.0, 0.5, HASH, HASH, time.time())
                    for _ in range(2))  # fmt: skip
    trainer.view = PipelineView(stages={0: [honest, liar]})

    def picks(n: int = 400) -> int:
        return sum(trainer._choose(0, 0) == liar.peer_id for _ in range(n))

    assert picks() > 100  # equal weights before it refuses
    avoid = trainer.avoid
    assert not avoid.refused_ahead(liar.peer_id, views=5)  # its record may lag one view...
    assert not avoid.refused_ahead(liar.peer_id, views=6)  # ...or two
    assert avoid.refused_ahead(liar.peer_id, views=7)  # still listed at the step it refuses: avoided
    assert picks() == 0
    avoid.until.clear()
    avoid.busy(liar.peer_id)
    assert picks() == 0  # busy: the next picks go to the other replica...
    avoid.until[liar.peer_id] = time.monotonic() - 1
    assert picks() > 100  # ...for a moment only: an honest replica is busy now and then
    alone = Avoidance(cooldown_s=60.0, busy_s=0.5)
    alone.failed(liar.peer_id)
    assert pick_server([liar], trainer.rng, avoid=alone.current()) == liar  # the only one left: still picked


@pytest.mark.timeout(180)  # three DHT nodes start in the fixture: half a minute on a loaded machine
def stage_one_workers(keyed_dhts, *, min_group_size: int, run_id: str) -> tuple[RunConfig, list]:
    """A StageWorker of stage 1 on each DHT of ``keyed_dhts``, each with its replica and averager built
    (not started), in a run with short rounds."""
    from swarm.pipeline.worker import StageWorker

    torch.set_num_threads(1)
    data = attack_run().model_dump(mode="json")
    data["run_id"] = run_id
    data["training"].update(
        min_group_size=min_group_size, matchmaking_time_s=1.0, sender_timeout_s=2.0, averaging_timeout_s=10.0
    )
    run = RunConfig.parse(data)
    members = {key.peer_id for _, key in keyed_dhts}
    workers = [
        StageWorker(run, dht, peer_id=key.peer_id, stage=1, members=members, signing_key=key, rebalance=False)
        for dht, key in keyed_dhts
    ]
    for worker in workers:
        worker.replica = StageReplica(run, 1)
        worker.averager = worker.build_averager(1, worker.replica.numel)
    return run, workers


async def start_and_announce(workers: list) -> None:
    """Start each worker's averager, hash and announce its replica, then let each read the others."""
    for worker in workers:
        await worker.averager.start()
        await worker.replica.commit()
        await worker._announce()
    for worker in workers:
        await worker._refresh_view()


def test_a_stage_round_whose_counted_replicas_are_a_minority_applies_no_gradient(keyed_dhts):
    """Three replicas of stage 1 average; only one counted a micro-batch (the others hold weight 0). Before
    the fix the robust rule left the weight-0 replicas out and all three applied that one's gradient,
    whatever it was; now a minority's vector is never applied and the replicas still agree and step."""
    run, workers = stage_one_workers(keyed_dhts, min_group_size=3, run_id="pipeline-attacks-minority")
    reference = StageReplica(run, 1)  # where the stage is after a step with no gradient
    counter = workers[0]
    counter.replica.forward(last_stage_request(run, 1, seed=1), caller=SigningKey.generate().peer_id)
    assert counter.replica.samples == BATCH and all(w.replica.samples == 0 for w in workers[1:])

    async def scenario() -> None:
        await start_and_announce(workers)
        for _ in range(5):
            pending = [w for w in workers if w.replica.step == 0]
            if not pending:
                break
            await asyncio.gather(*(w._step_round() for w in pending))
        for worker in workers:
            await worker.averager.shutdown()

    try:
        asyncio.run(scenario())
        reference.apply(torch.zeros(reference.numel))
        assert all(w.replica.step == 1 for w in workers), "the stage did not step"
        hashes = {w.replica._hashes()[2] for w in workers}
        assert hashes == {reference._hashes()[2]}, "a minority's gradient was applied to the stage"
        assert all(w.applied[1][0] == 0 and w._stats["rounds_refused"] == 1 for w in workers)
    finally:
        reference.close()
        for worker in workers:
            worker.replica.close()


def test_a_replica_a_step_behind_never_averages_with_one_a_step_ahead(keyed_dhts):
    """Replica A's round at step 0 failed while B and C stepped on to 1; A tries step 0 again while B
    runs its round of step 1. Before the fix A and B formed a group (the stage's averager never compared
    the steps its members signed), both applied the average, and in a 20-step clean `swarm-sim --stages 2`
    all three replicas of stage 0 ended on three different states. Now each excludes the other: neither
    applies anything, and A catches up by download (the catch-up rule)."""
    run, workers = stage_one_workers(keyed_dhts, min_group_size=2, run_id="pipeline-attacks-behind")
    behind, ahead, idle = workers
    for worker in workers:
        worker.replica.forward(last_stage_request(run, 1, seed=1), caller=SigningKey.generate().peer_id)
    for worker in (ahead, idle):  # the round of step 0 that ``behind`` missed
        worker.replica.apply(torch.zeros(worker.replica.numel))
        request = last_stage_request(run, 2, seed=2)
        request.step = 1
        worker.replica.forward(request, caller=SigningKey.generate().peer_id)

    async def scenario() -> tuple[str, str]:
        await start_and_announce(workers)
        before = (behind.replica.state_hash, ahead.replica.state_hash)
        await asyncio.gather(behind._step_round(), ahead._step_round())
        for worker in workers:
            await worker.averager.shutdown()
        return before

    try:
        before = asyncio.run(scenario())
        assert (behind.replica.step, ahead.replica.step) == (0, 1), "a cross-step round was applied"
        assert (behind.replica.state_hash, ahead.replica.state_hash) == before
        assert behind._stats["rounds_failed"] == ahead._stats["rounds_failed"] == 1
    finally:
        for worker in workers:
            worker.replica.close()


def test_a_replica_claiming_1e12_samples_per_s_does_not_move_its_honest_stage_mates_away():
    """Rebalancing can only read reported rates. Before the fix, in `swarm-sim --stages 2 --peers-per-stage 2
    --byzantine 1 --attack stage_throughput_lie` the liar's stage looked the richest, its honest replica
    moved to the other stage, and the liar served its stage alone."""
    from swarm.pipeline.balance import choose_stage, rebalance_move

    keys = sorted(SigningKey.generate().peer_id for _ in range(4))
    honest_mate, liar = keys[0], keys[3]  # the stage's mover is its replica with the lowest peer ID

    def record(peer_id: str, stage: int) -> StageRecord:
        return StageRecord(peer_id, stage, 0, 50.0, 0.5, HASH, HASH, time.time())

    attack = make_attack("stage_throughput_lie", group_size=2, attackers=1)
    view = PipelineView(stages={0: [record(keys[1], 0), record(keys[2], 0)],
                                1: [record(honest_mate, 1), attack.announce(record(liar, 1))]})  # fmt: skip
    assert rebalance_move(view, honest_mate, 1, 2, margin=0.1) is None, (
        "the liar's claim moved its stage-mate"
    )
    assert choose_stage(view, 2, [True, True]) == 0, "a joining peer counts the liar as at most two replicas"
    # An honest imbalance still moves a replica: stage 1 really has three and stage 0 one.
    view = PipelineView(stages={0: [record(keys[3], 0)], 1: [record(k, 1) for k in keys[:3]]})
    assert rebalance_move(view, keys[0], 1, 2, margin=0.1) == 0


def test_swarm_sim_names_the_flag_when_a_pipeline_attack_cannot_be_mounted():
    from lab.pipeline_sim import pipeline_attackers
    from lab.simconfig import SimConfig
    from protocols.errors import ConfigError

    def attackers(**flags) -> dict[str, str]:
        return pipeline_attackers(SimConfig(stages=2, model_size="tiny", byzantine=1, **flags))

    assert attackers(attack="stage_throughput_lie") == {"stage1-0": "stage_throughput_lie"}
    assert attackers(attack="stuck_in_flight", trainers=3) == {"trainer0": "stuck_in_flight"}
    # Several at once: the last stage's replicas first, each stage and the trainers keep an honest peer.
    assert attackers(attack="stage_poison,forged_retried,front_runner", peers_per_stage=2) == {
        "stage1-0": "stage_poison", "stage0-0": "forged_retried", "trainer0": "front_runner"
    }  # fmt: skip
    with pytest.raises(ConfigError, match="forged_retried is mounted by a stage"):
        attackers(attack="stage_poison,stage_throughput_lie,forged_retried", peers_per_stage=2)
    with pytest.raises(ValueError, match="a list of attacks is for a pipeline run"):
        SimConfig(model_size="tiny", byzantine=1, attack="sign_flip,nan")
    with pytest.raises(ConfigError, match="--attack sign_flip is not a pipeline attack"):
        attackers(attack="sign_flip")
    with pytest.raises(ConfigError, match="--peers-per-stage 1 leaves no honest one"):
        attackers(attack="forged_retried", peers_per_stage=1)


def test_a_trainer_sending_outlying_grad_outputs_moves_a_stage_no_more_than_the_robust_rule_allows():
    """Three trainers call stage 0; one sends grad_outputs at the norm bound (~1000x an honest one). Before
    the fix the replica summed every micro-batch's gradient, so that trainer set the stage's gradient;
    now the trainers' means go through the run's rule (centered_clip) and the outlier is named."""
    torch.set_num_threads(1)
    run = attack_run()
    honest = sorted(SigningKey.generate().peer_id for _ in range(2))
    attacker = SigningKey.generate().peer_id
    replica, reference = StageReplica(run, 0), StageReplica(run, 0)
    codec = get_codec(run.training.compression)
    bound = run.pipeline.max_grad_output_norm

    def send(target: StageReplica, trainer: str, microbatch_id: int, scale: float) -> None:
        generator = torch.Generator().manual_seed(microbatch_id)
        ids = torch.randint(0, 256, (BATCH, 32), generator=generator)
        grad = torch.randn(BATCH, 32, 32, generator=generator)
        grad = grad / grad.norm() * scale
        base = dict(run_id=run.run_id, stage=0, step=0, microbatch_id=microbatch_id)
        torch.manual_seed(microbatch_id)  # the same dropout draws on both replicas
        target.forward(ppb.ForwardRequest(inputs=encode_ids(ids), **base), caller=trainer)
        reply = target.backward(
            ppb.BackwardRequest(grad_outputs=encode_floats(grad, codec), **base), caller=trainer
        )
        assert reply.code == ppb.OK

    try:
        for target in (replica, reference):
            for i, trainer in enumerate(honest):
                for k in range(2):
                    send(target, trainer, 10 * i + k, scale=1.0)
        send(replica, attacker, 99, scale=0.999 * bound)
        clean = reference.mean_gradient()
        attacked = replica.mean_gradient()
        assert replica.samples == 5 * BATCH, "every micro-batch is counted for its samples"
        shift = float((attacked - clean).norm())
        assert shift < float(clean.norm()), f"one trainer moved the stage's gradient by {shift:.3g}"
        assert replica.outliers == [attacker]
        assert reference.outliers == []
    finally:
        replica.close()
        reference.close()


def test_one_trainers_robust_stage_gradient_is_its_summed_gradient_bit_for_bit():
    """A guard on the change: with one trainer the rule is not applied, and the replica's per-trainer sum
    is the gradient the parameters accumulated before, bit for bit (a fresh replica summing in place)."""
    torch.set_num_threads(1)
    run = attack_run()
    trainer = SigningKey.generate().peer_id
    replica, reference = StageReplica(run, 1), StageReplica(run, 1)
    try:
        for microbatch_id in (1, 2, 3):
            request = last_stage_request(run, microbatch_id, seed=microbatch_id)
            torch.manual_seed(microbatch_id)
            replica.forward(request, caller=trainer)
            torch.manual_seed(microbatch_id)
            inputs, targets = reference._inputs(request)
            reference.model.train()
            (reference.model.loss(inputs, targets) * BATCH).backward()
        summed = torch.cat([p.grad.flatten() for p in reference.params]) / (3 * BATCH)
        assert torch.equal(replica.mean_gradient(), summed)
    finally:
        replica.close()
        reference.close()


def test_a_flood_of_trainer_identities_is_refused_past_the_replicas_limit():
    """Each trainer holds a flat copy of the stage's gradient at a replica: without a bound, identities
    minted for one micro-batch each would fill its memory."""
    torch.set_num_threads(1)
    run = attack_run()
    replica = StageReplica(run, 1)
    replica.max_trainers = 2
    first, second, third = (SigningKey.generate().peer_id for _ in range(3))
    try:
        replica.forward(last_stage_request(run, 1, seed=1), caller=first)
        replica.forward(last_stage_request(run, 2, seed=2), caller=second)
        with pytest.raises(Refusal) as refused:
            replica.forward(last_stage_request(run, 3, seed=3), caller=third)
        assert refused.value.code == ppb.BUSY and "serves 2 trainers at step 0" in refused.value.message
        replica.forward(last_stage_request(run, 4, seed=4), caller=first)  # a trainer already served is not
        assert replica.samples == 3 * BATCH and len(replica.by_trainer) == 2
    finally:
        replica.close()
