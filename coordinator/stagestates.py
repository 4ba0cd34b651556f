"""The state of a pipeline stage at a recent step, as the coordinator learns it to judge stage evidence.

The coordinator checkpoints a stage only every ``checkpoint_every_steps``; ``stage_mismatch`` evidence
of any other step is judged from the stage's replicas instead. Each replica keeps the state of its last
``pipeline.kept_states`` steps (``swarm.pipeline.history``), and ``RecentStageStates`` downloads each
state a reply names by its hash (``StateRequest.state_hash``) from any replica of the stage: the bytes
must hash to it, so it does not matter which replica serves it, and no vote of replicas is involved.
A state no replica serves is asked of the replica that signed a reply naming it (``fetch_from``): a
replica that cannot show a state it signed for is at fault (``coordinator.accusations.judge_stage``).

Example::

    states = RecentStageStates(run, p2p, refresh=lambda: fetch_view(dht, trust, stages), banned=set)
    state = await states.fetch(stage, step, state_hash)   # a DecodedState, or None
    state = await states.fetch_from(stage, step, state_hash, signer)  # from that replica only
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from hivemind.p2p import P2P, PeerID

from swarm.config import RunConfig
from swarm.pipeline.layout import stage_bytes
from swarm.pipeline.records import PipelineView, StageRecord
from swarm.records import stage_prefix
from swarm.training.state import DecodedState
from swarm.training.sync import download_limit, download_state, from_any_holder, state_namespace

logger = logging.getLogger(__name__)


class StageStates:
    """What the coordinator can learn of a stage's state at a step it holds no checkpoint of: this base
    knows nothing, so such evidence bans nobody."""

    async def fetch(self, stage: int, step: int, state_hash: str) -> DecodedState | None:
        """The stage's state of ``state_hash`` at ``step``, verified against it; None if nobody served it."""
        return None

    async def fetch_from(self, stage: int, step: int, state_hash: str, holder: str) -> DecodedState | None:
        """That state from ``holder`` only, verified; None if it did not serve it."""
        return None

    async def members(self, stage: int) -> list[StageRecord]:
        """The signed records of the stage's unbanned replicas, read now: none here, so nobody is a
        current replica that must show a state."""
        return []


class RecentStageStates(StageStates):
    """Recent stage states from the stage's replicas (``refresh`` reads their signed records). One download
    runs at a time, and the last state downloaded is kept for the next accusation of the same step."""

    def __init__(
        self,
        run: RunConfig,
        p2p: P2P,
        *,
        refresh: Callable[[], Awaitable[PipelineView]],
        banned: Callable[[], set[str]],
    ):
        self.run, self.p2p, self.refresh, self.banned = run, p2p, refresh, banned
        self.view = PipelineView()
        self._lock = asyncio.Lock()
        self._last: DecodedState | None = None

    def observe(self, view: PipelineView) -> None:
        """Take ``view`` as the stage replicas to download from."""
        self.view = view

    def _replicas(self, stage: int) -> list[str]:
        banned = self.banned()
        return [r.peer_id for r in self.view.members(stage) if r.peer_id not in banned]

    async def members(self, stage: int) -> list[StageRecord]:
        self.observe(await self.refresh())
        banned = self.banned()
        return [r for r in self.view.members(stage) if r.peer_id not in banned]

    def _download(self, stage: int, step: int, state_hash: str, holder: PeerID) -> Awaitable[DecodedState]:
        return download_state(
            self.p2p, holder, namespace=state_namespace(stage_prefix(self.run.run_id, stage)),
            run_id=self.run.run_id, min_step=step, expected_hash=state_hash, exact=True,
            max_bytes=download_limit(stage_bytes(self.run, stage)),
            timeout_s=self.run.training.averaging_timeout_s,
        )  # fmt: skip

    async def fetch(self, stage: int, step: int, state_hash: str) -> DecodedState | None:
        async with self._lock:
            last = self._last
            if last is not None and (last.step, last.state_hash) == (step, state_hash):
                return last
            self._last = None
            self.observe(await self.refresh())  # the replicas serving now

            def fetch(holder: PeerID) -> Awaitable[DecodedState]:
                return self._download(stage, step, state_hash, holder)

            what = f"the state of stage {stage} at step {step} to judge evidence"
            self._last = await from_any_holder(self._replicas(stage), fetch, what)
            return self._last

    async def fetch_from(self, stage: int, step: int, state_hash: str, holder: str) -> DecodedState | None:
        async with self._lock:
            try:
                state = await self._download(stage, step, state_hash, PeerID.from_base58(holder))
            except asyncio.CancelledError:
                raise
            except Exception as e:  # refused, unreachable, or bytes that do not hash to it: not shown
                logger.info(f"{holder} did not serve the state {state_hash[:12]} of stage {stage} at step {step} "
                            f"that it signed for: {e!r}"[:500])  # fmt: skip
                return None
            self._last = state
            return state
