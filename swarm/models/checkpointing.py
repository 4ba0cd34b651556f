"""Activation checkpointing: keep only each block's input during the forward pass, recompute the rest in
backward. Peak activation memory then grows with one block instead of the whole stack, for about one
extra forward pass of compute.

A model opts in by declaring its repeated blocks with a method ``activation_blocks()`` that returns
them (the built-in ``gpt`` returns its transformer blocks). Each block's ``forward`` is wrapped on the
instance, so parameter names, and with them the run's state names and hashes, do not change.
Recomputation replays the same random draws (dropout), so results equal the run without it up to
floating-point reassociation.

Example::

    model = build_model("gpt", {"n_layer": 6}, seed=0)
    set_activation_checkpointing(model, True)   # 6 blocks now recompute in backward
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["activation_blocks", "set_activation_checkpointing", "supports_activation_checkpointing"]

_ORIGINAL = "_swarm_unchecked_forward"


def activation_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks ``model`` declares for checkpointing; empty if it declares none."""
    declare = getattr(model, "activation_blocks", None)
    return list(declare()) if callable(declare) else []


def supports_activation_checkpointing(model: nn.Module) -> bool:
    return bool(activation_blocks(model))


def set_activation_checkpointing(model: nn.Module, enabled: bool) -> int:
    """Turn checkpointing of ``model``'s declared blocks on or off; returns how many blocks it covers."""
    blocks = activation_blocks(model)
    for block in blocks:
        wrapped = _ORIGINAL in block.__dict__
        if enabled and not wrapped:
            original = block.forward
            block.__dict__[_ORIGINAL] = original
            block.forward = functools.partial(_checkpointed, original)
        elif not enabled and wrapped:
            del block.__dict__["forward"]
            del block.__dict__[_ORIGINAL]
    return len(blocks)


def _checkpointed(forward: Any, *args: Any, **kwargs: Any) -> Any:
    if not torch.is_grad_enabled():  # evaluation: nothing to save, nothing to recompute
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)
