"""The states a stage replica serves: its current one, and the ones it held at its last few steps.

A replica keeps the state of each of its last ``pipeline.kept_states`` steps (CPU copies of the model
and optimizer tensors, taken just before the step's update or a catch-up download replaces them), so
that the coordinator judging
``stage_mismatch`` evidence of a step the replica has moved past can still download the state the
evidence's replies were computed with, by its hash (``StateRequest.state_hash``). A kept state costs
one copy of the stage's state in host memory (``swarm.pipeline.layout.stage_bytes``: parameters and
optimizer state, about 3x the parameter bytes under Adam); it is encoded only when asked for.

Every state a replica answered with stays findable while it is one of the last ``kept_states`` steps:
``advance`` and ``replace`` keep the old state, change it and hash the new one in one call on the
replica's compute thread, so no reply is computed in between (a reply names the state it was computed
with), and states are pushed out by step, not by count, so a catch-up's extra state cannot push out
one still in the window. The coordinator convicts a replica that cannot show a state it signed for
within that window (``coordinator.accusations``), so an honest replica must always be able to.

Example::

    states = StateHistory(run.run_id, keep=2)
    await replica.compute(states.advance, replica, averaged)  # keep, apply, hash
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

#: States kept per step of the window: one at the step's update, more only after a catch-up from a fork.
MAX_KEPT_PER_STEP = 2


def rehash(replica: StageReplica) -> None:
    """Hash ``replica``'s state now, on its compute thread (``StageReplica.commit`` from the thread)."""
    replica.hashed_step, replica.state_hash, replica.param_hash = replica._hashes()


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
        """Copy ``replica``'s state, if hashed at its step, and drop the states of steps before the last
        ``keep`` (run on the replica's compute thread, before the state changes)."""
        if self.keep == 0 or not replica.state_hash or replica.hashed_step != replica.step:
            return
        tensors = state_tensors(replica.model, replica.optimizer)
        self.kept[replica.state_hash] = KeptState(replica.step, replica.state_hash, tensors)
        self.kept.move_to_end(replica.state_hash)
        oldest = replica.step + 1 - self.keep  # the state it moves to is step + 1 or later
        for state_hash in [h for h, k in self.kept.items() if k.step < oldest]:
            del self.kept[state_hash]
        while len(self.kept) > MAX_KEPT_PER_STEP * self.keep:  # forks caught up from, again and again
            self.kept.popitem(last=False)

    def advance(self, replica: StageReplica, averaged: torch.Tensor) -> None:
        """Keep the state, apply the stage's averaged gradient, hash the new state (on the compute thread)."""
        self.keep_current(replica)
        replica.apply(averaged)
        rehash(replica)

    def replace(self, replica: StageReplica, step: int, tensors: dict[str, torch.Tensor]) -> None:
        """Keep the state, load a downloaded one of ``step`` in its place, hash it (on the compute thread):
        the replica may have answered with the state it leaves."""
        self.keep_current(replica)
        replica.load(step, tensors)
        rehash(replica)

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
