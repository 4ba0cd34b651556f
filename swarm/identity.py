"""Persistent Ed25519 identities: one key signs a peer's messages and is its libp2p peer ID.

The file holds the key in libp2p's private-key format, so it is handed as-is to the p2p daemon and the
peer's network ID is the ID of its signing key. It is created with mode 0600 and never leaves the
machine.

Example::

    from swarm.identity import load_or_create_identity
    key = load_or_create_identity("~/.swarm/identity.key")
    print(key.peer_id)
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

from protocols.errors import IdentityError
from protocols.keys import SigningKey

logger = logging.getLogger(__name__)

DEFAULT_IDENTITY = Path("~/.swarm/identity.key")


def load_identity(path: str | Path) -> SigningKey:
    path = Path(path).expanduser()
    try:
        data = path.read_bytes()
    except OSError as e:
        raise IdentityError(f"cannot read identity {path}: {e.strerror or e}") from None
    try:
        key = SigningKey.from_libp2p_bytes(data)
    except IdentityError as e:
        raise IdentityError(
            f"identity {path} is corrupt ({e}); move it away to create a new identity"
        ) from None
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        logger.warning(f"identity {path} is readable by other users (mode {mode:o}); run: chmod 600 {path}")
    return key


def create_identity(path: str | Path) -> SigningKey:
    path = Path(path).expanduser()
    key = SigningKey.generate()
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as e:
        raise IdentityError(
            f"cannot create the folder {path.parent} for identity {path}: {e.strerror or e}"
        ) from None
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise IdentityError(f"identity {path} already exists") from None
    except OSError as e:
        raise IdentityError(f"cannot create identity {path}: {e.strerror or e}") from None
    with os.fdopen(fd, "wb") as f:
        f.write(key.to_libp2p_bytes())
    logger.info(f"created identity {path}: peer ID {key.peer_id}")
    return key


def load_or_create_identity(path: str | Path) -> SigningKey:
    """Load the key at ``path``, creating it (mode 0600) when the file does not exist yet."""
    path = Path(path).expanduser()
    if path.exists():
        return load_identity(path)
    return create_identity(path)
