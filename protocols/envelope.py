"""Signed envelopes: a body signed by one key and bound to a protocol version, purpose, run and time.

The signature covers the exact payload bytes, which carry the purpose and run ID, so a heartbeat
signature cannot be passed off as a join, and nothing signed for one run is accepted by another.
Freshness (``max_age_s``) and per-sender sequence numbers are what make replays fail.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

from protocols.codec import pack, unpack
from protocols.errors import ProtocolError, ReplayError, SignatureError
from protocols.keys import PublicKey, SigningKey
from protocols.version import MAX_ENVELOPE_BYTES, PROTOCOL_VERSION, SIGNATURE_DOMAIN

# How far a sender's clock may run ahead of ours before its messages are refused.
MAX_CLOCK_SKEW_S = 120.0


@dataclass(frozen=True)
class Envelope:
    """A verified envelope: who signed what, for which run and purpose, and when."""

    purpose: str
    run_id: str
    signer: PublicKey
    issued_at: float
    body: dict[str, Any]
    encoded: bytes

    @property
    def sender(self) -> str:
        return self.signer.peer_id


def seal(
    key: SigningKey, purpose: str, run_id: str, body: dict[str, Any], *, now: float | None = None
) -> bytes:
    """Sign ``body`` for ``purpose`` in ``run_id``; returns the bytes to send."""
    payload = pack(
        {
            "v": PROTOCOL_VERSION,
            "purpose": purpose,
            "run": run_id,
            "signer": key.public_key.raw,
            "t": time.time() if now is None else float(now),
            "body": body,
        }
    )
    return pack({"payload": payload, "sig": key.sign(SIGNATURE_DOMAIN + payload)})


def _field(obj: dict, name: str, kind: type | tuple[type, ...], what: str) -> Any:
    value = obj.get(name)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise ProtocolError(f"{what}: field {name!r} is missing or of the wrong type")
    return value


def open_envelope(
    data: bytes,
    *,
    purpose: str,
    run_id: str,
    signer: PublicKey | None = None,
    max_age_s: float | None = None,
    now: float | None = None,
    what: str = "signed message",
) -> Envelope:
    """Check an envelope from the network and return it; raises a SwarmError naming what is wrong.

    ``signer``, when given, is the only key accepted. ``max_age_s``, when given, refuses envelopes
    issued longer ago than that (or too far in the future) as replays.
    """
    outer = unpack(data, max_bytes=MAX_ENVELOPE_BYTES, what=what)
    if not isinstance(outer, dict):
        raise ProtocolError(f"{what} is not a map")
    payload = _field(outer, "payload", bytes, what)
    signature = _field(outer, "sig", bytes, what)
    inner = unpack(payload, what=what)
    if not isinstance(inner, dict):
        raise ProtocolError(f"{what}: payload is not a map")
    version = _field(inner, "v", int, what)
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"{what} uses protocol version {version}; this side speaks {PROTOCOL_VERSION}")
    signer_raw = _field(inner, "signer", bytes, what)
    if len(signer_raw) != 32:
        raise ProtocolError(f"{what}: signer is not a 32-byte Ed25519 public key")
    claimed = PublicKey(signer_raw)
    if signer is not None and claimed != signer:
        raise SignatureError(f"{what} is signed by {claimed.peer_id}, expected {signer.peer_id}")
    claimed.verify(signature, SIGNATURE_DOMAIN + payload)
    got_purpose = _field(inner, "purpose", str, what)
    if got_purpose != purpose:
        raise ProtocolError(f"{what} from {claimed.peer_id} is for {got_purpose!r}, expected {purpose!r}")
    got_run = _field(inner, "run", str, what)
    if got_run != run_id:
        raise ProtocolError(f"{what} from {claimed.peer_id} is for run {got_run!r}, expected {run_id!r}")
    issued_at = float(_field(inner, "t", (int, float), what))
    if not math.isfinite(issued_at):
        raise ProtocolError(f"{what} from {claimed.peer_id} has a non-finite timestamp")
    if max_age_s is not None:
        current = time.time() if now is None else now
        if issued_at < current - max_age_s:
            raise ReplayError(
                f"{what} from {claimed.peer_id} is {current - issued_at:.0f}s old (limit {max_age_s:.0f}s)"
            )
        if issued_at > current + MAX_CLOCK_SKEW_S:
            raise ReplayError(
                f"{what} from {claimed.peer_id} is dated {issued_at - current:.0f}s in the future"
            )
    body = _field(inner, "body", dict, what)
    return Envelope(got_purpose, got_run, claimed, issued_at, body, bytes(data))
