"""DiLoCo: many local optimizer steps, then one averaged outer step (``[training] sync = "diloco"``).

Each peer keeps a *synced* copy of the parameters (the same bits on every peer) and trains its own copy
for ``inner_steps`` local optimizer steps, one micro-batch each, with the run's ``[optimizer]`` (its
state stays local). Then the peers average the *pseudo-gradient*, synced minus local parameters, through
the same signed, robust butterfly as a gradient, and every peer applies the result to the synced copy
with the ``[outer_optimizer]`` (Nesterov SGD). Synced parameters and outer momentum are the state that
is hashed, voted on, checkpointed and downloaded by late joiners; a step of the run is an outer step.

Peers of different speeds: the window ends once every peer at the outer step has done its
``inner_steps`` (as the progress records show), or a peer has done ``window_stretch`` (2) times as many; faster peers train on
meanwhile, and each brings what it has, weighted by its samples (signed claims, as for gradients). With
``outer_overlap`` each peer's window ends at its own ``inner_steps``.

With a sparse wire codec (``compression = "topk"``) each peer keeps what the wire did not carry of its
pseudo-gradient (error feedback) and adds it, scaled by ``topk_feedback_decay``, to the next one
(SparseLoCo); such a run's default outer optimizer is plain SGD at lr 1, the decaying feedback being
its momentum.

With ``outer_overlap`` the outer round runs in the background while the next inner steps compute, and
its result is applied one outer step late (see :class:`DilocoSync` for the exact update).

:class:`DilocoSync` is the trainer's strategy for such a run (``swarm.training.strategies``); the
arithmetic, with no network, is :class:`DilocoReplica`'s.

Example::

    run.training.sync = "diloco"
    trainer = Trainer(run, dht, peer_id=key.peer_id, signing_key=key)  # builds a DilocoSync
    await trainer.run(stop_event)
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import time
from typing import TYPE_CHECKING

import torch

from swarm.averaging.allreduce import RoundResult
from swarm.config import RunConfig, resets_inner_state, window_stretch
from swarm.training.state import (
    build_outer_optimizer,
    clip_gradients,
    learning_rate,
    set_flat_gradient,
    set_learning_rate,
)

if TYPE_CHECKING:
    from swarm.training.strategies import Action, Flag, RoundCall

logger = logging.getLogger(__name__)


def flat_params(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """``params`` as one float32 vector on the CPU."""
    return torch.cat([p.detach().flatten().to("cpu", torch.float32) for p in params])


def write_flat_params(params: list[torch.nn.Parameter], flat: torch.Tensor) -> None:
    """Copy the vector ``flat`` (as ``flat_params`` makes it) into ``params``."""
    offset = 0
    with torch.no_grad():
        for p in params:
            p.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()


class DilocoReplica:
    """One peer's DiLoCo state and arithmetic, without the network: the local copy and its inner optimizer,
    the synced copy and its outer optimizer, the error feedback of a sparse codec, and ``outer_overlap``'s
    window in flight. ``DilocoSync`` drives one with the run's rounds; a benchmark drives several in
    one process (``benchmarks/diloco_recipes.py``), with the same bits.

    Args:
        model: the local copy (trained by the inner steps); the synced copy starts as a copy of it.
        optimizer: the run's ``[optimizer]`` over ``model`` (its state stays local).
        run: the run (``training``'s ``inner_steps``, ``compression``, ``topk_feedback_decay``,
            ``outer_overlap``; ``[optimizer]``'s schedule and clipping; ``[outer_optimizer]``).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, run: RunConfig):
        self.model, self.optimizer, self.config = model, optimizer, run
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.synced_model = copy.deepcopy(model)
        self.synced_params = [p for p in self.synced_model.parameters() if p.requires_grad]
        self.synced_optimizer = build_outer_optimizer(self.synced_model, run.outer_optimizer)
        numel = sum(p.numel() for p in self.params)
        self.inner = 0  # local optimizer steps in this window
        sparse = run.training.compression == "topk"
        self.residual = torch.zeros(numel) if sparse else None  # error feedback, never shared
        self.feedback_decay = run.training.topk_feedback_decay
        self.resets = resets_inner_state(run.training)
        # outer_overlap: what the round in flight sends (and for how many samples), where the local window
        # began, and whether the round's result has reached the synced copy.
        self.overlap = run.training.outer_overlap
        self.outbox: torch.Tensor | None = None
        self.outbox_samples = 0
        self.window_start: torch.Tensor | None = None
        self.outbox_applied = False

    def inner_step(self, outer_step: int, batch: int, *, mean: bool) -> None:
        """One step of the inner optimizer on the local copy with the gradient in ``.grad`` (of the mean
        loss, or with ``mean=False`` of the loss summed over ``batch`` samples), clipped, at the schedule's
        learning rate of inner step ``outer_step * inner_steps + inner``."""
        with torch.no_grad():
            if not mean:
                for p in self.params:
                    if p.grad is not None:
                        p.grad.div_(batch)
            optimizer = self.config.optimizer
            clip_gradients(self.model, optimizer.grad_clip_norm)
            global_inner = outer_step * self.config.training.inner_steps + self.inner
            set_learning_rate(self.optimizer, learning_rate(optimizer, global_inner))
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.inner += 1

    def contribution(self) -> torch.Tensor:
        """What this replica sends to the outer round: the frozen window with ``outer_overlap``, else its
        pseudo-gradient (synced minus local), plus the decayed error feedback of a sparse codec."""
        if self.overlap:
            return self.outbox
        pseudo = flat_params(self.synced_params) - flat_params(self.params)
        if self.residual is not None:
            pseudo += self.feedback_decay * self.residual
        return pseudo

    def weight(self, samples: int) -> float:
        """The samples behind ``contribution`` (``samples``: those of the window now computing)."""
        return float(self.outbox_samples) if self.overlap else float(samples)

    def apply(self, averaged: torch.Tensor, sent: torch.Tensor | None = None) -> None:
        """Apply an outer round's result: keep what the wire did not carry of ``contribution`` (``sent``: what
        it carried) for the next one, step the synced copy with the outer optimizer, and move the local copy
        onto it (with ``outer_overlap``, at the end of the window now computing: ``close_window``)."""
        if self.residual is not None:
            self.residual = (
                self.contribution() - sent if sent is not None else torch.zeros_like(self.residual)
            )
        set_flat_gradient(self.synced_params, averaged)
        self.synced_optimizer.step()
        self.synced_optimizer.zero_grad(set_to_none=True)
        if self.overlap:
            self.outbox_applied = True
        else:
            self.reset()

    def close_window(self, samples: int) -> None:
        """``outer_overlap``: freeze this window's pseudo-gradient (of ``samples`` samples) as the next round's
        contribution and start a new window. If the last round reached the synced copy, the local copy moves
        onto the new synced copy plus this window's own progress; if it failed, its contribution is sent
        again with this window's."""
        local = flat_params(self.params)
        start = self.window_start if self.window_start is not None else flat_params(self.synced_params)
        delta = start - local
        if self.outbox is not None and not self.outbox_applied:
            delta += self.outbox
            self.outbox_samples += samples
        else:
            if self.residual is not None:
                delta += self.feedback_decay * self.residual
            self.outbox_samples = samples
            if self.outbox is not None:
                write_flat_params(self.params, flat_params(self.synced_params) - (start - local))
        self.outbox, self.outbox_applied = delta, False
        self.window_start = flat_params(self.params)
        self.inner = 0
        self.fresh_inner_state()

    def fresh_inner_state(self) -> None:
        """Where the run starts every window with a fresh inner optimizer (``swarm.config.resets_inner_state``),
        drop its state (moments and step count), as a new optimizer would have none: a window is then a
        function of the synced parameters and the peer's public batch seeds alone, which a validator can
        replay (``swarm.training.sendercheck``)."""
        if self.resets:
            self.optimizer.state.clear()

    def reset(self) -> None:
        """Start a window from the synced parameters (after an outer step, a download, or a pause)."""
        self.inner = 0
        self.outbox, self.outbox_samples, self.window_start = None, 0, None
        self.fresh_inner_state()
        with torch.no_grad():
            for local, synced in zip(self.params, self.synced_params, strict=True):
                local.copy_(synced)


class DilocoSync:
    """``sync = "diloco"`` as the trainer's strategy (``swarm.training.strategies``): each micro-batch is an
    inner step on the local copy, and a round averages the window's pseudo-gradient every ``inner_steps``.

    ``step`` counts outer steps, and ``max_steps``, ``validation_every_steps`` and checkpoints count them
    too; the inner learning rate follows the run's schedule over ``outer_step * inner_steps + inner_step``.
    The arithmetic is its :class:`DilocoReplica`'s; this class decides when a window closes and schedules
    its rounds.

    With ``outer_overlap``, at the end of window t the peer starts averaging its pseudo-gradient d_t in
    the background and trains on; at the end of window t + 1 it waits for that round, applies its result
    to the synced copy, and sets its local copy to the new synced copy minus its own d_{t+1}, so it keeps
    its newest local progress while every peer's synced copy moves by the same bits, one window late.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, run: RunConfig):
        self.config, self.optimizer = run, optimizer
        self.replica = DilocoReplica(model, optimizer, run)
        self.synced_model, self.synced_optimizer = self.replica.synced_model, self.replica.synced_optimizer
        self.stats: dict[str, float] = dict(outer_steps=0.0, inner_steps=0.0)
        self.overlap = run.training.outer_overlap
        self.stretch = window_stretch(run.training)  # 1 where validators replay windows
        # When this window's first inner step began, and when it reached its cap of inner steps.
        self._started_at: float | None = None
        self._capped_at: float | None = None
        self._pending: asyncio.Task | None = None  # outer_overlap: the round in flight

    @property
    def inner(self) -> int:
        """Local optimizer steps in this window."""
        return self.replica.inner

    # --- inner steps ---------------------------------------------------------------------------------

    def absorb(self, batch: int, *, step: int, mean: bool) -> None:
        """An inner step on the local copy with the micro-batch's gradient (of the summed loss from the
        built-in loop, or with ``mean`` of the mean loss from the caller's)."""
        if self.replica.inner == 0:
            self._started_at, self._capped_at = time.monotonic(), None
        self.replica.inner_step(step, batch, mean=mean)
        self.stats["inner_steps"] += 1

    def window_closed(self, samples: int, others: list[int]) -> bool:
        """Every peer at this outer step, this one included, has done its ``inner_steps`` (by the samples
        its signed progress record claims), or this one has done ``window_stretch`` (2; 1 where validators
        replay windows, ``swarm.config.window_stretch``) times as many. Peers that get there
        first train on until the last one does, so no peer idles and a window holds at least
        ``inner_steps`` of every peer's samples. A claim, which nobody checks, can only hold the window
        open, and then no longer than ``window_stretch * inner_steps``: claiming a full window at once cannot cut the
        others' windows short (before, one such claim closed every window after one inner step, and
        the run averaged as often as with ``every_step``)."""
        training = self.config.training
        if self.overlap:
            # A round lands one window late, so the records of two consecutive windows carry the same
            # step: another peer's count says nothing about this window. Each closes at its own H.
            return self.inner >= training.inner_steps
        if self.inner >= self.stretch * training.inner_steps:
            return True
        full = training.inner_steps * training.micro_batch_size
        return samples >= full and all(theirs >= full for theirs in others)

    def wants_compute(self, samples: int, others: list[int]) -> bool:
        # At least one inner step: a peer that arrives after the window closed brings that much.
        return self.inner == 0 or not self.window_closed(samples, others)

    def ready(self, samples: int, others: list[int], *, fresh_view: bool) -> bool:
        if self.inner == 0 or self.wants_compute(samples, others):
            return False
        training = self.config.training
        full = training.inner_steps * training.micro_batch_size
        if self.overlap or self.stretch >= training.window_stretch or all(t >= full for t in others):
            return True
        # A window held at inner_steps so that it can be replayed: rather than train on, wait for the
        # slower peers at this step as long as the run's window_stretch would have let this one train
        # on (that share of its own window's time), so that they still make the round.
        now = time.monotonic()
        if self._capped_at is None:
            self._capped_at = now
        window_s = self._capped_at - (self._started_at if self._started_at is not None else self._capped_at)
        return now - self._capped_at >= window_s * (training.window_stretch - 1)

    # --- the outer step ------------------------------------------------------------------------------

    def contribution(self, samples: int) -> torch.Tensor:
        return self.replica.contribution()

    def weight(self, samples: int) -> float:
        return self.replica.weight(samples)

    def apply(self, result: RoundResult, step: int) -> bool:
        # What the wire carried of this contribution (a sparse codec's result says); the rest waits.
        self.replica.apply(result.vector, getattr(result, "sent", None))
        self.stats["outer_steps"] += 1
        return not self.overlap

    def reset(self) -> None:
        """Start a window from the synced parameters (after an outer step, a download, or a pause)."""
        self.optimizer.zero_grad(set_to_none=True)
        self.replica.reset()

    def close_window(self, samples: int) -> None:
        self.replica.close_window(samples)
        self.optimizer.zero_grad(set_to_none=True)

    # --- outer_overlap -------------------------------------------------------------------------------

    async def schedule(self, round: RoundCall, close_window: Action, reached_max: Flag) -> None:
        if not self.overlap:
            return await round()
        if self._pending is not None:  # the previous window's round: hidden behind this window's compute
            await asyncio.shield(self._pending)
            if reached_max():
                return
        await asyncio.to_thread(close_window)
        self._pending = asyncio.create_task(round())

    async def drop_pending(self) -> None:
        """A download replaces the synced copy: the round in flight must not land on it afterwards."""
        if self._pending is not None:
            self._pending.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._pending
            self._pending = None

    async def finish_rounds(self, reached_max: bool) -> None:
        if self._pending is not None and reached_max:  # it committed the last step; validating it
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.shield(self._pending)


__all__ = ["DilocoReplica", "DilocoSync", "flat_params", "write_flat_params"]
