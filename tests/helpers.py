"""Helpers shared by tests that run real DHT nodes and trainers in the test process."""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

from protocols.keys import SigningKey
from swarm.averaging.allreduce import ButterflyAllReduce
from swarm.dht import SpawnedDHT, start_dht
from swarm.identity import create_identity

KEYS: dict[str, SigningKey] = {}  # peer ID -> the identity its DHT runs under (trainers sign with it)


def start_dhts(count: int, initial_peers: list[str] | None = None, validators=()) -> list[SpawnedDHT]:
    """``count`` DHT nodes on loopback, each under a fresh identity recorded in ``KEYS``; the first
    bootstraps the others unless ``initial_peers`` is given."""
    dhts: list[SpawnedDHT] = []
    home = Path(tempfile.mkdtemp(prefix="swarm-test-keys-"))
    for _ in range(count):
        peers = initial_peers or ([str(a) for a in dhts[0].get_visible_maddrs()] if dhts else [])
        path = home / f"peer{len(dhts)}.key"
        key = create_identity(path)
        dht = start_dht(key, path, host="127.0.0.1", port=0, initial_peers=peers, validators=validators)
        KEYS[key.peer_id] = key
        dhts.append(dht)
    return dhts


class VanishingAllReduce(ButterflyAllReduce):
    """A groupmate that dies right after its group formed: it neither sends nor reduces."""

    async def run(self):
        await asyncio.sleep(3600)
