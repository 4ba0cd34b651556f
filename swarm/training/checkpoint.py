"""Checkpoints on local disk: the full training state plus the run config, written atomically.

A checkpoint is one ``ckpt-<step:08d>.safetensors`` file in the format of :func:`encode_state`, its
metadata also holding the run config as JSON, so a whole-swarm restart needs nothing else. Files are
written to a temporary name and renamed into place, so a crash never leaves a half-written checkpoint
under a checkpoint's name; a file damaged anyway (disk full, bad copy) is skipped with a warning by
:func:`load_latest_checkpoint` in favour of the previous one.

The run config is stored whole, admission secrets included: a checkpoint is the coordinator's private
file, not something to serve to peers (peers get state through :func:`encode_state`).

Example::

    path = save_checkpoint(Path("ckpt"), step, state_tensors(model, optimizer), run, keep=3)
    checkpoint = load_latest_checkpoint(Path("ckpt"))
    if checkpoint is not None:
        load_state_tensors(model, optimizer, checkpoint.tensors)
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from protocols.errors import ConfigError, ProtocolError
from swarm.config import RunConfig
from swarm.training.state import build_shared_optimizer, decode_state, encode_state, load_state_tensors

__all__ = [
    "Checkpoint",
    "CorruptCheckpoint",
    "checkpoint_name",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "load_latest_checkpoint",
    "load_model",
    "save_checkpoint",
]

logger = logging.getLogger(__name__)

RUN_CONFIG_KEY = "run_config"
_NAME = re.compile(r"^ckpt-(\d{8,19})\.safetensors$")
_TEMP_PREFIX = ".ckpt-"
_TEMP_SUFFIX = ".tmp"


class CorruptCheckpoint(ConfigError):
    """A checkpoint file is truncated or damaged: its bytes do not decode or do not match their hash."""


@dataclass(frozen=True)
class Checkpoint:
    """A verified checkpoint: its tensors hash to ``state_hash`` together with ``step``."""

    step: int
    tensors: dict[str, torch.Tensor]
    run_config: RunConfig
    state_hash: str
    path: Path


def checkpoint_name(step: int) -> str:
    """The file name of the checkpoint at ``step``."""
    return f"ckpt-{step:08d}.safetensors"


def save_checkpoint(
    directory: Path, step: int, tensors: Mapping[str, torch.Tensor], run_config: RunConfig, *, keep: int
) -> Path:
    """Write the state at ``step`` to ``directory/ckpt-<step:08d>.safetensors`` and keep the newest ``keep``.

    The write is atomic (temporary file, fsync, rename). Older checkpoints beyond ``keep`` are deleted;
    the one just written never is. Returns the checkpoint's path.
    """
    if keep < 1:
        raise ValueError(f"keep must be at least 1, got {keep}")
    directory = Path(directory)
    metadata = {RUN_CONFIG_KEY: json.dumps(run_config.model_dump(mode="json"), sort_keys=True)}
    data = encode_state(step, tensors, metadata)
    path = directory / checkpoint_name(step)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        _write_atomically(path, data)
    except OSError as e:
        raise ConfigError(f"cannot write checkpoint {path}: {e.strerror or e}") from None
    _prune(directory, keep=keep, protect=path)
    logger.info("saved checkpoint %s (step %d, %d bytes)", path, step, len(data))
    return path


def _write_atomically(path: Path, data: bytes) -> None:
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=_TEMP_PREFIX, suffix=_TEMP_SUFFIX)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
    # Make the rename itself durable; not every platform can open a directory.
    with contextlib.suppress(OSError):
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def _prune(directory: Path, *, keep: int, protect: Path) -> None:
    stale = [p for p in list_checkpoints(directory)[:-keep] if p != protect]
    # Temporary files left by a crash mid-write; one coordinator writes a directory at a time.
    stale += [p for p in directory.glob(f"{_TEMP_PREFIX}*{_TEMP_SUFFIX}") if p.is_file()]
    for p in stale:
        try:
            p.unlink()
        except OSError as e:
            logger.warning("could not delete old checkpoint %s: %s", p, e.strerror or e)


def list_checkpoints(directory: Path) -> list[Path]:
    """The checkpoint files in ``directory``, oldest step first (none if it does not exist)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = []
    for p in directory.iterdir():
        match = _NAME.match(p.name)
        if match and p.is_file():
            found.append((int(match.group(1)), p))
    return [p for _, p in sorted(found)]


def latest_checkpoint(directory: Path) -> Path | None:
    """The checkpoint file with the highest step, unread; see :func:`load_latest_checkpoint` to load one."""
    found = list_checkpoints(directory)
    return found[-1] if found else None


def load_checkpoint(path: Path) -> Checkpoint:
    """Read and verify one checkpoint; any problem is a ConfigError naming the file.

    A truncated or damaged file raises the subclass :class:`CorruptCheckpoint`.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"cannot read checkpoint {path}: {e.strerror or e}") from None
    try:
        decoded = decode_state(data, max_bytes=len(data))
    except ProtocolError as e:
        raise CorruptCheckpoint(f"checkpoint {path} is corrupt or truncated: {e}") from None
    match = _NAME.match(path.name)
    if match and int(match.group(1)) != decoded.step:
        raise CorruptCheckpoint(f"checkpoint {path} holds step {decoded.step}, not the step in its name")
    raw = decoded.metadata.get(RUN_CONFIG_KEY)
    if raw is None:
        raise ConfigError(f"checkpoint {path} has no run config in its metadata")
    try:
        config_data = json.loads(raw)
    except ValueError as e:
        raise ConfigError(f"checkpoint {path} has an unreadable run config: {e}") from None
    if not isinstance(config_data, dict):
        raise ConfigError(f"checkpoint {path} has a run config that is not a JSON object")
    run_config = RunConfig.parse(config_data, source=f"run config in checkpoint {path}")
    return Checkpoint(
        step=decoded.step,
        tensors=decoded.tensors,
        run_config=run_config,
        state_hash=decoded.state_hash,
        path=path,
    )


def load_latest_checkpoint(directory: Path) -> Checkpoint | None:
    """The newest checkpoint in ``directory`` that loads and verifies, or None if there is none.

    A truncated or damaged newer checkpoint is skipped with a warning naming it, and the previous one is
    tried. Any other error (an unreadable file, a run config this version cannot parse) is raised: falling
    back past it would silently throw away training.
    """
    for path in reversed(list_checkpoints(directory)):
        try:
            return load_checkpoint(path)
        except CorruptCheckpoint as e:
            logger.warning("skipping checkpoint %s: %s", path, e)
    return None


def load_model(path: str | Path) -> torch.nn.Module:
    """The run's model with a checkpoint's parameters, built from the run config the checkpoint holds.

    ``path`` is a checkpoint file, a directory of checkpoints, or a coordinator's data dir (its
    ``checkpoints/``); from a directory the newest checkpoint that verifies is taken. The model is on the
    CPU in eval mode. A path with no checkpoint, or one whose tensors do not fit the model, is a
    ConfigError naming it.

    Example::

        model = swarm.load_model("coordinator-data")  # the final checkpoint once the run has finished
    """
    from swarm.models import build_model

    path = Path(path)
    if path.is_file():
        checkpoint = load_checkpoint(path)
    else:
        directory = path / "checkpoints" if (path / "checkpoints").is_dir() else path
        found = load_latest_checkpoint(directory)
        if found is None:
            raise ConfigError(f"no checkpoint in {directory}")
        checkpoint = found
    run = checkpoint.run_config
    model = build_model(run.model.name, run.model.config, seed=run.training.seed)
    try:
        load_state_tensors(model, build_shared_optimizer(model, run), checkpoint.tensors)
    except ProtocolError as e:
        raise ConfigError(
            f"checkpoint {checkpoint.path} does not fit model {run.model.name!r}: {e}"
        ) from None
    return model.eval()
