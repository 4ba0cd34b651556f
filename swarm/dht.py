"""Starting hivemind's DHT under a swarm identity, so the DHT peer ID is the ID of the signing key.

hivemind runs its DHT in a child process. We never fork the running process for it: our processes
already run grpc and executor threads when the DHT starts, and a child forked from a threaded process
can hang on a lock some other thread held at the moment of the fork. A command forks the child from
the copy of itself it made before any thread (``swarm.forkserver``); any other process spawns it. Every
fork of a process that imported this module gets hivemind's process-wide locks of its own
(``_fresh_hivemind_locks``). The child keeps no more for others than its ``StorageLimits``
(``swarm.dhtstorage``).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import multiprocessing
import os
import signal
import socket
import threading
import time
from collections.abc import Sequence
from functools import partial
from multiprocessing.popen_spawn_posix import Popen as SpawnPopen
from pathlib import Path
from typing import Any

import hivemind
import hivemind.dht.node
import hivemind.dht.protocol
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.dht.validation import RecordValidatorBase

from protocols.errors import ConfigError, DHTStartFailed, NetworkError
from protocols.keys import SigningKey
from swarm import forkserver
from swarm.dhtstorage import BoundedStorage, StorageLimits

logger = logging.getLogger(__name__)


def listen_maddr(host: str, port: int) -> str:
    """The libp2p multiaddr to listen on for ``host`` (an IPv4/IPv6 address) and TCP ``port``."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        raise ConfigError(f"host {host!r} is not an IPv4 or IPv6 address") from None
    return f"/ip{address.version}/{address}/tcp/{port}"


def _fresh_hivemind_locks() -> None:
    """hivemind creates process-wide multiprocessing locks when it is imported (``MPFuture``'s, and its
    executor's). A process forked after that import shares each of them with every other fork of the
    same process, so one killed while it held one (a DHT process, a peer killed outright) would stall all
    the others at their next future update. A spawned child imports hivemind and has locks of its own;
    a forked one is given its own here (hivemind's own reset)."""
    from hivemind.utils.asyncio import _AsyncContextWrapper
    from hivemind.utils.mpfuture import MPFuture

    MPFuture.reset_backend()
    _AsyncContextWrapper.EXECUTOR_LOCK = multiprocessing.Lock()


os.register_at_fork(after_in_child=_fresh_hivemind_locks)


class CheckedProtocol(DHTProtocol):
    """hivemind's DHT protocol that refuses an empty dictionary, in a store or in a node's answer.

    An empty dictionary passes every record validator (it holds no record to check), and hivemind's
    lookup keeps whichever answer expires last: a node that answered with an empty dictionary expiring in
    30 years would hide a key's real value (the ban list, a checkpoint record) from every reader that
    asks it. Honest nodes never send one: a dictionary expires with its last entry.
    """

    def _validate_dictionary(self, key_bytes: bytes, dictionary: DictionaryDHTValue) -> bool:
        with dictionary.freeze():
            if not dictionary.data:
                return False
        return super()._validate_dictionary(key_bytes, dictionary)


class DroppedCoroutineNoise(logging.Filter):
    """Drops what hivemind's DHT process logs when a request's coroutine is dropped before it ends (its
    task garbage-collected while it waited): an ERROR with a ``GeneratorExit`` traceback from
    ``DHT._run_coroutine`` and asyncio's "Task was destroyed but it is pending!" for that task. Nothing
    failed there: the peer's own wait for the request has a timeout, which says so where it matters.
    Every other record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.exc_info[0] is GeneratorExit:
            return False
        message = record.getMessage()
        return not (
            message.startswith("Task was destroyed but it is pending") and "_run_coroutine" in message
        )


class SpawnedDHT(hivemind.DHT):
    """hivemind's DHT in a child spawned, or forked from the fork server (never a fork of the running
    process), that exits when its parent dies, even by SIGKILL,
    keeps no more for others than its ``storage_limits`` (``swarm.dhtstorage``) and refuses empty
    dictionaries (``CheckedProtocol``)."""

    storage_limits = StorageLimits()

    @staticmethod
    def _Popen(process_obj: hivemind.DHT) -> SpawnPopen | forkserver.ForkServerPopen:
        if forkserver.running():
            try:
                return forkserver.ForkServerPopen(process_obj)
            except forkserver.ForkServerError as e:
                logger.warning(f"spawning the DHT's process instead: {e}")
        return SpawnPopen(process_obj)

    def run(self) -> None:
        # hivemind builds its protocol, storage and cache from these module-level names and takes no
        # argument for them; this runs in the DHT's own child process, so nothing else sees the change.
        BoundedStorage.limits = self.storage_limits
        for name in ("hivemind.dht.dht", "asyncio"):
            logging.getLogger(name).addFilter(DroppedCoroutineNoise())
        hivemind.dht.protocol.DHTLocalStorage = BoundedStorage
        hivemind.dht.node.DHTProtocol = CheckedProtocol
        parent = os.getppid()

        def watch_parent() -> None:
            # Without this, a peer killed outright would leave its DHT node and p2p daemon running.
            while os.getppid() == parent:
                time.sleep(1.0)
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Thread(target=watch_parent, name="swarm-parent-watch", daemon=True).start()
        super().run()


def start_dht(
    key: SigningKey,
    identity_path: Path,
    *,
    host: str,
    port: int,
    initial_peers: list[str],
    upnp: bool = False,
    startup_timeout_s: float = 30.0,
    ready_timeout_s: float = 180.0,
    validators: Sequence[RecordValidatorBase] = (),
    client_mode: bool = False,
) -> hivemind.DHT:
    """Start a DHT node whose libp2p identity is ``identity_path`` (which must hold ``key``).

    ``validators`` check every record this node stores or receives: pass ``swarm.keyspace.RunValidator``
    for the run, so the node refuses every key the run does not use, and unsigned records and far-future
    values under the keys it does.
    ``client_mode``: this machine cannot be dialed (behind NAT), so it stores nothing for others and
    only asks; others do not list it in their routing tables (hivemind's DHT client mode).
    ``startup_timeout_s`` bounds the p2p daemon's start inside the node's process; ``ready_timeout_s`` the
    whole start, process included, which says every ``DHT_PROGRESS_EVERY_S`` what it is waiting for."""
    dht = _spawn_dht(
        identity_path, host, port, initial_peers=initial_peers, record_validators=list(validators),
        client_mode=client_mode, nat_port_map=upnp, startup_timeout=startup_timeout_s,
    )  # fmt: skip
    return _await_dht(dht, key, f"{host}:{port}", timeout_s=max(ready_timeout_s, startup_timeout_s))


def refuse_port_in_use(host: str, port: int) -> None:
    """Raise NetworkError naming ``host:port`` if a process listens on it.

    The p2p daemon binds with SO_REUSEPORT, so a second daemon on a used port would start and the
    kernel would split connections between the two; a probe bound without it fails instead."""
    if port == 0:
        return
    family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        # SO_REUSEADDR lets a restart bind over its predecessor's closing connections, never a listener.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as e:
            raise NetworkError(f"cannot serve the DHT on {host}:{port}: {e.strerror}") from None


def _spawn_dht(
    identity_path: Path,
    host: str,
    port: int,
    storage_limits: StorageLimits | None = None,
    **hivemind_options: Any,
) -> SpawnedDHT:
    """The DHT's child process, started (``hivemind_options``: ``hivemind.DHT``'s own arguments, such as
    ``initial_peers``); ``_await_dht`` waits for it and checks its identity."""
    maddr = listen_maddr(host, port)
    refuse_port_in_use(host, port)
    dht = SpawnedDHT(
        host_maddrs=[maddr],
        identity_path=str(identity_path),
        # hivemind's check assumes RSA identities; our Ed25519 peer ID is checked in _await_dht.
        check_if_identity_free=False,
        start=False,
        **hivemind_options,
    )
    dht.name = "swarm-dht"
    if storage_limits is not None:
        dht.storage_limits = storage_limits
    try:
        dht.run_in_background(await_ready=False)
    except Exception as e:
        raise NetworkError(f"could not start the DHT's process for {host}:{port}: {e!r}") from None
    return dht


# How often a slow DHT start says what it waits for: its process imports torch and hivemind and starts
# the p2p daemon, which takes seconds on a quiet machine and can take minutes on a loaded one.
DHT_PROGRESS_EVERY_S = 20.0
CHILD_EXIT_TIMEOUT_S = 10.0  # how long a DHT process that did not start may take to exit


def _await_dht(dht: SpawnedDHT, key: SigningKey, where: str, *, timeout_s: float) -> hivemind.DHT:
    started = time.monotonic()
    deadline = started + timeout_s
    while True:
        try:
            dht.wait_until_ready(max(0.0, min(DHT_PROGRESS_EVERY_S, deadline - time.monotonic())))
            break
        except TimeoutError:
            waited = time.monotonic() - started
            if time.monotonic() < deadline and dht.is_alive():
                logger.info(
                    f"still waiting for the DHT node on {where} to start ({waited:.0f}s of at most "
                    f"{timeout_s:.0f}s; load average {_load()}): its process imports torch and hivemind"
                )
                continue
            _stop_child(dht)
            # Only a wait that ran out may go better later (a busy machine): the session tries again.
            raise DHTStartFailed(
                f"could not start the DHT on {where}: not ready after {waited:.0f}s"
            ) from None
        except Exception as e:  # hivemind raises bare P2P/daemon errors with no common base
            _stop_child(dht)
            raise NetworkError(f"could not start the DHT on {where}: {e!r}") from None
    if dht.peer_id.to_base58() != key.peer_id:
        dht.shutdown()
        raise ConfigError(f"the DHT came up as {dht.peer_id}, not as identity {key.peer_id}")
    return dht


def _stop_child(dht: SpawnedDHT) -> None:
    """End a DHT process that did not start, and wait for it (bounded), so that a new try on the same
    port does not find it still bound."""
    if dht.is_alive():
        dht.terminate()
        dht.join(CHILD_EXIT_TIMEOUT_S)


def _load() -> str:
    try:
        return f"{os.getloadavg()[0]:.1f}"
    except OSError:
        return "unknown"


def visible_maddrs(dht: hivemind.DHT) -> list[str]:
    return [str(maddr) for maddr in dht.get_visible_maddrs()]


# The addresses of one node that a ping tries: a node listens on a few (IPv4, IPv6, relays), not more.
MAX_PING_MADDRS = 16


async def ping_node(dht: hivemind.DHT, maddrs: Sequence[str], *, peer_id: str, timeout_s: float) -> bool:
    """Dial the DHT node ``peer_id`` at those of ``maddrs`` that name it, and ping it; True if it answered.

    A ping enters each node in the other's routing table (unless this one is in client mode). This is
    how a running peer re-enters a coordinator's DHT node that restarted empty, perhaps on a new port:
    bootstrapping happens only when a node starts, and a restarted node knows no one.
    """
    from hivemind.utils.multiaddr import Multiaddr

    own = []
    for text in list(maddrs)[:MAX_PING_MADDRS]:
        try:
            if Multiaddr(text).value_for_protocol("p2p") == peer_id:
                own.append(text)
        except Exception:  # multiaddr raises several unrelated types for a malformed address
            logger.debug(f"ignoring malformed multiaddr {text!r}")
    if not own:
        return False
    future = dht.run_coroutine(partial(_ping_in_node, peer_id=peer_id, maddrs=own), return_future=True)
    try:
        return bool(await asyncio.wait_for(future, timeout=timeout_s))
    except asyncio.TimeoutError:
        future.cancel()
        return False
    except Exception as e:  # the DHT process is gone or the ping failed inside it
        logger.debug(f"pinging {peer_id} failed: {e!r}")
        return False


async def _ping_in_node(_dht: hivemind.DHT, node: Any, *, peer_id: str, maddrs: list[str]) -> bool:
    """Runs in the DHT's process (see :func:`ping_node`)."""
    from hivemind.p2p import PeerID
    from hivemind.utils.multiaddr import Multiaddr

    target = PeerID.from_base58(peer_id)
    suffix = Multiaddr(f"/p2p/{peer_id}")
    addresses = [Multiaddr(m).decapsulate(suffix) for m in maddrs]
    # hivemind exposes no public dial; an address the daemon already knows still lets the ping through.
    with contextlib.suppress(Exception):
        await node.p2p._client.connect(target, addresses)
    return await node.protocol.call_ping(target) is not None


def start_local_dhts(
    count: int,
    home: Path,
    *,
    initial_peers: list[str] | None = None,
    validators: Sequence[RecordValidatorBase] = (),
    storage_limits: StorageLimits | None = None,
) -> list[tuple[hivemind.DHT, SigningKey]]:
    """``count`` DHT nodes on loopback, each under a fresh identity in ``home`` (for local rehearsals,
    benchmarks and tests: a peer signs its records with the key of its DHT's peer ID), each keeping at
    most ``storage_limits`` (default: ``StorageLimits()``)."""
    from swarm.identity import create_identity

    def identity() -> tuple[Path, SigningKey]:
        path = home / f"dht-{len(list(home.glob('dht-*.key')))}.key"
        return path, create_identity(path)

    nodes: list[tuple[hivemind.DHT, SigningKey]] = []
    if count > 0 and not initial_peers:  # the others bootstrap from the first
        path, key = identity()
        dht = _spawn_dht(
            path, "127.0.0.1", 0, storage_limits, initial_peers=[], record_validators=list(validators)
        )
        nodes.append((_await_dht(dht, key, "127.0.0.1", timeout_s=60.0), key))
        initial_peers = visible_maddrs(nodes[0][0])
    # The rest start at once: each child process spends most of its start importing, so on a multi-core
    # machine they overlap.
    spawned = []
    for path, key in [identity() for _ in range(count - len(nodes))]:
        dht = _spawn_dht(
            path,
            "127.0.0.1",
            0,
            storage_limits,
            initial_peers=initial_peers,
            record_validators=list(validators),
        )
        spawned.append((dht, key))
    ready: list[tuple[hivemind.DHT, SigningKey]] = []
    try:
        for dht, key in spawned:
            ready.append((_await_dht(dht, key, "127.0.0.1", timeout_s=60.0), key))
    except BaseException:
        for dht, _ in spawned[len(ready) :]:
            if dht.is_alive():
                dht.terminate()
        for dht, _ in nodes + ready:
            dht.shutdown()
        raise
    return nodes + ready
