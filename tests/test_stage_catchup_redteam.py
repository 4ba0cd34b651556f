"""A stage replica's catch-up (``StageMoves._ahead_or_apart``) read as an admitted attacker that serves as a
stage replica would: whom a stalled replica follows (its anchors: its last round's mates, the replica that
served its last download, the servers it joined behind), and whether honest joiners still follow their stage.

Each test names the outcome before its fix ("Before"); each now asserts the outcome after it. A real
``StageReplica`` and the real join, with no DHT: each test sets the view.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from protocols.keys import SigningKey
from swarm.config import RunConfig
from swarm.pipeline.balance import rebalance_move
from swarm.pipeline.records import PipelineView, StageRecord
from swarm.pipeline.replica import StageReplica
from swarm.pipeline.worker import StageWorker
from swarm.training.catchup import Position, catch_up_target
from swarm.training.state import DecodedState, state_tensors

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

    mine, theirs = Position(10, "1" * 64), Position(10, "2" * 64)
    mates = {"a": theirs, "b": theirs, "attacker": Position(11, POISON)}
    moved = catch_up_target(mine, mates, max_step=10, stalled=True, trusted={"a", "b"})
    assert moved is not None and moved.holders == ["a", "b"]


def fresh_joiner(run: RunConfig, key: SigningKey, stage: int) -> tuple[StageWorker, str]:
    """A worker about to join ``stage``, and the hash of the stage's initial state (every replica built
    from the run's seed holds it at step 0)."""
    worker = worker_on(run, key, stage)
    initial = worker.replica.state_hash
    worker.replica.close()
    worker.replica = None
    return worker, initial


def sat_out_for(worker: StageWorker, rounds: float) -> None:
    """The joiner has sat out the step it joined at for ``rounds`` round times (a long step: the trainers
    take that long to bring the batch; nobody has to break any round)."""
    worker._step_since = time.monotonic() - rounds * worker.config.training.round_s


def close(worker: StageWorker) -> None:
    if worker.replica is not None:
        worker.replica.close()


def test_one_attacker_record_at_a_join_does_not_keep_honest_joiners_sitting_out():
    """Before: a stage has one honest server H; two honest replicas join it. One admitted attacker
    key A publishes a serving record of the stage at the step the joiners join at, so both joiners'
    anchors are {H, A}. Right after, A turns its record into a joiner's (``serving=False, joining=True``
    at that step): it is then in no round of H (``PipelineView.averaging`` leaves it out), so H closes
    the step alone and steps on, but it stays a member of the stage's view, an anchor at the joiners'
    step. A stalled joiner asks its anchors: H ahead is 1 of 2 anchors in view, no strict majority.
    Twice as long stalled, only the anchors ahead vote, but only while the peers at its step are no
    more than those ahead: A and the other honest joiner (a sitting-out joiner counts, though it can
    take no round there) are 2 against H's 1. So neither joiner ever catches up, and
    ``_continue_joining`` never lets it serve either (H serves, and the joiner's step never passes
    the join step): the stage's honest joiners sit out for as long as one attacker record stays, while
    the stage runs on its one server. With honest joiners only (anchors {H}), both follow H at once.
    One attacker key, a quarter of the view, not the only anchor, and no Sybil majority: a case the
    documented open weaknesses do not name. Now replicas that sit out the joiner's step with it have no say
    in its catch-up, and a joiner has no "twice as long" rule: both joiners follow H."""
    torch.set_num_threads(1)
    run = review_run()
    joiner, j2, server, attacker = (SigningKey.generate() for _ in range(4))
    worker, initial = fresh_joiner(run, joiner, 0)
    honest_only, _ = fresh_joiner(run, j2, 0)  # the same join without the attacker's record, for contrast
    try:
        serving = [record(server, 0, 0, initial), record(attacker, 0, 0, initial)]
        joined_behind(worker, 0, PipelineView(stages={0: serving}, holders={0: serving}))
        assert worker._anchors == {server.peer_id, attacker.peer_id}
        joined_behind(honest_only, 0, PipelineView(stages={0: serving[:1]}, holders={0: serving[:1]}))
        mine = worker.replica.state_hash
        stepped = "b" * 64  # H's state of step 1, after the round it closed alone
        view = PipelineView(
            stages={0: [record(server, 0, 1, stepped)]},
            holders={0: [record(joiner, 0, 0, mine, serving=False, joining=True),
                         record(j2, 0, 0, mine, serving=False, joining=True),
                         record(server, 0, 1, stepped),
                         record(attacker, 0, 0, mine, serving=False, joining=True)]},
        )  # fmt: skip
        assert [x.peer_id for x in view.averaging(0, 0)] == [server.peer_id], "H's round at step 0 is its own"
        worker.view = view
        # Without the attacker's record, the same two joiners follow H whenever they look.
        honest_only.view = PipelineView(stages=view.stages, holders={0: view.holders[0][:3]})
        for rounds in (1.5, 2.5, 50.0):
            sat_out_for(worker, rounds)
            sat_out_for(honest_only, rounds)
            assert worker._ahead_or_apart() == (1, stepped, [server.peer_id]), f"after {rounds} round times"
            assert honest_only._ahead_or_apart() == (1, stepped, [server.peer_id])
    finally:
        close(worker)
        close(honest_only)


def test_claimed_serving_records_at_a_join_do_not_count_in_the_proven_view():
    """Before: ``_proven_view`` (rebalancing) cuts the mover's own stage to itself and its
    ``_round_mates``, because "a serving record costs nothing": Sybil records of a stage must not make its
    honest replicas look spare. The change makes the joiner's anchors every serving record at the join
    and, after it follows them, every record that showed the position it downloaded. Three attacker keys
    publish serving records of stage 0 when V joins it behind the honest server H; they echo H's
    position (the hashes are public), so they stay V's anchors through its catch-up and are its
    "round mates" until V completes its first round. If V (lowest peer ID of the stage) considers
    rebalancing in that window (its rebalance timer has usually run out while it sat out), its proven
    view counts five replicas in stage 0 against two in stage 1, and V moves to stage 1: the honest
    pipeline goes from 2 + 2 replicas to 1 + 3 and its bottleneck stage to half its throughput.
    Now rebalancing counts only the members of its completed rounds (``_round_mates``), which a join
    leaves empty: the same view moves nobody."""
    torch.set_num_threads(1)
    run = review_run()
    keys = sorted((SigningKey.generate() for _ in range(7)), key=lambda k: k.peer_id)
    mover, server, s1, s2, s3, x1, x2 = keys  # the mover has the lowest peer ID of its stage
    worker, initial = fresh_joiner(run, mover, 0)
    try:
        sybils = [record(k, 0, 0, initial) for k in (s1, s2, s3)]
        serving = [record(server, 0, 0, initial), *sybils]
        joined_behind(worker, 0, PipelineView(stages={0: serving}, holders={0: serving}))
        assert worker._anchors == {server.peer_id, s1.peer_id, s2.peer_id, s3.peer_id}
        # It caught up and serves (``_continue_joining``): no round completed yet, so its anchors stand.
        worker._joining_at, worker._serving = None, True
        mine = worker.replica.state_hash
        stage0 = [record(mover, 0, 0, mine), record(server, 0, 0, mine), *sybils]
        stage1 = [record(x1, 1, 0, "c" * 64), record(x2, 1, 0, "c" * 64)]
        worker.view = PipelineView(stages={0: stage0, 1: stage1}, holders={0: stage0, 1: stage1})
        proven = worker._proven_view()
        assert {x.peer_id for x in proven.replicas(0)} == {mover.peer_id}
        worker.rebalance = True
        asyncio.run(worker._maybe_move())
        assert worker._leave_to is None, "the honest replica stays where it is needed"
        assert (
            rebalance_move(worker._proven_view(), mover.peer_id, 0, 2, run.pipeline.rebalance_margin) is None
        )
    finally:
        close(worker)


def test_a_download_makes_only_its_server_and_the_anchors_that_hold_its_state_anchors(monkeypatch):
    """Before: after any download ``_catch_up`` sets ``_round_mates`` to *every* peer whose record
    showed the position downloaded, not to the peer that served it nor to peers it shared a round with.
    An attacker's records need only echo the honest (step, hash) (public) at that moment. Here a replica
    V that fell one step behind its mates H1, H2 catches up by the majority rule; three attacker keys echo
    H1 and H2's position, so V's anchors become {H1, H2, A1, A2, A3}. Once V's rounds at the new step fail
    for a round's time (the attacker breaks them), A1..A3 announcing the next step with their own state
    are 3 of V's 5 anchors and V downloads it, though the honest replicas in view (H1, H2, V) are as
    many as the attacker's keys and the rule of a replica that is not stalled refuses it. The attackers
    never took part in a round with V, never served it a byte: echoing a record was enough. Now the
    anchors after a download are the replica that served the verified bytes and the earlier anchors that
    hold that state: V asks H1 and H2."""
    torch.set_num_threads(1)
    run = review_run()
    me, h1, h2, a1, a2, a3 = (SigningKey.generate() for _ in range(6))
    worker = worker_on(run, me, 0)
    try:
        r = worker.replica
        worker._anchors = {h1.peer_id, h2.peer_id}  # its last round
        tensors = state_tensors(r.model, r.optimizer)
        ahead = "a" * 64

        class Holder:
            def to_base58(self):
                return h1.peer_id

        async def served_by_h1(holders, fetch, what):  # the honest holder serves the honest state
            return Holder(), DecodedState(1, tensors, {}, ahead)

        monkeypatch.setattr("swarm.pipeline.moves.from_any_holder", served_by_h1)
        echo = [record(k, 0, 1, ahead) for k in (h1, h2, a1, a2, a3)]
        worker.view = PipelineView(stages={0: echo}, holders={0: [record(me, 0, 0, r.state_hash), *echo]})
        worker.averager = type("A", (), {"p2p": None})()
        assert asyncio.run(worker._catch_up()) is True
        assert worker._anchors == {h1.peer_id, h2.peer_id}
        mine = r.state_hash
        honest = [record(h1, 0, 1, mine, closing=True), record(h2, 0, 1, mine, closing=True)]
        attackers = [record(k, 0, 2, POISON) for k in (a1, a2, a3)]
        worker.view = PipelineView(stages={0: [*honest, *attackers]},
                                   holders={0: [record(me, 0, 1, mine, closing=True), *honest, *attackers]})  # fmt: skip
        others = {x.peer_id: Position(x.step, x.state_hash) for x in [*honest, *attackers]}
        assert catch_up_target(Position(1, mine), others, max_step=run.training.max_steps) is None
        r.closing = True
        worker._step_since = time.monotonic() - 1.5 * run.training.round_s  # its rounds failed that long
        assert worker._ahead_or_apart() is None
    finally:
        close(worker)


def test_three_honest_joiners_behind_one_server_follow_it_however_long_its_step_lasts():
    """Before (honest peers only): three replicas join a stage behind its one server H (rebalancing
    sends several to a bottleneck stage). Each sits out H's step, and counts as stalled from the join;
    the step is long (the trainers bring the batch in more than two round times, with the default
    30 s averaging timeout about a minute and a half). When H steps on, every joiner is already "long
    stalled", so only anchors ahead vote, and only while the peers at its step are no more than those
    ahead. But the other two joiners, which sit out and can take no round at that step, count as peers
    at its step: 2 > 1, and ``catch_up_target`` returns None. The stall clock only grows, so it stays None;
    ``_continue_joining`` waits for the joiner's step to pass the join step while H serves. All three
    sit out for as long as H serves, and the stage never gains their throughput. Had H stepped on
    within two round times of the join they would have followed it (shown too): the outcome hangs on
    how long the step lasts. Now the joiners sitting out with it have no say, and there is no "twice as
    long" rule for a joiner: it follows H however long the step lasted."""
    torch.set_num_threads(1)
    run = review_run()
    joiner, j2, j3, server = (SigningKey.generate() for _ in range(4))
    worker, initial = fresh_joiner(run, joiner, 0)
    try:
        serving = [record(server, 0, 0, initial)]
        joined_behind(worker, 0, PipelineView(stages={0: serving}, holders={0: serving}))
        assert worker._anchors == {server.peer_id}
        mine = worker.replica.state_hash
        stepped = "b" * 64
        worker.view = PipelineView(
            stages={0: [record(server, 0, 1, stepped)]},
            holders={0: [record(joiner, 0, 0, mine, serving=False, joining=True),
                         record(j2, 0, 0, mine, serving=False, joining=True),
                         record(j3, 0, 0, mine, serving=False, joining=True),
                         record(server, 0, 1, stepped)]},
        )  # fmt: skip
        sat_out_for(worker, 1.5)
        assert worker._ahead_or_apart() == (1, stepped, [server.peer_id]), "a short step: it follows H"
        for rounds in (2.5, 10.0, 1000.0):
            sat_out_for(worker, rounds)
            assert worker._ahead_or_apart() == (1, stepped, [server.peer_id]), f"after {rounds} round times"
    finally:
        close(worker)
