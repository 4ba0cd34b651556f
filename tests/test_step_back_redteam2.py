"""Rule 6 of the catch-up rule (``swarm.training.catchup.step_back_target``) where the run is not stuck.

A version of the rule whose settle loop started the stall clock the moment a peer reached ``max_steps``
measured how long a finished peer waited, not how long its rounds failed: fast diloco peers that finished
the last outer step together, while the slower ones still computed it, went back one step (and again each
time they finished it anew), and the clock outlived a raised ``max_steps``. Each test failed on that
version.

Each test drives the real ``CatchUp`` (and ``Trainer._settle``) over a view of signed positions.
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from lab.localswarm import tiny_run
from swarm.models import build_model
from swarm.training.catchup import STEP_BACK_ROUNDS, Groupmates, Position
from swarm.training.diloco import DilocoSync
from swarm.training.progress import PeerProgress
from swarm.training.resync import CatchUp
from swarm.training.state import build_optimizer
from swarm.training.trainer import Trainer

pytestmark = pytest.mark.timeout(60)

ROUND_S = 10.0
MAX = 10
X = Position(MAX - 1, "x-step-9")  # the state every peer held at the last step's start (public in records)
Z = Position(MAX, "z-final")  # what the peers that finished the last step hold
BACK_S = STEP_BACK_ROUNDS * ROUND_S + 1


def build_catchup(
    me: str,
    mine: Position,
    view: dict[str, Position],
    *,
    before: Position | None,
    mates: list[str],
    max_steps: int = MAX,
    credit: dict[str, float] | None = None,
) -> CatchUp:
    """``me``'s real ``CatchUp`` at ``mine``; its last applied round (with ``mates``) took it from ``before``."""
    now = time.time()
    training = SimpleNamespace(round_s=ROUND_S, max_steps=max_steps, progress_interval_s=0.01)
    peers = {
        name: PeerProgress(name, pos.step, 0, 1.0, pos.state_hash, now)
        for name, pos in {**view, me: mine}.items()
    }
    groupmates = Groupmates()
    groupmates.record(mates, mine.step, moved=None if before is None else (before, mine))
    return CatchUp(
        SimpleNamespace(step=mine.step, state_hash=mine.state_hash),
        SimpleNamespace(run_id="r", training=training),
        progress_view=SimpleNamespace(peers=peers, count=5),
        averager=None,
        dht=None,
        peer_id=me,
        groupmates=groupmates,
        standing=None if credit is None else SimpleNamespace(credit=credit),
    )


def settle(catchup: CatchUp, *, raise_to: int | None = None) -> None:
    """The built-in loop's settle loop at ``max_steps``, for two looks (``raise_to``: the coordinator raises
    ``max_steps`` meanwhile, and the loop ends as ``Trainer.run`` then trains on)."""
    training = catchup.config.training
    stop = asyncio.Event()
    calls = 0
    real = catchup.catch_up

    async def looked() -> bool:
        nonlocal calls
        calls += 1
        if calls >= 2:
            if raise_to is None:
                stop.set()
            else:
                training.max_steps = raise_to
        return await real()

    catchup.catch_up = looked
    peer = SimpleNamespace(
        reached_max=lambda: catchup.synced.step >= training.max_steps, catchup=catchup, config=catchup.config
    )
    asyncio.run(asyncio.wait_for(Trainer._settle(SimpleNamespace(peer=peer), stop), timeout=10))
    catchup.catch_up = real


def test_peers_that_finished_the_last_step_while_slower_honest_peers_still_compute_it_stay():
    """A diloco run of mixed devices, floor 1: two fast peers hit their window's cap and finish the last outer
    step without the three slower peers, which are still inside their window (they tried no round; nothing
    failed). Waiting at ``max_steps`` is no failed round: their stall clock does not run, however long they
    wait, and they keep the step they finished."""
    run = tiny_run("mixed", sync="diloco", inner_steps=8, sender_check_probability=0.0)
    model = build_model(run.model.name, run.model.config, seed=run.training.seed)
    fast = DilocoSync(model, build_optimizer(model, run.optimizer), run)
    fast.replica.inner = int(fast.stretch * run.training.inner_steps)  # its window's cap
    slow_samples = 3 * run.training.micro_batch_size  # 3 of their 8 inner steps done
    assert fast.ready(fast.replica.inner * 4, [slow_samples] * 3, fresh_view=True), "it rounds without them"

    slow = {"s1": X, "s2": X, "s3": X}
    for me, mate in (("f1", "f2"), ("f2", "f1")):
        catchup = build_catchup(me, Z, {mate: Z, **slow}, before=X, mates=[mate])
        settle(catchup)
        assert catchup.stalled_since is None, "waiting at max_steps is no failed round"
        assert catchup.ahead_or_apart() is None, me


def test_a_peer_enters_an_extended_run_with_no_stall_clock_from_its_wait_at_max_steps():
    """When the coordinator raises ``max_steps`` while a peer waits at the old one, it enters the extended run
    with its stall clock unstarted: a single member of its last round showing the next step under a made-up
    hash does not move it (the clock started at ``max_steps`` made it stalled from its first look, and that
    groupmate was all it followed)."""
    credit = {"mate": 100.0, "h": 100.0, "k": 100.0, "me": 100.0}
    forged = Position(MAX + 1, "made-up")
    view = {"mate": forged, "h": Z, "k": Position(MAX - 3, "old")}
    waited = build_catchup("me", Z, {"mate": Z, "h": Z, "k": view["k"]}, before=X, mates=["mate", "h"],
                           credit=credit)  # fmt: skip
    settle(waited, raise_to=MAX + 10)
    assert waited.config.training.max_steps == MAX + 10 and waited.synced.step == MAX
    assert waited.stalled_since is None
    for name, pos in view.items():
        waited.progress_view.peers[name] = PeerProgress(name, pos.step, 0, 1.0, pos.state_hash, time.time())
    assert waited.ahead_or_apart() is None
