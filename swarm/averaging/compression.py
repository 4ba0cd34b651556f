"""Encodings of float vectors on the wire: fp16 (the default) or fp32, always little-endian.

Decoding is where untrusted bytes become numbers, so it checks the byte count and finiteness and
raises ProtocolError naming the sender; a reducer drops such a sender from the round.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from protocols.errors import ConfigError, ProtocolError

FP16_MAX = float(np.finfo(np.float16).max)


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
        array = values.detach().to(torch.float32).cpu().numpy()
        if self.clamp is not None:
            array = np.clip(array, -self.clamp, self.clamp)
        return array.astype(self.dtype).tobytes()

    def decode(self, data: bytes, numel: int, *, sender: str) -> torch.Tensor:
        """Decode exactly ``numel`` finite values into a float32 tensor."""
        expected = numel * self.bytes_per_value
        if len(data) != expected:
            raise ProtocolError(
                f"{sender} sent {len(data)} bytes where {numel} {self.name} values ({expected} bytes) were expected"
            )
        array = np.frombuffer(data, dtype=self.dtype).astype(np.float32)
        if not np.isfinite(array).all():
            raise ProtocolError(f"{sender} sent non-finite values (NaN or Inf)")
        return torch.from_numpy(array)


CODECS = {
    "fp16": Codec("fp16", np.dtype("<f2"), FP16_MAX),
    "none": Codec("fp32", np.dtype("<f4"), None),
}


def get_codec(name: str) -> Codec:
    try:
        return CODECS[name]
    except KeyError:
        raise ConfigError(f"unknown compression {name!r}; available: {', '.join(CODECS)}") from None
