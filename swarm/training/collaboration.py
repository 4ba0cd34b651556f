"""A collaboration that the researcher's own training loop calls: ``collab.step(samples)`` after each backward.

The researcher builds the model, draws the data and runs forward and backward; the collaboration does the
rest, with the guarantees of the built-in loop (both drive a ``TrainingPeer``): it takes each micro-batch's
gradient (of the mean loss over ``samples`` examples) out of ``.grad``, and once the peers at this step
together hold the run's target batch it averages with a group (signed, robust, verified rounds), applies
the run's optimizer to the averaged gradient exactly as every other peer does, and commits the step; a peer
behind or apart from the others downloads the agreed state instead. Between steps it publishes progress,
serves its state to peers that join late, files evidence against cheating reducers, and reports to the
coordinator's heartbeats (step, parameter hash, metrics). With ``training.sync = "diloco"`` each call is an
inner step of the caller's optimizer on the local copy, and every ``inner_steps`` the pseudo-gradients are
averaged and the outer optimizer steps the synced copy.

The collaboration owns the optimizer step: the optimizer must be the run's (``optimizer=None`` builds it),
and one on per-device kernels (``foreach``, ``fused``) is refused, since peers given the same gradient
would step to different bits. The model must hold the run's tensors (``swarm.models.external`` declares
a model that lives in the researcher's code).

What verification still applies when peers bring their own data: every round input is signed with the
samples it claims, aggregated with the run's robust rule (CenteredClip by default) that bounds what any
one input can move, and each reducer's output is checked by its groupmates from the signed inputs
(evidence to the coordinator bans a reducer that lied); states are compared by hash and a peer apart from
the majority is moved back. What no longer applies is recomputing a peer's gradient from its public seed:
data only the peer holds cannot be replayed, so a peer that sends a well-formed but wrong gradient is
bounded by the robust rule, not caught. Such a run sets ``training.sender_check_probability = 0``; a
collaboration (``EveryStep`` or ``DiLoCo``) refuses a run that recomputes senders
(``swarm.training.sendercheck``), whose validators would replay the run's public batches and accuse this
loop.

Example::

    with swarm.connect("203.0.113.7:31330", identity="~/.swarm/identity.key") as session:
        collab = session.collaborate(model, strategy=swarm.EveryStep())
        for x, y in loader:
            loss_fn(model(x), y).backward()
            collab.step(samples=len(x))
            if collab.finished:
                break
        collab.finish()
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from protocols.errors import ConfigError, SwarmError
from swarm.config import RunConfig, sender_checks_on
from swarm.training.ownmodel import check_own_model
from swarm.training.peer import TrainingPeer
from swarm.training.state import build_optimizer

if TYPE_CHECKING:
    from swarm.session import Session

logger = logging.getLogger(__name__)
T = TypeVar("T")

# How long ``finish`` waits, by default, for the peers it sees to hold its step and state.
FINISH_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class EveryStep:
    """Average the gradient at every step of the run (``[training] sync = "every_step"``)."""

    def check(self, run: RunConfig) -> None:
        if run.training.sync != "every_step":
            raise ConfigError(
                f"collaborate: strategy EveryStep(), but run {run.run_id!r} trains with "
                f"training.sync = {run.training.sync!r}; pass strategy=None to follow the run"
            )
        _refuse_sender_checks(run)


@dataclass(frozen=True)
class DiLoCo:
    """``inner_steps`` local steps of the caller's optimizer, then an averaged outer step
    (``[training] sync = "diloco"``); None: the run's ``inner_steps``."""

    inner_steps: int | None = None

    def check(self, run: RunConfig) -> None:
        training = run.training
        if training.sync != "diloco":
            raise ConfigError(
                f"collaborate: strategy DiLoCo(...), but run {run.run_id!r} trains with training.sync = "
                f"{training.sync!r}; pass strategy=None to follow the run"
            )
        if self.inner_steps is not None and self.inner_steps != training.inner_steps:
            raise ConfigError(
                f"collaborate: strategy DiLoCo(inner_steps={self.inner_steps}), but run {run.run_id!r} has "
                f"training.inner_steps = {training.inner_steps}: every peer's window is the run's"
            )
        _refuse_sender_checks(run)


def _refuse_sender_checks(run: RunConfig) -> None:
    """A loop on its own data (or model, or optimizer) cannot join a run whose validators replay senders'
    contributions: its groupmates would replay the run's public batches, not this loop's, and accuse it."""
    if sender_checks_on(run):
        raise ConfigError(
            f"collaborate: run {run.run_id!r} recomputes every sender's contribution from the run's public "
            f"batches (training.sender_check_probability = {run.training.sender_check_probability:g}); "
            "a loop on its own data needs a run with sender_check_probability = 0"
        )


Strategy = EveryStep | DiLoCo


def strategy_of(run: RunConfig) -> Strategy:
    """The strategy ``run``'s ``training.sync`` names."""
    return DiLoCo(run.training.inner_steps) if run.training.sync == "diloco" else EveryStep()


class Collaboration:
    """One peer's part in a run, driven by its caller's loop (see the module docstring).

    ``Session.collaborate`` (from a synchronous program whose session ``swarm.connect`` runs in the
    background) and ``await Session.acollaborate`` build one; its ``step`` and ``astep`` return after the
    micro-batch is taken and, when the batch of the run was complete, after the round.
    """

    def __init__(self, peer: TrainingPeer, loop: asyncio.AbstractEventLoop, stop: asyncio.Event):
        self.peer, self._loop, self._stop = peer, loop, stop
        self._publisher: asyncio.Task | None = None
        self._last_step_at = time.monotonic()
        self._closed = False

    # --- what the caller reads ----------------------------------------------------------------------

    @property
    def model(self) -> torch.nn.Module:
        """The model the caller trains (with ``diloco``: the local copy)."""
        return self.peer.model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The run's optimizer over the caller's model (with ``diloco``: the inner optimizer)."""
        return self.peer.optimizer

    @property
    def global_step(self) -> int:
        """The run's step this peer holds (outer steps with ``diloco``)."""
        return self.peer.step

    @property
    def finished(self) -> bool:
        """The run's ``max_steps`` is reached, or the session ended (the coordinator says the run finished,
        this peer was banned, or the session was closed): further ``step`` calls take no gradient."""
        return self.peer.reached_max() or self._stop.is_set() or self._closed

    @property
    def state_hash(self) -> str:
        return self.peer.state_hash

    @property
    def param_hash(self) -> str:
        return self.peer.param_hash

    def metrics(self) -> dict[str, float]:
        """The numbers the coordinator's heartbeats carry (step, losses, rounds, bytes, utilization...)."""
        return self.peer.metrics()

    # --- starting -----------------------------------------------------------------------------------

    @classmethod
    async def start(
        cls,
        session: Session,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        strategy: Strategy | None = None,
        validate: Callable[[torch.nn.Module], float] | None = None,
        stop: asyncio.Event | None = None,
    ) -> Collaboration:
        """Check the model and optimizer against the session's run, start averaging and state serving,
        and move the model to the run's current state (a checkpoint, or the state the peers hold)."""
        run = session.run_config
        if run is None or session.dht is None:
            raise SwarmError("collaborate: the session has not joined a run yet")
        if run.pipeline.stages > 1:
            raise ConfigError(
                f"collaborate: run {run.run_id!r} is split into {run.pipeline.stages} pipeline stages; "
                "join it with swarm-peer join --role stage or --role trainer"
            )
        (strategy or strategy_of(run)).check(run)
        if not isinstance(model, torch.nn.Module):
            raise ConfigError(f"collaborate: the model must be a torch.nn.Module, got {type(model).__name__}")
        device = str(next(model.parameters()).device)
        optimizer = optimizer or build_optimizer(model, run.optimizer)
        await asyncio.to_thread(check_own_model, run, model, optimizer)
        peer = await asyncio.to_thread(
            TrainingPeer, run, session.dht, peer_id=session.key.peer_id, device=device,
            coordinator_key=session.coordinator_key, signing_key=session.key, record_signer=session.records,
            data_host=session.config.host, accuse=session.accuser(), client_mode=not session.dialable,
            coordinator_checkpoint=session.admission.holds_checkpoint, standing=session.standing,
            model=model, optimizer=optimizer, validate=validate,
        )  # fmt: skip
        collab = cls(peer, asyncio.get_running_loop(), stop or asyncio.Event())
        await collab._begin()
        session.progress = peer
        return collab

    async def _begin(self) -> None:
        peer = self.peer
        await peer.start()
        self._publisher = asyncio.create_task(peer.publish_forever())
        try:
            await peer.enter(self._stop)
        except BaseException:
            await self.close()
            raise
        self._last_step_at = time.monotonic()  # the caller's first micro-batch starts now

    # --- stepping -----------------------------------------------------------------------------------

    def step(self, samples: int) -> bool:
        """Take the gradient now in the model's ``.grad`` (of the mean loss over ``samples`` examples) and,
        once the run's batch is complete, average and apply it. Returns True when this peer moved to another
        step of the run (a round, or the agreed state downloaded). Call it from the caller's thread, not
        from the session's event loop (use ``astep`` there)."""
        refuse_on(self._loop, "Collaboration.step")
        self._take(samples)
        try:
            return call_on(self._loop, self._advance(), "Collaboration.step")
        finally:
            self._last_step_at = time.monotonic()  # the round is not the caller's compute

    async def astep(self, samples: int) -> bool:
        """``step`` for a caller on an event loop (the session's, or another)."""
        await asyncio.to_thread(self._take, samples)
        advance = self._advance()
        try:
            if asyncio.get_running_loop() is self._loop:
                return await advance
            return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(advance, self._loop))
        finally:
            self._last_step_at = time.monotonic()

    def _take(self, samples: int) -> None:
        if self._closed:
            raise SwarmError("this collaboration is closed")
        if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
            raise ConfigError(f"Collaboration.step: samples must be a positive integer, got {samples!r}")
        peer = self.peer
        device = str(peer.params[0].device)
        if device != peer.device:
            raise SwarmError(
                f"the model moved to {device} after collaborate took it on {peer.device}: the run's "
                "optimizer state (and a DiLoCo synced copy) stay where they were built; move the model first"
            )
        now = time.monotonic()
        elapsed, self._last_step_at = now - self._last_step_at, now
        if peer.paused or self.finished:
            peer.optimizer.zero_grad(set_to_none=True)  # nothing to bring to a round: dropped
            return
        peer.count_compute(elapsed)  # the caller's forward and backward since its last step
        peer.absorb(samples, elapsed, mean=True)

    async def _advance(self) -> bool:
        """After a micro-batch: catch up, or average once the batch is complete; return when the caller
        should compute the next micro-batch. True when the step changed."""
        peer, interval_s = self.peer, self.peer.config.training.progress_interval_s
        before = (peer.step, peer.state_hash)
        while not self._stop.is_set() and not peer.reached_max() and not peer.paused:
            if await peer.catchup.catch_up():
                break  # the accumulated gradient was of another state; the caller computes on from here
            if peer.ready_for_round():
                await peer.take_round()
            if peer.wants_compute():
                break
            await asyncio.sleep(interval_s / 4)  # the batch is complete: wait for the others' view
        if peer.reached_max() and not peer.finished:
            await peer.finish()
        return (peer.step, peer.state_hash) != before

    # --- pausing and ending -------------------------------------------------------------------------

    def pause(self) -> None:
        """Stop taking gradients (those not yet averaged are dropped) and stop joining rounds; the peer keeps
        serving its state. A DiLoCo round in flight is dropped first: it would land on a reset window."""
        call_on(self._loop, self.apause(), "Collaboration.pause")

    async def apause(self) -> None:
        self.peer.pause()
        await self.peer.drop_accumulation()

    def resume(self) -> None:
        self.peer.resume()

    def finish(self, timeout_s: float = FINISH_TIMEOUT_S) -> bool:
        """Keep serving this peer's state, and move to the state most peers hold, until every peer in
        view holds this peer's step and state or ``timeout_s`` passes: a groupmate whose last round
        failed catches up from this peer before it leaves. True when all agree."""
        return call_on(self._loop, self.afinish(timeout_s), "Collaboration.finish")

    async def afinish(self, timeout_s: float = FINISH_TIMEOUT_S) -> bool:
        if _running_loop() is not self._loop:
            return await asyncio.wrap_future(
                asyncio.run_coroutine_threadsafe(self.afinish(timeout_s), self._loop)
            )
        if self._closed:
            raise SwarmError("Collaboration.finish: the session has ended (see Collaboration.finished)")
        peer = self.peer
        deadline = time.monotonic() + timeout_s
        while not self._stop.is_set():
            await peer.catchup.catch_up()
            others = [p for k, p in peer.view.items() if k != peer.peer_id]
            if all((p.step, p.state_hash) == (peer.step, peer.state_hash) for p in others):
                return True
            if time.monotonic() >= deadline:
                apart = sum(1 for p in others if (p.step, p.state_hash) != (peer.step, peer.state_hash))
                logger.warning(
                    f"finish: {apart} of {len(others)} peers in view still hold another step or state"
                )
                return False
            await asyncio.sleep(peer.config.training.progress_interval_s)
        return False

    async def close(self) -> None:
        """Stop publishing progress and shut the averager down (the session's ``close`` calls it)."""
        if self._closed:
            return
        self._closed = True
        if self._publisher is not None:
            self._publisher.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._publisher
        await self.peer.strategy.drop_pending()
        await self.peer.shutdown()


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def refuse_on(loop: asyncio.AbstractEventLoop | None, what: str) -> None:
    """Refuse a blocking call from the session's own event loop (it would wait on itself), or without one."""
    if loop is None or loop.is_closed():
        raise SwarmError(f"{what}: the session is not running (use it inside swarm.connect's with block)")
    if _running_loop() is loop:
        raise SwarmError(f"{what} blocks: on the session's event loop, await its async form instead")


def call_on(loop: asyncio.AbstractEventLoop | None, work: Coroutine[Any, Any, T], what: str) -> T:
    """Run ``work`` on the session's ``loop`` (in its own thread) and wait for its result in this thread."""
    try:
        refuse_on(loop, what)
    except SwarmError:
        work.close()
        raise
    try:
        return asyncio.run_coroutine_threadsafe(work, loop).result()
    except concurrent.futures.CancelledError:
        raise SwarmError(
            f"{what}: the session ended meanwhile (the run finished, this peer was banned, or it was closed)"
        ) from None


__all__ = ["Collaboration", "DiLoCo", "EveryStep", "Strategy", "call_on", "refuse_on", "strategy_of"]
