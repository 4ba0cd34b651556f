"""Choosing the compute device for ``--gpu``, ``--cpu`` or neither."""

from __future__ import annotations

import os

from protocols.errors import ConfigError


def resolve_device(choice: str) -> str:
    """Return ``"cuda"`` or ``"cpu"`` for the requested choice; ``gpu`` without a usable GPU is an error."""
    import torch

    if choice == "cpu":
        return "cpu"
    usable = torch.cuda.is_available()
    if choice == "gpu" and not usable:
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise ConfigError(
            f"--gpu was given but no CUDA device is usable (torch {torch.__version__} is {build}, "
            f"{torch.cuda.device_count()} devices visible); install a CUDA build of torch, check the "
            "driver with nvidia-smi, or join with --cpu"
        )
    return "cuda" if usable else "cpu"


def describe_device(device: str) -> str:
    """A short label for the organizer's peer table, such as ``cuda: NVIDIA H100 80GB HBM3`` or ``cpu: 16 cores``."""
    import torch

    if device == "cuda":
        return f"cuda: {torch.cuda.get_device_name(0)}"[:64]
    return f"cpu: {os.cpu_count() or 1} cores"
