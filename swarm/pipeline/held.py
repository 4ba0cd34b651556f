"""What a stage replica holds of the micro-batches it serves, and the bounds on it.

A forward pass is held (``HeldForward``: its graph, its answer, what a replay recomputes from) until its
backward arrives or ``forward_state_ttl_s`` passes. A replica holds at most ``MAX_FORWARD_STATES`` of
them, and one caller at most ``forwards_per_caller(run)`` awaiting their backward: a caller's forward
past that retires its own oldest one (``make_room``). Without the per-caller bound one trainer that
never sent a backward filled the replica's 512 states, and every other trainer was refused ``BUSY`` for
``forward_state_ttl_s``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from protocols import pipeline_pb2 as ppb
from swarm.config import RunConfig

#: Forward states one replica keeps at most; past it a new forward is refused (BUSY) until some expire.
MAX_FORWARD_STATES = 512
#: A micro-batch as a replica keeps it: (the trainer that sent it, its ID).
Key = tuple[str, int]


class Refusal(Exception):
    """A request this replica will not serve: a code and a message for the caller."""

    def __init__(self, code: int, message: str, step: int):
        super().__init__(message)
        self.code, self.message, self.step = code, message, step


@dataclass
class HeldForward:
    """A forward pass a stage replica holds until its backward arrives (or it expires)."""

    inputs: torch.Tensor | None  # the leaf whose gradient goes back (None on the first stage)
    outputs: torch.Tensor | None  # hidden states with their graph, until the backward
    samples: int
    created: float
    compute_s: float
    reply: ppb.Tensor | None = None  # the encoded outputs, answered again to a repeated forward
    result: ppb.Tensor | None = None  # grad_inputs once counted, answered again to a repeated backward
    loss: float = math.nan
    request: ppb.ForwardRequest | None = None  # what a replay of this micro-batch recomputes from
    rng: torch.Tensor | None = None  # the random state its forward ran with (dropout)
    signature: bytes = b""  # the trainer's signature of the latest attempt that reached it here


def forwards_per_caller(run: RunConfig) -> int:
    """Forwards one caller may hold awaiting their backward: twice what a trainer keeps in flight, so
    that an honest trainer's abandoned attempts (a later stage failed) never retire a live one."""
    return 2 * run.pipeline.max_inflight_microbatches + 2


def make_room(forwards: dict[Key, HeldForward], key: Key, limit: int) -> int:
    """Before ``key``'s forward: drop its caller's oldest forwards awaiting a backward until it holds
    fewer than ``limit``; returns how many were dropped."""
    waiting = sorted(
        (f.created, k) for k, f in forwards.items() if k[0] == key[0] and k != key and f.result is None
    )
    excess = max(0, len(waiting) - limit + 1)
    for _, k in waiting[:excess]:
        del forwards[k]
    return excess
