"""``TrainingHooks``: what a data-parallel peer trains on, sends and claims, honest by default.

``TrainingPeer`` (and the built-in loop, for ``batch``) calls these, whatever its sync strategy, at the points where a volunteer could lie; the default
returns what it is given, so the loop calls it unconditionally:

- ``batch(inputs, targets) -> (inputs, targets)``: the micro-batch the peer trains on;
- ``contribute(trainer, honest) -> Tensor``: the vector it sends to the round, given the honest one
  (run in a worker thread; ``trainer`` is the live ``TrainingPeer``, for hooks that read its state);
- ``weight(claimed) -> float``: the weight (samples) it signs for that vector;
- ``claim(samples) -> int``: the samples its signed progress record says it holds at its step;
- ``entry(extra) -> dict``: what it signs into its group entry besides (its step and state hash);
- ``round_hooks``: the ``swarm.averaging.hooks.RoundHooks`` its averager runs rounds with.

``omniscient`` says that ``contribute`` recomputes the other peers' gradients from their public seeds,
which only ``every_step`` training allows (``swarm.training.strategies.check_hooks`` refuses it with a ``ConfigError``).

Rehearsed attacks (``swarm.byzantine.attacks.Attack``) implement these; the library never imports them.

Example::

    trainer = Trainer(run, dht, peer_id=key.peer_id, signing_key=key, hooks=TrainingHooks())  # honest
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from swarm.averaging.hooks import RoundHooks

if TYPE_CHECKING:
    from swarm.training.peer import TrainingPeer


class TrainingHooks:
    """An honest data-parallel peer: trains on its own batches, sends and claims what it computed."""

    #: What logs and errors call this behaviour.
    name: str = "honest"

    @property
    def omniscient(self) -> bool:
        """Whether ``contribute`` recomputes every other peer's gradient of the step from public seeds."""
        return False

    @property
    def round_hooks(self) -> RoundHooks:
        """What this peer does in its averaging rounds."""
        return RoundHooks()

    def batch(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return inputs, targets

    def contribute(self, trainer: TrainingPeer, honest: torch.Tensor) -> torch.Tensor:
        return honest

    def weight(self, claimed: float) -> float:
        return claimed

    def claim(self, samples: int) -> int:
        return samples

    def entry(self, extra: dict) -> dict:
        return extra


__all__ = ["TrainingHooks"]
