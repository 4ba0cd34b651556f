"""A stage replica's catch-up (``StageWorker._ahead_or_apart``) read as an admitted attacker that serves as a
stage replica would: whom a stalled replica follows, and whether honest joiners still follow their stage.

Each test names the outcome before its fix ("Before"); each now asserts the outcome after it.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from protocols.keys import SigningKey
from swarm.config import RunConfig
from swarm.pipeline.records import PipelineView, StageRecord
from swarm.pipeline.replica import StageReplica
from swarm.pipeline.worker import StageWorker

pytestmark = pytest.mark.timeout(60)

POISON = "e" * 64


def review_run() -> RunConfig:
    return RunConfig(
        run_id="review-stage-catchup",
        model={"name": "gpt", "config": {"d_model": 32, "n_layer": 2, "n_head": 2, "seq_len": 32}},
        pipeline={"stages": 2, "request_timeout_s": 2.0, "announce_interval_s": 0.2},
        training={"target_batch_size": 4, "micro_batch_size": 2},
    )


def record(key: SigningKey, stage: int, step: int, state_hash: str, **flags) -> StageRecord:
    return StageRecord(key.peer_id, stage, step, 50.0, 0.5, state_hash, state_hash, time.time(), **flags)


def worker_on(run: RunConfig, key: SigningKey, stage: int) -> StageWorker:
    """A StageWorker with a real replica of ``stage`` (hashed), no DHT: its view is set by the test."""
    worker = StageWorker(run, None, peer_id=key.peer_id, stage=stage, signing_key=key, rebalance=False)
    worker.replica = StageReplica(run, stage)
    asyncio.run(worker.replica.commit())

    async def same_view() -> None:  # no DHT: the view is what the test set
        return None

    worker._refresh_view = same_view
    return worker


def stalled(worker: StageWorker) -> None:
    """The replica closed its step and its rounds there have failed for longer than a round's time (and
    for less than twice as long, the window that a "long stalled" rule would treat otherwise)."""
    worker.replica.closing = True
    worker._step_since = time.monotonic() - 1.5 * worker.config.training.round_s


def joined_behind(worker: StageWorker, stage: int, view: PipelineView) -> None:
    """Run the real join of ``stage`` (``StageMoves._serve``) with ``view`` as the stage's records, with
    no averager or handlers behind it."""

    class Averager:
        async def start(self):
            return None

    async def nothing(*_, **__):
        return None

    worker.build_averager = lambda index, numel: Averager()
    worker._register = nothing
    worker.view = view
    asyncio.run(worker._serve(stage))


def test_a_round_mate_of_the_stage_a_replica_left_is_no_anchor_in_the_stage_it_moved_to():
    """Before: ``_round_mates`` was kept across a move, so an attacker that shared the mover's last round
    in stage 0 moved its (free) record to stage 1, announced the next step with a state of its own, and
    once the mover's first rounds there failed for a round's time the mover downloaded that state, with
    every other replica of stage 1 in view holding its own. Now a join starts with no anchors (or, behind
    servers, with those servers)."""
    torch.set_num_threads(1)
    run = review_run()
    mover, mate, attacker, g1, g2 = (SigningKey.generate() for _ in range(5))
    worker = worker_on(run, mover, 0)
    try:
        worker._round_mates = worker._anchors = {mate.peer_id, attacker.peer_id}  # its last round in stage 0
        worker.replica.close()
        worker.replica = None
        joined_behind(worker, 1, PipelineView())  # nobody serves stage 1 in this view: it serves at once
        assert worker.replica.index == 1 and worker._anchors == worker._round_mates == set()
        mine = worker.replica.state_hash
        worker.view = PipelineView(holders={1: [record(mover, 1, 0, mine, closing=True), record(g1, 1, 0, mine),
                                                record(g2, 1, 0, mine), record(attacker, 1, 1, POISON)]})  # fmt: skip
        stalled(worker)
        assert worker._ahead_or_apart() is None
    finally:
        if worker.replica is not None:
            worker.replica.close()


def test_joiners_follow_the_server_they_joined_behind_and_no_replica_ahead_besides():
    """Two replicas that join a stage behind one server sit out the step they joined at; the server closes
    it alone and steps on. Before (stalled only while closing), the joiners, a majority at the old step,
    never followed it and the stage stopped for good (the pipeline attack sim stopped at step 1). With the
    stall clock running from the join and every replica ahead voting, one attacker announcing the next
    step led a joiner instead. Now the servers it joined behind are its anchors: it follows them, and only
    them."""
    torch.set_num_threads(1)
    run = review_run()
    joiner, other_joiner, server, attacker = (SigningKey.generate() for _ in range(4))
    worker = worker_on(run, joiner, 0)
    try:
        mine = worker.replica.state_hash
        worker.replica.close()
        worker.replica = None
        joined_behind(worker, 0, PipelineView(stages={0: [record(server, 0, 0, mine)]},
                                              holders={0: [record(server, 0, 0, mine)]}))  # fmt: skip
        assert worker._joining_at == 0 and worker._anchors == {server.peer_id}
        mine = worker.replica.state_hash
        joining = [record(joiner, 0, 0, mine, serving=False, joining=True),
                   record(other_joiner, 0, 0, mine, serving=False, joining=True)]  # fmt: skip
        worker._step_since = time.monotonic() - 1.5 * run.training.round_s  # a long step of micro-batches
        worker.view = PipelineView(stages={0: [record(server, 0, 0, mine)]},
                                   holders={0: [*joining, record(server, 0, 0, mine), record(attacker, 0, 1, POISON)]})  # fmt: skip
        assert worker._ahead_or_apart() is None, "one attacker ahead leads no joiner"
        served = "b" * 64  # the server's state of step 1, after the round it closed alone
        worker.view = PipelineView(stages={0: [record(server, 0, 1, served)]},
                                   holders={0: [*joining, record(server, 0, 1, served)]})  # fmt: skip
        assert worker._ahead_or_apart() == (1, served, [server.peer_id]), "it follows its server"
    finally:
        if worker.replica is not None:
            worker.replica.close()


def test_a_record_past_max_steps_does_not_keep_a_stalled_peer_apart_at_its_own_step():
    """A stalled caller with nobody ahead follows the majority at its own step. Before, "ahead" counted
    every record, also one past ``max_step`` that is never followed: one attacker record of step
    max_steps + 1 kept a stalled peer, apart from its groupmates at the run's last step, apart."""
    from swarm.training.catchup import Position, catch_up_target

    mine, theirs = Position(10, "1" * 64), Position(10, "2" * 64)
    mates = {"a": theirs, "b": theirs, "attacker": Position(11, POISON)}
    moved = catch_up_target(mine, mates, max_step=10, stalled=True, trusted={"a", "b"})
    assert moved is not None and moved.holders == ["a", "b"]
