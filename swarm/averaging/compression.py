"""Encodings of float vectors on the wire: fp16 (the default) or fp32, always little-endian.

Decoding is where untrusted bytes become numbers, so it checks the byte count and finiteness and
raises ProtocolError naming the sender; a reducer drops such a sender from the round.
"""

from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from protocols.errors import ConfigError, ProtocolError

FP16_MAX = float(np.finfo(np.float16).max)
# torch's own conversions (vectorized) when the machine's byte order is the wire's, numpy's otherwise.
_NATIVE = sys.byteorder == "little"
_TORCH_DTYPES = {"<f2": torch.float16, "<f4": torch.float32}
# Decoding reads the received bytes in place and converts into a new tensor, so nothing writes to them.
warnings.filterwarnings("ignore", message="The given NumPy array is not writable")


@dataclass(frozen=True)
class Codec:
    name: str
    dtype: np.dtype
    clamp: float | None

    @property
    def bytes_per_value(self) -> int:
        return self.dtype.itemsize

    def encode(self, values: torch.Tensor) -> bytes:
        """Encode a 1-D float tensor; fp16 saturates at its largest finite value instead of overflowing."""
        values = values.detach().to(torch.float32).cpu()
        if self.clamp is not None:
            values = values.clamp(-self.clamp, self.clamp)
        if _NATIVE:
            return values.to(_TORCH_DTYPES[self.dtype.str]).numpy().tobytes()
        return values.numpy().astype(self.dtype).tobytes()

    def decode(self, data: bytes, numel: int, *, sender: str) -> torch.Tensor:
        """Decode exactly ``numel`` finite values into a float32 tensor."""
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


CODECS = {
    "fp16": Codec("fp16", np.dtype("<f2"), FP16_MAX),
    "none": Codec("fp32", np.dtype("<f4"), None),
}


def get_codec(name: str) -> Codec:
    try:
        return CODECS[name]
    except KeyError:
        raise ConfigError(f"unknown compression {name!r}; available: {', '.join(CODECS)}") from None
