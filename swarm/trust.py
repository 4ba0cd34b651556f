"""Pinned coordinator keys: a peer trusts the key a run's coordinator first showed it, and no other.

Like SSH's known_hosts: ``--coordinator-key`` (or the run config's ``coordinator_key``) pins up front;
otherwise the first successful join pins, and a later different key for the same run is refused.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import tempfile
from pathlib import Path

from protocols.errors import ConfigError, CoordinatorKeyMismatch, ProtocolError
from protocols.keys import PublicKey

logger = logging.getLogger(__name__)


class KnownCoordinators:
    """The coordinator keys this volunteer pinned, one per run ID, in a JSON file (see the module docstring)."""

    def __init__(self, path: Path):
        self.path = path.expanduser()

    def _load(self) -> dict[str, str]:
        if not self.path.exists():
            return {}
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(
                f"cannot read pinned coordinator keys {self.path}: {e}; fix or remove the file"
            ) from None
        if not isinstance(data, dict) or not all(isinstance(v, str) for v in data.values()):
            raise ConfigError(f"{self.path} is not a map of run ID to coordinator peer ID; fix or remove it")
        return data

    def pinned(self, run_id: str) -> PublicKey | None:
        peer_id = self._load().get(run_id)
        if peer_id is None:
            return None
        try:
            return PublicKey.from_peer_id(peer_id)
        except ProtocolError as e:
            raise ConfigError(f"{self.path}: entry for run {run_id!r}: {e}") from None

    def pin(self, run_id: str, key: PublicKey, *, replace: bool = False) -> None:
        """Pin ``key`` for ``run_id``. Another key pinned meanwhile (by a peer under the same HOME that
        trusted another coordinator first) is a CoordinatorKeyMismatch, unless ``replace`` (the user named
        the key with --coordinator-key)."""
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        # Peers on one machine (one HOME) may pin at the same moment: the read, change and write of the
        # file happen under a lock, so that no pin is lost, and the write goes through a temporary file
        # of its own, so that every reader sees a whole file.
        with open(self.path.with_name(f".{self.path.name}.lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            data = self._load()
            if data.get(run_id) == key.peer_id:
                return
            if data.get(run_id) is not None and not replace:
                raise CoordinatorKeyMismatch(
                    f"run {run_id!r}: {self.path} pinned coordinator {data[run_id]} while this peer joined "
                    f"{key.peer_id}; {key_mismatch_fix(run_id, key.peer_id, str(self.path))}",
                    offered=key.peer_id,
                    run_id=run_id,
                )
            data[run_id] = key.peer_id
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.", suffix=".tmp")
            with os.fdopen(fd, "w") as out:
                out.write(json.dumps(data, indent=2, sort_keys=True))
            os.replace(tmp, self.path)
        logger.info(f"pinned coordinator key {key.peer_id} for run {run_id!r} in {self.path}")


def key_mismatch_fix(run_id: str, offered: str, pinned_by: str) -> str:
    """What a volunteer does when the coordinator's key differs from the pinned one (``pinned_by``: the
    flag or the file that pinned it)."""
    where = (
        "pass that key with --coordinator-key instead"
        if pinned_by == "--coordinator-key"
        else f"remove run {run_id!r}'s entry from {pinned_by} (or pass --coordinator-key {offered})"
    )
    return (
        f"if the organizer confirms the run's coordinator key is now {offered}, {where}; otherwise do not "
        "join: another server may be posing as the coordinator"
    )
