"""Tensors on the pipeline wire: encoding, and the checks every tensor from the network passes first.

Hidden states and their gradients travel in the run's compression (fp16 by default, through the same
codec as averaging: saturating, little-endian); token IDs and targets as int64. Decoding checks the
dtype, the rank and every dimension against what the receiver expects, the byte count, finiteness and
the range of token IDs, and raises a ProtocolError that says which of them was wrong.

A retry (attempt > 1) carries the trainer's signature of its attempt ticket (``attempt_ticket``): the
stage's replicas drop an earlier copy of a micro-batch only on a ticket its own trainer signed, so
nobody can retire another trainer's micro-batch.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from protocols import pipeline_pb2 as ppb
from protocols.errors import ProtocolError, SwarmError
from protocols.keys import PublicKey, SigningKey
from protocols.messages import MAX_ATTEMPT
from swarm.averaging.compression import Codec
from swarm.models.gpt import VOCAB_SIZE

#: hivemind's unary P2P calls carry at most 4 MiB; one tensor may take most of it.
MAX_TENSOR_BYTES = 3 << 20
_FLOAT_DTYPES = {"fp16": ppb.FLOAT16, "fp32": ppb.FLOAT32}
_DTYPE_NAMES = {ppb.FLOAT16: "float16", ppb.FLOAT32: "float32", ppb.INT64: "int64", ppb.DTYPE_UNSET: "unset"}


def encode_floats(tensor: torch.Tensor, codec: Codec) -> ppb.Tensor:
    return ppb.Tensor(
        shape=list(tensor.shape), dtype=_FLOAT_DTYPES[codec.name], data=codec.encode(tensor.reshape(-1))
    )


def encode_ids(tensor: torch.Tensor) -> ppb.Tensor:
    array = tensor.detach().to(torch.int64).cpu().numpy().astype("<i8")
    return ppb.Tensor(shape=list(tensor.shape), dtype=ppb.INT64, data=array.tobytes())


def _check_shape(message: ppb.Tensor, expected: list[int | tuple[int, int]], what: str) -> list[int]:
    """``expected`` holds, per dimension, an exact size or an inclusive (low, high) range."""
    shape = list(message.shape)
    if len(shape) != len(expected):
        raise ProtocolError(
            f"{what} has shape {shape}: expected {len(expected)} dimensions {_show(expected)}"
        )
    for size, want in zip(shape, expected, strict=True):
        low, high = want if isinstance(want, tuple) else (want, want)
        if not low <= size <= high:
            raise ProtocolError(f"{what} has shape {shape}: expected {_show(expected)}")
    return shape


def _show(expected: list[int | tuple[int, int]]) -> str:
    return "[" + ", ".join(f"{w[0]}..{w[1]}" if isinstance(w, tuple) else str(w) for w in expected) + "]"


def decode_floats(
    message: ppb.Tensor, codec: Codec, expected: list[int | tuple[int, int]], *, what: str
) -> torch.Tensor:
    """A float32 tensor from ``message``, which must be in the run's ``codec`` and of the expected shape."""
    want = _FLOAT_DTYPES[codec.name]
    if message.dtype != want:
        raise ProtocolError(
            f"{what} has dtype {_DTYPE_NAMES.get(message.dtype, message.dtype)}: this run sends {_DTYPE_NAMES[want]}"
        )
    shape = _check_shape(message, expected, what)
    if len(message.data) > MAX_TENSOR_BYTES:
        raise ProtocolError(f"{what} is {len(message.data)} bytes; the limit is {MAX_TENSOR_BYTES}")
    values = codec.decode(message.data, math.prod(shape), sender=what)  # checks size and finiteness
    return values.reshape(shape)


def decode_ids(message: ppb.Tensor, expected: list[int | tuple[int, int]], *, what: str) -> torch.Tensor:
    """An int64 tensor of token IDs in [0, 256) from ``message``, of the expected shape."""
    if message.dtype != ppb.INT64:
        raise ProtocolError(
            f"{what} has dtype {_DTYPE_NAMES.get(message.dtype, message.dtype)}: expected int64"
        )
    shape = _check_shape(message, expected, what)
    if len(message.data) != 8 * math.prod(shape):
        raise ProtocolError(
            f"{what} is {len(message.data)} bytes where {math.prod(shape)} int64 values "
            f"({8 * math.prod(shape)} bytes) were expected"
        )
    array = np.frombuffer(message.data, dtype="<i8")
    if array.size and (array.min() < 0 or array.max() >= VOCAB_SIZE):
        raise ProtocolError(f"{what} holds token IDs outside [0, {VOCAB_SIZE})")
    return torch.from_numpy(array.astype(np.int64)).reshape(shape)


def shape_of(message: ppb.Tensor) -> list[int]:
    return list(message.shape)


def attempt_ticket(
    run_id: str, stage: int, step: int, trainer: str, microbatch_id: int, attempt: int
) -> bytes:
    """What a trainer signs for attempt ``attempt`` of its micro-batch at one stage and step."""
    return (
        f"swarm-pipeline-attempt\0{run_id}\0{stage}\0{step}\0{trainer}\0{microbatch_id}\0{attempt}".encode()
    )


def sign_attempt(
    key: SigningKey, run_id: str, stage: int, step: int, microbatch_id: int, attempt: int
) -> bytes:
    return key.sign(attempt_ticket(run_id, stage, step, key.peer_id, microbatch_id, attempt))


def check_attempt(
    run_id: str, stage: int, step: int, trainer: str, microbatch_id: int, attempt: int, signature: bytes
) -> None:
    """Raise a ProtocolError unless ``trainer`` signed this attempt (attempt 1 needs no signature)."""
    if not 0 <= attempt <= MAX_ATTEMPT:
        raise ProtocolError(f"attempt {attempt} is over the bound {MAX_ATTEMPT}")
    if attempt <= 1:
        return
    try:
        PublicKey.from_peer_id(trainer).verify(
            signature, attempt_ticket(run_id, stage, step, trainer, microbatch_id, attempt)
        )
    except SwarmError as e:
        raise ProtocolError(
            f"attempt {attempt} of micro-batch {microbatch_id} is not signed by its trainer {trainer}: {e}"
        ) from None
