"""A peer's gradient replayed from public facts: the state at a step, the run's dataset and the batch seeds.

A data-parallel peer on the built-in loop draws its micro-batches with ``derive_seed(run_id, peer_id,
step, micro)`` (``swarm.data.seeds``) for ``micro`` = 0, 1, ... and sends the mean gradient of the summed
loss over the samples it holds. Anyone holding the state every peer holds at that step therefore gets
the very vector that peer sends, down to the last bit on the same kind of device. Two users: the sender
checks (``swarm.training.sendercheck``), where a validator and the coordinator recompute a groupmate's
contribution to catch a lie, and the rehearsed attackers that read the code
(``swarm.byzantine.colluders``), which aim at the honest peers' exact gradients.

Example::

    rows = honest_gradients(model, dataset, run_id="demo", step=7, micro_batch=8, seq_len=128,
                            peers={"12D3KooW...": 32, "12D3KooX...": 16})
    dataset = public_dataset(run.dataset.name, run.dataset.config)
"""

from __future__ import annotations

import copy
import functools
import itertools
import json
import time
from collections.abc import Mapping

import torch

from protocols.errors import SwarmError
from swarm.data import build_dataset, derive_seed
from swarm.training.diloco import DilocoReplica, flat_params, write_flat_params
from swarm.training.microbatch import MicroBatchRunner
from swarm.training.state import flat_mean_gradient


class ReplayTooLong(SwarmError):
    """A replay ran past the deadline its caller set."""


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
    deadline: float | None = None,
    in_place: bool = False,
    first_micro: int = 0,
    span: tuple[int, int] | None = None,
) -> torch.Tensor | None:
    """The flat mean gradient each of ``peers`` (peer ID -> samples it holds at ``step``) computes at
    ``step`` from ``model``'s state, one row per peer that holds a whole micro-batch, in peer-ID order;
    None if none does. ``model`` itself is left as it is (its gradients included), unless ``in_place``
    (its gradients are then overwritten, and no copy is made). ``first_micro``: the micro-batches from that
    number on (0: from the first, as a peer computes them). ``span`` (lo, hi): only those values of the
    flat gradient, taking the gradients of the parameters that hold them alone (the backward pass stops
    below the lowest of them), the same values up to the rounding of a pass that computes fewer of them.
    ``deadline`` (``time.monotonic()``): a ``ReplayTooLong`` once it passes, checked between micro-batches."""
    replica = model if in_place else copy.deepcopy(model)
    frozen, offset = _freeze_outside(replica, span)
    try:
        runner = MicroBatchRunner(replica, device=device, precision=precision)
        replica.train()
        rows = []
        for peer_id, samples in sorted(peers.items()):
            micro_batches = int(samples) // micro_batch
            if micro_batches <= 0:
                continue
            for p in runner.params:
                p.grad = None
            for micro in range(first_micro, first_micro + micro_batches):
                if deadline is not None and time.monotonic() > deadline:
                    raise ReplayTooLong(f"the replay of {peer_id} at step {step} ran past its deadline")
                seed = derive_seed(run_id, peer_id, step, micro)
                inputs, targets = dataset.sample_batch(seed, micro_batch, seq_len)
                runner.run(inputs, targets)
            row = flat_mean_gradient(runner.params, micro_batches * micro_batch)
            rows.append(row if span is None else row[span[0] - offset : span[1] - offset])
    finally:
        for p in frozen:
            p.requires_grad_(True)
    return torch.stack(rows) if rows else None


def _freeze_outside(model: torch.nn.Module, span: tuple[int, int] | None) -> tuple[list, int]:
    """Stop the gradients of ``model``'s parameters that hold none of the flat values ``span`` (lo, hi);
    (the parameters stopped, for the caller to restore; the flat offset of the first one kept)."""
    if span is None:
        return [], 0
    lo, hi = span
    params = [p for p in model.parameters() if p.requires_grad]
    ends = list(itertools.accumulate(p.numel() for p in params))
    kept = [i for i, end in enumerate(ends) if end - params[i].numel() < hi and end > lo]
    if not kept:
        raise ValueError(f"no parameter holds the values {lo}..{hi} of the flat gradient")
    frozen = params[: kept[0]] + params[kept[-1] + 1 :]  # the kept ones are contiguous
    for p in frozen:
        p.requires_grad_(False)
    return frozen, ends[kept[0]] - params[kept[0]].numel()


def replay_window(
    replica: DilocoReplica,
    synced: torch.Tensor,
    dataset,
    *,
    run_id: str,
    peer_id: str,
    step: int,
    micro_batches: int,
    seq_len: int,
    precision: str = "fp32",
    device: str = "cpu",
    deadline: float | None = None,
) -> torch.Tensor:
    """The pseudo-gradient ``peer_id`` sends at outer ``step`` of a diloco run after ``micro_batches``
    inner steps from the synced parameters ``synced`` (flat), on its public batch seeds
    ``derive_seed(run_id, peer_id, step, micro)``: ``replica`` (a ``DilocoReplica`` whose inner
    optimizer state is the one that peer's own earlier windows left) takes those inner steps as the
    built-in loop does. Exact, bit for bit on the same kind of device, when ``replica``'s inner optimizer
    followed every window of that peer since its start, or when the run starts every window with a fresh
    inner optimizer (``swarm.config.resets_inner_state``); a sparse codec's error feedback is left out.
    ``deadline`` (``time.monotonic()``): a ``ReplayTooLong`` once it passes, checked between inner steps."""
    write_flat_params(replica.synced_params, synced)
    replica.reset()
    runner = MicroBatchRunner(replica.model, device=device, precision=precision)
    replica.model.train()
    batch = replica.config.training.micro_batch_size
    for micro in range(micro_batches):
        if deadline is not None and time.monotonic() > deadline:
            raise ReplayTooLong(f"the replay of {peer_id}'s window at step {step} ran past its deadline")
        inputs, targets = dataset.sample_batch(derive_seed(run_id, peer_id, step, micro), batch, seq_len)
        runner.run(inputs, targets)  # the gradient of the summed loss, as the built-in loop takes it
        replica.inner_step(step, batch, mean=False)
    return synced - flat_params(replica.params)


def public_dataset(name: str, config: Mapping):
    """The run's dataset, built once per process for each (name, config)."""
    return _dataset(name, json.dumps(dict(config), sort_keys=True, default=str))


@functools.lru_cache(maxsize=4)
def _dataset(name: str, config_json: str):
    return build_dataset(name, json.loads(config_json))


__all__ = ["ReplayTooLong", "honest_gradients", "public_dataset", "replay_window"]
