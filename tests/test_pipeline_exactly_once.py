"""Exactly-once micro-batches: a retry after a timeout is applied once, though two replicas counted it.

Stage 1 has two replicas. ``SlowReplica`` computes and counts every micro-batch it is sent first, then
holds its answer until the other replica has counted it, so the trainer always times out on it and
retries there. ``RetriesOnly`` takes only micro-batches the slow replica already counted (it refuses
the rest as BUSY), so every micro-batch goes through that sequence: no sleeps, no luck.
Before the fix, the slow replica's copies went into the stage's round and every sample weighed double.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import torch

from lab.localswarm import tiny_run
from protocols import pipeline_pb2 as ppb
from protocols.keys import SigningKey
from swarm.config import RunConfig
from swarm.dht import start_local_dhts
from swarm.pipeline.server import StageServicer
from swarm.pipeline.trainer import PipelineTrainer
from swarm.pipeline.worker import StageWorker

STEPS = 2
HOLD_LIMIT_S = 30.0


class Fault:
    """What the two misbehaving replicas share: the micro-batches the slow one holds, and the other."""

    def __init__(self) -> None:
        self.held: set[int] = set()
        self.other: StageWorker | None = None


FAULT = Fault()


class SlowServicer(StageServicer):
    async def rpc_forward(self, request: ppb.ForwardRequest, context) -> ppb.ForwardReply:
        reply = await super().rpc_forward(request, context)  # computed and counted here
        key = request.microbatch_id
        if not request.inference and reply.code == ppb.OK and key not in FAULT.held:
            FAULT.held.add(key)
            deadline = time.monotonic() + HOLD_LIMIT_S
            while time.monotonic() < deadline:  # the trainer gives up on this call and retries elsewhere
                other = FAULT.other.replica
                if other is not None and any(k[1] == key for k in other.claims):
                    break
                await asyncio.sleep(0.02)
        return reply


class RetriesOnlyServicer(StageServicer):
    async def rpc_forward(self, request: ppb.ForwardRequest, context) -> ppb.ForwardReply:
        if not request.inference and request.microbatch_id not in FAULT.held:
            return ppb.ForwardReply(code=ppb.BUSY, error="only retries here", step=self.replica.step)
        return await super().rpc_forward(request, context)


class SlowReplica(StageWorker):
    servicer_type = SlowServicer


class RetriesOnly(StageWorker):
    servicer_type = RetriesOnlyServicer


def retry_run() -> RunConfig:
    data = tiny_run("once").model_dump(mode="json")
    data["model"]["config"]["n_layer"] = 2
    data["training"].update(target_batch_size=16, min_group_size=1, max_steps=STEPS, matchmaking_time_s=1.0,
                            averaging_timeout_s=10.0, validation_every_steps=100)  # fmt: skip
    data["pipeline"] = {"stages": 2, "announce_interval_s": 0.2, "request_timeout_s": 1.5,
                        "failed_server_cooldown_s": 1.0, "rebalance_interval_s": 3600.0,
                        # A check may re-send a micro-batch to the slow replica as the latest attempt, so
                        # that the other replica drops it instead: this test counts the slow one's drops.
                        "verify_probability": 0.0}  # fmt: skip
    return RunConfig.parse(data)


@pytest.mark.timeout(240)
def test_a_microbatch_retried_after_a_timeout_is_applied_once(tmp_path: Path):
    torch.set_num_threads(1)
    run = retry_run()
    nodes = start_local_dhts(4, tmp_path)
    dhts, keys = [d for d, _ in nodes], [k for _, k in nodes]
    ids = {k.peer_id for k in keys}

    def worker(cls: type[StageWorker], i: int, stage: int) -> StageWorker:
        return cls(run, dhts[i], peer_id=keys[i].peer_id, stage=stage, members=ids, signing_key=keys[i],
                   rebalance=False)  # fmt: skip

    first, slow, fast = worker(StageWorker, 0, 0), worker(SlowReplica, 1, 1), worker(RetriesOnly, 2, 1)
    FAULT.held.clear()
    FAULT.other = fast
    trainer = PipelineTrainer(run, dhts[3], peer_id=keys[3].peer_id, seed=0, signing_key=keys[3])
    hashes: dict[str, str] = {}

    async def scenario() -> None:
        stop = asyncio.Event()
        tasks = [asyncio.create_task(x.run(stop)) for x in (first, slow, fast, trainer)]
        try:
            deadline = time.monotonic() + 180
            while not (trainer.finished and slow.step == fast.step == STEPS):
                for task in tasks:
                    if task.done():
                        task.result()
                assert time.monotonic() < deadline, f"stuck at trainer step {trainer.step}"
                await asyncio.sleep(0.1)
            hashes.update(slow=slow.replica.param_hash, fast=fast.replica.param_hash)
        finally:
            stop.set()
            await asyncio.wait(tasks, timeout=30)
        for task in tasks:
            task.result()

    try:
        asyncio.run(scenario())
    finally:
        for dht in dhts:
            dht.shutdown()
    metrics = trainer.metrics()
    assert metrics["microbatches_lost"] == 0
    assert metrics["retries"] >= len(trainer.completed), "every micro-batch was retried after a timeout"
    completed = {s: float(trainer.completed_at[s]) for s in range(STEPS)}
    for w, stage in ((first, 0), (slow, 1), (fast, 1)):
        assert w.applied[stage] == completed, "each stage's round took every completed sample exactly once"
    # A micro-batch whose retry reached the other replica before the slow one counted it is dropped nowhere
    # (with BUSY answers avoided for a moment, the timing of picks varies): most are counted, then dropped.
    counted = len(trainer.completed) * run.training.micro_batch_size
    assert slow._stats.get("samples_dropped", 0) >= counted // 2, (
        "the slow replica counted the micro-batches too, then dropped them"
    )
    assert hashes["slow"] == hashes["fast"], "the replicas of stage 1 hold identical parameters"


def test_microbatches_the_last_step_outran_are_left_over_not_lost():
    """A micro-batch the run outran waits to be issued again at the next step; at the last step there is
    none, so it is left over. Only one that neither completed nor waits is lost."""
    key = SigningKey.generate()
    trainer = PipelineTrainer(retry_run(), None, peer_id=key.peer_id, seed=0, signing_key=key)
    done, outran, dropped = (trainer._new_microbatch() for _ in range(3))
    trainer.completed.add(done.id)
    trainer.pending.append(outran)
    metrics = trainer.metrics()
    assert (metrics["microbatches_issued"], metrics["microbatches_completed"]) == (3, 1)
    assert metrics["microbatches_waiting"] == 1
    assert metrics["microbatches_lost"] == 1, (
        f"micro-batch {dropped.id} is lost: it neither completed nor waits"
    )


def test_a_closing_stage_takes_the_backward_of_a_forward_it_holds_and_nothing_new():
    """A stage closes its step once the trainers' records say the batch is done; a record may lag the
    trainer's last micro-batch, which ran forward here and was counted by the last stage at this step.
    The closing stage takes that micro-batch's backward (the later stages' rounds hold its samples; its
    worker waits for such backwards, bounded, in ``StageWorker._await_backwards``); new forwards, and
    backwards of forwards it never ran, stay refused. Before the fix the backward was refused as BUSY: the last stage applied 32 samples at the
    step and the first 24 (seen in tests/test_pipeline_moves.py)."""
    from swarm.averaging.compression import get_codec
    from swarm.pipeline.replica import Refusal, StageReplica
    from swarm.pipeline.wire import encode_floats, encode_ids

    torch.set_num_threads(1)
    run = retry_run()
    replica = StageReplica(run, 0)
    codec = get_codec(run.training.compression)
    batch = 2

    def forward(microbatch_id: int) -> ppb.ForwardReply:
        ids = encode_ids(
            torch.randint(0, 256, (batch, 32), generator=torch.Generator().manual_seed(microbatch_id))
        )
        request = ppb.ForwardRequest(
            run_id=run.run_id, stage=0, step=0, microbatch_id=microbatch_id, inputs=ids
        )
        return replica.forward(request)

    def backward(microbatch_id: int, outputs: ppb.Tensor) -> ppb.BackwardReply:
        grad = torch.full(list(outputs.shape), 1e-3)
        return replica.backward(ppb.BackwardRequest(run_id=run.run_id, stage=0, step=0, microbatch_id=microbatch_id,
                                                    grad_outputs=encode_floats(grad, codec)))  # fmt: skip

    try:
        first = forward(1).outputs
        replica.closing = True  # what StageWorker._step_round sets before it waits for backwards
        assert replica.samples == 0
        backward(1, first)  # before the fix: Refusal BUSY "step 0 is closed"
        assert replica.samples == batch and replica.awaiting_backward() == 0, (
            "the held micro-batch counts here"
        )
        with pytest.raises(Refusal, match="is closed") as refused:
            forward(2)
        assert refused.value.code == ppb.BUSY
        with pytest.raises(Refusal, match="is closed"):
            backward(3, first)
        assert replica.samples == batch
    finally:
        replica.close()
