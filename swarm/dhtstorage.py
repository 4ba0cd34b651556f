"""Bounded storage for a DHT node: what a node keeps for others has a ceiling, in total and per signer.

hivemind's ``DHTLocalStorage`` keeps every record it is asked to store until it expires, with no bound
(its cache's ``maxsize`` evicts the entry that expires first, which an attacker's far-expiring records
would turn against honest ones). ``BoundedStorage`` refuses, never evicts: a new entry is stored only
while the node holds fewer than ``max_entries`` entries and ``max_bytes`` bytes, its key fewer than
``max_subkeys_per_key`` subkeys, and its subkey (a per-peer record's subkey is its signer) fewer than
``max_bytes_per_subkey`` bytes across keys. An entry already held may always be refreshed by a newer one
of no more bytes than the bounds leave, so an honest peer that re-announces keeps its place however full
the node is; what fills a node empties when it expires (every key's records are bounded in lifetime by
``swarm.keyspace.RunValidator``).

A node also reads the run's ban list: every ban list page signed by the coordinator that passes through
it (stored here, or found by this node's own reads) updates ``NODE_BANS``, and every storage of the
process drops the entries of newly banned peers and refuses their new ones, so a banned identity's
records give way to honest ones at once instead of when they expire.

``swarm.dht`` installs it in every DHT child it starts (hivemind builds its storage itself and takes no
storage argument).
"""

from __future__ import annotations

import contextlib
import heapq
import weakref
from collections import Counter
from dataclasses import dataclass

from hivemind.dht.routing import DHTID, BinaryDHTValue, Subkey
from hivemind.dht.storage import DHTLocalStorage, DictionaryDHTValue
from hivemind.p2p import PeerID
from hivemind.utils import DHTExpiration, MSGPackSerializer, get_dht_time


class NodeBans:
    """The peers this process's DHT node refuses and drops records of: those on the newest ban list the
    coordinator signed, as far as its pages have passed through this node (an unban is a newer list
    without the peer). While the newest list is incomplete here, the peers of the newest complete one
    stay banned too. A record's subkey is its signer (a per-peer record's: the peer ID as text; a
    matchmaking declaration's: the peer ID's bytes), both as their msgpack bytes, as storage holds them."""

    def __init__(self) -> None:
        self.subkeys: dict[bytes, str] = {}
        self.storages: weakref.WeakSet[BoundedStorage] = weakref.WeakSet()
        self._lists: dict[tuple[float, bytes, int], dict[int, list[str]]] = {}

    def add_page(self, changed_at: float, digest: bytes, pages: int, page: int, banned: list[str]) -> None:
        """Take page ``page`` of the list that changed at ``changed_at``; every storage drops the entries of
        peers it newly bans."""
        version = (changed_at, digest, pages)
        newest = max(self._lists, default=None)
        if newest is not None and version < newest and version not in self._lists and self._complete(newest):
            return  # an old list's page: nothing to learn
        self._lists.setdefault(version, {})[page] = list(banned)
        ordered = sorted(self._lists, reverse=True)
        newest = ordered[0]
        complete = next((v for v in ordered if self._complete(v)), None)
        peers = set(_peers(self._lists[newest]))
        if complete is not None and complete != newest:  # the newest is incomplete: its bans stay too
            peers |= set(_peers(self._lists[complete]))
        self._lists = {v: self._lists[v] for v in (newest, complete) if v is not None}
        subkeys = {subkey: peer for peer in peers for subkey in _subkeys_of(peer)}
        new = set(subkeys) - set(self.subkeys)
        self.subkeys = subkeys
        if new:
            for storage in list(self.storages):
                storage.drop_signers(new)

    def _complete(self, version: tuple[float, bytes, int]) -> bool:
        return len(self._lists.get(version, {})) == version[2]

    def __contains__(self, subkey: object) -> bool:
        return isinstance(subkey, bytes) and subkey in self.subkeys


def _peers(pages: dict[int, list[str]]) -> list[str]:
    return [peer for page in sorted(pages) for peer in pages[page]]


def _subkeys_of(peer_id: str) -> list[bytes]:
    forms = [MSGPackSerializer.dumps(peer_id)]
    with contextlib.suppress(Exception):  # not a base58 peer ID: only its text form can be a subkey
        forms.append(MSGPackSerializer.dumps(PeerID.from_base58(peer_id).to_bytes()))
    return forms


#: The ban list as this process's DHT node has read it (one node per process: the DHT's child).
NODE_BANS = NodeBans()


@dataclass(frozen=True)
class StorageLimits:
    """The most one DHT node keeps for others (its storage and its cache each)."""

    max_entries: int = 16384  # values and dictionary entries in all
    max_bytes: int = 64 << 20  # their value bytes in all
    max_subkeys_per_key: int = 4096  # entries of one dictionary (per-peer records: peers)
    max_bytes_per_subkey: int = 256 << 10  # one subkey's (one signer's) value bytes across keys


class BoundedStorage(DHTLocalStorage):
    """``DHTLocalStorage`` that refuses what would pass its ``StorageLimits`` (class attribute ``limits``,
    set in the DHT child before hivemind builds its storage)."""

    limits = StorageLimits()

    def __init__(self, maxsize: int | None = None):
        super().__init__(maxsize)
        self._held: dict[tuple[DHTID, Subkey | None], tuple[int, DHTExpiration]] = {}
        self._expiry_heap: list[tuple[DHTExpiration, int, DHTID, Subkey | None]] = []
        self._pushed = 0
        self._bytes = 0
        self._per_key: Counter[DHTID] = Counter()
        self._per_subkey: Counter[Subkey] = Counter()
        self.dropped_banned = 0
        NODE_BANS.storages.add(self)

    def store(
        self, key: DHTID, value: BinaryDHTValue, expiration_time: DHTExpiration, subkey: Subkey | None = None
    ) -> bool:
        if subkey is not None:
            return self.store_subkey(key, subkey, value, expiration_time)
        if isinstance(value, DictionaryDHTValue):  # a found dictionary cached whole: entry by entry
            with value.freeze():
                items = list(value.items())
            results = [self.store_subkey(key, sub, item.value, item.expiration_time) for sub, item in items]
            return any(results)
        if not self._admit(key, None, len(value)):
            return False
        stored = super().store(key, value, expiration_time)
        if stored:
            self._account(key, None, len(value), expiration_time)
        return stored

    def store_subkey(
        self, key: DHTID, subkey: Subkey, value: BinaryDHTValue, expiration_time: DHTExpiration
    ) -> bool:
        if not self._admit(key, subkey, len(value)):
            return False
        stored = super().store_subkey(key, subkey, value, expiration_time)
        if stored:
            self._account(key, subkey, len(value), expiration_time)
        return stored

    @property
    def held_bytes(self) -> int:
        """Value bytes of the entries held now."""
        self._forget_expired()
        return self._bytes

    @property
    def held_entries(self) -> int:
        self._forget_expired()
        return len(self._held)

    def _admit(self, key: DHTID, subkey: Subkey | None, nbytes: int) -> bool:
        if subkey is not None and subkey in NODE_BANS:
            return False
        self._forget_expired()
        limits = self.limits
        held = self._held.get((key, subkey))
        grows = nbytes - (held[0] if held is not None else 0)
        if self._bytes + grows > limits.max_bytes:
            return False
        if subkey is not None and self._per_subkey[_signer(subkey)] + grows > limits.max_bytes_per_subkey:
            return False
        if held is None:
            if len(self._held) >= limits.max_entries:
                return False
            if subkey is not None and self._per_key[key] >= limits.max_subkeys_per_key:
                return False
        return True

    def _account(
        self, key: DHTID, subkey: Subkey | None, nbytes: int, expiration_time: DHTExpiration
    ) -> None:
        self._release(key, subkey)
        self._held[key, subkey] = (nbytes, expiration_time)
        self._bytes += nbytes
        if subkey is not None:
            self._per_key[key] += 1
            self._per_subkey[_signer(subkey)] += nbytes
        self._pushed += 1  # a tie-breaker, so the heap never compares keys
        heapq.heappush(self._expiry_heap, (expiration_time, self._pushed, key, subkey))

    def _release(self, key: DHTID, subkey: Subkey | None) -> None:
        held = self._held.pop((key, subkey), None)
        if held is None:
            return
        self._bytes -= held[0]
        if subkey is not None:
            self._per_key[key] -= 1
            if self._per_key[key] <= 0:
                del self._per_key[key]
            signer = _signer(subkey)
            self._per_subkey[signer] -= held[0]
            if self._per_subkey[signer] <= 0:
                del self._per_subkey[signer]

    def drop_signers(self, subkeys: set[bytes]) -> None:
        """Drop every entry whose subkey (its signer) is in ``subkeys``: they were just banned."""
        for key, subkey in [held for held in self._held if held[1] in subkeys]:
            found = self.get(key)
            if found is not None and isinstance(found.value, DictionaryDHTValue):
                del found.value[subkey]
                if not found.value.data:  # an empty dictionary is refused by readers: hold none
                    del self[key]
            self._release(key, subkey)
            self.dropped_banned += 1

    def _forget_expired(self) -> None:
        now = get_dht_time()
        while self._expiry_heap and self._expiry_heap[0][0] < now:
            expiration_time, _, key, subkey = heapq.heappop(self._expiry_heap)
            held = self._held.get((key, subkey))
            if held is not None and held[1] == expiration_time:  # else refreshed since: a later entry counts
                self._release(key, subkey)


def _signer(subkey: Subkey) -> Subkey:
    # Subkeys are msgpack scalars (peer ID strings or bytes); a stray unhashable one counts as one signer.
    try:
        hash(subkey)
    except TypeError:
        return repr(subkey)[:128]
    return subkey


async def storage_usage(dht: object, node: object) -> tuple[int, int]:
    """(entries, value bytes) a DHT node keeps for others, storage and cache together: pass to
    ``dht.run_coroutine`` to ask the DHT's child process."""
    stores = [node.protocol.storage, node.protocol.cache]  # type: ignore[attr-defined]
    bounded = [s for s in stores if isinstance(s, BoundedStorage)]
    return sum(s.held_entries for s in bounded), sum(s.held_bytes for s in bounded)
