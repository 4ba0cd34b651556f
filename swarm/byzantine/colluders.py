"""What an attacker who reads the code knows: every honest peer's exact gradient of the step.

A peer's micro-batches are drawn with ``derive_seed(run_id, peer_id, step, micro)`` from public facts
(``swarm.data.seeds``), and every peer in line holds the same state at a step. An attacker at that step
therefore replays each honest peer's micro-batches on its own copy of the state and gets the very
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

import copy
import functools
import json
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from swarm.data import build_dataset, derive_seed
from swarm.training.microbatch import MicroBatchRunner
from swarm.training.state import flat_mean_gradient

if TYPE_CHECKING:
    from swarm.training.peer import TrainingPeer


def honest_gradients(
    model: torch.nn.Module,
    dataset,
    *,
    run_id: str,
    step: int,
    micro_batch: int,
    seq_len: int,
    peers: Mapping[str, int],
    precision: str = "fp32",
    device: str = "cpu",
) -> torch.Tensor | None:
    """The flat mean gradient each of ``peers`` (peer ID -> samples it holds at ``step``) computes at
    ``step`` from ``model``'s state, one row per peer that holds a whole micro-batch, in peer-ID order;
    None if none does. ``model`` itself is left as it is (its gradients included)."""
    replica = copy.deepcopy(model)
    runner = MicroBatchRunner(replica, device=device, precision=precision)
    replica.train()
    rows = []
    for peer_id, samples in sorted(peers.items()):
        micro_batches = int(samples) // micro_batch
        if micro_batches <= 0:
            continue
        for p in runner.params:
            p.grad = None
        for micro in range(micro_batches):
            seed = derive_seed(run_id, peer_id, step, micro)
            inputs, targets = dataset.sample_batch(seed, micro_batch, seq_len)
            runner.run(inputs, targets)
        rows.append(flat_mean_gradient(runner.params, micro_batches * micro_batch))
    return torch.stack(rows) if rows else None


@functools.lru_cache(maxsize=4)
def _public_dataset(name: str, config_json: str):
    return build_dataset(name, json.loads(config_json))


def exact_gradients(trainer: TrainingPeer, own: torch.Tensor) -> torch.Tensor:
    """The gradients a rehearsed attacker that reads the code aims at: its own honest one (first row) and
    every other peer's at ``trainer``'s step, recomputed from their public batch seeds and the samples
    their signed progress records claim."""
    step, config = trainer.step, trainer.config
    others = {k: p.samples for k, p in trainer.view.items() if k != trainer.peer_id and p.step == step}
    dataset = _public_dataset(
        config.dataset.name, json.dumps(config.dataset.config, sort_keys=True, default=str)
    )
    rows = honest_gradients(
        trainer.model, dataset, run_id=config.run_id, step=step,
        micro_batch=config.training.micro_batch_size, seq_len=trainer.seq_len, peers=others,
        precision=config.training.precision, device=trainer.device,
    )  # fmt: skip
    return own.unsqueeze(0) if rows is None else torch.cat([own.unsqueeze(0), rows])


__all__ = ["exact_gradients", "honest_gradients"]
