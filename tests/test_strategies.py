"""The sync strategies in process, with no network: what every_step and diloco decide for the trainer
(absorb a micro-batch, want more compute, be ready for a round, contribute, apply, schedule)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from lab.localswarm import tiny_run
from protocols.errors import ConfigError
from swarm.config import RunConfig
from swarm.models import build_model
from swarm.training.diloco import DilocoSync, flat_params
from swarm.training.state import build_optimizer
from swarm.training.strategies import EveryStepSync, build_strategy

pytestmark = pytest.mark.timeout(60)

INNER_STEPS = 4


def model_and_optimizer(run: RunConfig, seed: int = 0):
    model = build_model(run.model.name, run.model.config, seed=seed)
    return model, build_optimizer(model, run.optimizer)


def backward(model: torch.nn.Module, seed: int, *, mean: bool, batch: int = 4) -> None:
    """A gradient in ``.grad``: of the mean loss over ``batch`` samples, or (``mean=False``) of their sum."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (batch, 32), generator=generator)
    y = torch.randint(0, 256, (batch, 32), generator=generator)
    loss = model.loss(x, y)
    (loss if mean else loss * batch).backward()


class Result:
    def __init__(self, vector: torch.Tensor, sent: torch.Tensor | None = None):
        self.vector, self.sent = vector, sent


def diloco_run(**training) -> RunConfig:
    return tiny_run("strategies", sync="diloco", inner_steps=INNER_STEPS, **training)


def test_the_runs_sync_picks_the_strategy():
    run = tiny_run("every")
    assert type(build_strategy(run, *model_and_optimizer(run))) is EveryStepSync
    run = diloco_run()
    assert type(build_strategy(run, *model_and_optimizer(run))) is DilocoSync
    with pytest.raises(ConfigError, match="outer_optimizer: .*nesterov needs momentum"):
        RunConfig.parse({"run_id": "x", "outer_optimizer": {"momentum": 0.0}})


def test_every_step_sends_the_same_mean_gradient_from_the_built_in_loop_and_from_a_callers_loop():
    """The built-in loop leaves gradients of the summed loss in ``.grad``; a caller's loop the gradient of
    its mean loss, which is moved aside (so its next backward starts clean) and scaled to a sum. Both
    contribute the same mean gradient, and a round's result steps the run's optimizer on every peer the same."""
    run = tiny_run("every", target_batch_size=16)
    built_in = EveryStepSync(*model_and_optimizer(run), run)
    caller = EveryStepSync(*model_and_optimizer(run), run)
    for seed in (1, 2):
        backward(built_in.synced_model, seed, mean=False)
        built_in.absorb(4, step=0, mean=False)
        backward(caller.synced_model, seed, mean=True)
        caller.absorb(4, step=0, mean=True)
        assert all(p.grad is None for p in caller.params), "the caller's next backward starts from nothing"
    mean_of_built_in, mean_of_caller = built_in.contribution(8), caller.contribution(8)
    assert torch.allclose(mean_of_built_in, mean_of_caller, atol=1e-6)
    assert built_in.weight(8) == 8.0
    # The batch: at least one micro-batch of its own, then until the peers at the step hold the target.
    assert built_in.wants_compute(0, [100]) and built_in.wants_compute(8, [4])
    assert not built_in.wants_compute(8, [8])
    assert not built_in.ready(8, [8], fresh_view=False), "a view from before this step began counts nothing"
    assert built_in.ready(8, [8], fresh_view=True) and not built_in.ready(0, [16], fresh_view=True)
    # Applying one result to two peers' states gives the same bits; then the accumulation is over.
    before = flat_params(built_in.params)
    assert built_in.apply(Result(mean_of_built_in), 0) and caller.apply(Result(mean_of_built_in), 0)
    assert torch.equal(flat_params(built_in.params), flat_params(caller.params))
    assert not torch.equal(flat_params(built_in.params), before)
    built_in.reset()
    assert all(p.grad is None for p in built_in.params)


def test_one_claim_cannot_cut_the_window_short_and_a_laggard_holds_it_at_most_twice_as_long():
    """Progress records are signed claims nobody checks. Before, one record claiming a full window closed
    every other peer's window after its first inner step, so the run averaged as often as every_step.
    A run that checks no senders: one that does holds every window at H (the test below)."""
    run = diloco_run(sender_check_probability=0.0)
    strategy = DilocoSync(*model_and_optimizer(run), run)
    batch = run.training.micro_batch_size
    full = INNER_STEPS * batch
    liar = [10**9]
    backward(strategy.replica.model, 0, mean=False)
    strategy.absorb(batch, step=0, mean=False)
    assert strategy.inner == 1
    assert strategy.wants_compute(batch, liar) and not strategy.ready(batch, liar, fresh_view=True)
    for seed in range(1, INNER_STEPS):
        backward(strategy.replica.model, seed, mean=False)
        strategy.absorb(batch, step=0, mean=False)
    assert strategy.ready(full, liar, fresh_view=False), "every peer at the step has done its inner steps"
    # A peer at the same step that lags (or claims it does): this one trains on, up to 2H.
    assert strategy.wants_compute(full, [*liar, batch])
    for seed in range(INNER_STEPS):
        backward(strategy.replica.model, 100 + seed, mean=False)
        strategy.absorb(batch, step=0, mean=False)
    assert strategy.ready(2 * full, [*liar, batch], fresh_view=False)
    assert strategy.stats["inner_steps"] == 2 * INNER_STEPS


def test_a_window_stretch_of_one_closes_every_window_at_exactly_inner_steps():
    """``window_stretch = 1``: a peer done with its window waits for a laggard instead of training on, so
    every window holds exactly H micro-batches (the same samples in every run of a comparison)."""
    run = diloco_run(window_stretch=1.0)
    strategy = DilocoSync(*model_and_optimizer(run), run)
    batch = run.training.micro_batch_size
    laggard = [batch]
    for seed in range(INNER_STEPS):
        assert strategy.wants_compute(seed * batch, laggard)
        backward(strategy.replica.model, seed, mean=False)
        strategy.absorb(batch, step=0, mean=False)
    full = INNER_STEPS * batch
    assert not strategy.wants_compute(full, laggard) and strategy.ready(full, laggard, fresh_view=False)
    with pytest.raises(ConfigError, match="window_stretch"):
        RunConfig.parse({"run_id": "x", "training": {"sync": "diloco", "window_stretch": 0.5}})


def test_topk_error_feedback_decays_what_the_wire_left_out():
    run = diloco_run(compression="topk", topk_feedback_decay=0.5)
    strategy = DilocoSync(*model_and_optimizer(run), run)
    numel = sum(p.numel() for p in strategy.replica.params)
    with torch.no_grad():
        for p in strategy.replica.params:
            p.add_(0.01)  # a window of local progress: the pseudo-gradient is -0.01 everywhere
    strategy.replica.residual = torch.full((numel,), 0.2)
    assert torch.allclose(strategy.contribution(0), torch.full((numel,), -0.01 + 0.5 * 0.2))
    sent = torch.zeros(numel)
    sent[0] = 0.09
    contribution = strategy.contribution(0)
    assert strategy.apply(Result(torch.zeros(numel), sent), 0), "the window is over"
    # What was not sent waits for the next window; the window starts again from the synced copy.
    assert torch.equal(strategy.replica.residual, contribution - sent)
    assert torch.equal(strategy.contribution(0), 0.5 * (contribution - sent))
    assert strategy.stats["outer_steps"] == 1


def test_overlap_runs_the_round_behind_the_next_window_and_a_download_drops_it():
    """With ``outer_overlap`` the window closes and its round runs in the background; the next window's
    round waits for it first. Without, the round runs at once. A dropped round never lands."""
    run = diloco_run(outer_overlap=True)
    strategy = DilocoSync(*model_and_optimizer(run), run)
    events: list[str] = []

    async def scenario() -> None:
        release = asyncio.Event()

        async def round_() -> None:
            events.append("round started")
            await release.wait()
            events.append("round ended")

        await strategy.schedule(round_, lambda: events.append("closed"), lambda: False)
        await asyncio.sleep(0.05)
        assert events == ["closed", "round started"], "the round runs in the background"
        release.set()
        await strategy.schedule(round_, lambda: events.append("closed"), lambda: False)
        assert events[:4] == ["closed", "round started", "round ended", "closed"]
        await strategy.drop_pending()
        assert "round ended" not in events[4:], "a round dropped before it ended never lands"

    asyncio.run(scenario())
    at_once = DilocoSync(*model_and_optimizer(diloco_run()), diloco_run())
    ran: list[str] = []

    async def now() -> None:
        ran.append("round")

    asyncio.run(at_once.schedule(now, lambda: ran.append("closed"), lambda: False))
    assert ran == ["round"], "without overlap no window is frozen: the round runs in place"
