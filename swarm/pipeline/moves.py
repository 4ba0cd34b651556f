"""How a stage replica joins, serves, catches up, leaves and moves between stages (the move protocol of
``swarm.pipeline.worker``): its stage is built, announced as not serving, caught up to the stage's verified
state (or the coordinator's checkpoint of it), then its handlers are registered; a move drains, removes
every handler and the stage's averager, and joins the target stage the same way. A replica behind or
apart from its stage downloads the state its stage-mates hold (``_ahead_or_apart``, ``_catch_up``); once
stalled it follows only its anchors: its last round's mates, the replica that served its last download,
or the servers it joined behind.

:class:`StageMoves` is a part of :class:`swarm.pipeline.worker.StageWorker`, kept in its own module: it
uses the worker's replica, averager, view, policy, announce methods and catch-up clocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import random
import time

from hivemind.p2p import PeerID

from protocols.errors import ConfigError, SwarmError
from swarm.averaging.averager import Averager
from swarm.averaging.factory import build_averager
from swarm.pipeline.balance import choose_stage, rebalance_move, stage_totals
from swarm.pipeline.history import StateHistory
from swarm.pipeline.layout import stage_bytes
from swarm.pipeline.records import PipelineView
from swarm.pipeline.replica import StageReplica
from swarm.pipeline.server import pipeline_namespace
from swarm.records import stage_prefix
from swarm.training.catchup import Position, catch_up_move
from swarm.training.state import DecodedState
from swarm.training.sync import (
    StateServicer,
    download_limit,
    download_state,
    fetch_checkpoint_record,
    from_any_holder,
    state_namespace,
)

logger = logging.getLogger(__name__)

UNSERVE_TIMEOUT_S = 5.0
#: The longest a move waits for the stage's round to take what the leaving replica counted.
LEAVE_TIMEOUT_S = 60.0
#: The longest a joining replica keeps trying to download its stage's state before serving as it is.
JOIN_CATCH_UP_TIMEOUT_S = 60.0
#: Reads of the stage's checkpoint record, 1 s apart, before a replica of a coordinated run starts from step 0.
CHECKPOINT_RECORD_TRIES = 3


class StageMoves:
    """Joining, serving, leaving and moving: the membership half of a ``StageWorker``."""

    # --- serving a stage -----------------------------------------------------------------------------

    def _fits(self) -> list[bool]:
        if self.memory_bytes is None:
            return [True] * self.num_stages
        return [stage_bytes(self.config, k) <= self.memory_bytes for k in range(self.num_stages)]

    async def _pick_stage(self) -> int:
        if self.wanted_stage is not None:
            return self.wanted_stage
        await self._refresh_view()
        # Peers that start together would all see the same empty view: a random pause spreads them out.
        await asyncio.sleep(random.uniform(0, 3 * self.config.pipeline.announce_interval_s))
        await self._refresh_view()
        stage = choose_stage(self.view, self.num_stages, self._fits())
        if stage is None:
            raise SwarmError(f"no stage of this run fits in {self.memory_bytes / 2**30:.1f} GiB of memory")
        logger.info(f"taking stage {stage}, the one most short of throughput "
                    f"({self.view.throughput(stage):.1f} samples/s from {len(self.view.replicas(stage))} replicas)")  # fmt: skip
        return stage

    async def _serve(self, index: int) -> None:
        """Join stage ``index``: build it, announce it as not serving yet, take the stage's verified state,
        then register its handlers and serve."""
        replica = await asyncio.to_thread(StageReplica, self.config, index, device=self.device)
        averager = self.build_averager(index, replica.numel)
        await averager.start()
        replica.paused = self.paused
        self._serving = False
        self._joining_at = replica.step  # while it loads the stage's state it takes no round either
        self.replica, self.averager = replica, averager
        self._round_mates, self._anchors = set(), set()  # those of the stage it left count for nothing here
        self.states = StateHistory(self.config.run_id, self.config.pipeline.kept_states)
        self._busy_mark, self._load = (time.monotonic(), 0.0), 0.0  # busy time is counted per replica
        await replica.measure()
        await replica.commit()
        with contextlib.suppress(Exception):
            await self._announce()  # replaces the record of the stage this peer left, if any
        await self._join_catch_up()
        state = StateServicer(
            self.config.run_id,
            self.encoded_state,
            admit=self._admit_download,
            upload_limiter=self.upload_limiter,
            find=self.state_of,
        )
        await self._register(state, state_namespace(stage_prefix(self.config.run_id, index)))
        self._step_view = self._views
        self._step_since = time.monotonic()
        # Serving at once, it could count micro-batches at a step its stage-mates close without it (their
        # view of the stage is a beat older than the trainers'), and those samples would die with its
        # round. Where the stage has servers it sits this step out and serves from the next.
        others = [x for x in self.view.replicas(index) if x.peer_id != self.peer_id]
        self._joining_at = replica.step if others else None
        if others:  # it sits this step out: the servers' round decides the state it then follows
            self._anchors = {x.peer_id for x in others}
        with contextlib.suppress(Exception):
            await self._announce()
        if self._joining_at is None:
            await self._start_serving()
        else:
            logger.info(f"stage {index}: holds the state of step {replica.step}; serves from the next step")

    async def _start_serving(self) -> None:
        replica, index = self.replica, self.replica.index
        self._joining_at = None
        key = self.signing_key or (self.records.key if self.records is not None else None)
        self.servicer = self.servicer_type(replica, self.gate, key=key, hooks=self.hooks)
        await self._register(self.servicer, pipeline_namespace(self.config.run_id, index))
        self._serving = True
        with contextlib.suppress(Exception):
            await self._announce()
        logger.info(f"serving stage {index} (blocks {replica.spec.first_block}..{replica.spec.last_block - 1}"
                    f"{', embedding' if replica.is_first else ''}{', head' if replica.is_last else ''}) at step "
                    f"{replica.step}, {replica.samples_per_s:.1f} samples/s")  # fmt: skip

    async def _join_catch_up(self) -> None:
        """Download the stage's agreed state while its other replicas are ahead or apart; a first replica
        (nobody to catch up with) serves from the run's initial state at once."""
        deadline = time.monotonic() + JOIN_CATCH_UP_TIMEOUT_S
        await self._refresh_view()
        resume = await self._checkpoint_to_resume()
        if resume is not None:
            await self._catch_up(resume)
        while self._ahead_or_apart() is not None and time.monotonic() < deadline:
            if await self._catch_up():
                continue
            await asyncio.sleep(self.config.pipeline.announce_interval_s)
            await self._refresh_view()
        if self._ahead_or_apart() is not None:
            logger.warning(f"stage {self.replica.index}: could not download the stage's state within "
                           f"{JOIN_CATCH_UP_TIMEOUT_S:.0f}s; serving step {self.replica.step} and trying again")  # fmt: skip

    async def _checkpoint_to_resume(self) -> tuple[int, str, list[str]] | None:
        """The coordinator's signed checkpoint of this stage, when no replica of it holds a later state
        (a pipeline swarm restarted from nothing)."""
        r = self.replica
        if self.coordinator_key is None or any(x.step > r.step for x in self.view.members(r.index)):
            return None
        prefix = stage_prefix(self.config.run_id, r.index)
        for attempt in range(CHECKPOINT_RECORD_TRIES):  # the record may not have reached this DHT node yet
            with contextlib.suppress(Exception):
                record = await fetch_checkpoint_record(self.dht, prefix, self.coordinator_key)
                if record is not None:
                    break
            record = None
            if attempt + 1 < CHECKPOINT_RECORD_TRIES:
                await asyncio.sleep(1.0)
        if record is None or record[0] <= r.step:
            return None
        logger.info(
            f"stage {r.index}: no replica is ahead; resuming from the coordinator's checkpoint of step {record[0]}"
        )
        return record[0], record[1], [self.coordinator_key.peer_id]

    async def _register(self, servicer, namespace: str) -> None:
        """Add ``servicer``'s handlers under ``namespace``; ``_unserve`` removes every one of them."""
        p2p = self.averager.p2p
        try:
            await servicer.add_p2p_handlers(p2p, namespace=namespace)
        except Exception as e:
            # A handler left behind by a leave whose removal did not finish: take it down and add ours.
            logger.warning(f"handlers under {namespace} were still registered ({e!r}); replacing them")
            with contextlib.suppress(Exception):
                await servicer.remove_p2p_handlers(p2p, namespace=namespace)
            await servicer.add_p2p_handlers(p2p, namespace=namespace)
        self._handlers.append((servicer, namespace))

    def build_averager(self, index: int, numel: int) -> Averager:
        """The averager of stage ``index``'s replicas: signed, validated, and held to the run's policy."""
        return build_averager(
            self.config, self.dht, prefix=stage_prefix(self.config.run_id, index), numel=numel,
            signing_key=self.signing_key, policy=self.policy, upload_limiter=self.upload_limiter,
            accuse=self.accuse, max_weight=4.0 * self.config.training.target_batch_size,  # trainers overshoot
            record_signer=self.records,
        )  # fmt: skip

    async def _unserve(self) -> None:
        """Leave the stage served: every handler registered for it, its averager (and so its groups)."""
        replica, averager = self.replica, self.averager
        if replica is None:
            return
        self._serving = False
        handlers, self._handlers = self._handlers, []
        for servicer, namespace in handlers:
            # Bounded: the daemon may already be gone (a killed peer), and then these never answer.
            try:
                await asyncio.wait_for(
                    servicer.remove_p2p_handlers(averager.p2p, namespace=namespace), timeout=UNSERVE_TIMEOUT_S
                )
            except Exception as e:
                logger.warning(
                    f"stage {replica.index}: could not remove the handlers under {namespace}: {e!r}"
                )
        with contextlib.suppress(Exception):
            await asyncio.wait_for(averager.shutdown(), timeout=UNSERVE_TIMEOUT_S)
        replica.close()
        self.replica = self.averager = None

    # --- catching up ------------------------------------------------------------------------------

    def _ahead_or_apart(self) -> tuple[int, str, list[str]] | None:
        """The step and hash to move to, with the replicas that hold it; None when in line. The rule is the
        data-parallel peer's (``swarm.training.catchup``), among the replicas of this stage: it counts as
        stalled only while its step's rounds fail or while it sits out the step it joined at (serving a long
        step is not stalling), and a stalled one follows its anchors (``_anchors``), never a replica
        ahead that is not one of them. A joiner sitting out its step follows the servers it joined behind
        once they step on: replicas that sit out that step with it (joining, or not serving) have no say,
        and nor does the "twice as long" rule, in which replicas at its step outvote those ahead."""
        r = self.replica
        joining = self._joining_at is not None
        others = {
            x.peer_id: Position(x.step, x.state_hash)
            for x in self.view.members(r.index)
            if x.peer_id != self.peer_id
            and not (joining and x.step == r.step and (x.joining or not x.serving))
        }
        mine = Position(r.step, r.state_hash)
        stuck_s = time.monotonic() - self._step_since if r.closing or joining else 0.0
        return catch_up_move(
            mine,
            others,
            self.config.training,
            stuck_s=stuck_s,
            trusted=self._anchors,
            long_stall_rule=not joining,
        )

    async def _catch_up(self, move: tuple[int, str, list[str]] | None = None) -> bool:
        move = move or self._ahead_or_apart()
        if move is None:
            return False
        step, expected, holders = move
        r = self.replica
        logger.info(f"stage {r.index}: replicas hold step {step} ({expected[:12]}), this one step {r.step}: "
                    "downloading their state")  # fmt: skip

        async def fetch(holder: PeerID) -> tuple[PeerID, DecodedState]:
            return holder, await download_state(
                self.averager.p2p, holder,
                namespace=state_namespace(stage_prefix(self.config.run_id, r.index)), run_id=self.config.run_id,
                min_step=step, expected_hash=expected, max_bytes=download_limit(stage_bytes(self.config, r.index)),
                timeout_s=self.config.training.averaging_timeout_s,
            )  # fmt: skip

        loaded = await from_any_holder(holders, fetch, f"stage {r.index} state")
        if loaded is None:
            return False
        holder, decoded = loaded
        await r.compute(self.states.replace, r, decoded.step, decoded.tensors)  # keeps the state it leaves
        # The replica that served the verified bytes, and the anchors that hold that state too: a record
        # that merely shows a position (hashes are public) earns no say.
        self._anchors = {holder.to_base58()} | {
            x.peer_id for x in self.view.members(r.index)
            if x.peer_id in self._anchors and (x.step, x.state_hash) == (step, expected)
        }  # fmt: skip
        self._step_view, self._step_since, self._held_since = self._views, time.monotonic(), None
        self._stats["resyncs"] += 1
        logger.info(f"stage {r.index}: loaded the state of step {r.step} from {holder.to_base58()}")
        return True

    # --- rebalancing ---------------------------------------------------------------------------------

    def move_to(self, stage: int) -> None:
        """Move to ``stage``: drain, leave this stage cleanly, join ``stage`` with its verified state."""
        if not 0 <= stage < self.num_stages:
            raise ConfigError(
                f"stage {stage}: run {self.config.run_id!r} has stages 0..{self.num_stages - 1}"
            )
        if self.replica is not None and stage != self.replica.index and self._leave_to is None:
            self._leave_to, self._leave_since = stage, time.monotonic()
            self.replica.leaving = True
            self._serving = False

    def _proven_view(self) -> PipelineView:
        """The view with this replica's own stage cut to itself and the peers it completed its last round
        with. A serving record costs nothing: four Sybil records of a stage (no server behind them) made
        its only honest replica look spare, and rebalancing moved it away, leaving the stage to them."""
        r = self.replica
        mates = [x for x in self.view.replicas(r.index) if x.peer_id in self._round_mates | {self.peer_id}]
        return dataclasses.replace(self.view, stages={**self.view.stages, r.index: mates})

    async def _maybe_move(self) -> None:
        r = self.replica
        serving = self.view.replicas(r.index)
        if serving and min(x.peer_id for x in serving) != self.peer_id:
            return  # one mover per stage, named from every record: proven sets differ between replicas
        view = self._proven_view()
        target = rebalance_move(
            view, self.peer_id, r.index, self.num_stages, self.config.pipeline.rebalance_margin
        )
        if target is None or not self._fits()[target]:
            return
        before = {k: round(v, 1) for k, v in stage_totals(view, self.num_stages).items()}
        logger.info(f"rebalancing: moving from stage {r.index} to the bottleneck stage {target} "
                    f"(samples/s by stage: {before})")  # fmt: skip
        self.move_to(target)
        self._leave_throughput = before

    def _sitting_out(self) -> bool:
        """Joined at the replica's current step: it takes no round of it. Once caught up past it, the
        stage expects it in the next round, though it starts serving only a moment later."""
        return self._joining_at is not None and self.replica.hashed_step <= self._joining_at

    async def _continue_joining(self) -> None:
        """A joiner serves once its stage moved past the step it joined at (it then caught up), or at once
        when the stage has no server left."""
        r = self.replica
        if r.step > self._joining_at or not any(
            x.peer_id != self.peer_id for x in self.view.replicas(r.index)
        ):
            await self._start_serving()

    async def _continue_leaving(self) -> None:
        """The drain's next move: announce it, wait while the stage's round takes what this replica
        counted, then leave and join the target stage."""
        r = self.replica
        with contextlib.suppress(Exception):
            await self._announce()  # trainers see that it serves no more
        if not await r.compute(r.drained):
            if time.monotonic() - self._leave_since < LEAVE_TIMEOUT_S:
                return
            logger.warning(f"stage {r.index}: leaving with {r.samples} samples of step {r.step} that no round "
                           f"took within {LEAVE_TIMEOUT_S:.0f}s; they are dropped")  # fmt: skip
        target, self._leave_to = self._leave_to, None
        self.moves.append(
            {"from": r.index, "to": target, "at_step": r.step, "throughput": self._leave_throughput}
        )
        self._leave_throughput = {}
        self._stats["moves"] += 1
        logger.info(f"leaving stage {r.index} at step {r.step} for stage {target}")
        await self._unserve()
        await self._serve(target)


__all__ = ["StageMoves", "stage_prefix"]
