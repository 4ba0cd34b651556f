"""A stage replica moves between stages any number of times while trainers train: 0 -> 1 -> 0 -> 1.

Every peer is a real libp2p daemon and DHT process on loopback; the stage workers and trainers run in
this process. Moves are requested through ``StageWorker.move_to`` (rebalancing off), so the test decides
when they happen. Before the fix, the second move to stage 0 died with hivemind's ControlFailure
"handler for protocol ... already set": leaving a stage never removed its state-download handlers.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import torch

from lab.localswarm import tiny_run
from swarm.config import RunConfig
from swarm.dht import start_local_dhts
from swarm.pipeline.trainer import PipelineTrainer
from swarm.pipeline.worker import StageWorker

STEPS = 12


def moving_run() -> RunConfig:
    data = tiny_run("moves").model_dump(mode="json")
    data["model"]["config"]["n_layer"] = 2
    data["training"].update(target_batch_size=16, min_group_size=1, max_steps=STEPS, matchmaking_time_s=1.0,
                            averaging_timeout_s=10.0, validation_every_steps=100)  # fmt: skip
    data["pipeline"] = {"stages": 2, "announce_interval_s": 0.2, "request_timeout_s": 5.0,
                        "failed_server_cooldown_s": 2.0, "rebalance_interval_s": 3600.0}  # fmt: skip
    return RunConfig.parse(data)


def _hashes_by_step(workers: list[StageWorker], seen: dict[tuple[int, int], set[str]]) -> None:
    for w in workers:
        r = w.replica
        if r is not None and w._serving and r.param_hash:
            seen.setdefault((r.index, r.hashed_step), set()).add(r.param_hash)


@pytest.mark.timeout(300)
def test_a_replica_moves_0_1_0_1_while_trainers_train_and_nothing_is_lost(tmp_path: Path):
    torch.set_num_threads(1)
    run = moving_run()
    nodes = start_local_dhts(5, tmp_path)
    dhts, keys = [d for d, _ in nodes], [k for _, k in nodes]
    ids = {k.peer_id for k in keys}
    home0, home1, mover = (
        StageWorker(run, dhts[i], peer_id=keys[i].peer_id, stage=stage, members=ids, signing_key=keys[i],
                    rebalance=False)
        for i, stage in enumerate([0, 1, 0])
    )  # fmt: skip
    workers = [home0, home1, mover]
    trainers = [
        PipelineTrainer(run, dhts[3 + i], peer_id=keys[3 + i].peer_id, seed=i, signing_key=keys[3 + i])
        for i in range(2)
    ]
    seen: dict[tuple[int, int], set[str]] = {}

    async def scenario() -> None:
        stop = asyncio.Event()
        tasks = [asyncio.create_task(x.run(stop)) for x in [*workers, *trainers]]

        async def until(condition, what: str, timeout_s: float = 90.0) -> None:
            deadline = time.monotonic() + timeout_s
            while not condition():
                for task in tasks:
                    if task.done():
                        task.result()  # a worker or trainer died: raise its error here
                        raise AssertionError(f"a peer stopped while waiting for {what}")
                assert time.monotonic() < deadline, f"timed out waiting for {what}"
                _hashes_by_step(workers, seen)
                await asyncio.sleep(0.05)

        try:
            step = lambda: min(t.step for t in trainers)  # noqa: E731
            await until(lambda: step() >= 1, "the first step")
            for hop, target in enumerate([1, 0, 1], start=1):
                mover.move_to(target)
                moved = lambda n=hop: len(mover.moves) == n and mover._serving  # noqa: E731
                await until(moved, f"move {hop} to stage {target}")
                # It serves the new stage, and that stage takes a round with it.
                joined = mover.moves[-1]["at_step"]
                stepped = lambda k=target, s=joined: max(mover.applied.get(k, {}), default=-1) >= s  # noqa: E731
                await until(stepped, f"a round of stage {target} with the mover after move {hop}")
            await until(lambda: all(t.finished for t in trainers), f"step {STEPS}", timeout_s=150)
            await until(lambda: all(w.step == STEPS for w in workers), "the replicas' last round")
            _hashes_by_step(workers, seen)
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
    assert [(m["from"], m["to"]) for m in mover.moves] == [(0, 1), (1, 0), (0, 1)]
    assert all(t.metrics()["microbatches_lost"] == 0 for t in trainers)
    disagreements = {k: v for k, v in seen.items() if len(v) > 1}
    assert not disagreements, f"replicas of one stage held different parameters at one step: {disagreements}"
    # Every sample the trainers completed at a step went into each stage's round of that step, once.
    completed = trainers[0].completed_at + trainers[1].completed_at
    for stage in (0, 1):
        applied: dict[int, float] = {}
        for w in workers:
            for s, samples in w.applied.get(stage, {}).items():
                applied[s] = max(applied.get(s, 0.0), samples)
        assert {s: applied.get(s) for s in range(STEPS)} == {s: float(completed[s]) for s in range(STEPS)}, (
            stage
        )
