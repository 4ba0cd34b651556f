"""The states a stage replica serves: its current one, and the ones it held at its last few steps.

A replica keeps the state of each of its last ``pipeline.kept_states`` steps (CPU copies of the model
and optimizer tensors, taken just before the step's update), so that the coordinator judging
``stage_mismatch`` evidence of a step the replica has moved past can still download the state the
evidence's replies were computed with, by its hash (``StateRequest.state_hash``). A kept state costs
one copy of the stage's state in host memory (``swarm.pipeline.layout.stage_bytes``: parameters and
optimizer state, about 3x the parameter bytes under Adam); it is encoded only when asked for.

Example::

    states = StateHistory(run.run_id, keep=2)
    await replica.compute(states.keep_current, replica)    # before the step's update
    state = await states.find(replica, wanted_hash)  # an EncodedState, or None
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass

import torch

from swarm.pipeline.replica import StageReplica
from swarm.training.state import encode_state, state_tensors
from swarm.training.sync import EncodedState


@dataclass(frozen=True)
class KeptState:
    step: int
    state_hash: str
    tensors: dict[str, torch.Tensor]


class StateHistory:
    """One replica's current state (encoded once per step for downloads) and its ``keep`` kept ones."""

    def __init__(self, run_id: str, keep: int):
        self.run_id, self.keep = run_id, keep
        self.kept: OrderedDict[str, KeptState] = OrderedDict()  # state hash -> state, oldest first
        self._encoded: EncodedState | None = None

    def _metadata(self, replica: StageReplica) -> dict[str, str]:
        return {"run_id": self.run_id, "stage": str(replica.index)}

    def keep_current(self, replica: StageReplica) -> None:
        """Copy ``replica``'s state, if hashed at its step (run on the replica's compute thread)."""
        if self.keep == 0 or not replica.state_hash or replica.hashed_step != replica.step:
            return
        tensors = state_tensors(replica.model, replica.optimizer)
        self.kept[replica.state_hash] = KeptState(replica.step, replica.state_hash, tensors)
        self.kept.move_to_end(replica.state_hash)
        while len(self.kept) > self.keep:
            self.kept.popitem(last=False)

    async def current(self, replica: StageReplica | None) -> EncodedState | None:
        """``replica``'s state now, encoded; None before it has a hash."""
        r = replica
        if r is None or not r.state_hash:
            return None
        encoded = self._encoded
        if encoded is None or encoded.step != r.step or encoded.state_hash != r.state_hash:
            tensors = await r.compute(state_tensors, r.model, r.optimizer)
            data = await asyncio.to_thread(encode_state, r.step, tensors, self._metadata(r))
            encoded = self._encoded = EncodedState(r.step, r.state_hash, data)
        return encoded

    async def find(self, replica: StageReplica | None, state_hash: str) -> EncodedState | None:
        """The state of ``state_hash``: the current one or a kept one, encoded; None if neither."""
        current = await self.current(replica)
        if current is not None and current.state_hash == state_hash:
            return current
        held = self.kept.get(state_hash)
        if held is None or replica is None:
            return None
        data = await asyncio.to_thread(encode_state, held.step, held.tensors, self._metadata(replica))
        return EncodedState(held.step, held.state_hash, data)
