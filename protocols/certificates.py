"""Peer certificates: the coordinator's signed statement that a key was admitted to a run.

A certificate names the peer ID, its public key, the run, the role and an expiry. Peers present it in
the DHT; anyone holding the coordinator's public key can check it offline with ``verify_certificate``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from protocols.envelope import open_envelope, seal
from protocols.errors import CertificateError, ProtocolError, SwarmError
from protocols.keys import PublicKey, SigningKey

CERTIFICATE_PURPOSE = "peer-certificate"
ROLES = ("data", "stage", "trainer")


@dataclass(frozen=True)
class PeerCertificate:
    """A verified certificate: the coordinator (``issuer``) admits ``public_key`` to ``run_id`` in ``role``
    until ``expires_at``; ``encoded`` is the signed form peers carry in their DHT records."""

    peer_id: str
    public_key: PublicKey
    run_id: str
    role: str
    name: str
    serial: int
    issued_at: float
    expires_at: float
    issuer: PublicKey
    encoded: bytes

    def expires_in(self, now: float | None = None) -> float:
        return self.expires_at - (time.time() if now is None else now)


def issue_certificate(
    issuer: SigningKey,
    *,
    public_key: PublicKey,
    run_id: str,
    role: str,
    name: str,
    serial: int,
    ttl_s: float,
    now: float | None = None,
) -> PeerCertificate:
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    if not (math.isfinite(ttl_s) and ttl_s > 0):
        raise ValueError(f"ttl_s must be a positive number of seconds, got {ttl_s!r}")
    issued_at = time.time() if now is None else now
    body = {
        "peer_id": public_key.peer_id,
        "public_key": public_key.raw,
        "role": role,
        "name": name,
        "serial": serial,
        "expires_at": issued_at + ttl_s,
    }
    encoded = seal(issuer, CERTIFICATE_PURPOSE, run_id, body, now=issued_at)
    return verify_certificate(encoded, issuer=issuer.public_key, run_id=run_id, now=issued_at)


def verify_certificate(
    data: bytes, *, issuer: PublicKey, run_id: str, now: float | None = None
) -> PeerCertificate:
    """Check a certificate against the run's coordinator key; raises CertificateError if it is not valid."""
    try:
        envelope = open_envelope(data, purpose=CERTIFICATE_PURPOSE, run_id=run_id, what="certificate")
    except SwarmError as e:
        raise CertificateError(f"invalid certificate: {e}") from None
    if envelope.signer != issuer:
        raise CertificateError(
            f"certificate was signed by {envelope.signer.peer_id}, not by this run's coordinator {issuer.peer_id}"
        )
    body = envelope.body
    try:
        public_key = PublicKey(body.get("public_key"))
        fields = {k: body[k] for k in ("peer_id", "role", "name", "serial", "expires_at")}
    except (KeyError, ProtocolError) as e:
        raise CertificateError(f"certificate is missing a field: {e}") from None
    if public_key.peer_id != fields["peer_id"]:
        raise CertificateError("certificate's peer ID does not match its public key")
    if (
        fields["role"] not in ROLES
        or not isinstance(fields["name"], str)
        or not isinstance(fields["serial"], int)
    ):
        raise CertificateError("certificate has a malformed role, name or serial")
    if not isinstance(fields["expires_at"], (int, float)) or not math.isfinite(fields["expires_at"]):
        raise CertificateError("certificate has a malformed expiry")
    current = time.time() if now is None else now
    if fields["expires_at"] <= current:
        raise CertificateError(
            f"certificate of {fields['peer_id']} expired {current - fields['expires_at']:.0f}s ago"
        )
    return PeerCertificate(
        peer_id=fields["peer_id"],
        public_key=public_key,
        run_id=run_id,
        role=fields["role"],
        name=fields["name"],
        serial=fields["serial"],
        issued_at=envelope.issued_at,
        expires_at=float(fields["expires_at"]),
        issuer=issuer,
        encoded=envelope.encoded,
    )
