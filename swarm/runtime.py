"""Process entry helpers: uvloop, logging, the fork server, and a stop event set by SIGINT/SIGTERM.

Only CLI entry points call these; importing the library changes no global state.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from swarm import forkserver

T = TypeVar("T")


def setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(
        level=level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
        force=True,
    )
    # hivemind logs every connection at INFO; keep the volunteer's screen about the run.
    logging.getLogger("hivemind").setLevel(logging.DEBUG if level == "DEBUG" else logging.WARNING)


def run(main: Coroutine[Any, Any, T], *, fork_server: bool = False) -> T:
    """Run ``main`` on uvloop where available (not on Windows), else on asyncio's default loop.

    ``fork_server``: first fork the copy of this process that its DHT node's process is then forked
    from (``swarm.forkserver``), with the DHT's modules imported; a command that starts a DHT node
    passes True, before anything starts a thread."""
    if fork_server:
        forkserver.start(preload=("swarm.dht",))
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def stop_event_on_signals(*, exit_deadline_s: float = 10.0) -> asyncio.Event:
    """An event set on the first SIGINT or SIGTERM; a second signal ends the process at once.

    A process still running ``exit_deadline_s`` after the first signal ends itself anyway: a clean
    leave is worth a few seconds, never a process that lingers on a loaded machine (the timer is a
    thread, so it fires even when the event loop is stuck)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def force_exit(signum: int) -> None:
        logging.getLogger("swarm").warning(
            f"still running {exit_deadline_s:.0f}s after the stop signal; exiting now"
        )
        logging.shutdown()
        os._exit(128 + signum)

    def on_signal(signum: int) -> None:
        if stop.is_set():
            raise SystemExit(128 + signum)
        logging.getLogger("swarm").info(f"received {signal.Signals(signum).name}; shutting down")
        stop.set()
        timer = threading.Timer(exit_deadline_s, force_exit, args=(signum,))
        timer.daemon = True
        timer.start()

    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, on_signal, signum)
    return stop
