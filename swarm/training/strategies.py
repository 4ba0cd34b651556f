"""How a data-parallel peer turns its micro-batches into rounds: a sync strategy the trainer composes.

The trainer owns the run's machinery (progress records, matchmaking, the signed round, commit, catch-up,
state serving); its strategy owns what differs between ``[training] sync`` modes: what a micro-batch's
gradient does (``absorb``), when the peer wants more compute and when its round is due
(``wants_compute``, ``ready``), what it sends and for how many samples (``contribution``, ``weight``),
what a complete round does to the state (``apply``), which model and optimizer are the state every peer
holds bit for bit (``synced_model``, ``synced_optimizer``), and how rounds are scheduled (``schedule``:
at once, or with DiLoCo's ``outer_overlap`` in the background).

- ``EveryStepSync`` (``sync = "every_step"``): gradients accumulate until the peers at this step hold the
  target batch; the round averages the mean gradient and every member applies the run's optimizer to it.
- ``swarm.training.diloco.DilocoSync`` (``sync = "diloco"``): each micro-batch is an inner optimizer
  step; the round averages the pseudo-gradient of a window and applies the outer optimizer.

Both are plain objects over a model and an optimizer, with no network: ``tests/test_strategies.py`` drives
each in process. ``build_strategy`` picks the run's.

Example::

    strategy = build_strategy(run, model, optimizer)
    strategy.absorb(batch=8, step=0, mean=False)  # after a backward of the summed loss
    if strategy.ready(samples=8, others=[8, 8], fresh_view=True):
        vector, weight = strategy.contribution(8), strategy.weight(8)
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol

import torch

from protocols.errors import ConfigError
from swarm.averaging.allreduce import RoundResult
from swarm.config import RunConfig
from swarm.training.hooks import TrainingHooks
from swarm.training.state import apply_flat_gradient, flat_mean, flat_mean_gradient

RoundCall = Callable[[], Awaitable[None]]  # one round of the trainer's, run to its end
Action = Callable[[], None]
Flag = Callable[[], bool]


class SyncStrategy(Protocol):
    """What a sync mode decides for the trainer (see the module docstring)."""

    synced_model: torch.nn.Module
    synced_optimizer: torch.optim.Optimizer
    #: Counters the peer's metrics carry beside the trainer's own.
    stats: dict[str, float]

    def absorb(self, batch: int, *, step: int, mean: bool) -> None:
        """Take a micro-batch of ``batch`` samples whose gradient is in the parameters' ``.grad`` (of the
        summed loss, or with ``mean`` of the mean loss, from a caller's own loop)."""

    def wants_compute(self, samples: int, others: list[int]) -> bool:
        """Whether to compute another micro-batch, holding ``samples`` while ``others`` are the samples of
        the other peers at this step, by their signed progress records."""

    def ready(self, samples: int, others: list[int], *, fresh_view: bool) -> bool:
        """Whether this peer's round is due (``fresh_view``: the view was fetched after this step began)."""

    def contribution(self, samples: int) -> torch.Tensor:
        """The flat vector this peer sends to the round."""

    def weight(self, samples: int) -> float:
        """The samples behind ``contribution`` (a signed claim in the round)."""

    def apply(self, result: RoundResult, step: int) -> bool:
        """Apply a complete round's result to the state at ``step``; whether the accumulation is over."""

    def reset(self) -> None:
        """Drop what was accumulated and start again from the synced state (after a round, download, pause)."""

    def close_window(self, samples: int) -> None:
        """Freeze what was accumulated as the contribution of a round about to run in the background."""

    async def schedule(self, round: RoundCall, close_window: Action, reached_max: Flag) -> None:
        """Run ``round`` now, or (``outer_overlap``) in the background after ``close_window``."""

    async def drop_pending(self) -> None:
        """Cancel a round running in the background: it must not land on a state replaced meanwhile."""

    async def finish_rounds(self, reached_max: bool) -> None:
        """Let a background round end before the peer reports it finished."""


class EveryStepSync:
    """``sync = "every_step"``: accumulate gradients of the summed loss until the peers at this step hold
    ``target_batch_size`` samples, average the mean gradient, step the run's optimizer on it.

    Args:
        model, optimizer: the peer's model and the run's optimizer over it: the synced state itself.
        run: the run (``training.target_batch_size``, ``[optimizer]``'s schedule and clipping).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, run: RunConfig):
        self.synced_model, self.synced_optimizer = model, optimizer
        self.config = run
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.stats: dict[str, float] = {}
        # Gradient sums of a caller's micro-batches (``absorb(mean=True)``), kept out of ``.grad``.
        self._held: list[torch.Tensor | None] | None = None

    def absorb(self, batch: int, *, step: int, mean: bool) -> None:
        """This loop's gradient of the summed loss stays in ``.grad``; a caller's of the mean loss is moved
        aside, scaled to a sum, so that the caller's next backward starts from no gradient."""
        if not mean:
            return
        with torch.no_grad():
            held = self._held if self._held is not None else [None] * len(self.params)
            for i, p in enumerate(self.params):
                if p.grad is None:
                    continue
                grad = p.grad.mul_(batch)
                held[i] = grad if held[i] is None else held[i].add_(grad)
                p.grad = None
            self._held = held

    def wants_compute(self, samples: int, others: list[int]) -> bool:
        # A peer always brings at least one micro-batch: one that joined a round with none would count
        # toward the group's size but not toward the aggregate, so the attackers among the senders the
        # rule uses could be a majority of a group whose size says 2f + 1.
        return not samples or samples + sum(others) < self.config.training.target_batch_size

    def ready(self, samples: int, others: list[int], *, fresh_view: bool) -> bool:
        """The peers at this step hold the target batch, by a view fetched after this step began."""
        return fresh_view and samples > 0 and samples + sum(others) >= self.config.training.target_batch_size

    def contribution(self, samples: int) -> torch.Tensor:
        """The mean gradient of the accumulated micro-batches."""
        if self._held is not None:
            return flat_mean(self._held, self.params, samples)
        return flat_mean_gradient(self.params, samples)

    def weight(self, samples: int) -> float:
        return float(samples)

    def apply(self, result: RoundResult, step: int) -> bool:
        apply_flat_gradient(
            self.synced_model, self.params, self.synced_optimizer, self.config.optimizer, step, result.vector
        )
        return True

    def reset(self) -> None:
        self.synced_optimizer.zero_grad(set_to_none=True)
        self._held = None

    def close_window(self, samples: int) -> None:
        raise ConfigError("every_step rounds never run in the background (outer_overlap is a diloco setting)")

    async def schedule(self, round: RoundCall, close_window: Action, reached_max: Flag) -> None:
        await round()

    async def drop_pending(self) -> None:
        return None

    async def finish_rounds(self, reached_max: bool) -> None:
        return None


def check_hooks(run: RunConfig, hooks: TrainingHooks) -> None:
    """Refuse a rehearsed attack the run's sync mode cannot carry out, naming it."""
    if run.training.sync == "diloco" and run.training.outer_overlap and hooks.omniscient:
        # The attacker replays each peer's whole window (swarm.byzantine.colluders.ShadowWindows); with
        # outer_overlap what a peer sends is a window frozen one round earlier, which it does not replay.
        raise ConfigError(f"attack {hooks.name!r} is not rehearsed with outer_overlap")


def build_strategy(run: RunConfig, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> SyncStrategy:
    """The strategy of ``run``'s ``training.sync`` over ``model`` and its ``optimizer``."""
    if run.training.sync == "diloco":
        from swarm.training.diloco import DilocoSync

        return DilocoSync(model, optimizer, run)
    return EveryStepSync(model, optimizer, run)


__all__ = ["Action", "EveryStepSync", "Flag", "RoundCall", "SyncStrategy", "build_strategy", "check_hooks"]
