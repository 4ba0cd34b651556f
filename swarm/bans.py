"""The run's ban list: signed by the coordinator, stored in the DHT, fetched and enforced by every peer.

Peers refuse banned peers wherever they meet them without the coordinator: matchmaking neither leads
nor follows them, reducers refuse their part streams, and a group holding one is left. The list is a
whole signed record (not per-peer entries), so nobody but the coordinator can add or remove a name.
"""

from __future__ import annotations

import logging

import hivemind
from hivemind.utils import get_dht_time

from protocols.envelope import open_envelope, seal
from protocols.errors import SwarmError
from protocols.keys import PublicKey, SigningKey
from protocols.messages import BAN_LIST, BanListBody, parse_body

logger = logging.getLogger(__name__)


def ban_list_key(run_id: str) -> str:
    return f"{run_id}.bans"


async def publish_ban_list(
    dht: hivemind.DHT, key: SigningKey, run_id: str, banned: list[str], *, ttl_s: float
) -> bool:
    record = seal(key, BAN_LIST, run_id, {"banned": sorted(banned)})
    return bool(
        await dht.store(
            ban_list_key(run_id), record, expiration_time=get_dht_time() + ttl_s, return_future=True
        )
    )


async def fetch_ban_list(
    dht: hivemind.DHT, run_id: str, coordinator_key: PublicKey
) -> tuple[float, set[str]] | None:
    """(when the coordinator signed it, the banned peer IDs); None when no validly signed list is there.

    Callers keep the newest list they have seen: an older signed list stored again later is stale."""
    found = await dht.get(ban_list_key(run_id), latest=True, return_future=True)
    if found is None or not isinstance(found.value, bytes):
        return None
    try:
        envelope = open_envelope(found.value, purpose=BAN_LIST, run_id=run_id, signer=coordinator_key)
        body = parse_body(BanListBody, envelope.body, sender=coordinator_key.peer_id, what="ban list")
    except SwarmError as e:
        logger.warning(f"ignoring the ban list in the DHT: {e}")
        return None
    return envelope.issued_at, set(body.banned)
