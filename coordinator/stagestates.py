"""The state of a pipeline stage at a recent step, as the coordinator learns it to judge stage evidence.

The coordinator checkpoints a stage only every ``checkpoint_every_steps``; ``stage_mismatch`` evidence
of any other step is judged from the stage's replicas instead. Each replica keeps the state of its last
``pipeline.kept_states`` steps (``swarm.pipeline.history``), and ``RecentStageStates`` downloads the
one the evidence names by hash (``StateRequest.state_hash``) from any replica of the stage: the bytes
must hash to it, so it does not matter which replica serves it. Which hash is the stage's state at a
step, when the two replies name different ones, is read from the replicas' signed stage records: the
hash a strict majority of the stage's current, unbanned replicas were seen holding at that step
(``swarm.training.catchup.PositionHistory``, the rule replicas catch up by). Under open admission
certified Sybils that are a majority of a stage's replicas decide that hash, as they decide the
stage's checkpoints.

Example::

    states = RecentStageStates(run, p2p, refresh=lambda: fetch_view(dht, trust, stages), banned=set)
    agreed = await states.agreed_hash(stage, step, candidates)   # None: no majority
    state = await states.fetch(stage, step, agreed)              # a DecodedState, or None
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Collection

from hivemind.p2p import P2P, PeerID

from swarm.config import RunConfig
from swarm.keyspace import stage_prefix
from swarm.pipeline.layout import stage_bytes
from swarm.pipeline.records import PipelineView
from swarm.training.catchup import Position, PositionHistory
from swarm.training.state import DecodedState
from swarm.training.sync import download_limit, download_state, from_any_holder, state_namespace


class StageStates:
    """What the coordinator can learn of a stage's state at a step it holds no checkpoint of: this base
    knows nothing, so such evidence bans nobody."""

    async def agreed_hash(self, stage: int, step: int, candidates: Collection[str]) -> str | None:
        """The one of ``candidates`` that is the stage's agreed state at ``step``, or None."""
        return None

    async def fetch(self, stage: int, step: int, state_hash: str) -> DecodedState | None:
        """The stage's state of ``state_hash`` at ``step``, verified against it; None if nobody served it."""
        return None


class RecentStageStates(StageStates):
    """Recent stage states from the stage's replicas (``refresh`` reads their signed records; ``observe``
    remembers the positions each view shows). One download runs at a time, and the last state
    downloaded is kept for the next accusation of the same step: at most two stage states in memory."""

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
        self.history = {k: PositionHistory() for k in range(run.pipeline.stages)}
        self._lock = asyncio.Lock()
        self._last: DecodedState | None = None

    def observe(self, view: PipelineView) -> None:
        """Remember the positions ``view``'s stage records show."""
        self.view = view
        for k, history in self.history.items():
            members = view.members(k)
            history.observe(
                {r.peer_id: Position(r.step, r.state_hash) for r in members if r.state_hash},
                max_step=self.run.training.max_steps, keep={r.peer_id for r in members},
            )  # fmt: skip

    def _replicas(self, stage: int) -> list[str]:
        banned = self.banned()
        return [r.peer_id for r in self.view.members(stage) if r.peer_id not in banned]

    async def agreed_hash(self, stage: int, step: int, candidates: Collection[str]) -> str | None:
        self.observe(await self.refresh())
        voters = self._replicas(stage)
        agreed = [h for h in set(candidates) if h and self.history[stage].agreed(step, h, voters)]
        return agreed[0] if len(agreed) == 1 else None

    async def fetch(self, stage: int, step: int, state_hash: str) -> DecodedState | None:
        async with self._lock:
            last = self._last
            if last is not None and (last.step, last.state_hash) == (step, state_hash):
                return last
            self._last = None
            self.observe(await self.refresh())  # the replicas serving now

            def fetch(holder: PeerID) -> Awaitable[DecodedState]:
                return download_state(
                    self.p2p, holder, namespace=state_namespace(stage_prefix(self.run.run_id, stage)),
                    run_id=self.run.run_id, min_step=step, expected_hash=state_hash, exact=True,
                    max_bytes=download_limit(stage_bytes(self.run, stage)),
                    timeout_s=self.run.training.averaging_timeout_s,
                )  # fmt: skip

            what = f"the state of stage {stage} at step {step} to judge evidence"
            self._last = await from_any_holder(self._replicas(stage), fetch, what)
            return self._last
