"""The run's ban list: signed by the coordinator, stored in the DHT, fetched and enforced by every peer.

Peers refuse banned peers wherever they meet them without the coordinator: matchmaking neither leads
nor follows them, reducers refuse their part streams, and a group holding one is left. Nobody but the
coordinator can add or remove a name: the list is published in pages of up to 200 peer IDs, page 0
under the key ``<run>.bans`` and page k under ``<run>.bans.k``, each page an envelope of purpose
``ban-list`` signed by the coordinator and carrying the hash of the whole list, the page count and
when the list last changed. A reader takes the newest list whose pages are all there and hash to that
value; a reader that finds none complete (pages of two versions while the coordinator republishes)
keeps the list it had. Readers look at page 0 first and fetch the other pages only when it announces
a list they have not assembled yet, so an unchanged list costs one lookup however long it is.

Page 0 is a run record that ``swarm.records.TrustValidator`` checks on every DHT node; pages 1 and on
are checked by ``BanPageValidator``; ``swarm.keyspace.RunValidator`` routes each page's key to its check,
or a stranger could store junk that outlives the real page under ``<run>.bans.k`` and keep long lists
from ever assembling again.

Pages are small because a value stored through hivemind's DHT crosses a pipe into the DHT process,
and a message over 16 KiB reaches it in two writes that the DHT process can read half of under load.

Example::

    await publish_ban_list(dht, coordinator_key, "my-run", banned, changed_at=time.time(), ttl_s=60)
    found = await fetch_ban_list(dht, "my-run", coordinator_key.public_key)  # (changed_at, {peer IDs})
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Iterable

import hivemind
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import MSGPackSerializer, get_dht_time

from protocols.envelope import open_envelope, seal
from protocols.errors import ProtocolError, SwarmError
from protocols.keys import PublicKey, SigningKey
from protocols.messages import BAN_LIST, BAN_PAGE_ENTRIES, MAX_BAN_PAGES, BanListBody, parse_body
from swarm.records import check_signed_expiry, default_expiry, record_ttl_s

logger = logging.getLogger(__name__)

MAX_BANNED = BAN_PAGE_ENTRIES * MAX_BAN_PAGES
# A page may live this long past its signature (the coordinator republishes far sooner), plus clock skew.
MAX_PAGE_TTL_S = 3600.0
MAX_CLOCK_SKEW_S = 120.0
MAX_PAGE_BYTES = 16 << 10
_REGULAR_SUBKEY = MSGPackSerializer.dumps(None)
# The last complete list assembled per (run, coordinator key), so an unchanged list is not fetched again.
_assembled: dict[tuple[str, bytes], tuple[tuple[float, bytes, int], set[str]]] = {}


def ban_list_key(run_id: str, page: int = 0) -> str:
    return f"{run_id}.bans" if page == 0 else f"{run_id}.bans.{page}"


def list_digest(banned: Iterable[str]) -> bytes:
    """What every page of one list signs: the SHA-256 of the sorted peer IDs, one per line."""
    return hashlib.sha256("\n".join(sorted(banned)).encode()).digest()


def ban_list_pages(
    key: SigningKey, run_id: str, banned: Iterable[str], *, changed_at: float, expires_at: float | None = None
) -> list[bytes]:
    """The signed pages of a list of at most ``MAX_BANNED`` peer IDs, to expire at ``expires_at``."""
    expires_at = default_expiry("bans") if expires_at is None else float(expires_at)
    ordered = sorted(set(banned))
    if len(ordered) > MAX_BANNED:
        raise ValueError(f"a ban list holds at most {MAX_BANNED} peers, not {len(ordered)}")
    chunks = [ordered[i : i + BAN_PAGE_ENTRIES] for i in range(0, len(ordered), BAN_PAGE_ENTRIES)] or [[]]
    digest = list_digest(ordered)
    return [
        seal(
            key,
            BAN_LIST,
            run_id,
            {
                "banned": chunk,
                "page": page,
                "pages": len(chunks),
                "list_sha256": digest,
                "changed_at": changed_at,
                "expires_at": expires_at,
            },
        )  # fmt: skip
        for page, chunk in enumerate(chunks)
    ]


async def publish_ban_list(
    dht: hivemind.DHT,
    key: SigningKey,
    run_id: str,
    banned: Iterable[str],
    *,
    changed_at: float,
    ttl_s: float,
) -> bool:
    """Store every page, the last first (a reader looks at page 0 first); True when all were stored."""
    expiration = get_dht_time() + record_ttl_s("bans", ttl_s)
    pages = ban_list_pages(key, run_id, banned, changed_at=changed_at, expires_at=expiration)
    stored = [
        await dht.store(ban_list_key(run_id, index), pages[index], expiration, return_future=True)
        for index in reversed(range(len(pages)))
    ]
    return all(stored)


def assemble_ban_list(
    records: Iterable[object], run_id: str, coordinator_key: PublicKey
) -> tuple[float, set[str]] | None:
    """(when the list last changed, the banned peer IDs) of the newest complete list among ``records``
    (page envelopes as found in the DHT); None when no list is complete. Anything not a page signed by
    the coordinator is ignored with a log line."""
    versions: dict[tuple[float, bytes, int], dict[int, list[str]]] = {}
    for record in records:
        body = open_ban_page(record, run_id, coordinator_key)
        if body is not None and body.page < body.pages:
            versions.setdefault((body.changed_at, body.list_sha256, body.pages), {})[body.page] = body.banned
    for (changed_at, digest, pages), found in sorted(versions.items(), key=lambda item: -item[0][0]):
        if len(found) != pages:
            continue
        banned = [peer for page in range(pages) for peer in found[page]]
        if list_digest(banned) == digest:
            return changed_at, set(banned)
    return None


class BanPageValidator(RecordValidatorBase):
    """hivemind record validator for pages 1 and on of one run's ban list: each must be a page of that
    number signed by the coordinator (any key when the node knows none), one value with no subkey, and
    expire within ``MAX_PAGE_TTL_S`` of its signature. Other keys pass through: a DHT node runs it inside
    ``swarm.keyspace.RunValidator``, which refuses every key the run does not use.

    Picklable (plain attributes only): the DHT runs it in its spawned child process.
    """

    def __init__(self, run_id: str, coordinator_key: PublicKey | None):
        self.run_id = run_id
        self.coordinator_raw = coordinator_key.raw if coordinator_key is not None else None
        self.pages = {
            DHTID.generate(source=ban_list_key(run_id, page)).to_bytes(): page
            for page in range(1, MAX_BAN_PAGES)
        }

    def validate(self, record: DHTRecord) -> bool:
        page = self.pages.get(record.key)
        return True if page is None else self.check(record, page)

    def check(self, record: DHTRecord, page: int) -> bool:
        """Whether ``record`` is page ``page`` of the run's ban list, signed by the coordinator."""
        try:
            if record.subkey != _REGULAR_SUBKEY or len(record.value) > MAX_PAGE_BYTES:
                raise ProtocolError("not a single value of at most 16 KiB")
            value = MSGPackSerializer.loads(record.value)
            signer = PublicKey(self.coordinator_raw) if self.coordinator_raw is not None else None
            if not isinstance(value, bytes):
                raise ProtocolError("the value is not a signed record")
            envelope = open_envelope(
                value, purpose=BAN_LIST, run_id=self.run_id, signer=signer, what="ban list page"
            )
            body = parse_body(BanListBody, envelope.body, sender=envelope.sender, what="ban list page")
            if body.page != page:
                raise ProtocolError(f"page {body.page} stored as page {page}")
            limit = envelope.issued_at + MAX_PAGE_TTL_S + MAX_CLOCK_SKEW_S
            if record.expiration_time > limit or envelope.issued_at > get_dht_time() + MAX_CLOCK_SKEW_S:
                raise ProtocolError("expires too long after it was signed")
            check_signed_expiry("bans", envelope.issued_at, body.expires_at, record.expiration_time)
        except Exception as e:  # anything a stranger's bytes can raise: refuse the record, never crash
            logger.debug(f"refusing ban list page {page} of run {self.run_id!r}: {e}")
            return False
        return True


def open_ban_page(record: object, run_id: str, coordinator_key: PublicKey) -> BanListBody | None:
    try:
        if not isinstance(record, bytes):
            raise ProtocolError("the value is not a signed record")
        envelope = open_envelope(record, purpose=BAN_LIST, run_id=run_id, signer=coordinator_key)
        return parse_body(BanListBody, envelope.body, sender=coordinator_key.peer_id, what="ban list page")
    except SwarmError as e:
        logger.warning(f"ignoring a ban list page in the DHT: {e}")
        return None


async def fetch_ban_list(
    dht: hivemind.DHT, run_id: str, coordinator_key: PublicKey
) -> tuple[float, set[str]] | None:
    """(when the coordinator last changed it, the banned peer IDs); None when no complete, validly signed
    list is there.

    Callers keep the newest list they have seen: an older signed list stored again later is stale."""
    first = await dht.get(ban_list_key(run_id), latest=True, return_future=True)
    head = None if first is None else open_ban_page(first.value, run_id, coordinator_key)
    if head is None:
        return None
    cache_key = (run_id, coordinator_key.raw)
    version = (head.changed_at, head.list_sha256, head.pages)
    cached = _assembled.get(cache_key)
    if cached is not None and cached[0] == version:
        return head.changed_at, set(cached[1])
    records = [first.value]
    if head.pages > 1:
        rest = await asyncio.gather(
            *(
                dht.get(ban_list_key(run_id, page), latest=True, return_future=True)
                for page in range(1, head.pages)
            )
        )
        records += [found.value for found in rest if found is not None]
    found = assemble_ban_list(records, run_id, coordinator_key)
    if found is not None and found[0] == head.changed_at:
        if len(_assembled) >= 16 and cache_key not in _assembled:
            _assembled.clear()
        _assembled[cache_key] = (version, found[1])
    return found
