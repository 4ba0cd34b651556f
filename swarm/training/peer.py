"""One data-parallel peer of a run, whoever computes its gradients: ``TrainingPeer``.

It takes each micro-batch's gradient out of the model's ``.grad`` (``absorb``) and, once the peers at this
step together hold the run's target batch (``ready_for_round``), averages with a group (signed, robust,
verified rounds) and applies the run's optimizer to the averaged gradient exactly as every other member
does (``take_round``); a failed round keeps what was accumulated and is tried again. Its ``catchup`` moves
it to the agreed state when it is behind or apart, and serves its own to peers that join late. Two loops
drive it, and neither reaches into the other: the built-in one (``swarm.training.trainer.Trainer``, on the
run's data) and the researcher's own (``swarm.training.collaboration.Collaboration``).

Example::

    peer = TrainingPeer(run, dht, peer_id=key.peer_id, signing_key=key, model=model)
    await peer.start()
    peer.absorb(samples, elapsed_s, mean=True)  # after forward and backward into model's .grad
    if peer.ready_for_round():
        await peer.take_round()
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterator

import hivemind
import torch

from protocols.errors import ConfigError
from protocols.keys import PublicKey, SigningKey
from swarm import journal
from swarm.averaging.factory import build_averager
from swarm.averaging.matchmaking import FailedSearches
from swarm.averaging.policy import PeerPolicy
from swarm.averaging.verification import Accuser
from swarm.config import RunConfig, window_replay_obstacle
from swarm.models import model_config
from swarm.ratelimit import RateLimiter
from swarm.records import RecordSigner, RecordTrust
from swarm.standing import Standing
from swarm.training.catchup import Groupmates, Position
from swarm.training.hooks import TrainingHooks
from swarm.training.memory import peak_memory_bytes
from swarm.training.progress import PeerProgress, ProgressView, step_misfit
from swarm.training.readiness import ShownWork, counted_claims
from swarm.training.resync import CatchUp
from swarm.training.sendercheck import SenderChecks
from swarm.training.state import build_optimizer, ensure_optimizer_state, state_tensors
from swarm.training.strategies import build_strategy, check_hooks
from swarm.training.sync import EncodedState, StateServicer, state_namespace
from swarm.training.synced import SyncedState
from swarm.training.tiered import SecondTier, adopt_order
from swarm.training.witness import WitnessedRounds

logger = logging.getLogger(__name__)

#: The validation loss of a model: the built-in loop's on the run's data, or the caller's own.
Validate = Callable[[torch.nn.Module], float]


class TrainingPeer:
    """One data-parallel peer: takes micro-batch gradients, averages them with a group, steps.

    Args:
        run: the run's config (model, optimizer, training and averaging settings).
        dht: the running DHT this peer is a member of; the averager talks through its libp2p daemon.
        peer_id: this peer's ID (base58); its progress is published under it.
        model: the model the gradients land in, holding the run's tensors (``check_own_model``).
        optimizer: the run's optimizer over ``model``; None: built from the run.
        device: where the model trains (``cpu``, ``cuda``, ``cuda:1``...).
        coordinator_key: the coordinator's key; when set, only peers it certified count (None: no
            coordinator, any signer counts, as in some tests).
        upload_limiter: the token bucket shared by everything this peer sends (``--max-upload-mbps``).
        signing_key: the key of ``peer_id``, which signs group entries, round inputs and DHT records.
        data_host, data_port: where the averaging data plane listens for part streams (port 0: any).
        data_announce_host: the host groupmates dial for the data plane, when not ``data_host``.
        accuse: sends evidence of a cheating reducer to the coordinator (validators call it).
        hooks: what the peer sends and claims (``swarm.training.hooks``); None: honestly.
        record_signer: signs this peer's DHT records with its certificate (default: one from
            ``signing_key``); the volunteer passes its own so it can renew the certificate in place.
        client_mode: this peer cannot be dialed (behind NAT), so it never leads an averaging group.
        coordinator_checkpoint: whether the coordinator said it holds a checkpoint when this peer joined;
            False spares a fresh run's peers the look for one before they train from step 0.
        standing: the coordinator's signed standing (the session's): catch-up weighs votes by credit.
        validate: the validation loss of a model (the synced one); None: no validation.
    """

    def __init__(
        self,
        run: RunConfig,
        dht: hivemind.DHT,
        *,
        peer_id: str,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        device: str = "cpu",
        coordinator_key: PublicKey | None = None,
        upload_limiter: RateLimiter | None = None,
        signing_key: SigningKey | None = None,
        data_host: str = "127.0.0.1",
        data_port: int = 0,
        data_announce_host: str | None = None,
        accuse: Accuser | None = None,
        hooks: TrainingHooks | None = None,
        record_signer: RecordSigner | None = None,
        client_mode: bool = False,
        coordinator_checkpoint: bool = True,
        standing: Standing | None = None,
        validate: Validate | None = None,
    ):
        self.hooks = hooks if hooks is not None else TrainingHooks()
        check_hooks(run, self.hooks)
        self.config, self.dht, self.peer_id, self.device = run, dht, peer_id, device
        if record_signer is None and signing_key is None:
            raise ConfigError("a trainer signs its DHT records: pass signing_key (the key of its peer ID)")
        # Holds this peer's certificate; the volunteer renews it in place.
        self.records = record_signer or RecordSigner(signing_key)
        self.coordinator_key, self.upload_limiter = coordinator_key, upload_limiter
        training = run.training
        self.model, self.optimizer = model, optimizer or build_optimizer(model, run.optimizer)
        ensure_optimizer_state(self.model, self.optimizer)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        # What the run's sync mode decides (swarm.training.strategies), and the state every peer holds bit
        # for bit, hashed, served and downloaded: the model and its optimizer with every_step; diloco's
        # synced copy and outer optimizer.
        self.strategy = build_strategy(run, self.model, self.optimizer)
        self.synced = SyncedState(self.strategy.synced_model, self.strategy.synced_optimizer, run.run_id)
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
        # Validators recompute drawn senders' contributions from their public batch seeds (every_step).
        self.sender_checks = SenderChecks(
            run, device=device, state=self._state_now, accuse=accuse, suspect=self.policy.suspect
        )
        if self.sender_checks.enabled:
            self.averager.sender_checks = self.sender_checks
        elif (
            training.sync == "diloco"
            and training.sender_check_probability > 0
            and (obstacle := window_replay_obstacle(training))
        ):
            logger.warning(f"sender checks do not cover this run's diloco windows: {obstacle}")
        # Beyond one group: what every group of a step applies (swarm.training.tiered).
        self.tiers = SecondTier(
            run, dht, first=self.averager, numel=self.numel, policy=self.policy,
            signing_key=signing_key or self.records.key, record_signer=self.records,
            upload_limiter=upload_limiter, accuse=accuse, hooks=self.hooks.round_hooks, client_mode=client_mode,
        )  # fmt: skip
        self.trust = RecordTrust(run.run_id, coordinator_key, is_banned=lambda p: p in self.averager.banned)
        self.samples = self.micro = 0
        self.progress_view = ProgressView(
            dht, self.records, self.trust, peer_id, training, is_banned=lambda p: p in self.averager.banned
        )
        self.finished = False
        self.first_validation: tuple[int, float] | None = None
        self._stats = dict(
            train_loss=float("nan"), val_loss=float("nan"), val_step=-1.0, rounds_ok=0.0, rounds_failed=0.0,
            compute_s=0.0, averaging_s=0.0, last_round_s=0.0, eval_s=0.0,
        )  # fmt: skip
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
        # What that round showed of the others' work: how far their claimed samples count (``readiness``).
        self.shown: ShownWork | None = None
        self._searches = FailedSearches()  # matchmaking at this step that formed no group (widens the window)
        # Serving the synced state, and moving to the state the run holds (swarm.training.resync).
        self.catchup = CatchUp(
            self.synced, run, progress_view=self.progress_view, averager=self.averager, dht=dht,
            peer_id=peer_id, groupmates=self.groupmates, coordinator_key=coordinator_key,
            coordinator_checkpoint=coordinator_checkpoint, standing=standing,
            before_load=self.strategy.drop_pending, after_load=self._loaded,
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

    def _state_now(self) -> tuple[int, str, dict[str, torch.Tensor]]:
        return self.step, self.state_hash, state_tensors(self.synced.model, self.synced.optimizer)

    async def _find_state(self, wanted: str) -> EncodedState | None:
        """The state of hash ``wanted`` for a download: the current one, or one a sender check kept."""
        current = await self.synced.encoded()
        if current.state_hash == wanted:
            return current
        return await asyncio.to_thread(self.sender_checks.find, wanted)

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
        return self.policy.avoided(limit)

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
            "bytes_sent": float(self.averager.traffic.sent + self.tiers.averager.traffic.sent),
            "bytes_received": float(self.averager.traffic.received + self.tiers.averager.traffic.received),
            "step": float(self.step),
            "samples": float(self.samples),
            "samples_per_s": self._sps,
            "compute_utilization": self._stats["compute_s"] / wall,
            "contributed_samples": float(self.contributed_samples),
            "senders_checked": float(self.sender_checks.checked),  # replayed contributions (sendercheck)
            "senders_caught": float(self.sender_checks.caught),
            "senders_outliers": float(self.sender_checks.outliers),  # of those, replayed for standing out
            "senders_fit_scored": float(self.sender_checks.fits),  # fits to a micro-batch of theirs scored
            "sender_fit_s": self.sender_checks.fit_s,  # the time those took
            "sender_replay_s": self.sender_checks.replay_s,  # the time the replays took
            "last_round_peers": float(self.last_group_size),
            "paused": float(self.paused),
            "peak_memory_bytes": float(peak_memory_bytes(self.device)),
        }

    def note_train_loss(self, loss: float) -> None:
        """A micro-batch's training loss, for the metrics' running average."""
        previous = self._stats["train_loss"]
        self._stats["train_loss"] = loss if math.isnan(previous) else 0.9 * previous + 0.1 * loss

    # --- taking micro-batches ------------------------------------------------------------------------

    def absorb(self, batch: int, elapsed_s: float, *, mean: bool = False) -> None:
        """Take a micro-batch of ``batch`` samples whose gradient is in the parameters' ``.grad``, computed
        in ``elapsed_s``: the built-in loop's (of the summed loss), or with ``mean`` one that the caller's
        loop computed (of the mean loss). What it does with it is the strategy's (accumulate, or an inner step)."""
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
        if self.validate_fn is None:
            return float("nan")
        model = self.synced_model  # what every peer holds, whatever local steps this one took since
        was_training = model.training  # the caller's loop may train this very model: give it back as it was
        model.eval()
        try:
            with torch.no_grad():
                return float(self.validate_fn(model))
        finally:
            model.train(was_training)

    async def evaluate(self) -> None:
        """Take the validation loss of the state held now (the metrics' ``val_loss``)."""
        started = time.monotonic()
        self._stats["val_loss"] = await asyncio.to_thread(self._validate)
        if self._first_compute is not None and self._finished_at is None:  # inside the training window
            self._stats["eval_s"] += time.monotonic() - started
        self._stats["val_step"] = float(self.step)
        if self.first_validation is None:
            self.first_validation = (self.step, self._stats["val_loss"])
        logger.info(f"step {self.step}: validation loss {self._stats['val_loss']:.4f}")

    # --- progress and rounds -------------------------------------------------------------------------

    def _progress(self) -> PeerProgress:
        claimed = self.hooks.claim(self.samples)
        return PeerProgress(self.peer_id, self.step, claimed, self._sps, self.state_hash, time.time())

    async def exchange_progress(self) -> None:
        """Publish this peer's signed progress record and read the verified records of the others."""
        # A paused peer must not look like a groupmate the others wait for.
        await self.progress_view.exchange(None if self.paused else self._progress())
        await self._refresh_bans()

    async def publish_forever(self) -> None:
        """Exchange progress records every ``progress_interval_s`` until cancelled."""
        await self.progress_view.run(lambda: None if self.paused else self._progress(), self._refresh_bans)

    async def _refresh_bans(self) -> None:
        """Take the coordinator's newest signed ban list; the averager refuses those peers from then on."""
        await self.policy.refresh_bans()

    def _others_at_step(self) -> list[int]:
        """The samples the other peers at this step claim, by their signed progress records; in
        ``every_step``, only as far as this peer's last round showed their work (``readiness``)."""
        claims = {
            p.peer_id: p.samples
            for p in self.view.values()
            if p.step == self.step and p.peer_id != self.peer_id
        }
        if self.config.training.sync != "every_step":
            return list(claims.values())
        return counted_claims(claims, own=self.samples, shown=self.shown, step=self.step)

    def ready_for_round(self) -> bool:
        """Whether this peer's round is due, by the strategy (with every_step: the peers at this step hold
        the target batch, by a view fetched after this step began)."""
        fresh_view = self.progress_view.count > self._step_view
        return self.strategy.ready(self.samples, self._others_at_step(), fresh_view=fresh_view)

    async def take_round(self) -> None:
        """Average what this peer holds now: at once, or (diloco's ``outer_overlap``) in the background."""
        self.catchup.round_tried()
        await self.strategy.schedule(self._round, self._close_window, self.reached_max)

    async def _round(self) -> None:
        # Alone only if nobody else is training: peers at another step will soon be at this one.
        others = [p for p in self.view.values() if p.peer_id != self.peer_id]
        # The organizer's robustness floor: bans never lower it, or each banned Sybil would.
        needed = self.config.training.min_group_size
        if needed > 1 and len(others) + 1 < needed:
            return  # not enough peers in the run yet: keep the accumulated gradient and wait
        # What this peer sends and signs for: its own gradient and samples, but in a rehearsed attack.
        vector = await asyncio.to_thread(lambda: self.hooks.contribute(self, self._own_contribution()))
        weight = self.hooks.weight(self.strategy.weight(self.samples))
        extra = self.hooks.entry(self._round_extra())
        # Everyone training at this step is about to look for a group too: assemble once all have joined
        # (never fewer than the run needs; a peer that left only makes the leader wait out its window).
        # A suspect is refused in matchmaking: waiting for it only holds the group until the window ends.
        # So is every member of the round that brought this peer here, though the view may still show it a
        # step behind (its record of this step not read yet): assembling without it left one peer of three
        # out of every round of a fast run.
        arriving = self.groupmates.arriving(self.step)
        at_step = [
            p
            for p in others
            if (p.step == self.step or (p.step == self.step - 1 and p.peer_id in arriving))
            and self.policy.refusal(p.peer_id) is None
        ]
        held_steps = {p.step for p in others}  # a groupmate claiming one of these is ahead, not lying
        expected = max(needed, 1 + len(at_step))
        started = time.monotonic()
        same_state = self.sender_checks.enabled  # its validators replay senders on their own state
        fits = lambda entry, _signer: step_misfit(entry.extra, extra, held_steps, state=same_state)  # noqa: E731 - both tiers check it
        outcome = await self.averager.average(
            vector,
            weight,
            extra,
            alone=not others and needed == 1,
            expected_size=expected,
            out=self._averaged,
            fits=fits,
            failed_tries=self._searches.failed(self.step),
        )
        # Matchmaking plus all-reduce: what a slow link costs this peer (docs/wan.md reads it).
        self._stats["last_round_s"] = time.monotonic() - started
        self._stats["averaging_s"] += self._stats["last_round_s"]
        # A group too small for the run counts as none: under load a leader assembles whoever joined by the
        # end of its window, and resetting the count there kept the window from ever widening past double.
        self._searches.record(self.step, formed=outcome is not None and len(outcome[0].peer_ids) >= needed)
        if outcome is None:
            if await self._adopt(extra):
                return
            self._stats["rounds_failed"] += 1
            self._journal("no_group")
            logger.info(f"step {self.step}: no averaging group formed; accumulating further")
            return
        group, result = outcome
        if len(group.peer_ids) < needed:
            self._stats["rounds_failed"] += 1
            self._journal("too_small", group)
            logger.info(f"step {self.step}: a group of {len(group.peer_ids)} formed; the run needs {needed}")
            return
        strangers = [str(p) for p, e in zip(group.peer_ids, group.extras, strict=True) if e != extra]
        if not self._group_usable(group):
            self._stats["rounds_failed"] += 1
            self._journal("other_step", group)
            return
        if not result.complete:
            self._stats["rounds_failed"] += 1
            self._journal("incomplete", group)
            logger.warning(
                f"step {self.step}: round incomplete ({len(result.dropped)} peers failed); retrying"
            )
            return
        # Peers whose records show this step or the one before (a record lags its peer by up to an interval),
        # suspects, banned peers and those this group excluded (their signed entries claimed otherwise) left
        # out: what the step's groups may hold.
        step = self.step

        def kept(p) -> bool:
            return self.policy.refusal(p.peer_id) is None and p.peer_id not in group.excluded

        coming = 1 + sum(1 for p in others if step - 1 <= p.step <= step and kept(p))

        def here() -> set[str]:  # read again at each join: records keep arriving while the tier searches
            return {
                p.peer_id
                for p in self.view.values()
                if p.step == step and p.peer_id != self.peer_id and kept(p)
            }

        await self.policy.refresh_members()  # at most once per refresh interval
        result = await self.tiers.combine(
            group, result, me=self.peer_id, extra=extra, fits=fits, peers_at_step=coming,
            run_peers=max(coming, self.policy.member_count()), here=here, showing=self._showing,
            behind=lambda: {p.peer_id for p in self.view.values() if p.step == step - 1 and kept(p)},
            ahead=None if getattr(self.strategy, "overlap", False) else self._ahead,
        )  # fmt: skip
        if result is None:  # its group's representative gave nothing to apply (see tiered)
            if await self._adopt(extra):
                return
            self._stats["rounds_failed"] += 1
            self._journal("no_tier", group)
            return
        if strangers:
            logger.warning(
                f"step {self.step}: {len(strangers)} groupmates held another state; the majority check follows"
            )
        contributed = int(self.strategy.weight(self.samples))
        before = Position(self.step, self.state_hash)
        async with self.synced.lock:
            with self.computing():
                await asyncio.to_thread(self._apply_round, result)
            await self._commit(self.step + 1)
        self._journal(
            "applied", group, step=self.step - 1, state_hash=self.state_hash, samples=math.fsum(group.weights)
        )
        self.contributed_samples += contributed
        members = [str(p) for p in group.peer_ids]
        mates = [p for p in members if p != self.peer_id]
        self.groupmates.record(mates, self.step, moved=(before, Position(self.step, self.state_hash)))
        self.shown = ShownWork.of_round(
            step=self.step, members=members, weights=group.weights, me=self.peer_id,
            target=self.config.training.target_batch_size, dropped=result.dropped, groups=result.tier_groups,
            group_id=group.group_id,
        )  # fmt: skip
        self.witness.record(group)
        self.last_group_size = len(group.peer_ids)
        self._step_view = self.progress_view.count
        self._stats["rounds_ok"] += 1
        loss = self._stats["train_loss"]
        logger.info(
            f"step {self.step}: averaged with {len(group.peer_ids)} peers, {sum(group.weights):.0f} samples"
            + ("" if math.isnan(loss) else f", loss {loss:.4f}")
        )
        await self._validate_if_due()

    async def _validate_if_due(self) -> None:
        """Validate at every ``validation_every_steps`` and at the run's last step, however the step came
        (a round, or an adopted result: a run whose last step was adopted waited for its final loss)."""
        if self.step % self.config.training.validation_every_steps == 0 or self.reached_max():
            await self.evaluate()

    def _ahead(self) -> list[str]:
        """The peers (not refused) whose records show the next step, in the order this peer asks them for the
        step's combined result (``adopt_order``): they applied it, without this peer when it is still here."""
        return adopt_order(
            self.peer_id,
            (
                p.peer_id
                for p in self.view.values()
                if p.step == self.step + 1 and self.policy.refusal(p.peer_id) is None
            ),
        )

    def _showing(self) -> set[str]:
        """This peer and those (not refused) whose records show its step or a later one: a round ahead that it
        adopts must hold at least half of them (``SecondTier.adopt``)."""
        others = (
            p.peer_id
            for p in self.view.values()
            if p.step >= self.step and self.policy.refusal(p.peer_id) is None
        )
        return {self.peer_id, *others}

    async def _adopt(self, extra: dict) -> bool:
        """Apply the combined result that peers a step ahead applied at this step, when the others moved on
        without this peer (``SecondTier.adopt``): one checked vector instead of a state download. Its own
        gradient was in no round, so it earns no credit and is dropped."""
        if getattr(self.strategy, "overlap", False):  # a background round owns the window: catch-up's
            return False
        ahead = self._ahead()
        adopted = await self.tiers.adopt(extra, ahead, showing=self._showing()) if ahead else None
        if adopted is None:
            return False
        async with self.synced.lock:
            with self.computing():
                await asyncio.to_thread(self._apply_round, adopted)
            self._reset_accumulation()
            await self._commit(self.step + 1)
        self.shown = None  # it was in none of the round's groups: claims count as made (``readiness``)
        self._journal("adopted", step=self.step - 1, state_hash=self.state_hash)
        self._step_view = self.progress_view.count
        logger.info(f"step {self.step}: adopted the combined result the peers ahead applied")
        await self._validate_if_due()
        return True

    def _journal(self, outcome: str, group=None, *, step: int | None = None, **fields: object) -> None:
        """The round journal's line for the round just tried at ``step`` (default: this peer's step)."""
        journal.record(
            "round", self.step if step is None else step, outcome=outcome,
            group=group.group_id.hex()[:16] if group is not None else "",
            size=len(group.peer_ids) if group is not None else 0,
            form_s=round(self.averager.last_form_s, 3), round_s=round(self._stats["last_round_s"], 3),
            sent=self.averager.traffic.sent + self.tiers.averager.traffic.sent,
            received=self.averager.traffic.received + self.tiers.averager.traffic.received, **fields,
        )  # fmt: skip

    def _own_contribution(self) -> torch.Tensor:
        """This peer's honest contribution to the step's round; FloatingPointError if it is not finite (the
        model has diverged, as fp16's loss scaling reports): an honest peer never signs an input the run's
        codecs refuse, so one that does is provably lying (``WrongContributionEvidence.undecodable``)."""
        vector = self.strategy.contribution(self.samples)
        if not bool(torch.isfinite(vector).all()):
            raise FloatingPointError(
                f"step {self.step}: this peer's own contribution is not finite: the model has diverged"
            )
        return vector

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

    def reached_max(self) -> bool:
        """Whether this peer holds the run's ``max_steps``."""
        return self.config.training.max_steps is not None and self.step >= self.config.training.max_steps

    # --- starting, pausing, finishing ----------------------------------------------------------------

    async def start(self) -> None:
        """Join the run's averaging and start serving this peer's state."""
        await self.averager.start()
        await self.tiers.start()
        servicer = StateServicer(
            self.config.run_id,
            self.synced.encoded,
            admit=self.catchup.admit_download,
            upload_limiter=self.upload_limiter,
            find=self._find_state,
        )
        await servicer.add_p2p_handlers(self.averager.p2p, namespace=state_namespace(self.config.run_id))
        await self._commit(self.step)

    async def enter(self, stop: asyncio.Event) -> None:
        """Take a first view of the run, move to the state it holds (the peers', or the coordinator's
        checkpoint), and take its validation loss: what every loop does before its first micro-batch."""
        await asyncio.sleep(2 * self.config.training.progress_interval_s)
        await self.catchup.catch_up()
        await self.catchup.look_for_checkpoint(stop)
        if self.validate_fn is not None:
            await self.evaluate()  # where this peer starts: step 0, or the state it just caught up to

    async def finish(self) -> None:
        """Report this peer finished: let a background round end, take the last step's validation loss,
        and keep the final state encoded for the peers that download it."""
        await self.strategy.finish_rounds(self.reached_max())
        if self.validate_fn is not None and self.reached_max() and self._stats["val_step"] != self.step:
            await self.evaluate()  # the last step's loss, whichever path reached it (round or download)
        self.finished = True
        self._finished_at = self._finished_at or time.monotonic()
        await self.synced.encoded()

    async def shutdown(self) -> None:
        """Leave the run's averaging (both tiers)."""
        self.sender_checks.close()
        await self.tiers.shutdown()
        await self.averager.shutdown()

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
        self.paused = False  # the next micro-batch and round go ahead
        # A paused peer publishes no record, nor do the peers resumed with it: its first round waits for a
        # view read after theirs are back (two exchanges on), or it would count too few peers at its step.
        self._step_view = self.progress_view.count + 1


__all__ = ["TrainingPeer", "Validate"]
