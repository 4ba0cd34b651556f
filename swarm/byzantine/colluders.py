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

import copy
from typing import TYPE_CHECKING

import torch

from swarm.training.diloco import DilocoReplica, flat_params
from swarm.training.replay import honest_gradients, public_dataset, replay_window
from swarm.training.state import build_optimizer

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


class ShadowWindows:
    """What an attacker who reads the code knows in a diloco run: every honest peer's pseudo-gradient.

    A peer's window is inner steps from the agreed synced parameters on its public batch seeds, with an
    inner optimizer whose state only that peer's own earlier windows made. The attacker keeps a shadow
    of each peer it has seen (a ``DilocoReplica``: a model copy and its inner optimizer) and replays
    every window of it (``swarm.training.replay.replay_window``), so the shadow's optimizer state follows
    the peer's. Exact, bit for bit on the same kind of device, for a peer whose every window since its
    start the attacker replayed with the samples its signed progress record claims (in a rehearsal every
    peer starts at once; a peer seen first later, or one that reset its window after a download, is
    approximated from a fresh inner optimizer). Costs the attacker a whole window of compute per honest
    peer per outer step."""

    def __init__(self) -> None:
        self.shadows: dict[str, DilocoReplica] = {}
        # peer -> (outer step, its shadow's inner optimizer state at that window's start): a window
        # replayed again (a failed round retried at the same step) starts from it, not from its own end.
        self.starts: dict[str, tuple[int, dict]] = {}

    def pseudo_gradients(self, trainer: TrainingPeer, own: torch.Tensor) -> torch.Tensor:
        """``own`` (first row), then the pseudo-gradient of every other peer at ``trainer``'s outer step
        that holds at least one micro-batch, in peer-ID order."""
        step, config = trainer.step, trainer.config
        training = config.training
        synced = flat_params(trainer.strategy.replica.synced_params)
        dataset = public_dataset(config.dataset.name, config.dataset.config)
        others = {k: p.samples for k, p in trainer.view.items() if k != trainer.peer_id and p.step == step}
        rows = [own]
        for peer_id, samples in sorted(others.items()):
            micro_batches = int(samples) // training.micro_batch_size
            if micro_batches <= 0:
                continue
            shadow = self.shadows.get(peer_id)
            if shadow is None:
                model = copy.deepcopy(trainer.strategy.replica.model)
                shadow = self.shadows[peer_id] = DilocoReplica(
                    model, build_optimizer(model, config.optimizer), config
                )
            start = self.starts.get(peer_id)
            if start is not None and start[0] == step:
                shadow.optimizer.load_state_dict(copy.deepcopy(start[1]))
            else:
                self.starts[peer_id] = (step, copy.deepcopy(shadow.optimizer.state_dict()))
            rows.append(
                replay_window(
                    shadow,
                    synced,
                    dataset,
                    run_id=config.run_id,
                    peer_id=peer_id,
                    step=step,
                    micro_batches=micro_batches,
                    seq_len=trainer.seq_len,
                    precision=training.precision,
                    device=trainer.device,
                )  # fmt: skip
            )
        return torch.stack(rows)


__all__ = ["ShadowWindows", "exact_gradients", "honest_gradients"]
