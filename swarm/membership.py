"""Who is in the run, as the DHT tells it: each peer publishes its certificate, everyone verifies.

A peer stores a member record (``swarm.records``: signed by the peer, carrying its coordinator-signed
certificate) under ``<run_id>.members`` (subkey: its peer ID) with a short expiry that its heartbeats
keep extending, so a departed peer drops out within seconds. Readers accept only records whose
signature and certificate verify, name the subkey's peer, and whose peer is not banned; anything else
is ignored with one log line naming the record.
"""

from __future__ import annotations

import hivemind
from hivemind.utils import get_dht_time

from protocols.certificates import PeerCertificate, verify_certificate
from protocols.keys import PublicKey, SigningKey
from swarm.records import RecordTrust, record_key, record_ttl_s, seal_peer_record


def members_key(run_id: str) -> str:
    return record_key(run_id, "members")


async def publish_certificate(
    dht: hivemind.DHT, key: SigningKey, certificate: PeerCertificate, *, ttl_s: float
) -> bool:
    """Announce ``certificate`` (of ``key``'s peer) for ``ttl_s`` seconds (never past its own expiry)."""
    expiration = min(certificate.expires_at, get_dht_time() + record_ttl_s("members", ttl_s))
    record = seal_peer_record(
        key, "members", certificate.run_id, {}, certificate.encoded, expires_at=expiration
    )
    return bool(
        await dht.store(
            members_key(certificate.run_id), record, expiration_time=expiration, subkey=key.peer_id,
            return_future=True,
        )
    )  # fmt: skip


async def fetch_members(
    dht: hivemind.DHT,
    run_id: str,
    coordinator_key: PublicKey,
    *,
    now: float | None = None,
    trust: RecordTrust | None = None,
) -> dict[str, PeerCertificate]:
    """The verified, unbanned members of ``run_id`` currently announced in the DHT, by peer ID.

    ``trust`` (for ``run_id`` and ``coordinator_key``) carries the ban list and the log of ignored records."""
    trust = trust or RecordTrust(run_id, coordinator_key)
    found = await dht.get(members_key(run_id), latest=True, return_future=True)
    records = trust.open_dictionary("members", found)
    return {
        peer_id: verify_certificate(r.body.certificate, issuer=coordinator_key, run_id=run_id, now=now)
        for peer_id, r in records.items()
    }
