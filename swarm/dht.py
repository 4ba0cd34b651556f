"""Starting hivemind's DHT under a swarm identity, so the DHT peer ID is the ID of the signing key.

hivemind runs its DHT in a child process. We start that child with ``spawn`` rather than ``fork``:
our processes already run grpc and executor threads when the DHT starts, and a child forked from a
threaded process can hang on a lock some other thread held at the moment of the fork.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Sequence
from multiprocessing.popen_spawn_posix import Popen as SpawnPopen
from pathlib import Path
from typing import Any

import hivemind
from hivemind.dht.validation import RecordValidatorBase

from protocols.errors import ConfigError, NetworkError
from protocols.keys import SigningKey

logger = logging.getLogger(__name__)


def listen_maddr(host: str, port: int) -> str:
    """The libp2p multiaddr to listen on for ``host`` (an IPv4/IPv6 address) and TCP ``port``."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        raise ConfigError(f"host {host!r} is not an IPv4 or IPv6 address") from None
    return f"/ip{address.version}/{address}/tcp/{port}"


class SpawnedDHT(hivemind.DHT):
    """hivemind's DHT in a spawned (not forked) child that exits when its parent dies, even by SIGKILL."""

    @staticmethod
    def _Popen(process_obj: hivemind.DHT) -> SpawnPopen:
        return SpawnPopen(process_obj)

    def run(self) -> None:
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
    validators: Sequence[RecordValidatorBase] = (),
    client_mode: bool = False,
) -> hivemind.DHT:
    """Start a DHT node whose libp2p identity is ``identity_path`` (which must hold ``key``).

    ``validators`` check every record this node stores or receives: pass ``swarm.records.TrustValidator``
    for the run, so the node refuses unsigned records and far-future values under the run's keys.
    ``client_mode``: this machine cannot be dialed (behind NAT), so it stores nothing for others and
    only asks; others do not list it in their routing tables (hivemind's DHT client mode)."""
    dht = _spawn_dht(
        identity_path, host, port, initial_peers=initial_peers, record_validators=list(validators),
        client_mode=client_mode, nat_port_map=upnp, startup_timeout=startup_timeout_s,
    )  # fmt: skip
    return _await_dht(dht, key, f"{host}:{port}", timeout_s=2 * startup_timeout_s)


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


def _spawn_dht(identity_path: Path, host: str, port: int, **hivemind_options: Any) -> SpawnedDHT:
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
    try:
        dht.run_in_background(await_ready=False)
    except Exception as e:
        raise NetworkError(f"could not start the DHT's process for {host}:{port}: {e!r}") from None
    return dht


def _await_dht(dht: SpawnedDHT, key: SigningKey, where: str, *, timeout_s: float) -> hivemind.DHT:
    try:
        dht.wait_until_ready(timeout_s)
    except Exception as e:  # hivemind raises bare P2P/daemon errors with no common base
        if dht.is_alive():
            dht.terminate()
        raise NetworkError(f"could not start the DHT on {where}: {e!r}") from None
    if dht.peer_id.to_base58() != key.peer_id:
        dht.shutdown()
        raise ConfigError(f"the DHT came up as {dht.peer_id}, not as identity {key.peer_id}")
    return dht


def visible_maddrs(dht: hivemind.DHT) -> list[str]:
    return [str(maddr) for maddr in dht.get_visible_maddrs()]


def start_local_dhts(
    count: int,
    home: Path,
    *,
    initial_peers: list[str] | None = None,
    validators: Sequence[RecordValidatorBase] = (),
) -> list[tuple[hivemind.DHT, SigningKey]]:
    """``count`` DHT nodes on loopback, each under a fresh identity in ``home`` (for local rehearsals,
    benchmarks and tests: a peer signs its records with the key of its DHT's peer ID)."""
    from swarm.identity import create_identity

    def identity() -> tuple[Path, SigningKey]:
        path = home / f"dht-{len(list(home.glob('dht-*.key')))}.key"
        return path, create_identity(path)

    nodes: list[tuple[hivemind.DHT, SigningKey]] = []
    if count > 0 and not initial_peers:  # the others bootstrap from the first
        path, key = identity()
        nodes.append(
            (start_dht(key, path, host="127.0.0.1", port=0, initial_peers=[], validators=validators), key)
        )
        initial_peers = visible_maddrs(nodes[0][0])
    # The rest start at once: each child process spends most of its start importing, so on a multi-core
    # machine they overlap.
    spawned = []
    for path, key in [identity() for _ in range(count - len(nodes))]:
        dht = _spawn_dht(
            path, "127.0.0.1", 0, initial_peers=initial_peers, record_validators=list(validators)
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
