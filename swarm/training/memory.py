"""How much memory a peer's training takes, and recognizing when it ran out.

- :func:`peak_memory_bytes`: the peak so far: ``torch.cuda.max_memory_allocated`` on a GPU (tensors
  only, not the allocator's cache), the process's peak resident set (``getrusage``) on the CPU
- :func:`is_out_of_memory`: whether an exception from a step is an allocator failure that a smaller
  micro-batch can avoid

Example::

    try:
        loss = step(batch)
    except Exception as e:
        if not is_out_of_memory(e):
            raise
    print(peak_memory_bytes("cuda") / 2**30, "GiB")
"""

from __future__ import annotations

import resource
import sys

import torch

__all__ = ["is_out_of_memory", "peak_memory_bytes", "reset_peak_memory"]

# ru_maxrss is in kibibytes on Linux and in bytes on macOS.
_RSS_UNIT = 1 if sys.platform == "darwin" else 1024


def peak_memory_bytes(device: str | torch.device) -> int:
    """Peak bytes held so far on ``device``: CUDA tensors since the last reset, or the process's RSS."""
    if torch.device(device).type == "cuda":
        return int(torch.cuda.max_memory_allocated(torch.device(device)))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * _RSS_UNIT


def reset_peak_memory(device: str | torch.device) -> None:
    """Start a new CUDA peak (after emptying the cache); the CPU's RSS peak cannot be reset."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(torch.device(device))


def is_out_of_memory(error: BaseException) -> bool:
    """True for CUDA's OutOfMemoryError and for the RuntimeErrors allocators raise when memory runs out."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    if not isinstance(error, RuntimeError):
        return False
    text = str(error).lower()
    return "out of memory" in text or "failed to allocate" in text
