"""The state every peer of a run holds bit for bit: the synced model and optimizer at a step, its hashes,
and its encoding for the peers that download it.

With ``every_step`` the synced state is the trained model and its optimizer; with ``diloco`` the synced
copy and the outer optimizer (``swarm.training.strategies``). It changes in two ways only, both under
``lock``: a round's result is applied and the peer moves to the next step (``commit``), or a state
downloaded from another peer replaces it (``load``). The step and its hashes change together on the
event loop, so a progress record never pairs a new step with an old hash.

Example::

    synced = SyncedState(model, optimizer, run_id="my-run")
    async with synced.lock:
        ...  # apply a round's result to model and optimizer
        await synced.commit(synced.step + 1)
    print(synced.step, synced.state_hash)
"""

from __future__ import annotations

import asyncio

import torch

from swarm.training.state import (
    DecodedState,
    encode_state,
    load_state_tensors,
    params_hash,
    state_hash,
    state_tensors,
)
from swarm.training.sync import EncodedState, download_limit


class SyncedState:
    """The synced ``model`` and ``optimizer`` of run ``run_id`` at ``step``, with ``state_hash`` (of model and
    optimizer, what peers vote on) and ``param_hash`` (of the parameters, what the coordinator shows)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, run_id: str):
        self.model, self.optimizer, self.run_id = model, optimizer, run_id
        self.step = 0
        self.state_hash = self.param_hash = ""
        self.lock = asyncio.Lock()
        self._encoded: EncodedState | None = None  # of the current step, made on the first request

    def hashes(self, step: int) -> tuple[str, str]:
        return state_hash(step, state_tensors(self.model, self.optimizer)), params_hash(self.model)

    async def commit(self, step: int) -> bool:
        """Move to ``step`` with the hashes of the state now held; whether the step changed."""
        hashes = await asyncio.to_thread(self.hashes, step)
        changed = step != self.step
        self.step, (self.state_hash, self.param_hash) = step, hashes
        self._encoded = None
        return changed

    async def encoded(self) -> EncodedState:
        """The current state as peers download it (made once per step)."""
        async with self.lock:
            if self._encoded is None or self._encoded.step != self.step:
                tensors = state_tensors(self.model, self.optimizer)
                data = await asyncio.to_thread(encode_state, self.step, tensors, {"run_id": self.run_id})
                self._encoded = EncodedState(self.step, self.state_hash, data)
            return self._encoded

    def max_bytes(self) -> int:
        """The most a download of this state may carry (its tensors, with room for the encoding)."""
        tensors = state_tensors(self.model, self.optimizer)
        return download_limit(sum(t.numel() * t.element_size() for t in tensors.values()))

    async def load(self, decoded: DecodedState) -> None:
        """Replace the state with a downloaded one (its hash already checked); the caller holds ``lock``."""
        await asyncio.to_thread(load_state_tensors, self.model, self.optimizer, decoded.tensors)


__all__ = ["SyncedState"]
