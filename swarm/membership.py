"""Who is in the run, as the DHT tells it: each peer publishes its certificate, everyone verifies.

A peer stores its coordinator-signed certificate under ``<run_id>.members`` (subkey: its peer ID) with a
short expiry that its heartbeats keep extending, so a departed peer drops out within seconds. Readers
accept only records whose certificate verifies against the coordinator key and names the subkey's
peer; anything else is ignored with one log line naming the record.
"""

from __future__ import annotations

import logging
import time

import hivemind
from hivemind.utils import get_dht_time

from protocols.certificates import PeerCertificate, verify_certificate
from protocols.errors import SwarmError
from protocols.keys import PublicKey

logger = logging.getLogger(__name__)


def members_key(run_id: str) -> str:
    return f"{run_id}.members"


async def publish_certificate(dht: hivemind.DHT, certificate: PeerCertificate, *, ttl_s: float) -> bool:
    """Announce ``certificate`` for ``ttl_s`` seconds (never past its own expiry)."""
    expiration = min(certificate.expires_at, get_dht_time() + ttl_s)
    return bool(
        await dht.store(
            members_key(certificate.run_id),
            certificate.encoded,
            expiration_time=expiration,
            subkey=certificate.peer_id,
            return_future=True,
        )
    )


async def fetch_members(
    dht: hivemind.DHT, run_id: str, coordinator_key: PublicKey, *, now: float | None = None
) -> dict[str, PeerCertificate]:
    """The verified members of ``run_id`` currently announced in the DHT, by peer ID."""
    found = await dht.get(members_key(run_id), latest=True, return_future=True)
    if found is None or not isinstance(found.value, dict):
        return {}
    now = time.time() if now is None else now
    members: dict[str, PeerCertificate] = {}
    for subkey, item in found.value.items():
        try:
            if not isinstance(item.value, bytes):
                raise SwarmError("record is not a certificate")
            certificate = verify_certificate(item.value, issuer=coordinator_key, run_id=run_id, now=now)
            if certificate.peer_id != subkey:
                raise SwarmError(f"certificate of {certificate.peer_id} is announced under another peer ID")
        except SwarmError as e:
            logger.warning(f"ignoring member record {str(subkey)[:64]!r} in the DHT: {e}")
            continue
        members[certificate.peer_id] = certificate
    return members
