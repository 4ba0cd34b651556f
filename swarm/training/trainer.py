"""The built-in training loop: a ``TrainingPeer`` fed with the run's own data.

It computes gradients on local micro-batches (drawn from a seed of run, peer, step and micro-batch index,
so anyone can recompute them) until the peer's round is due, then lets the peer average and step. It is
one caller of ``swarm.training.peer.TrainingPeer``, as a researcher's own loop is through
``swarm.training.collaboration``; everything that makes a round safe is the peer's.

Example::

    trainer = Trainer(run, dht, peer_id=key.peer_id, signing_key=key)
    await trainer.run(stop_event)
    print(trainer.metrics())
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import hivemind
import torch

from swarm.averaging.averager import Averager
from swarm.config import RunConfig
from swarm.data import build_dataset, derive_seed
from swarm.models import build_model
from swarm.training.microbatch import MicroBatchRunner
from swarm.training.peer import TrainingPeer

logger = logging.getLogger(__name__)


class Trainer:
    """One data-parallel peer training on the run's dataset until ``stop`` (see the module docstring).

    Args:
        run, dht, peer_id, device: as ``TrainingPeer``'s; the model is built from ``run`` on ``device``.
        activation_checkpointing: recompute block activations in backward to save memory.
        fit_memory: on running out of memory, turn on checkpointing, then shrink the micro-batch.
        peer_options: the rest of ``TrainingPeer``'s keyword arguments (``signing_key``,
            ``coordinator_key``, ``hooks``, ``accuse``, ``data_host``...).
    """

    def __init__(
        self,
        run: RunConfig,
        dht: hivemind.DHT,
        *,
        peer_id: str,
        device: str = "cpu",
        activation_checkpointing: bool = False,
        fit_memory: bool = False,
        **peer_options: Any,
    ):
        training = run.training
        model = build_model(run.model.name, run.model.config, seed=training.seed).to(device)
        # Precision, checkpointing and running out of memory are this peer's own: see microbatch.py.
        self.runner = MicroBatchRunner(
            model, device=device, precision=training.precision,
            activation_checkpointing=activation_checkpointing, fit_memory=fit_memory,
        )  # fmt: skip
        self.dataset = build_dataset(run.dataset.name, run.dataset.config)
        self.peer = TrainingPeer(
            run, dht, peer_id=peer_id, model=model, device=device, validate=self._validate, **peer_options
        )
        self._validation: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    # --- what the volunteer and the session read (the peer's) ----------------------------------------

    @property
    def step(self) -> int:
        return self.peer.step

    @property
    def param_hash(self) -> str:
        return self.peer.param_hash

    @property
    def state_hash(self) -> str:
        return self.peer.state_hash

    @property
    def finished(self) -> bool:
        return self.peer.finished

    @property
    def averager(self) -> Averager:
        return self.peer.averager

    def metrics(self) -> dict[str, float]:
        return self.peer.metrics()

    def suspected(self, limit: int) -> list[str]:
        return self.peer.suspected(limit)

    def witnessed(self) -> list[list[bytes]]:
        return self.peer.witnessed()

    def pause(self) -> None:
        self.peer.pause()

    def resume(self) -> None:
        self.peer.resume()

    # --- local work (runs in a worker thread) --------------------------------------------------------

    def _micro_step(self) -> float:
        peer, training = self.peer, self.peer.config.training
        seed = derive_seed(peer.config.run_id, peer.peer_id, peer.step, peer.micro)
        inputs, targets = self.dataset.sample_batch(seed, training.micro_batch_size, peer.seq_len)
        inputs, targets = peer.hooks.batch(inputs, targets)
        started = time.monotonic()
        peer.model.train()
        with peer.computing():  # gradients of the sum; divided by the count when averaged
            loss = self.runner.run(inputs, targets)
        peer.absorb(training.micro_batch_size, time.monotonic() - started)
        return loss

    def _validate(self, model: torch.nn.Module) -> float:
        """The mean loss of ``model`` on the run's validation batches (the peer sets eval mode, no grad)."""
        training, device = self.peer.config.training, self.peer.device
        if self._validation is None:
            self._validation = self.dataset.validation_batches(
                training.micro_batch_size, self.peer.seq_len, training.validation_batches
            )
        with self.runner.evaluation():
            losses = [float(model.loss(x.to(device), y.to(device))) for x, y in self._validation]
        return sum(losses) / len(losses)

    # --- the loop ------------------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Train until ``stop`` is set; after ``max_steps`` keep serving state until then, and train on
        if the run's ``max_steps`` is raised meanwhile (the volunteer applies the coordinator's)."""
        peer = self.peer
        await peer.start()
        publisher = asyncio.create_task(peer.publish_forever())
        try:
            while True:
                await self._loop(stop)
                await self._settle(stop)
                if stop.is_set():
                    break
                peer.finished = False
        finally:
            publisher.cancel()
            await peer.shutdown()

    async def _settle(self, stop: asyncio.Event) -> None:
        """After ``max_steps``: serve state, and still move to the state most peers hold. A last step that
        came out apart (another kind of device rounds differently) must not leave this peer apart."""
        while not stop.is_set() and self.peer.reached_max():
            await self.peer.catchup.catch_up()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=self.peer.config.training.progress_interval_s)

    async def _loop(self, stop: asyncio.Event) -> None:
        peer, interval_s = self.peer, self.peer.config.training.progress_interval_s
        try:
            await peer.enter(stop)
            while not stop.is_set() and not peer.reached_max():
                if peer.paused:
                    await self._wait_while_paused(stop)
                    continue
                if peer.wants_compute():
                    peer.note_train_loss(await asyncio.to_thread(self._micro_step))
                else:
                    # The batch is (nearly) complete: wait for a fresh view rather than pile up more samples.
                    await asyncio.sleep(interval_s / 4)
                if await peer.catchup.catch_up():
                    continue
                if peer.ready_for_round():
                    await peer.take_round()
            await peer.finish()
        finally:
            await peer.strategy.drop_pending()

    async def _wait_while_paused(self, stop: asyncio.Event) -> None:
        await self.peer.drop_accumulation()
        logger.info(f"paused at step {self.peer.step}")
        while self.peer.paused and not stop.is_set():
            await asyncio.sleep(0.2)
        if not stop.is_set():
            logger.info(f"resumed at step {self.peer.step}")
