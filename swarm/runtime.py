"""Process entry helpers: uvloop, logging, and a stop event set by SIGINT/SIGTERM.

Only CLI entry points call these; importing the library changes no global state.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(
        level=level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
        force=True,
    )
    # grpc core notes at INFO each time hivemind forks its DHT process; nothing for a user to act on.
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    # hivemind logs every connection at INFO; keep the volunteer's screen about the run.
    logging.getLogger("hivemind").setLevel(logging.DEBUG if level == "DEBUG" else logging.WARNING)


def run(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` on uvloop where available (not on Windows), else on asyncio's default loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def stop_event_on_signals() -> asyncio.Event:
    """An event set on the first SIGINT or SIGTERM; a second signal ends the process at once."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal(signum: int) -> None:
        if stop.is_set():
            raise SystemExit(128 + signum)
        logging.getLogger("swarm").info(f"received {signal.Signals(signum).name}; shutting down")
        stop.set()

    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, on_signal, signum)
    return stop
