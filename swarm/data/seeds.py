"""Seeds for batch sampling, derived from public facts so anyone can recompute any peer's batch."""

from __future__ import annotations

import hashlib

from protocols.errors import ConfigError

_SEED_DOMAIN = b"swarm/batch-seed/v1"
_ROW_DOMAIN = b"swarm/batch-row/v1"
MAX_SEED = 2**64 - 1


def derive_seed(run_id: str, peer_id: str, step: int, micro: int = 0) -> int:
    """The 63-bit sampling seed of ``peer_id``'s micro-batch ``micro`` at ``step`` of ``run_id``.

    It is the first 8 bytes (big-endian) of SHA-256 over a domain tag, the length-prefixed UTF-8 run and
    peer ids and the 8-byte step and micro index, shifted right by one bit.

    Example::

        seed = derive_seed("demo", "12D3KooW...", step=7)
        inputs, targets = dataset.sample_batch(seed, batch_size=8, seq_len=128)
    """
    for field, value in (("run_id", run_id), ("peer_id", peer_id)):
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{field} must be a non-empty string, got {value!r}")
    for field, value in (("step", step), ("micro", micro)):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_SEED:
            raise ConfigError(f"{field} must be an integer in [0, 2**64), got {value!r}")
    digest = hashlib.sha256(_SEED_DOMAIN)
    for text in (run_id, peer_id):
        encoded = text.encode("utf-8")
        digest.update(len(encoded).to_bytes(4, "big") + encoded)
    digest.update(step.to_bytes(8, "big") + micro.to_bytes(8, "big"))
    return int.from_bytes(digest.digest()[:8], "big") >> 1


def row_offsets(seed: int, rows: int, span: int) -> list[int]:
    """Start offsets in ``[0, span)`` of the ``rows`` windows of a batch drawn with ``seed``.

    Row ``i`` starts at ``int.from_bytes(sha256(domain + seed8 + i8)[:8], "big") % span``: plain SHA-256
    rather than a numpy generator, whose streams may change between numpy releases.
    """
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise ConfigError(f"seed must be an integer in [0, 2**64), got {seed!r}")
    prefix = _ROW_DOMAIN + seed.to_bytes(8, "big")
    return [
        int.from_bytes(hashlib.sha256(prefix + row.to_bytes(8, "big")).digest()[:8], "big") % span
        for row in range(rows)
    ]
