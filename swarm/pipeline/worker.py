"""A peer that hosts a pipeline stage: serve it, step with the stage's other replicas, catch up, move.

The loop of one stage replica:

1. Announce itself in the DHT (stage, step, measured throughput, load, state and parameter hashes).
2. Serve forward and backward calls from trainers (``StageServicer``).
3. When the trainers together completed the target batch at this step and have nothing left in flight,
   close the step: average the accumulated gradient with the stage's other replicas through the
   project's all-reduce (one averager per stage, prefix ``<run_id>.stage<k>``) and apply the optimizer,
   so that every replica of the stage holds bit-identical parameters.
4. A replica that finds the others of its stage ahead of it, or holding another state than most of them
   at its step, downloads the agreed state (verified against its hash) before serving again.
5. Every ``rebalance_interval_s`` a replica of the stage with the most spare throughput may move to the
   bottleneck stage (or ``move_to`` asks it to). A move is a drain, a clean leave and a join:

   - drain: the replica announces that it no longer serves (trainers stop routing to it), refuses new
     micro-batches, answers the backwards of forwards it already ran, and adds what it counted to its
     stage's round; it leaves once it holds nothing of the current step (or, past ``leave_timeout_s``,
     abandons what it holds, with one log line naming the samples);
   - leave: it removes every P2P handler it registered for the stage (forward/backward, state download,
     averaging) and shuts the stage's averager, so it is in no group of that stage any more;
   - join: it builds the new stage, announces itself there as not yet serving, downloads the stage's
     agreed state (verified against its hash), and only then registers its handlers and serves.

   Joining, leaving and moving are in ``swarm.pipeline.moves`` (``StageMoves``, a base of this class).

Example::

    worker = StageWorker(run, dht, peer_id=key.peer_id, stage=None)   # None: the stage most short of throughput
    await worker.run(stop_event)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time

import hivemind
import torch
from hivemind.p2p import ServicerBase

from protocols.errors import ConfigError
from protocols.keys import PublicKey, SigningKey
from swarm.averaging.averager import Averager
from swarm.averaging.policy import PeerPolicy
from swarm.averaging.verification import Accuser
from swarm.config import RunConfig
from swarm.pipeline.gate import PeerGate
from swarm.pipeline.history import StateHistory
from swarm.pipeline.hooks import PipelineHooks
from swarm.pipeline.layout import available_memory_bytes as available_memory_bytes  # the volunteer's import
from swarm.pipeline.moves import StageMoves
from swarm.pipeline.records import PipelineView, StageRecord, fetch_view, publish_record
from swarm.pipeline.replica import StageReplica
from swarm.pipeline.server import StageServicer
from swarm.ratelimit import RateLimiter
from swarm.records import RecordSigner, RecordTrust
from swarm.training.progress import step_misfit
from swarm.training.sync import EncodedState

logger = logging.getLogger(__name__)


def counted_by_majority(weights: list[float]) -> bool:
    """Whether the members that counted samples (positive weight) are no minority of a stage's group.

    The robust rule leaves weight-0 senders out whenever another sender has a positive weight, so a
    round whose counted members are a minority would apply what that minority sent, however many
    honest replicas stood by with nothing counted."""
    return 2 * sum(1 for w in weights if w > 0) >= len(weights)


class StageWorker(StageMoves):
    """A peer that hosts one pipeline stage: serve trainers, step with the stage's replicas, catch up, move.

    Args:
        run: the run's config; ``run.pipeline`` says how the model splits into stages.
        dht: the running DHT this peer is a member of.
        peer_id: this peer's ID (base58).
        stage: the stage to host; None: the one most short of throughput that fits in memory.
        device: where the stage computes.
        coordinator_key: the coordinator's key; when set, only peers it certified may call or average.
        members: a fixed set of peer IDs allowed to take part (tests without a coordinator).
        memory_bytes: the memory this peer may use; stages that do not fit are never taken.
        rebalance: whether this replica may move to the bottleneck stage.
        signing_key: the key of ``peer_id``; required in a coordinated run (rounds are signed).
        upload_limiter: the peer's shared upload token bucket.
        accuse: sends evidence of a cheating reducer to the coordinator.
        record_signer: signs this replica's pipeline records with its certificate.
        hooks: what the replica announces and answers (``swarm.pipeline.hooks``); None: honestly.
    """

    #: The handlers of the stage served (tests subclass it to delay or refuse calls).
    servicer_type: type[StageServicer] = StageServicer

    def __init__(
        self,
        run: RunConfig,
        dht: hivemind.DHT,
        *,
        peer_id: str,
        stage: int | None = None,
        device: str = "cpu",
        coordinator_key: PublicKey | None = None,
        members: set[str] | None = None,
        memory_bytes: int | None = None,
        rebalance: bool = True,
        signing_key: SigningKey | None = None,
        upload_limiter: RateLimiter | None = None,
        accuse: Accuser | None = None,
        record_signer: RecordSigner | None = None,
        hooks: PipelineHooks | None = None,
    ):
        if coordinator_key is not None and signing_key is None:
            raise ConfigError("a stage worker in a coordinated run signs its rounds: pass signing_key")
        self.config, self.dht, self.peer_id, self.device = run, dht, peer_id, device
        self.coordinator_key = coordinator_key
        self.wanted_stage, self.memory_bytes, self.rebalance = stage, memory_bytes, rebalance
        self.signing_key, self.upload_limiter, self.accuse = signing_key, upload_limiter, accuse
        self.hooks = hooks if hooks is not None else PipelineHooks()
        # Signs this replica's pipeline records; in a coordinated run it carries the peer's certificate.
        self.records = record_signer or (RecordSigner(signing_key) if signing_key is not None else None)
        self.num_stages = run.pipeline.stages
        # One view of who is certified and banned, for the stage's averaging and for its server alike.
        self.policy = PeerPolicy(dht, run.run_id, coordinator_key, allowed=members)
        self.trust = RecordTrust(run.run_id, coordinator_key, is_banned=lambda p: p in self.policy.banned)
        self.gate = PeerGate(
            dht, run.run_id, coordinator_key, policy=self.policy,
            ban_after_bad_requests=run.pipeline.ban_after_bad_requests,
        )  # fmt: skip
        self.replica: StageReplica | None = None
        self.averager: Averager | None = None
        self.view = PipelineView()
        self._views = 0
        self._step_view = 0
        self.states = StateHistory(run.run_id, run.pipeline.kept_states)
        self._busy_mark = (time.monotonic(), 0.0)
        self._load = 0.0
        self.moves: list[dict] = []
        # stage -> step -> samples the stage's round averaged, for the rounds this peer took part in
        self.applied: dict[int, dict[int, float]] = {}
        self._serving = False  # announced as serving: handlers registered, state in line with the stage
        self._behind_since: float | None = None  # since when another stage is past this replica's step
        self._held_since: float | None = None  # since when only in-flight claims hold a done step
        self._joining_at: int | None = None  # joined the stage at this step; serves from the next one
        self._leave_to: int | None = None  # the stage a requested move goes to
        self._leave_since = 0.0
        self._leave_throughput: dict[int, float] = {}  # samples/s by stage when rebalancing chose the move
        # The other members of its last completed round in the stage it serves (rebalancing counts them).
        self._round_mates: set[str] = set()
        # The replicas whose state this one holds, the anchors of its catch-up when stalled: its round
        # mates, the replica that served its last download (with the anchors that held that state too),
        # or the stage's servers when it joined; never those of a stage it left.
        self._anchors: set[str] = set()
        self._handlers: list[tuple[ServicerBase, str]] = []  # registered for the stage served
        self._last_record: StageRecord | None = None
        self._stats = {
            "rounds_ok": 0.0,
            "rounds_failed": 0.0,
            "resyncs": 0.0,
            "moves": 0.0,
            "averaging_s": 0.0,
            "settle_s": 0.0,
        }
        self.finished = False
        self.paused = False
        # When this replica changed step or began its step's rounds: the catch-up rule's stall clock,
        # which the time trainers take to bring the batch must not start.
        self._step_since = time.monotonic()

    def pause(self) -> None:
        """Refuse new micro-batches (trainers go to other replicas); keep averaging to stay in sync."""
        self.paused = True
        if self.replica is not None:
            self.replica.paused = True

    def resume(self) -> None:
        self.paused = False
        if self.replica is not None:
            self.replica.paused = False

    # --- what the volunteer reports ------------------------------------------------------------------

    @property
    def stage(self) -> int:
        return self.replica.index if self.replica else -1

    @property
    def step(self) -> int:
        return self.replica.step if self.replica else 0

    @property
    def param_hash(self) -> str:
        # Stages hold different parameters at one step: reported to the coordinator they would look
        # divergent, so the per-stage hash is announced in the pipeline's DHT records instead.
        return ""

    def witnessed(self) -> list[list[bytes]]:
        """No data-parallel rounds here: pipeline roles are credited by what they report (bounded)."""
        return []

    def suspected(self, limit: int) -> list[str]:
        """The peers this one avoids now for breaking its rounds, for the coordinator (at most ``limit``)."""
        return self.policy.avoided(limit)

    def metrics(self) -> dict[str, float]:
        r = self.replica
        extra = {} if r is None else {
            "stage": float(r.index), "samples_per_s": r.samples_per_s, "load": self._load,
            "microbatches_served": float(r.stats["backwards"] + (r.stats["forwards"] if r.is_last else 0)),
            "requests_refused": float(r.stats["refused"]),
        }  # fmt: skip
        return {**self._stats, **extra}

    # --- DHT -----------------------------------------------------------------------------------------

    def _record(self) -> StageRecord:
        r = self.replica
        now = time.monotonic()
        started, busy = self._busy_mark
        if now - started >= 1.0:
            self._load = min(1.0, max(0.0, (r.busy_s - busy) / (now - started)))
            self._busy_mark = (now, r.busy_s)
        self._last_record = StageRecord(self.peer_id, r.index, r.hashed_step, r.samples_per_s, self._load, r.state_hash,
                                        r.param_hash, time.time(), serving=self._serving,
                                        joining=self._sitting_out(), closing=r.closing,
                                        retried=tuple(r.retried()))  # fmt: skip
        if self.hooks.hears_microbatches:  # a rehearsed liar claims what the trainers issue
            training = self.config.training
            per_trainer = -(-training.target_batch_size // training.micro_batch_size)
            self.hooks.heard(self.view.public_microbatches(self.config.run_id, r.step, per_trainer))
        self._last_record = self.hooks.announce(self._last_record)  # a rehearsed liar's rewrite
        return self._last_record

    def _signer(self) -> RecordSigner:
        if self.records is None:
            raise ConfigError("a stage worker signs its pipeline records: pass signing_key or record_signer")
        return self.records

    def _ttl_s(self) -> float:
        return max(3.0, 6 * self.config.pipeline.announce_interval_s)

    async def _refresh_view(self) -> None:
        self.view = await fetch_view(self.dht, self.trust, self.num_stages)
        self._views += 1

    async def _announce(self) -> None:
        if self.replica is not None and self.replica.state_hash:
            await publish_record(
                self.dht, self._signer(), self.config.run_id, self._record(), ttl_s=self._ttl_s()
            )

    async def _announce_forever(self) -> None:
        while True:
            try:
                await self._announce()
                await self._refresh_view()
                await self.policy.refresh_bans()
            except Exception as e:
                logger.debug(f"pipeline announce failed: {e!r}")
            await asyncio.sleep(self.config.pipeline.announce_interval_s)

    async def encoded_state(self) -> EncodedState | None:
        return await self.states.current(self.replica)

    async def state_of(self, state_hash: str) -> EncodedState | None:
        """The state of ``state_hash``: the current one or one kept from the last steps."""
        return await self.states.find(self.replica, state_hash)

    # --- catching up ---------------------------------------------------------------------------------

    async def _admit_download(self, requester: str) -> str | None:
        """A stage's state goes to certified, unbanned peers only: a replica with a verified pipeline
        record (it carries a certificate), or a peer the stage server's policy admits."""
        if self.coordinator_key is not None and requester == self.coordinator_key.peer_id:
            return None  # the coordinator checkpoints the stage
        replicas = {r.peer_id for rs in self.view.holders.values() for r in rs}
        if requester in replicas and requester not in self.policy.banned:
            return None
        await self.policy.admit([requester])
        return self.policy.refusal(requester)

    # --- closing a step ------------------------------------------------------------------------------

    def _reached_max(self) -> bool:
        max_steps = self.config.training.max_steps
        return max_steps is not None and self.replica.step >= max_steps

    def _ready_to_step(self) -> bool:
        r = self.replica
        if self._views <= self._step_view or self._reached_max():
            return False
        trainers = [t for t in self.view.trainers if t.step == r.step]
        done = sum(t.samples for t in trainers)
        if self._left_behind():
            logger.warning(f"stage {r.index}: another stage has been past step {r.step} for a stall; closing it "
                           f"with the {r.samples} samples counted here")  # fmt: skip
            return True
        if not trainers or done < self.config.training.target_batch_size:
            self._held_since = None
            return False
        # Any peer may publish a trainer record: an in-flight claim holds the step only for a trainer whose
        # micro-batches this replica served at this step, and for one request's timeout at most.
        holding = [t.peer_id for t in trainers if t.in_flight and t.peer_id in r.served]
        if not holding:
            return True
        now = time.monotonic()
        if self._held_since is None:
            self._held_since = now
        if now - self._held_since <= self.config.pipeline.request_timeout_s:
            return False
        logger.info(f"stage {r.index}: step {r.step} held by in-flight claims of {len(holding)} trainers for "
                    f"{now - self._held_since:.1f}s; closing it")  # fmt: skip
        return True

    def _left_behind(self) -> bool:
        """Every server of another stage is past this step, and has been for longer than a round may take:
        the trainers' micro-batches of this step can no longer complete, so waiting for them never ends."""
        r, training = self.replica, self.config.training
        ahead = any(
            self.view.replicas(k) and min(x.step for x in self.view.replicas(k)) > r.step
            for k in range(self.num_stages)
            if k != r.index
        )
        if not ahead:
            self._behind_since = None
            return False
        if self._behind_since is None:
            self._behind_since = time.monotonic()
        return time.monotonic() - self._behind_since > training.round_s

    async def _await_backwards(self) -> None:
        """Let the micro-batches run forward here come back for their backward (bounded by one request's
        timeout): a trainer's record may lag its last micro-batch, which the later stages count at
        this step, so closing without it would apply their share of it without this stage's. A step an
        in-flight claim already held shares that claim's deadline: a trainer that sends one forward a
        step and never its backward delays each step by one timeout, not two."""
        r = self.replica
        start = self._held_since if self._held_since is not None else time.monotonic()
        deadline = start + self.config.pipeline.request_timeout_s
        while await r.compute(r.awaiting_backward) and time.monotonic() < deadline:
            await asyncio.sleep(self.config.pipeline.announce_interval_s / 4)

    async def _settle_duplicates(self) -> None:
        """Exactly once per micro-batch: wait (bounded) until the stage's other replicas at this step have
        closed it too, then drop what a later attempt counted elsewhere (``StageReplica.drop_superseded``)."""
        r, interval = self.replica, self.config.pipeline.announce_interval_s
        with contextlib.suppress(Exception):
            await self._announce()  # closing, with this replica's final claims
        deadline = time.monotonic() + max(1.0, 4 * interval)
        while True:
            others = [x for x in self.view.averaging(r.index, r.step) if x.peer_id != self.peer_id]
            if all(x.closing or x.step > r.step for x in others) or time.monotonic() > deadline:
                break
            await asyncio.sleep(interval / 2)
            await self._refresh_view()
        claims = [c for x in others if x.step == r.step for c in x.retried]
        latest = await r.compute(r.superseding, claims) if claims else {}
        dropped = await r.compute(r.drop_superseded, latest) if latest else 0
        if dropped:
            self._stats["samples_dropped"] = self._stats.get("samples_dropped", 0.0) + dropped
            logger.info(f"stage {r.index} step {r.step}: {dropped} samples counted here were retried on another "
                        "replica after a timeout; dropped here so that each counts once")  # fmt: skip

    async def _step_round(self) -> None:
        r = self.replica
        if not r.closing:
            self._step_since = time.monotonic()  # the step's first round: stalled counts from here
        r.closing = True  # new work for this step is refused from now on
        started = time.monotonic()
        await self._await_backwards()
        await self._settle_duplicates()
        self._stats["settle_s"] += time.monotonic() - started
        started = time.monotonic()
        vector = await r.compute(r.mean_gradient)
        for trainer in r.outliers:
            logger.warning(f"stage {r.index} step {r.step}: trainer {trainer}'s mean gradient lies far from "
                           "the other trainers'; suspected")  # fmt: skip
            self.policy.suspect(trainer, f"its gradient at stage {r.index} step {r.step} is an outlier")
        others = [x for x in self.view.averaging(r.index, r.step) if x.peer_id != self.peer_id]
        extra = {"step": r.step, "state_hash": r.state_hash}
        # Only replicas at this step average: one a step behind (its round failed, the others stepped on)
        # averaged with one a step ahead, and both applied a gradient to states nobody else held.
        held = {x.step for x in self.view.members(r.index)}
        outcome = await self.averager.average(
            vector, float(r.samples), extra, alone=not others,
            fits=lambda entry, _signer: step_misfit(entry.extra, extra, held),
        )  # fmt: skip
        self._stats["averaging_s"] += time.monotonic() - started
        if outcome is None or not outcome[1].complete:
            self._stats["rounds_failed"] += 1
            logger.info(f"stage {r.index} step {r.step}: averaging did not complete; trying again")
            return
        group, result = outcome
        if r.step != extra["step"]:
            return  # a catch-up replaced the state meanwhile
        if any(not isinstance(e, dict) or e.get("step") != r.step for e in group.extras):
            self._stats["rounds_failed"] += 1
            logger.info(
                f"stage {r.index} step {r.step}: a replica in the group was at another step; not applied"
            )
            return
        averaged, samples = result.vector, sum(group.weights)
        if not counted_by_majority(group.weights):
            # Every member sees the same signed weights, so all step alike: with no gradient, as a round
            # where nobody counted anything does, and the minority's vector is never applied.
            counted = [p.to_base58() for p, w in zip(group.peer_ids, group.weights, strict=True) if w > 0]
            logger.warning(f"stage {r.index} step {r.step}: only {len(counted)} of {len(group.peer_ids)} "
                           f"replicas counted samples ({', '.join(counted)}); a minority's gradient is not "
                           "applied: stepping with none")  # fmt: skip
            averaged, samples = torch.zeros_like(result.vector), 0.0
            self._stats["rounds_refused"] = self._stats.get("rounds_refused", 0.0) + 1
        await r.compute(self.states.advance, r, averaged)  # keeps the state: its replies may be judged later
        self._step_view, self._step_since, self._held_since = self._views, time.monotonic(), None
        self._stats["rounds_ok"] += 1
        self.applied.setdefault(r.index, {})[extra["step"]] = samples
        self._round_mates = self._anchors = {p.to_base58() for p in group.peer_ids} - {self.peer_id}
        logger.info(f"stage {r.index}: step {r.step} with {len(group.peer_ids)} replicas, "
                    f"{samples:.0f} samples (params {r.param_hash[:12]})")  # fmt: skip
        with contextlib.suppress(Exception):
            await publish_record(
                self.dht, self._signer(), self.config.run_id, self._record(), ttl_s=self._ttl_s()
            )

    # --- the loop ------------------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Serve a stage until ``stop`` is set."""
        self._signer()  # fail at once, not in the announce loop
        announcer = asyncio.create_task(self._announce_forever())
        try:
            await self._serve(await self._pick_stage())
            next_rebalance = time.monotonic() + self.config.pipeline.rebalance_interval_s
            interval = self.config.pipeline.announce_interval_s
            while not stop.is_set():
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=interval / 2)
                if stop.is_set():
                    break
                if await self._catch_up():
                    continue
                self.finished = self._reached_max()
                if self._joining_at is not None:
                    await self._continue_joining()
                # Once a step is closed its round is retried until it completes or a catch-up replaces it.
                elif self.replica.closing or self._ready_to_step():
                    await self._step_round()
                elif self._leave_to is not None:
                    await self._continue_leaving()
                elif self.rebalance and not self.finished and time.monotonic() > next_rebalance:
                    # A finished run stays put: a move at the last step leaves the mover's stage short and
                    # sends the mover through a catch-up that no round follows.
                    next_rebalance = time.monotonic() + self.config.pipeline.rebalance_interval_s
                    await self._maybe_move()
        finally:
            announcer.cancel()
            await self._unserve()

    @property
    def samples_per_s(self) -> float:
        return self.replica.samples_per_s if self.replica else math.nan
