"""Politeness limits a volunteer sets on what the run may take from their machine.

- ``--max-cpu-threads N``: torch uses at most N threads for compute (set when the volunteer starts)
- ``--max-gpu-memory GiB``: torch's CUDA allocator may hold at most this much of the GPU
- ``--max-upload-mbps M``: everything the peer sends is held to M megabits per second
  (one ``swarm.ratelimit.RateLimiter`` shared by all senders)

Example::

    apply_gpu_memory_limit(config, "cuda")
    limiter = upload_limiter(config)   # None when no limit is set
"""

from __future__ import annotations

import logging

from peer.config import PeerConfig
from protocols.errors import ConfigError
from swarm.ratelimit import RateLimiter

logger = logging.getLogger("swarm.peer")

GIB = 1 << 30


def apply_gpu_memory_limit(config: PeerConfig, device: str) -> float | None:
    """Cap the CUDA allocator at ``config.max_gpu_memory`` GiB; returns the fraction set, if any.

    With ``--cpu`` the flag is a contradiction and an error; when the peer picked the CPU itself
    (no usable GPU) the limit has nothing to apply to, which is logged and otherwise ignored.
    """
    limit_gib = config.max_gpu_memory
    if limit_gib is None:
        return None
    if device != "cuda":
        if config.device == "cpu":
            raise ConfigError("--max-gpu-memory limits GPU memory, but --cpu was given; drop one of them")
        logger.warning(
            f"--max-gpu-memory {limit_gib:g} ignored: this peer computes on the CPU (no usable GPU)"
        )
        return None
    import torch

    total = torch.cuda.get_device_properties(0).total_memory
    if limit_gib * GIB > total:
        raise ConfigError(
            f"--max-gpu-memory {limit_gib:g} GiB is more than this GPU has ({total / GIB:.1f} GiB); "
            f"give at most {total / GIB:.1f}"
        )
    fraction = limit_gib * GIB / total
    torch.cuda.set_per_process_memory_fraction(fraction, 0)
    logger.info(f"GPU memory capped at {limit_gib:g} GiB ({fraction:.0%} of {total / GIB:.1f} GiB)")
    return fraction


def upload_limiter(config: PeerConfig) -> RateLimiter | None:
    if config.max_upload_mbps is None:
        return None
    return RateLimiter.from_mbps(config.max_upload_mbps)
