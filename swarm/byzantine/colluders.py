"""What an attacker who reads the code knows: every honest peer's exact gradient of the step.

A peer's micro-batches are drawn with ``derive_seed(run_id, peer_id, step, micro)`` from public facts
(``swarm.data.seeds``), and every peer in line holds the same state at a step. An attacker at that step
therefore replays (``swarm.training.replay``) each honest peer's micro-batches on its own copy of the state and gets the very
gradient that peer will send, down to the last bit on the same kind of device. Colluding attacks
(``omniscient_alie``, ``omniscient_ipm``) aim at the true mean and spread instead of an estimate; the
rehearsal (``Trainer`` with such an attack as its hooks) makes robust rules face that attacker, not a
weaker one: ``exact_gradients`` reads the state and the signed progress records from the live peer, and
draws the batches from the run's public dataset, as any attacker can.

Example::

    rows = honest_gradients(model, dataset, run_id="demo", step=7, micro_batch=8, seq_len=128,
                            peers={"12D3KooW...": 32, "12D3KooX...": 16})
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from swarm.training.replay import honest_gradients, public_dataset

if TYPE_CHECKING:
    from swarm.training.peer import TrainingPeer


def exact_gradients(trainer: TrainingPeer, own: torch.Tensor) -> torch.Tensor:
    """The gradients a rehearsed attacker that reads the code aims at: its own honest one (first row) and
    every other peer's at ``trainer``'s step, recomputed from their public batch seeds and the samples
    their signed progress records claim."""
    step, config = trainer.step, trainer.config
    others = {k: p.samples for k, p in trainer.view.items() if k != trainer.peer_id and p.step == step}
    dataset = public_dataset(config.dataset.name, config.dataset.config)
    rows = honest_gradients(
        trainer.model, dataset, run_id=config.run_id, step=step,
        micro_batch=config.training.micro_batch_size, seq_len=trainer.seq_len, peers=others,
        precision=config.training.precision, device=trainer.device,
    )  # fmt: skip
    return own.unsqueeze(0) if rows is None else torch.cat([own.unsqueeze(0), rows])


__all__ = ["exact_gradients", "honest_gradients"]
