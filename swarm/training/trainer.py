"""One peer's part in collaborative data-parallel training.

The loop: compute gradients on local micro-batches (drawn from a seed of run, peer, step and
micro-batch index, so anyone can recompute them) until the peers at this step together hold the target
batch; then average with the group and apply the optimizer to the averaged gradient, exactly as every
other member does. A failed round keeps the accumulated gradient and tries again. A peer that finds the
run ahead of it, or its own state apart from what most peers hold, downloads the agreed state.

Example::

    trainer = Trainer(run, dht, peer_id=key.peer_id)
    await trainer.run(stop_event)
    print(trainer.metrics())
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Collection, Iterator

import hivemind
import torch

from protocols.errors import ConfigError
from protocols.keys import PublicKey, SigningKey
from swarm.averaging.factory import build_averager
from swarm.averaging.groups import Misfit
from swarm.averaging.policy import PeerPolicy
from swarm.averaging.verification import Accuser
from swarm.config import RunConfig
from swarm.data import build_dataset, derive_seed
from swarm.models import build_model, model_config
from swarm.ratelimit import RateLimiter
from swarm.records import RecordSigner, RecordTrust
from swarm.training.catchup import Groupmates
from swarm.training.hooks import TrainingHooks
from swarm.training.microbatch import MicroBatchRunner
from swarm.training.ownmodel import check_own_model
from swarm.training.progress import PeerProgress, ProgressView
from swarm.training.resync import CatchUp
from swarm.training.state import (
    build_optimizer,
    ensure_optimizer_state,
)
from swarm.training.strategies import build_strategy, check_hooks
from swarm.training.sync import (
    StateServicer,
    state_namespace,
)
from swarm.training.synced import SyncedState
from swarm.training.witness import WitnessedRounds

logger = logging.getLogger(__name__)


def _computed_elsewhere(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    raise ConfigError("this peer's gradients are computed by its caller's own loop (session.collaborate)")


def step_misfit(theirs: dict, mine: dict, held: Collection[int] = ()) -> Misfit | None:
    """Why a groupmate's signed round ``extra`` does not fit this peer's (``mine``); None if it fits.

    Only contributions of this step (in DiLoCo, this outer step): a gradient applied to another step's
    state would commit a state nobody holds, and a pseudo-gradient of another window would move the synced
    copy by a window's worth of stale progress. A member whose signed entry claims another step is
    excluded before the all-reduce (and suspected for a step ahead that no peer in ``held``, the steps
    of the run's signed progress records, holds, while the misfits are fewer than half of the group:
    ``VerifiedGroup.suspects``); the members at this step, who all see the same signed entries, exclude
    the same ones and average among themselves. A peer behind catches up by download. Before, in every_step,
    two Sybils claiming the next step in a group of four made the honest members skip the round, and a
    peer whose rounds fail for long enough lets the peers ahead decide its catch-up.
    """
    step = theirs.get("step")
    if type(step) is int and step == mine["step"]:  # not ``True``, which equals 1
        return None
    # A step behind is what an honest laggard signs, and what a leader replaying the member's entry of an
    # earlier round shows: excluded, never blamed. So is a step ahead that the run's signed progress
    # records hold (``held``): this peer is the laggard, and a Sybil leader that lists honest peers' fresh
    # entries beside its own at this peer's step must not make it avoid them once it has caught up.
    backed = type(step) is int and (step < mine["step"] or step in held)
    return Misfit(f"claims step {str(step)[:32]}, not this round's {mine['step']}", blamed=not backed)


class Trainer:
    """One data-parallel peer: accumulate micro-batches, average the gradient with a group, step.

    Args:
        run: the run's config (model, data, optimizer, training and averaging settings).
        dht: the running DHT this peer is a member of; the averager talks through its libp2p daemon.
        peer_id: this peer's ID (base58); it seeds the peer's data, and its progress is published under it.
        device: where the model trains (``cpu``, ``cuda``, ``cuda:1``...).
        coordinator_key: the coordinator's key; when set, only peers it certified count (None: no
            coordinator, any signer counts, as in some tests).
        upload_limiter: the token bucket shared by everything this peer sends (``--max-upload-mbps``).
        signing_key: the key of ``peer_id``, which signs group entries, round inputs and DHT records.
        data_host, data_port: where the averaging data plane listens for part streams (port 0: any).
        data_announce_host: the host groupmates dial for the data plane, when not ``data_host``.
        accuse: sends evidence of a cheating reducer to the coordinator (validators call it).
        hooks: what the peer trains on, sends and claims (``swarm.training.hooks``); None: honestly.
        activation_checkpointing: recompute block activations in backward to save memory.
        fit_memory: on running out of memory, turn on checkpointing, then shrink the micro-batch.
        record_signer: signs this peer's DHT records with its certificate (default: one from
            ``signing_key``); the volunteer passes its own so it can renew the certificate in place.
        client_mode: this peer cannot be dialed (behind NAT), so it never leads an averaging group.
        coordinator_checkpoint: whether the coordinator said it holds a checkpoint when this peer joined;
            False spares a fresh run's peers the look for one before they train from step 0.
        model, optimizer: a model and optimizer built by the caller (``swarm.training.collaboration``,
            whose caller computes the gradients), checked against the run's; None: built from the run.
        validate: the validation loss of a model, when the caller's data is not the run's dataset.
    """

    def __init__(
        self,
        run: RunConfig,
        dht: hivemind.DHT,
        *,
        peer_id: str,
        device: str = "cpu",
        coordinator_key: PublicKey | None = None,
        upload_limiter: RateLimiter | None = None,
        signing_key: SigningKey | None = None,
        data_host: str = "127.0.0.1",
        data_port: int = 0,
        data_announce_host: str | None = None,
        accuse: Accuser | None = None,
        hooks: TrainingHooks | None = None,
        activation_checkpointing: bool = False,
        fit_memory: bool = False,
        record_signer: RecordSigner | None = None,
        client_mode: bool = False,
        coordinator_checkpoint: bool = True,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        validate: Callable[[torch.nn.Module], float] | None = None,
    ):
        self.hooks = hooks if hooks is not None else TrainingHooks()
        check_hooks(run, self.hooks)
        self.config, self.dht, self.peer_id, self.device = run, dht, peer_id, device
        if record_signer is None and signing_key is None:
            raise ConfigError("a trainer signs its DHT records: pass signing_key (the key of its peer ID)")
        # Holds this peer's certificate; the volunteer renews it in place.
        self.records = record_signer or RecordSigner(signing_key)
        self.coordinator_key = coordinator_key
        # Shared by everything this peer sends (averaging parts, state downloads): --max-upload-mbps.
        self.upload_limiter = upload_limiter
        training = run.training
        if model is None:
            self.model = build_model(run.model.name, run.model.config, seed=training.seed).to(device)
            self.optimizer = build_optimizer(self.model, run.optimizer)
        else:  # the caller computes: its model must hold the run's state, its optimizer the run's
            self.model, self.optimizer = model, optimizer or build_optimizer(model, run.optimizer)
            check_own_model(run, self.model, self.optimizer)
        # Precision, checkpointing and running out of memory are this peer's own: see microbatch.py.
        self.runner = MicroBatchRunner(
            self.model, device=device, precision=training.precision,
            activation_checkpointing=activation_checkpointing, fit_memory=fit_memory,
            loss_fn=None if model is None else _computed_elsewhere,
        )  # fmt: skip
        ensure_optimizer_state(self.model, self.optimizer)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        # What the run's sync mode decides (swarm.training.strategies), and the state every peer holds bit
        # for bit, hashed, served and downloaded: the model and its optimizer with every_step; diloco's
        # synced copy and outer optimizer.
        self.strategy = build_strategy(run, self.model, self.optimizer)
        self.synced = SyncedState(self.strategy.synced_model, self.strategy.synced_optimizer, run.run_id)
        # The caller's own loop brings its own data (and, optionally, its own validation).
        self.dataset = build_dataset(run.dataset.name, run.dataset.config) if model is None else None
        self.validate_fn = validate
        self.seq_len = int(model_config(run.model.name, run.model.config).seq_len)
        self.numel = sum(p.numel() for p in self.params)
        self._averaged = torch.empty(self.numel)  # each round's result lands here (applied at once)
        # Whom this peer averages with: certified, not banned, not caught breaking a group.
        self.policy = PeerPolicy(dht, run.run_id, coordinator_key, also_certified=lambda: self.view)
        self.averager = build_averager(
            run, dht, prefix=run.run_id, numel=self.numel, signing_key=signing_key, policy=self.policy,
            upload_limiter=upload_limiter, accuse=accuse, hooks=self.hooks.round_hooks, data_host=data_host,
            data_port=data_port, data_announce_host=data_announce_host, client_mode=client_mode,
            record_signer=self.records,
        )  # fmt: skip
        self.trust = RecordTrust(run.run_id, coordinator_key, is_banned=lambda p: p in self.averager.banned)
        self.samples = self.micro = 0
        self.progress_view = ProgressView(
            dht, self.records, self.trust, peer_id, training, is_banned=lambda p: p in self.averager.banned
        )
        self.finished = False
        self.first_validation: tuple[int, float] | None = None
        self._validation = None
        self._stats = dict(
            train_loss=float("nan"), val_loss=float("nan"), val_step=-1.0, rounds_ok=0.0, rounds_failed=0.0,
            compute_s=0.0, averaging_s=0.0, last_round_s=0.0, eval_s=0.0,
        )  # fmt: skip
        self._started = time.monotonic()
        # The training window that compute_utilization covers: first micro-batch to max_steps, less the
        # validations inside it (eval_s), which neither train nor wait on other peers.
        self._first_compute: float | None = None
        self._finished_at: float | None = None
        self._sps = 0.0
        self._step_view = 0
        # Samples this peer put into rounds that were applied: its credit, reported to the coordinator.
        self.contributed_samples = 0
        # Whom this peer completed and applied rounds with lately: the anchors of its catch-up when stalled.
        self.groupmates = Groupmates()
        # Serving the synced state, and moving to the state the run holds (swarm.training.resync).
        self.catchup = CatchUp(
            self.synced, run, progress_view=self.progress_view, averager=self.averager, dht=dht,
            peer_id=peer_id, groupmates=self.groupmates, coordinator_key=coordinator_key,
            coordinator_checkpoint=coordinator_checkpoint, before_load=self.strategy.drop_pending,
            after_load=self._loaded,
        )  # fmt: skip
        # Its applied rounds, as their signed entries, for the heartbeats: the other members' credit.
        self.witness = WitnessedRounds(peer_id)
        self.last_group_size = 0
        self.paused = False  # set by pause(): no compute, no rounds; the peer stays in the run

    @property
    def step(self) -> int:
        """The run's step this peer holds (outer steps with ``diloco``)."""
        return self.synced.step

    @property
    def state_hash(self) -> str:
        return self.synced.state_hash

    @property
    def param_hash(self) -> str:
        return self.synced.param_hash

    @property
    def synced_model(self) -> torch.nn.Module:
        """The model every peer holds bit for bit (with ``diloco``: the synced copy)."""
        return self.synced.model

    @property
    def view(self) -> dict[str, PeerProgress]:
        """The verified progress records of the run's peers (this one's included), by peer ID."""
        return self.progress_view.peers

    @view.setter
    def view(self, peers: dict[str, PeerProgress]) -> None:
        self.progress_view.peers = peers

    # --- metrics -------------------------------------------------------------------------------------

    def suspected(self, limit: int) -> list[str]:
        """The peers this one avoids now for breaking its rounds, for the coordinator (at most ``limit``)."""
        return self.policy.suspects.avoided(limit)

    def witnessed(self) -> list[list[bytes]]:
        """The applied rounds the next heartbeat shows the coordinator (``swarm.training.witness``)."""
        return self.witness.next()

    def metrics(self) -> dict[str, float]:
        started = self._first_compute if self._first_compute is not None else time.monotonic()
        wall = max((self._finished_at or time.monotonic()) - started - self._stats["eval_s"], 1e-9)
        return {
            **self._stats,
            **self.strategy.stats,
            "resyncs": float(self.catchup.resyncs),
            "bytes_sent": float(self.averager.traffic.sent),
            "bytes_received": float(self.averager.traffic.received),
            "step": float(self.step),
            "samples": float(self.samples),
            "samples_per_s": self._sps,
            "compute_utilization": self._stats["compute_s"] / wall,
            "contributed_samples": float(self.contributed_samples),
            "last_round_peers": float(self.last_group_size),
            "paused": float(self.paused),
            "peak_memory_bytes": float(self.runner.peak_memory_bytes()),
        }

    # --- local work (runs in a worker thread) --------------------------------------------------------

    def _micro_step(self) -> float:
        batch = self.config.training.micro_batch_size
        seed = derive_seed(self.config.run_id, self.peer_id, self.step, self.micro)
        inputs, targets = self.dataset.sample_batch(seed, batch, self.seq_len)
        inputs, targets = self.hooks.batch(inputs, targets)
        started = time.monotonic()
        self.model.train()
        with self.computing():  # gradients of the sum; divided by the count when averaged
            loss = self.runner.run(inputs, targets)
        self.absorb(batch, time.monotonic() - started)
        return loss

    def absorb(self, batch: int, elapsed_s: float, *, mean: bool = False) -> None:
        """Take a micro-batch of ``batch`` samples whose gradient is in the parameters' ``.grad``, computed
        in ``elapsed_s``: this loop's own (of the summed loss), or with ``mean`` one that the caller's loop
        computed (of the mean loss). What it does with it is the strategy's (accumulate, or an inner step)."""
        with self.computing():
            self.strategy.absorb(batch, step=self.step, mean=mean)
        rate = batch / max(elapsed_s, 1e-6)
        self._sps = 0.8 * self._sps + 0.2 * rate if self._sps else rate
        self.samples += batch
        self.micro += 1

    def wants_compute(self) -> bool:
        """Whether to compute another micro-batch before the round (the strategy decides, by the samples
        of the peers at this step)."""
        return self.strategy.wants_compute(self.samples, self._others_at_step())

    def count_compute(self, seconds: float) -> None:
        """Count ``seconds`` that just ended as compute (the caller's own forward and backward)."""
        if self._first_compute is None:
            self._first_compute = time.monotonic() - seconds
        self._stats["compute_s"] += seconds

    @contextlib.contextmanager
    def computing(self) -> Iterator[None]:
        """Count the time inside as compute (forward, backward, optimizer steps) for compute_utilization."""
        started = time.monotonic()
        if self._first_compute is None:
            self._first_compute = started
        try:
            yield
        finally:
            self._stats["compute_s"] += time.monotonic() - started

    def _apply_round(self, result) -> None:
        if self.strategy.apply(result, self.step):
            self._reset_accumulation()

    def _reset_accumulation(self) -> None:
        self.strategy.reset()
        self.samples = self.micro = 0

    def _close_window(self) -> None:
        """``outer_overlap``: this window's work becomes the contribution of a round in the background."""
        self.strategy.close_window(self.samples)
        self.samples = self.micro = 0

    async def _commit(self, step: int) -> None:
        """Move to ``step`` with the hashes of the state now held (``SyncedState.commit``)."""
        if await self.synced.commit(step):
            self.catchup.step_changed()

    def _loaded(self) -> None:
        """A downloaded state replaced this peer's: what it accumulated was of the state before."""
        self._reset_accumulation()
        self._step_view = self.progress_view.count

    def _validate(self) -> float:
        model = self.synced_model  # what every peer holds, whatever local steps this one took since
        was_training = (
            model.training
        )  # the caller's own loop may train this very model: give it back as it was
        model.eval()
        try:
            with torch.no_grad():
                if self.validate_fn is not None:
                    return float(self.validate_fn(model))
                if self.dataset is None:
                    return float("nan")  # the caller's data, and no validation of its own
                if self._validation is None:
                    training = self.config.training
                    self._validation = self.dataset.validation_batches(
                        training.micro_batch_size, self.seq_len, training.validation_batches
                    )
                with self.runner.evaluation():
                    batches = self._validation
                    losses = [float(model.loss(x.to(self.device), y.to(self.device))) for x, y in batches]
                return sum(losses) / len(losses)
        finally:
            model.train(was_training)

    async def _evaluate(self) -> None:
        started = time.monotonic()
        self._stats["val_loss"] = await asyncio.to_thread(self._validate)
        if self._first_compute is not None and self._finished_at is None:  # inside the training window
            self._stats["eval_s"] += time.monotonic() - started
        self._stats["val_step"] = float(self.step)
        if self.first_validation is None:
            self.first_validation = (self.step, self._stats["val_loss"])
        logger.info(f"step {self.step}: validation loss {self._stats['val_loss']:.4f}")

    # --- the loop ------------------------------------------------------------------------------------

    def _progress(self) -> PeerProgress:
        return PeerProgress(self.peer_id, self.step, self.samples, self._sps, self.state_hash, time.time())

    async def exchange_progress(self) -> None:
        """Publish this peer's signed progress record and read the verified records of the others."""
        # A paused peer must not look like a groupmate the others wait for.
        await self.progress_view.exchange(None if self.paused else self._progress())
        await self._refresh_bans()

    async def _publish_forever(self) -> None:
        await self.progress_view.run(lambda: None if self.paused else self._progress(), self._refresh_bans)

    async def _refresh_bans(self) -> None:
        """Take the coordinator's newest signed ban list; the averager refuses those peers from then on."""
        await self.policy.refresh_bans()

    def _others_at_step(self) -> list[int]:
        """The samples the other peers at this step claim, by their signed progress records."""
        return [p.samples for p in self.view.values() if p.step == self.step and p.peer_id != self.peer_id]

    def ready_for_round(self) -> bool:
        """Whether this peer's round is due, by the strategy (with every_step: the peers at this step hold
        the target batch, by a view fetched after this step began)."""
        fresh_view = self.progress_view.count > self._step_view
        return self.strategy.ready(self.samples, self._others_at_step(), fresh_view=fresh_view)

    async def take_round(self) -> None:
        """Average what this peer holds now: at once, or (diloco's ``outer_overlap``) in the background."""
        self.catchup.round_tried()
        await self.strategy.schedule(self._round, self._close_window, self._reached_max)

    async def _round(self) -> None:
        # Alone only if nobody else is training: peers at another step will soon be at this one.
        others = [p for p in self.view.values() if p.peer_id != self.peer_id]
        # The organizer's robustness floor: bans never lower it, or each banned Sybil would.
        needed = self.config.training.min_group_size
        if needed > 1 and len(others) + 1 < needed:
            return  # not enough peers in the run yet: keep the accumulated gradient and wait
        # What this peer sends and signs for: its own gradient and samples, but in a rehearsed attack.
        vector = await asyncio.to_thread(
            lambda: self.hooks.contribute(self, self.strategy.contribution(self.samples))
        )
        weight = self.hooks.weight(self.strategy.weight(self.samples))
        extra = self.hooks.entry(self._round_extra())
        # Everyone training at this step is about to look for a group too: assemble once all have joined
        # (never fewer than the run needs; a peer that left only makes the leader wait out its window).
        # A suspect is refused in matchmaking: waiting for it only holds the group until the window ends.
        at_step = [p for p in others if p.step == self.step and self.policy.refusal(p.peer_id) is None]
        held_steps = {p.step for p in others}  # a groupmate claiming one of these is ahead, not lying
        expected = max(needed, 1 + len(at_step))
        started = time.monotonic()
        outcome = await self.averager.average(
            vector,
            weight,
            extra,
            alone=not others and needed == 1,
            expected_size=expected,
            out=self._averaged,
            fits=lambda entry: step_misfit(entry.extra, extra, held_steps),
        )
        # Matchmaking plus all-reduce: what a slow link costs this peer (docs/wan.md reads it).
        self._stats["last_round_s"] = time.monotonic() - started
        self._stats["averaging_s"] += self._stats["last_round_s"]
        if outcome is None:
            self._stats["rounds_failed"] += 1
            logger.info(f"step {self.step}: no averaging group formed; accumulating further")
            return
        group, result = outcome
        if len(group.peer_ids) < needed:
            self._stats["rounds_failed"] += 1
            logger.info(f"step {self.step}: a group of {len(group.peer_ids)} formed; the run needs {needed}")
            return
        strangers = [str(p) for p, e in zip(group.peer_ids, group.extras, strict=True) if e != extra]
        if not self._group_usable(group):
            self._stats["rounds_failed"] += 1
            return
        if not result.complete:
            self._stats["rounds_failed"] += 1
            logger.warning(
                f"step {self.step}: round incomplete ({len(result.dropped)} peers failed); retrying"
            )
            return
        if strangers:
            logger.warning(
                f"step {self.step}: {len(strangers)} groupmates held another state; the majority check follows"
            )
        contributed = int(self.strategy.weight(self.samples))
        async with self.synced.lock:
            with self.computing():
                await asyncio.to_thread(self._apply_round, result)
            await self._commit(self.step + 1)
        self.contributed_samples += contributed
        self.groupmates.record([str(p) for p in group.peer_ids if str(p) != self.peer_id], self.step)
        self.witness.record(group)
        self.last_group_size = len(group.peer_ids)
        self._step_view = self.progress_view.count
        self._stats["rounds_ok"] += 1
        loss = self._stats["train_loss"]
        logger.info(
            f"step {self.step}: averaged with {len(group.peer_ids)} peers, {sum(group.weights):.0f} samples"
            + ("" if math.isnan(loss) else f", loss {loss:.4f}")
        )
        if self.step % self.config.training.validation_every_steps == 0 or self._reached_max():
            await self._evaluate()

    def _round_extra(self) -> dict:
        """What this peer signs into its group entry for the round at its step."""
        return {"step": self.step, "state_hash": self.state_hash}

    def _group_usable(self, group) -> bool:
        """Every member kept claims this step (``step_misfit``); checked again before applying."""
        steps = {e.get("step") if isinstance(e, dict) else None for e in group.extras}
        if steps != {self.step}:
            logger.info(f"step {self.step}: a groupmate was at another step; not applied")
            return False
        return True

    def _reached_max(self) -> bool:
        return self.config.training.max_steps is not None and self.step >= self.config.training.max_steps

    async def start(self) -> None:
        """Join the run's averaging and start serving this peer's state."""
        await self.averager.start()
        servicer = StateServicer(
            self.config.run_id,
            self.synced.encoded,
            admit=self.catchup.admit_download,
            upload_limiter=self.upload_limiter,
        )
        await servicer.add_p2p_handlers(self.averager.p2p, namespace=state_namespace(self.config.run_id))
        await self._commit(self.step)

    async def run(self, stop: asyncio.Event) -> None:
        """Train until ``stop`` is set; after ``max_steps`` keep serving state until then, and train on
        if the run's ``max_steps`` is raised meanwhile (the volunteer applies the coordinator's)."""
        await self.start()
        publisher = asyncio.create_task(self._publish_forever())
        try:
            while True:
                await self._loop(stop)
                await self._settle(stop)
                if stop.is_set():
                    break
                self.finished = False
        finally:
            publisher.cancel()
            await self.averager.shutdown()

    async def _settle(self, stop: asyncio.Event) -> None:
        """After ``max_steps``: serve state, and still move to the state most peers hold. A last step that
        came out apart (another kind of device rounds differently) must not leave this peer apart."""
        while not stop.is_set() and self._reached_max():
            await self.catchup.catch_up()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=self.config.training.progress_interval_s)

    async def _loop(self, stop: asyncio.Event) -> None:
        try:
            await asyncio.sleep(2 * self.config.training.progress_interval_s)  # a first view of the run
            await self.catchup.catch_up()
            await self.catchup.look_for_checkpoint(stop)
            await self._evaluate()  # where this peer starts: step 0, or the state it just caught up to
            while not stop.is_set() and not self._reached_max():
                if self.paused:
                    await self._wait_while_paused(stop)
                    continue
                if self.wants_compute():
                    loss = await asyncio.to_thread(self._micro_step)
                    previous = self._stats["train_loss"]
                    self._stats["train_loss"] = loss if math.isnan(previous) else 0.9 * previous + 0.1 * loss
                else:
                    # The batch is (nearly) complete: wait for a fresh view rather than pile up more samples.
                    await asyncio.sleep(self.config.training.progress_interval_s / 4)
                if await self.catchup.catch_up():
                    continue
                if self.ready_for_round():
                    await self.take_round()
            await self.finish()
        finally:
            await self.strategy.drop_pending()

    async def finish(self) -> None:
        """Report this peer finished (this loop's or a caller's): let a background round end, take the
        last step's validation loss, and keep the final state encoded for the peers that download it."""
        await self.strategy.finish_rounds(self._reached_max())
        validates = self.dataset is not None or self.validate_fn is not None
        if validates and self._reached_max() and self._stats["val_step"] != self.step:
            await self._evaluate()  # the last step's loss, whichever path reached it (round or download)
        self.finished = True
        self._finished_at = self._finished_at or time.monotonic()
        await self.synced.encoded()

    async def drop_accumulation(self) -> None:
        """Drop the gradients not yet averaged (they earned no credit), so that peers do not count them
        towards a batch this peer will not bring to a round, and first a round in flight that would land
        on the state they were computed from."""
        await self.strategy.drop_pending()
        async with self.synced.lock:
            self._reset_accumulation()

    def pause(self) -> None:
        """Stop computing after the current micro-batch or round; the peer keeps serving its state."""
        self.paused = True

    def resume(self) -> None:
        self.paused = False

    async def _wait_while_paused(self, stop: asyncio.Event) -> None:
        await self.drop_accumulation()
        logger.info(f"paused at step {self.step}")
        while self.paused and not stop.is_set():
            await asyncio.sleep(0.2)
        if not stop.is_set():
            logger.info(f"resumed at step {self.step}")
