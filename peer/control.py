"""Pausing and resuming a running ``swarm-peer join`` from another terminal, by signal.

The running peer writes ``<identity>.pid`` (its process ID) beside its key file and listens for
SIGUSR1 (pause) and SIGUSR2 (resume); ``swarm-peer pause`` and ``swarm-peer resume`` find that file,
send the signal, and wait for the peer to confirm in ``<identity>.state.json``. A paused peer stays a
member of the run: it heartbeats (state ``paused``), keeps serving its state to others and keeps its
credit, but computes nothing and takes no part in rounds. ``kill -USR1 PID`` does the same.

Example::

    swarm-peer pause                      # the peer using ~/.swarm/identity.key
    swarm-peer resume --identity ./peer2.key
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from protocols.errors import ConfigError, NetworkError
from swarm.identity import DEFAULT_IDENTITY

logger = logging.getLogger("swarm.peer")

PAUSE_SIGNAL = signal.SIGUSR1
RESUME_SIGNAL = signal.SIGUSR2


def pid_path(identity_path: Path) -> Path:
    return identity_path.with_name(identity_path.name.removesuffix(".key") + ".pid")


def state_path(identity_path: Path) -> Path:
    return identity_path.with_name(identity_path.name.removesuffix(".key") + ".state.json")


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


class PeerControl:
    """The running peer's side: the pid file, the state file and the signal handlers."""

    def __init__(self, identity_path: Path):
        self.identity_path = identity_path
        self.pid_path = pid_path(identity_path)
        self.state_path = state_path(identity_path)
        self._signals: list[int] = []

    def start(self, on_pause: Callable[[], None], on_resume: Callable[[], None]) -> None:
        other = _running_pid(self.pid_path)
        if other is not None and other != os.getpid():
            raise ConfigError(
                f"another peer (pid {other}) is already running with identity {self.identity_path}; "
                "stop it, or give this one its own --identity"
            )
        loop = asyncio.get_running_loop()
        for signum, handler in ((PAUSE_SIGNAL, on_pause), (RESUME_SIGNAL, on_resume)):
            try:
                loop.add_signal_handler(signum, handler)
            except (RuntimeError, NotImplementedError, ValueError) as e:  # not the main thread, or no signals
                logger.warning(
                    f"cannot listen for {signal.Signals(signum).name} here ({e}); pause/resume disabled"
                )
                continue
            self._signals.append(signum)
        if self._signals:  # written once the handlers are in place: an early signal must not kill the peer
            self.pid_path.parent.mkdir(parents=True, exist_ok=True)
            _write_atomic(self.pid_path, f"{os.getpid()}\n")

    def publish(self, **state: Any) -> None:
        """Record the peer's state for ``swarm-peer pause/resume`` to confirm (best effort)."""
        try:
            _write_atomic(
                self.state_path, json.dumps({**state, "pid": os.getpid(), "updated_at": time.time()})
            )
        except OSError as e:
            logger.warning(f"cannot write {self.state_path}: {e}")

    def close(self) -> None:
        loop = asyncio.get_running_loop()
        for signum in self._signals:
            loop.remove_signal_handler(signum)
        self._signals.clear()
        if _running_pid(self.pid_path) == os.getpid():
            for path in (self.pid_path, self.state_path):
                with contextlib.suppress(OSError):
                    path.unlink()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _is_peer(pid: int) -> bool:
    """Whether ``pid`` runs swarm-peer, where /proc can tell (a killed peer's pid may be reused)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:
        return not Path("/proc/self").exists()  # no /proc (macOS): trust the pid
    except OSError:
        return True
    if pid == os.getpid() or any(marker in cmdline for marker in (b"swarm-peer", b"peer.cli", b"peer/cli")):
        return True
    # A peer forked by a rehearsal (lab/forked.py) carries the rehearsal's command line and this name.
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip() == "swarm-peer"
    except OSError:
        return True


def _running_pid(path: Path) -> int | None:
    """The pid in ``path`` if a peer still runs under it (a stale file from a killed peer reads as None)."""
    try:
        pid = int(path.read_text().strip())
    except (OSError, ValueError):
        return None
    return pid if pid > 0 and _alive(pid) and _is_peer(pid) else None


def read_state(identity_path: Path) -> dict[str, Any] | None:
    try:
        state = json.loads(state_path(identity_path).read_text())
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) else None


def send(command: str, identity_path: Path, *, timeout_s: float = 15.0) -> dict[str, Any]:
    """Pause or resume the peer running with ``identity_path``; returns its confirmed state."""
    if command not in ("pause", "resume"):
        raise ConfigError(f"unknown control command {command!r}; use pause or resume")
    pid = _running_pid(pid_path(identity_path))
    if pid is None:
        raise ConfigError(
            f"no running peer uses identity {identity_path} (no live pid in {pid_path(identity_path)}); "
            "start one with swarm-peer join, or pass the --identity it was started with"
        )
    os.kill(pid, PAUSE_SIGNAL if command == "pause" else RESUME_SIGNAL)
    want_paused = command == "pause"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = read_state(identity_path)
        if state and state.get("pid") == pid and state.get("paused") is want_paused:
            return state
        time.sleep(0.1)
    raise NetworkError(
        f"peer (pid {pid}) did not confirm {command} within {timeout_s:.0f}s; "
        "it may still be starting (it listens once it has joined), see its log"
    )


class ControlConfig(BaseModel):
    """``swarm-peer pause`` / ``swarm-peer resume``: which running peer, and how long to wait for it."""

    model_config = ConfigDict(extra="forbid")

    identity: Path = Field(DEFAULT_IDENTITY, description="key file of the running peer (as given to join)")
    timeout_s: float = Field(15.0, gt=0, le=300, description="wait this long for the peer to confirm")
