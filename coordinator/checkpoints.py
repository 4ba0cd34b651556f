"""The coordinator's checkpoints: it fetches the state the peers agree on and keeps it on disk.

Every ``checkpoint_every_steps`` (and at ``max_steps``) the keeper downloads the full state from peers
that hold the agreed hash (by the same rule peers follow, ``swarm.training.catchup``: a strict majority
of the certified, unbanned peers with a signed progress record), verifies it, and saves a safetensors
checkpoint under the data dir. It serves
the latest checkpoint to peers and announces it in the DHT with a record signed by the coordinator key,
so a swarm restarted from nothing resumes at the checkpoint's step. No gradient passes through here.
At start it refuses a run config the newest checkpoint no longer fits (``check_resumable``, naming the
changed fields); once it holds a checkpoint at ``max_steps`` the run has finished (``finished_step``).

A run split into pipeline stages is checkpointed stage by stage: when every stage's replicas agree on
a state at one step (the same rule, among the replicas with a signed pipeline record), the keeper
downloads each stage's state from its replicas, verifies it against its hash, and saves it under
``checkpoints/stage<k>/``; each stage's checkpoint is announced under the stage's own signed record
(``<run_id>.stage<k>``) and served under the stage's state namespace, where a restarted stage replica
finds it. Every view of the stage records it reads also feeds ``recent`` (``RecentStageStates``), which
fetches a stage's state at a recent step to judge stage evidence.
"""

from __future__ import annotations

import swarm.hivemind_import  # noqa: F401  # isort: skip  (first hivemind import: see its docstring)

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable
from pathlib import Path

import hivemind
from hivemind.p2p import PeerID

from coordinator.stagestates import RecentStageStates
from coordinator.standing import Standing
from coordinator.store import PeerRecord
from protocols.errors import ConfigError
from protocols.keys import SigningKey
from swarm.bans import fetch_ban_list
from swarm.config import RunConfig
from swarm.pipeline.layout import stage_bytes
from swarm.pipeline.records import PipelineView, fetch_view
from swarm.records import RecordTrust, stage_prefix
from swarm.training.catchup import Position, catch_up_target
from swarm.training.checkpoint import (
    Checkpoint,
    list_checkpoints,
    load_checkpoint,
    load_latest_checkpoint,
    save_checkpoint,
)
from swarm.training.progress import PeerProgress, fetch_progress
from swarm.training.state import (
    DecodedState,
    build_shared_optimizer,
    encode_state,
    ensure_optimizer_state,
    state_tensors,
)
from swarm.training.sync import (
    NOT_SEEN_YET,
    EncodedState,
    StateServicer,
    download_limit,
    download_state,
    from_any_holder,
    publish_checkpoint_record,
    state_namespace,
)

logger = logging.getLogger(__name__)

CHECK_INTERVAL_S = 2.0
RECORD_TTL_S = 60.0
# How long a peer may heartbeat without its signed progress reaching the coordinator's DHT node before
# it counts as split from the swarm the coordinator checkpoints (joining and catching up take less).
OUTSIDE_GRACE_S = 60.0
# A stage state request from a peer not in the pipeline view rereads the records (a replica announces
# itself just before it asks), at most this often: strangers' streams must not each cost a DHT lookup.
PIPELINE_REREAD_S = 1.0


def state_layout(run: RunConfig) -> dict[str, tuple[tuple[int, ...], int]]:
    """The shape and size in bytes of every tensor of the run's full state (model + optimizer), from a
    model built like the peers build it."""
    from swarm.models import build_model

    model = build_model(run.model.name, run.model.config, seed=run.training.seed)
    optimizer = build_shared_optimizer(model, run)
    ensure_optimizer_state(model, optimizer)
    tensors = state_tensors(model, optimizer)
    return {name: (tuple(t.shape), t.numel() * t.element_size()) for name, t in tensors.items()}


def changed_fields(old: RunConfig, new: RunConfig) -> list[str]:
    """The dotted names of the fields whose values differ between two run configs."""

    def flat(value: object, prefix: str) -> dict[str, object]:
        if isinstance(value, dict):
            out: dict[str, object] = {}
            for key, item in value.items():
                out.update(flat(item, f"{prefix}.{key}" if prefix else str(key)))
            return out
        return {prefix: value}

    a, b = flat(old.model_dump(mode="json"), ""), flat(new.model_dump(mode="json"), "")
    return sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))


def check_resumable(run: RunConfig, checkpoint: Checkpoint, shapes: dict[str, tuple[int, ...]]) -> None:
    """Raise ConfigError, naming the changed fields, if ``run`` cannot load ``checkpoint``'s state."""
    held = {name: tuple(t.shape) for name, t in checkpoint.tensors.items()}
    if held == shapes:
        return
    name = min(held.keys() ^ shapes.keys()) if held.keys() != shapes.keys() else None
    if name is None:
        name = min(k for k in held if held[k] != shapes[k])
        detail = f"tensor {name!r} is {held[name]} in the checkpoint but {shapes[name]} in this run"
    else:
        where = "only in the checkpoint" if name in held else "only in this run"
        detail = f"tensor {name!r} is {where}"
    changed = changed_fields(checkpoint.run_config, run)
    state_fields = [f for f in changed if f.split(".")[0] in ("model", "optimizer", "pipeline")]
    raise ConfigError(
        f"the run config changes {', '.join(state_fields or changed) or 'nothing visible'} since checkpoint "
        f"{checkpoint.path} (step {checkpoint.step}), which it can no longer load ({detail}); restore "
        "the checkpoint's values, or start a new run with another --data-dir"
    )


class CheckpointKeeper:
    """The coordinator's checkpoints: it follows the peers' signed progress (and, in a pipeline run, every
    stage's replicas) with the one catch-up rule, downloads the state a majority agrees on every
    ``checkpoint_every_steps``, verifies its hash, keeps it on disk in ``directory``, serves it to peers
    that resume, and announces it in a record signed with ``key``.
    """

    def __init__(
        self,
        run: RunConfig,
        dht: hivemind.DHT,
        key: SigningKey,
        directory: Path,
        standing: Standing | None = None,
    ):
        self.run, self.dht, self.key, self.directory = run, dht, key, directory
        self.standing = standing  # the coordinator's credit by peer: votes weigh by it (None: counted only)
        self.latest: Checkpoint | None = None
        self._encoded: EncodedState | None = None
        self._max_bytes = 0
        self._p2p = None
        self.banned: set[str] = set()
        self.trust = RecordTrust(run.run_id, key.public_key, is_banned=lambda p: p in self.banned)
        self.view: dict[str, PeerProgress] = {}
        self.num_stages = run.pipeline.stages
        self.stages: dict[int, Checkpoint] = {}  # a pipeline run's latest checkpoint, stage by stage
        self._stage_encoded: dict[int, EncodedState] = {}
        self.pipeline = PipelineView()
        self.recent: RecentStageStates | None = None  # a pipeline run's stage states at recent steps
        self._started_at = time.time()
        self._in_view_at: dict[str, float] = {}  # peer -> when its progress record was last read
        self._pipeline_read_at = -PIPELINE_REREAD_S  # when the last read of the pipeline records began
        self._rereading: asyncio.Future | None = None

    def outside_dht(self, records: list[PeerRecord], now: float) -> set[str]:
        """Online peers, up for over ``OUTSIDE_GRACE_S``, whose signed progress this coordinator's DHT
        node has not read for as long: they train in a swarm split from the one it checkpoints. Only
        for runs without pipeline stages (a stage replica publishes another kind of record)."""
        if self.num_stages > 1 or now - self._started_at < OUTSIDE_GRACE_S:
            return set()
        return {
            r.peer_id
            for r in records
            if r.state == "online"
            and r.metrics.get("uptime_s", 0.0) > OUTSIDE_GRACE_S
            and now - self._in_view_at.get(r.peer_id, 0.0) > OUTSIDE_GRACE_S
        }

    @property
    def p2p(self):
        """The keeper's libp2p node (started by ``start``), which the coordinator also asks peers with."""
        return self._p2p

    async def start(self) -> None:
        self._p2p = await self.dht.replicate_p2p()
        if self.num_stages > 1:
            await self._start_stages()
            return
        layout = await asyncio.to_thread(state_layout, self.run)
        self._max_bytes = download_limit(sum(size for _, size in layout.values()))
        self.latest = await asyncio.to_thread(load_latest_checkpoint, self.directory)
        if self.latest is not None:
            check_resumable(self.run, self.latest, {name: shape for name, (shape, _) in layout.items()})
            logger.info(f"resuming from checkpoint of step {self.latest.step} ({self.latest.path.name})")
        servicer = StateServicer(self.run.run_id, self._provide, admit=self._admit)
        await servicer.add_p2p_handlers(self._p2p, namespace=state_namespace(self.run.run_id))

    async def _admit(self, requester: str) -> str | None:
        if requester in self.banned or requester not in self.view:
            return f"{requester} {NOT_SEEN_YET} in run {self.run.run_id!r}"
        return None

    async def _provide(self) -> EncodedState | None:
        latest = self.latest
        if latest is None:
            return None
        if self._encoded is None or self._encoded.step != latest.step:
            # Only the tensors: the checkpoint file also holds the run config with its admission secrets.
            data = await asyncio.to_thread(
                encode_state, latest.step, latest.tensors, {"run_id": self.run.run_id}
            )
            self._encoded = EncodedState(latest.step, latest.state_hash, data)
        return self._encoded

    @property
    def finished_step(self) -> int | None:
        """The step of the final checkpoint once the run has reached ``max_steps``; None before (or after
        a restart with a higher ``max_steps``, which extends the run)."""
        max_steps, latest = self.run.training.max_steps, self.latest
        return (
            latest.step if max_steps is not None and latest is not None and latest.step >= max_steps else None
        )

    def _due(self, step: int) -> bool:
        done = self.latest.step if self.latest else 0
        training = self.run.training
        final = training.max_steps is not None and step >= training.max_steps
        return step > done and (step - done >= training.checkpoint_every_steps or final)

    async def run_forever(self) -> None:
        while True:
            try:
                await self._check_once()
            except Exception:
                logger.exception("checkpoint check failed; retrying")
            await asyncio.sleep(CHECK_INTERVAL_S)

    async def _check_once(self) -> None:
        if self.num_stages > 1:
            await self._check_stages()
            return
        if self.latest is not None:
            await publish_checkpoint_record(
                self.dht, self.key, self.run.run_id, step=self.latest.step, state_hash=self.latest.state_hash,
                ttl_s=RECORD_TTL_S,
            )  # fmt: skip
        bans = await fetch_ban_list(self.dht, self.run.run_id, self.key.public_key)
        if bans is not None:
            self.banned = bans[1]
        self.view = await fetch_progress(self.dht, self.trust)
        now = time.time()
        for peer_id in self.view:
            self._in_view_at[peer_id] = now
        if len(self._in_view_at) > 4 * len(self.view) + 1024:  # forget peers long gone
            self._in_view_at = {k: t for k, t in self._in_view_at.items() if now - t < OUTSIDE_GRACE_S}
        others = {k: Position(p.step, p.state_hash) for k, p in self.view.items()}
        credit = None if self.standing is None else (await self.standing.current())[1]
        target = catch_up_target(None, others, max_step=self.run.training.max_steps, credit=credit)
        if target is not None and self._due(target.step):
            await self._fetch_and_save(target.step, target.state_hash, target.holders)

    async def _fetch_and_save(self, step: int, expected: str, holders: list[str]) -> None:
        def fetch(holder: PeerID) -> Awaitable[DecodedState]:
            return download_state(
                self._p2p, holder, namespace=state_namespace(self.run.run_id),
                run_id=self.run.run_id, min_step=step, expected_hash=expected, max_bytes=self._max_bytes,
                timeout_s=self.run.training.averaging_timeout_s,
            )  # fmt: skip

        decoded = await from_any_holder(holders, fetch, f"the state of step {step} to checkpoint")
        if decoded is None:
            return
        path = await asyncio.to_thread(
            save_checkpoint, self.directory, decoded.step, decoded.tensors, self.run,
            keep=self.run.training.keep_checkpoints,
        )  # fmt: skip
        self.latest = Checkpoint(decoded.step, decoded.tensors, self.run, decoded.state_hash, path)
        logger.info(f"saved checkpoint of step {decoded.step} ({path.name}, hash {decoded.state_hash[:12]})")
        if self.finished_step is not None:
            logger.info(
                f"run {self.run.run_id!r} finished at step {decoded.step}: {path} is its final checkpoint"
            )
        await publish_checkpoint_record(
            self.dht, self.key, self.run.run_id, step=decoded.step, state_hash=decoded.state_hash,
            ttl_s=RECORD_TTL_S,
        )  # fmt: skip

    # --- a run split into pipeline stages ------------------------------------------------------------

    def _stage_dir(self, stage: int) -> Path:
        return self.directory / f"stage{stage}"

    def _load_stages(self) -> dict[int, Checkpoint]:
        """The newest step every stage has a checkpoint of, loaded and verified; {} if there is none."""
        steps = [{int(p.stem.split("-")[1]): p for p in list_checkpoints(self._stage_dir(k))}
                 for k in range(self.num_stages)]  # fmt: skip
        common = set.intersection(*(set(s) for s in steps))
        if not common:
            return {}
        step = max(common)
        return {k: load_checkpoint(steps[k][step]) for k in range(self.num_stages)}

    async def _start_stages(self) -> None:
        self.recent = RecentStageStates(
            self.run, self._p2p, refresh=self._refresh_pipeline, banned=lambda: self.banned
        )
        self.stages = await asyncio.to_thread(self._load_stages)
        if self.stages:
            self.latest = self.stages[0]
            logger.info(
                f"resuming {self.num_stages} pipeline stages from their checkpoints of step {self.latest.step}"
            )
        for k in range(self.num_stages):
            servicer = StateServicer(
                self.run.run_id, lambda k=k: self._provide_stage(k), admit=self._admit_stage
            )
            await servicer.add_p2p_handlers(
                self._p2p, namespace=state_namespace(stage_prefix(self.run.run_id, k))
            )

    async def _admit_stage(self, requester: str) -> str | None:
        def replicas() -> set[str]:
            return {r.peer_id for rs in self.pipeline.holders.values() for r in rs}

        if requester not in replicas():  # a replica announces itself just before it asks
            await self._fresh_pipeline()
        if requester in self.banned or requester not in replicas():
            return f"{requester} has no valid signed pipeline record in run {self.run.run_id!r}"
        return None

    async def _provide_stage(self, stage: int) -> EncodedState | None:
        latest = self.stages.get(stage)
        if latest is None:
            return None
        encoded = self._stage_encoded.get(stage)
        if encoded is None or encoded.step != latest.step:
            metadata = {"run_id": self.run.run_id, "stage": str(stage)}
            data = await asyncio.to_thread(encode_state, latest.step, latest.tensors, metadata)
            encoded = self._stage_encoded[stage] = EncodedState(latest.step, latest.state_hash, data)
        return encoded

    async def _fresh_pipeline(self) -> None:
        """Wait for a read of the pipeline records that began after this call. Reads begin at most once
        per ``PIPELINE_REREAD_S`` and every caller waiting meanwhile shares the next one: a requester the
        view does not show yet is found without each stranger's stream costing a DHT lookup."""
        asked = time.monotonic()
        for _ in range(3):  # the read under way may have begun before ``asked``: the next one has not
            if self._pipeline_read_at >= asked:
                return
            if self._rereading is None or self._rereading.done():
                self._rereading = asyncio.ensure_future(self._reread())
            await asyncio.shield(self._rereading)

    async def _reread(self) -> None:
        await asyncio.sleep(max(0.0, self._pipeline_read_at + PIPELINE_REREAD_S - time.monotonic()))
        self._pipeline_read_at = time.monotonic()
        with contextlib.suppress(Exception):  # a failed read leaves the view as it was; the caller is refused
            await self._refresh_pipeline()

    async def _refresh_pipeline(self) -> PipelineView:
        self.pipeline = await fetch_view(self.dht, self.trust, self.num_stages)
        if self.recent is not None:
            self.recent.observe(self.pipeline)
        return self.pipeline

    async def _publish_stages(self) -> None:
        for k, checkpoint in self.stages.items():
            await publish_checkpoint_record(
                self.dht, self.key, stage_prefix(self.run.run_id, k), step=checkpoint.step,
                state_hash=checkpoint.state_hash, ttl_s=RECORD_TTL_S,
            )  # fmt: skip

    async def _check_stages(self) -> None:
        if self.stages:
            await self._publish_stages()
        bans = await fetch_ban_list(self.dht, self.run.run_id, self.key.public_key)
        if bans is not None:
            self.banned = bans[1]
        await self._refresh_pipeline()
        targets = {}
        for k in range(self.num_stages):
            others = {
                r.peer_id: Position(r.step, r.state_hash) for r in self.pipeline.members(k) if not r.joining
            }
            targets[k] = catch_up_target(None, others, max_step=self.run.training.max_steps)
            if targets[k] is None:
                return
        steps = {t.step for t in targets.values()}
        if len(steps) != 1 or not self._due(steps.pop()):
            return  # the stages step one after another: a consistent checkpoint holds one step of each
        fetched = {}
        for k, target in targets.items():
            fetched[k] = await self._fetch_stage(k, target.step, target.state_hash, target.holders)
            if fetched[k] is None:
                return
        for k, decoded in fetched.items():
            path = await asyncio.to_thread(
                save_checkpoint, self._stage_dir(k), decoded.step, decoded.tensors, self.run,
                keep=self.run.training.keep_checkpoints,
            )  # fmt: skip
            self.stages[k] = Checkpoint(decoded.step, decoded.tensors, self.run, decoded.state_hash, path)
        self.latest = self.stages[0]
        logger.info(f"saved checkpoints of the {self.num_stages} pipeline stages at step {self.latest.step}")
        await self._publish_stages()

    async def _fetch_stage(self, stage: int, step: int, expected: str, holders: list[str]):
        def fetch(holder: PeerID) -> Awaitable[DecodedState]:
            return download_state(
                self._p2p, holder, namespace=state_namespace(stage_prefix(self.run.run_id, stage)),
                run_id=self.run.run_id, min_step=step, expected_hash=expected,
                max_bytes=download_limit(stage_bytes(self.run, stage)),
                timeout_s=self.run.training.averaging_timeout_s,
            )  # fmt: skip

        return await from_any_holder(
            holders, fetch, f"the state of stage {stage} at step {step} to checkpoint"
        )
