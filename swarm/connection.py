"""``swarm.connect``: a run's membership for an ordinary (synchronous) Python program.

The session (``swarm.session.Session``: join, DHT, heartbeats, certificate renewal) runs on an event loop
of its own in a background thread, so that the caller's loop, a plain ``for`` over its data, never has
to yield to it. Leaving the ``with`` block tells the coordinator this peer left and stops the DHT node.
An error at join (refused admission, a coordinator key that does not match the pinned one, a run whose
model is not installed here) is raised from ``connect``'s ``__enter__``.

Example::

    with swarm.connect("203.0.113.7:31330", identity="~/.swarm/identity.key") as session:
        print(session.run_config.run_id, "with", session.certificate.role, "certificate")
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any

from pydantic import ValidationError

from protocols.errors import ConfigError, SwarmError
from swarm.session import Session, SessionConfig

START_TIMEOUT_MARGIN_S = 60.0  # beyond the join timeout: identity, dial-back and the DHT's start
STOP_TIMEOUT_S = 30.0  # leaving, then the DHT node's shutdown


class Connection:
    """A ``Session`` running in a background thread: a context manager whose ``__enter__`` returns it
    joined, with its DHT node up and its heartbeats running (``connect`` builds one)."""

    def __init__(self, config: SessionConfig, *, device: str = "cpu"):
        self.session = Session(config, device=device)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._started: concurrent.futures.Future = concurrent.futures.Future()

    def __enter__(self) -> Session:
        self._thread = threading.Thread(target=self._serve, name="swarm-session", daemon=True)
        self._thread.start()
        timeout_s = self.session.config.join_timeout_s + START_TIMEOUT_MARGIN_S
        try:
            self._started.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            self.close()
            raise SwarmError(f"the session did not start within {timeout_s:.0f}s") from None
        except BaseException:
            self.close()
            raise
        return self.session

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def close(self) -> None:
        """Leave the run and stop the background thread (waits up to ``STOP_TIMEOUT_S``)."""
        if self._loop is not None and self._stop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(timeout=STOP_TIMEOUT_S)

    def _serve(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as e:  # a failed start is raised from __enter__
            if not self._started.done():
                self._started.set_exception(e)

    async def _main(self) -> None:
        from swarm.coordinator_client import CoordinatorClient

        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        session, config = self.session, self.session.config
        async with CoordinatorClient(
            config.coordinator, timeout_s=config.rpc_timeout_s, reconnect_s=config.max_retry_interval_s
        ) as client:
            try:
                if not await session.start(client, self._stop):
                    raise SwarmError("the session was closed before the coordinator admitted it")
                self._started.set_result(True)
                await session.heartbeats(self._stop)
                await session.leave()
            finally:
                await session.close()


def connect(coordinator: str, **options: Any) -> Connection:
    """Join the run at ``coordinator`` (``HOST:PORT``) as a data-parallel peer, in a ``with`` block.

    ``options`` are ``SessionConfig``'s fields (``identity``, ``name``, ``join_token``, ``coordinator_key``,
    ``host``, ``port``, ``dialable``, ``known_coordinators``, ``join_timeout_s``...); a wrong one is a
    ``ConfigError`` that names it.
    """
    options.setdefault("role", "data")
    device = options.pop("device", "cpu")
    try:
        config = SessionConfig(coordinator=coordinator, **options)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, i['loc'])) or 'options'}: {i['msg']}" for i in e.errors())
        raise ConfigError(f"swarm.connect: {problems}") from None
    return Connection(config, device=device)


__all__ = ["Connection", "connect"]
