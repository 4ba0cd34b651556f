"""Choosing the compute device for ``--gpu``, ``--cpu`` or neither.

``torch.cuda.is_available()`` only says that a driver answered and a device is visible: a GPU that this
torch build has no kernels for, or whose memory is exhausted, still passes it and then fails at the
first training step. So a GPU is taken only after a small matrix product has run on it: ``--gpu``
reports why it could not, and ``auto`` falls back to the CPU with a warning.

A peer computes on the first visible GPU; a machine with several runs one peer per GPU, each started
with its own ``CUDA_VISIBLE_DEVICES``.

Example::

    device = resolve_device("auto")    # "cuda" or "cpu"
    print(describe_device(device))     # cuda: NVIDIA H100 80GB HBM3, 79 GiB
"""

from __future__ import annotations

import logging
import os
from types import ModuleType

from protocols.errors import ConfigError

logger = logging.getLogger(__name__)


def resolve_device(choice: str) -> str:
    """Return ``"cuda"`` or ``"cpu"`` for ``choice`` (``gpu``, ``cpu`` or ``auto``).

    ``gpu`` without a GPU that actually computes is a ConfigError that says why and what to do.
    """
    if choice not in ("auto", "cpu", "gpu"):
        raise ConfigError(f"device must be one of auto, cpu, gpu; got {choice!r}")
    if choice == "cpu":
        return "cpu"
    import torch

    problem = _cuda_problem(torch)
    if problem is None:
        return "cuda"
    if choice == "gpu":
        raise ConfigError(
            f"--gpu was given but no CUDA device is usable: {problem}; install a CUDA build of torch "
            "that supports this GPU, check the driver with nvidia-smi, or join with --cpu"
        )
    if torch.cuda.is_available():  # a GPU is there but failed: worth telling, unlike a CPU-only machine
        logger.warning(f"not using the GPU ({problem}); computing on the CPU")
    return "cpu"


def _cuda_problem(torch: ModuleType) -> str | None:
    """None if a small matrix product runs on the first CUDA device, else what went wrong."""
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} is {build} and sees {torch.cuda.device_count()} devices"
    try:
        x = torch.ones(8, 8, device="cuda")
        value = float((x @ x).sum())  # a cuBLAS kernel, run and synchronized
    except RuntimeError as e:  # torch raises RuntimeError (or its subclasses) for CUDA failures
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return (
            f"a test computation on {_name(torch)} failed ({first_line}; torch {torch.__version__}, {build})"
        )
    if value != 512.0:
        return f"a test computation on {_name(torch)} gave {value}, not 512"
    return None


def _name(torch: ModuleType) -> str:
    try:
        return torch.cuda.get_device_name(0)
    except RuntimeError:
        return "CUDA device 0"


def describe_device(device: str) -> str:
    """A short label for the organizer's peer table, such as ``cuda: NVIDIA H100 80GB HBM3, 79 GiB``
    or ``cpu: 16 cores``."""
    if device == "cuda":
        import torch

        props = torch.cuda.get_device_properties(0)
        return f"cuda: {props.name}, {props.total_memory // 2**30} GiB"[:64]
    return f"cpu: {os.cpu_count() or 1} cores"
