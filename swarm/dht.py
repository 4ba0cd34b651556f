"""Starting hivemind's DHT under a swarm identity, so the DHT peer ID is the ID of the signing key."""

from __future__ import annotations

import ipaddress
import logging
from pathlib import Path

import hivemind

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


def start_dht(
    key: SigningKey,
    identity_path: Path,
    *,
    host: str,
    port: int,
    initial_peers: list[str],
    upnp: bool = False,
    startup_timeout_s: float = 30.0,
) -> hivemind.DHT:
    """Start a DHT node whose libp2p identity is ``identity_path`` (which must hold ``key``)."""
    try:
        dht = hivemind.DHT(
            initial_peers=initial_peers,
            host_maddrs=[listen_maddr(host, port)],
            identity_path=str(identity_path),
            # hivemind's check assumes RSA identities; our Ed25519 peer ID is checked just below.
            check_if_identity_free=False,
            nat_port_map=upnp,
            startup_timeout=startup_timeout_s,
            start=True,
        )
    except ConfigError:
        raise
    except Exception as e:  # hivemind raises bare P2P/daemon errors with no common base
        raise NetworkError(f"could not start the DHT on {host}:{port}: {e}") from None
    if dht.peer_id.to_base58() != key.peer_id:
        dht.shutdown()
        raise ConfigError(f"the DHT came up as {dht.peer_id}, not as identity {key.peer_id}")
    return dht


def visible_maddrs(dht: hivemind.DHT) -> list[str]:
    return [str(maddr) for maddr in dht.get_visible_maddrs()]
