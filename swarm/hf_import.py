"""The optional Hugging Face extra, imported on first use, offline, with one error when it is missing.

``swarm`` and its command lines never import ``transformers`` or ``datasets``; the ``hf-causal-lm``
model and the ``hf-dataset`` dataset do, when they are built. Before the first import the hub's offline
switches are set (unless the user set them already), and every path handed to them is checked to be a
local file first, so nothing is fetched from a hub at run time.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from types import ModuleType

from protocols.errors import ConfigError

INSTALL_HINT = 'pip install -e ".[hf]"'
_OFFLINE_SWITCHES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")


def import_hf(module: str, what: str) -> ModuleType:
    """``transformers``, ``datasets`` or ``tokenizers`` for ``what``; a ConfigError says how to install it."""
    for switch in _OFFLINE_SWITCHES:
        # Read by huggingface_hub when it is first imported; a user's own setting wins.
        os.environ.setdefault(switch, "1")
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError(
            f"{what} needs the Hugging Face extra, which is not installed here ({exc}): run {INSTALL_HINT}"
        ) from None


def local_path(value: str, field: str, what: str, *, want: str = "file or folder") -> Path:
    """``value`` as an existing local path; anything else (a hub name included) is refused naming ``field``."""
    path = Path(value).expanduser()
    if path.exists():
        return path
    looks_like_hub = (
        "/" not in value.strip("/") or value.count("/") == 1 and not value.startswith((".", "/", "~"))
    )
    hint = (
        " It looks like a Hugging Face hub name: nothing is downloaded at run time, so download it once "
        "(huggingface-cli download NAME --local-dir DIR) and give that folder."
        if looks_like_hub
        else ""
    )
    raise ConfigError(f"{what}: field '{field}': {value!r} is not a local {want} on this machine.{hint}")
