"""Encodings of float vectors on the wire, always little-endian, with checked decoding.

| codec | bytes on the wire for n values | error of one value |
| --- | --- | --- |
| ``none`` (fp32) | 4 n | none |
| ``fp16`` (default) | 2 n | fp16 rounding (relative 2^-11), saturating at +-65504 |
| ``int8`` | 4 + n | at most max abs / 254 (one float32 scale per message) |
| ``topk`` | 6 per block of ``TOPK_BLOCK`` + 3 per value sent | values not sent; sent ones as int8 |

``int8`` (INTELLECT-1 style): a float32 scale ``max|x| / 127`` and one signed byte per value,
``round(x / scale)`` in [-127, 127]. ``topk`` (SparseLoCo style) cuts a message into blocks of
``TOPK_BLOCK`` values; a sender's contribution (``encode_contribution``) keeps in each block the
``ceil(density * block length)`` values of largest magnitude (ties to the lower index), and an
aggregate (``encode``) keeps every nonzero value, so that all peers decode the very bytes its reducer
sent. A topk message of B blocks holds B uint16 counts, B float32 scales (``max|kept| / 127``), then
the kept values' uint16 indices within their block (strictly increasing in each block, blocks in
order), then their int8 values. At the default density 0.01 a sender keeps 41 values in a block of
4096: 129 bytes, 0.031 bytes a value, 63x fewer than fp16.

Every encoding is a function of the input bits alone (float32 IEEE arithmetic, round half to even), so
a validator recomputing an aggregate gets the reducer's bytes exactly. Non-finite input makes a message
that every receiver refuses, as with fp16's NaN. Decoding is where untrusted bytes become numbers, so it
checks the byte count, every count, index and scale, and finiteness, and raises ProtocolError naming
the sender; a reducer drops such a sender from the round. Nothing decodes to more than ``numel`` values.
"""

from __future__ import annotations

import math
import sys
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from protocols.errors import ConfigError, ProtocolError

FP16_MAX = float(np.finfo(np.float16).max)
TOPK_BLOCK = 4096  # values per topk block: block-relative indices fit in uint16
DEFAULT_TOPK_DENSITY = 0.01
# torch's own conversions (vectorized) when the machine's byte order is the wire's, numpy's otherwise.
_NATIVE = sys.byteorder == "little"
_TORCH_DTYPES = {"<f2": torch.float16, "<f4": torch.float32}
_F32, _U16 = np.dtype("<f4"), np.dtype("<u2")
_LEVELS = np.float32(127)
# Decoding reads the received bytes in place and converts into a new tensor, so nothing writes to them.
warnings.filterwarnings("ignore", message="The given NumPy array is not writable")


class Codec:
    """A wire encoding of 1-D float vectors: what every codec offers (see the module's table)."""

    name: str

    @property
    def schema(self) -> str:
        """What peers must share to meet in a round (part of the averaging schema hash)."""
        return self.name

    @property
    def bytes_per_value(self) -> int:
        """The most bytes one value may take on the wire, in whole bytes (sizes the chunk layout)."""
        raise NotImplementedError

    def max_bytes(self, numel: int) -> int:
        """The most bytes a valid message of ``numel`` values may take."""
        return numel * self.bytes_per_value

    def encode(self, values: torch.Tensor) -> bytes:
        """Encode a 1-D float tensor as a reducer's result (or any dense vector)."""
        raise NotImplementedError

    def encode_contribution(self, values: torch.Tensor) -> bytes:
        """Encode a sender's input to a round; the same as ``encode`` except for sparse codecs."""
        return self.encode(values)

    def decode(self, data: bytes, numel: int, *, sender: str) -> torch.Tensor:
        """Decode a message of exactly ``numel`` finite values into a float32 tensor, or raise
        ProtocolError naming ``sender``."""
        raise NotImplementedError

    def decode_contribution(self, data: bytes, numel: int, *, sender: str) -> torch.Tensor:
        """Decode a sender's input: ``decode``, and for sparse codecs no more values than its share."""
        return self.decode(data, numel, sender=sender)


def _floats(values: torch.Tensor, clamp: float | None) -> np.ndarray:
    """A float32 numpy copy of ``values``, saturated at +-``clamp`` (NaN stays NaN)."""
    array = values.detach().to(torch.float32).cpu().reshape(-1).numpy()
    return np.clip(array, -clamp, clamp) if clamp is not None else array


def _quantize(values: np.ndarray, scale: np.float32) -> np.ndarray:
    """int8 levels of ``values`` at ``scale`` (all zero where the scale is zero or not finite)."""
    if not (np.isfinite(scale) and scale > 0):
        return np.zeros(values.shape, np.int8)
    with np.errstate(over="ignore"):  # a subnormal scale: the clip saturates
        return np.clip(np.rint(values / scale), -127, 127).astype(np.int8)


def _check_scales(scales: np.ndarray, sender: str) -> None:
    with np.errstate(over="ignore", invalid="ignore"):
        bad = ~(np.isfinite(scales * _LEVELS) & (scales >= 0)) | np.signbit(scales)
    if bad.any():
        raise ProtocolError(
            f"{sender} sent a scale of {float(scales[bad][0])!r}; a scale is a finite number >= 0"
        )


def _check_levels(levels: np.ndarray, sender: str) -> None:
    if levels.size and levels.min() < -127:
        raise ProtocolError(f"{sender} sent the int8 level -128; levels lie in [-127, 127]")


@dataclass(frozen=True)
class DenseCodec(Codec):
    """fp16 or fp32, every value; fp16 saturates at its largest finite value instead of overflowing."""

    name: str
    dtype: np.dtype
    clamp: float | None

    @property
    def bytes_per_value(self) -> int:
        return self.dtype.itemsize

    def encode(self, values: torch.Tensor) -> bytes:
        values = values.detach().to(torch.float32).cpu()
        if self.clamp is not None:
            values = values.clamp(-self.clamp, self.clamp)
        if _NATIVE:
            return values.to(_TORCH_DTYPES[self.dtype.str]).numpy().tobytes()
        return values.numpy().astype(self.dtype).tobytes()

    def decode(self, data: bytes, numel: int, *, sender: str) -> torch.Tensor:
        expected = numel * self.bytes_per_value
        if len(data) != expected:
            raise ProtocolError(
                f"{sender} sent {len(data)} bytes where {numel} {self.name} values ({expected} bytes) were expected"
            )
        raw = np.frombuffer(data, dtype=self.dtype)
        values = (
            torch.from_numpy(raw).to(torch.float32, copy=True)
            if _NATIVE
            else torch.from_numpy(raw.astype(np.float32))
        )
        if not np.isfinite(values.numpy()).all():
            raise ProtocolError(f"{sender} sent non-finite values (NaN or Inf)")
        return values


@dataclass(frozen=True)
class Int8Codec(Codec):
    """One float32 scale per message, then one signed byte per value: ``4 + n`` bytes."""

    name: str = "int8"

    @property
    def bytes_per_value(self) -> int:
        return 1

    def max_bytes(self, numel: int) -> int:
        return 4 + numel

    def encode(self, values: torch.Tensor) -> bytes:
        array = _floats(values, FP16_MAX)
        scale = (np.max(np.abs(array)) if array.size else np.float32(0)) / _LEVELS
        return np.array([scale], _F32).tobytes() + _quantize(array, scale).tobytes()

    def decode(self, data: bytes, numel: int, *, sender: str) -> torch.Tensor:
        if len(data) != 4 + numel:
            raise ProtocolError(
                f"{sender} sent {len(data)} bytes where {numel} int8 values ({4 + numel} bytes) were expected"
            )
        scale = np.frombuffer(data, _F32, count=1)
        _check_scales(scale, sender)
        levels = np.frombuffer(data, np.int8, offset=4)
        _check_levels(levels, sender)
        return torch.from_numpy(levels.astype(np.float32) * scale.astype(np.float32)[0])


@dataclass(frozen=True)
class TopKCodec(Codec):
    """Sparse: per block of ``TOPK_BLOCK`` values, a count and a scale, then (index, int8) pairs."""

    density: float = DEFAULT_TOPK_DENSITY
    name: str = "topk"

    @property
    def schema(self) -> str:
        return f"topk/{self.density!r}"

    @property
    def bytes_per_value(self) -> int:
        return 4  # every value sent: 3 bytes, plus its block's 6-byte header, rounded up

    def max_bytes(self, numel: int) -> int:
        return 6 * _blocks(numel) + 3 * numel

    def kept(self, block_len: int) -> int:
        """How many values a contribution keeps in a block of ``block_len`` values."""
        return min(block_len, max(1, math.ceil(self.density * block_len)))

    def encode(self, values: torch.Tensor) -> bytes:
        array = _floats(values, FP16_MAX)
        return _pack(array, np.abs(array) > 0)

    def encode_contribution(self, values: torch.Tensor) -> bytes:
        array = _floats(values, FP16_MAX)
        magnitude = np.abs(array)
        keep = np.zeros(array.shape, bool)
        full = array.size // TOPK_BLOCK * TOPK_BLOCK
        if full:
            keep[:full] = _top(magnitude[:full].reshape(-1, TOPK_BLOCK), self.kept(TOPK_BLOCK)).reshape(-1)
        if full < array.size:
            keep[full:] = _top(magnitude[None, full:], self.kept(array.size - full))[0]
        return _pack(array, keep)

    def decode(self, data: bytes, numel: int, *, sender: str) -> torch.Tensor:
        return self._decode(data, numel, sender, None)

    def decode_contribution(self, data: bytes, numel: int, *, sender: str) -> torch.Tensor:
        return self._decode(data, numel, sender, self.kept)

    def _decode(self, data: bytes, numel: int, sender: str, share) -> torch.Tensor:
        blocks = _blocks(numel)
        header = 6 * blocks
        if len(data) < header:
            raise ProtocolError(
                f"{sender} sent {len(data)} bytes, fewer than the {header}-byte header of {numel} topk values"
            )
        counts = np.frombuffer(data, _U16, count=blocks).astype(np.int64)
        lengths = np.full(blocks, TOPK_BLOCK, np.int64)
        if blocks:
            lengths[-1] = numel - (blocks - 1) * TOPK_BLOCK
        limits = lengths if share is None else np.array([share(int(n)) for n in lengths], np.int64)
        over = np.flatnonzero(counts > limits)
        if over.size:
            block = int(over[0])
            raise ProtocolError(
                f"{sender} sent {counts[block]} values for block {block} of {lengths[block]} values; "
                f"at most {limits[block]} fit"
            )
        total = int(counts.sum())
        if len(data) != header + 3 * total:
            raise ProtocolError(
                f"{sender} sent {len(data)} bytes where {total} topk values in {blocks} blocks "
                f"({header + 3 * total} bytes) were expected"
            )
        scales = np.frombuffer(data, _F32, count=blocks, offset=2 * blocks)
        _check_scales(scales, sender)
        indices = np.frombuffer(data, _U16, count=total, offset=header).astype(np.int64)
        levels = np.frombuffer(data, np.int8, count=total, offset=header + 2 * total)
        _check_levels(levels, sender)
        rows = np.repeat(np.arange(blocks), counts)
        if (indices >= lengths[rows]).any():
            raise ProtocolError(f"{sender} sent a topk index beyond the end of its block")
        if (np.diff(indices)[rows[1:] == rows[:-1]] <= 0).any():
            raise ProtocolError(f"{sender} sent topk indices that do not strictly increase within a block")
        out = np.zeros(numel, np.float32)
        out[rows * TOPK_BLOCK + indices] = levels.astype(np.float32) * scales.astype(np.float32)[rows]
        return torch.from_numpy(out)


def _blocks(numel: int) -> int:
    return -(-numel // TOPK_BLOCK)


def _top(magnitude: np.ndarray, k: int) -> np.ndarray:
    """In each row, the ``k`` largest nonzero magnitudes, ties to the lower index (a boolean mask)."""
    width = magnitude.shape[1]
    threshold = np.partition(magnitude, width - k, axis=1)[:, width - k : width - k + 1]
    above = magnitude > threshold
    tied = magnitude == threshold
    room = k - above.sum(axis=1, keepdims=True)
    return (above | (tied & (np.cumsum(tied, axis=1) <= room))) & (magnitude > 0)


def _pack(array: np.ndarray, keep: np.ndarray) -> bytes:
    """The topk message of the values of ``array`` where ``keep`` holds."""
    blocks = _blocks(array.size)
    padded = blocks * TOPK_BLOCK
    values = np.zeros(padded, np.float32)
    values[: array.size] = array
    mask = np.zeros(padded, bool)
    mask[: array.size] = keep
    values, mask = values.reshape(blocks, TOPK_BLOCK), mask.reshape(blocks, TOPK_BLOCK)
    rows, indices = np.nonzero(mask)  # row-major: blocks in order, indices increasing
    kept = values[rows, indices]
    scales = np.where(mask, np.abs(values), np.float32(0)).max(axis=1, initial=np.float32(0)) / _LEVELS
    scales[~np.isfinite(values).all(axis=1)] = np.nan  # receivers refuse the block, as fp16's NaN
    levels = np.zeros(kept.size, np.int8)
    usable = np.isfinite(scales) & (scales > 0)
    per_value = usable[rows]
    with np.errstate(over="ignore"):
        levels[per_value] = np.clip(np.rint(kept[per_value] / scales[rows[per_value]]), -127, 127)
    counts = mask.sum(axis=1)
    return b"".join(
        [
            counts.astype(_U16).tobytes(),
            scales.astype(_F32).tobytes(),
            indices.astype(_U16).tobytes(),
            levels.tobytes(),
        ]
    )


CODECS = ("fp16", "none", "int8", "topk")


def get_codec(name: str, *, topk_density: float = DEFAULT_TOPK_DENSITY) -> Codec:
    """The codec called ``name`` in the run config (``topk_density``: the share a topk sender keeps)."""
    if name == "fp16":
        return DenseCodec("fp16", np.dtype("<f2"), FP16_MAX)
    if name == "none":
        return DenseCodec("fp32", np.dtype("<f4"), None)
    if name == "int8":
        return Int8Codec()
    if name == "topk":
        if not 0 < topk_density <= 1:
            raise ConfigError(f"topk_density is {topk_density!r}; it must lie in (0, 1]")
        return TopKCodec(float(topk_density))
    raise ConfigError(f"unknown compression {name!r}; available: {', '.join(CODECS)}")
