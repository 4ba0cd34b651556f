"""Signed DHT records: the one trust boundary for everything a peer reads from the run's DHT.

The DHT is open to anyone who learns a bootstrap address, so nothing read from it is used unless it is
a signed envelope (``protocols.envelope``) bound to the run, the record kind (its purpose) and its
signer, with an expiration no later than ``MAX_TTL_S[kind]`` after it was signed:

- per-peer records (``progress``, ``pipeline``, ``members``) live in a dictionary under
  ``<run_id>.<kind>``; the subkey is the signer's peer ID and the body carries the signer's coordinator
  certificate, so anyone holding the coordinator key checks admission offline;
- run records (``checkpoint``, ``bans``) are single values signed by the coordinator key.

``TrustValidator`` enforces this inside every DHT the project starts (through
``swarm.keyspace.RunValidator``; hivemind calls it when a node asks us to store a record and when a node
answers our query), so honest nodes refuse junk and far-future values. An attacker's own node skips validators, so readers check every record again with
``open_peer_record``/``open_run_record`` and also drop records of banned peers (``RecordTrust``).
Without a coordinator key (a local run with no admission) a record needs a valid signature only.
"""

from __future__ import annotations

import functools
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import hivemind
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import MSGPackSerializer, get_dht_time

from protocols.certificates import CERTIFICATE_PURPOSE, PeerCertificate, verify_certificate
from protocols.envelope import MAX_CLOCK_SKEW_S, Envelope, open_envelope, seal
from protocols.errors import CertificateError, ProtocolError, SwarmError
from protocols.keys import PublicKey, SigningKey
from protocols.messages import (
    BAN_LIST,
    CHECKPOINT_RECORD,
    MEMBER_RECORD,
    PIPELINE_RECORD,
    PROGRESS_RECORD,
    BanListBody,
    CheckpointRecordBody,
    MemberRecordBody,
    ProgressRecordBody,
    StageRecordBody,
    TrainerRecordBody,
    parse_body,
)
from protocols.version import MAX_ENVELOPE_BYTES

logger = logging.getLogger(__name__)

PEER_KINDS = {"progress": PROGRESS_RECORD, "pipeline": PIPELINE_RECORD, "members": MEMBER_RECORD}
RUN_KINDS = {"checkpoint": CHECKPOINT_RECORD, "bans": BAN_LIST}
# The longest a record may live past its signing time. Publishers stay well inside: progress and
# pipeline records live 6 announce intervals (at most 360 s), members offline_after_s (at most 3600 s),
# the ban list 10 heartbeats + 30 s (at most 3030 s), the checkpoint record 60 s.
MAX_TTL_S = {"progress": 600.0, "pipeline": 600.0, "members": 3600.0, "checkpoint": 600.0, "bans": 3600.0}
VALIDATED_KINDS = (*PEER_KINDS, *RUN_KINDS)
MAX_RECORD_BYTES = 16 << 10
# A ban list page holds up to a thousand peer IDs: it may fill a whole envelope.
MAX_RUN_RECORD_BYTES = MAX_ENVELOPE_BYTES
_REGULAR_SUBKEY = MSGPackSerializer.dumps(None)
# Floating-point room between the expiry a signer set and the one the DHT hands back.
EXPIRY_SLACK_S = 1e-3


def stage_prefix(run_id: str, stage: int) -> str:
    """The prefix of pipeline stage ``stage``'s records and averagers."""
    return f"{run_id}.stage{stage}"


def record_key(run_id: str, kind: str) -> str:
    """The DHT key of ``kind`` records of ``run_id`` (e.g. ``my-run.progress``)."""
    if kind not in PEER_KINDS and kind not in RUN_KINDS:
        raise ValueError(f"unknown record kind {kind!r}")
    return f"{run_id}.{kind}"


def record_ttl_s(kind: str, ttl_s: float) -> float:
    """``ttl_s`` clamped to what validators accept for ``kind`` (a little under, for clock skew)."""
    return min(ttl_s, MAX_TTL_S[kind] - MAX_CLOCK_SKEW_S / 4)


def default_expiry(kind: str) -> float:
    """The latest expiry a ``kind`` record signed now may carry (for callers that set none)."""
    return get_dht_time() + record_ttl_s(kind, MAX_TTL_S[kind])


def seal_peer_record(
    key: SigningKey,
    kind: str,
    run_id: str,
    body: dict[str, Any],
    certificate: bytes,
    *,
    expires_at: float | None = None,
) -> bytes:
    """Sign a per-peer record; ``expires_at`` (signed with it) is the latest expiry the DHT may store."""
    expires_at = default_expiry(kind) if expires_at is None else float(expires_at)
    return seal(key, PEER_KINDS[kind], run_id, {**body, "certificate": certificate, "expires_at": expires_at})


def check_signed_expiry(kind: str, issued_at: float, signed_expiry: float, expiration_time: float) -> None:
    """A record may be stored to expire no later than its signer said, and its signer may not say more than
    the kind's lifetime: so an old signed record cannot be stored again to outlive its newer ones."""
    if expiration_time > signed_expiry + EXPIRY_SLACK_S:
        raise ProtocolError(
            f"is stored to expire {expiration_time - signed_expiry:.0f}s after its signer set"
        )
    if signed_expiry > issued_at + MAX_TTL_S[kind] + MAX_CLOCK_SKEW_S:
        raise ProtocolError(f"was signed to live past a {kind} record's {MAX_TTL_S[kind]:.0f}s")


@dataclass(frozen=True)
class PeerRecord:
    """A verified per-peer record: who signed it, when, and its checked body."""

    peer_id: str
    kind: str
    issued_at: float
    body: Any  # the kind's pydantic body model


def _body_model(kind: str, body: dict[str, Any]) -> type:
    if kind == "progress":
        return ProgressRecordBody
    if kind == "members":
        return MemberRecordBody
    return StageRecordBody if body.get("role") == "stage" else TrainerRecordBody


def _check_expiration(kind: str, envelope: Envelope, expiration_time: float, now: float) -> None:
    limit = MAX_TTL_S[kind] + MAX_CLOCK_SKEW_S
    if envelope.issued_at > now + MAX_CLOCK_SKEW_S:
        raise ProtocolError(f"is dated {envelope.issued_at - now:.0f}s in the future")
    if expiration_time > envelope.issued_at + limit or expiration_time > now + limit:
        raise ProtocolError(
            f"expires {expiration_time - now:.0f}s from now; a {kind} record may live {MAX_TTL_S[kind]:.0f}s"
        )


@functools.lru_cache(maxsize=4096)
def _verified_certificate(data: bytes, issuer_raw: bytes, run_id: str) -> PeerCertificate:
    # Every record of a peer carries the same certificate: verify its signature once, its expiry each time.
    return verify_certificate(data, issuer=PublicKey(issuer_raw), run_id=run_id, now=0.0)


def open_peer_record(
    kind: str,
    run_id: str,
    subkey: object,
    value: object,
    expiration_time: float,
    coordinator_key: PublicKey | None,
    *,
    now: float | None = None,
) -> PeerRecord:
    """Check one entry of a per-peer dictionary; raises a SwarmError saying what is wrong with it."""
    if not isinstance(subkey, str) or len(subkey) > 128:
        raise ProtocolError("the subkey is not a peer ID")
    if not isinstance(value, bytes) or len(value) > MAX_RECORD_BYTES:
        raise ProtocolError("the value is not a signed record")
    envelope = open_envelope(value, purpose=PEER_KINDS[kind], run_id=run_id, what=f"{kind} record")
    if envelope.sender != subkey:
        raise ProtocolError(f"is signed by {envelope.sender}, not by the peer of its subkey")
    now = get_dht_time() if now is None else now
    _check_expiration(kind, envelope, expiration_time, now)
    body = parse_body(_body_model(kind, envelope.body), envelope.body, sender=subkey, what=f"{kind} record")
    check_signed_expiry(kind, envelope.issued_at, body.expires_at, expiration_time)
    if coordinator_key is not None:
        check_record_certificate(
            body.certificate, coordinator_key, run_id, peer_id=subkey, expires_at=body.expires_at, now=now
        )
    return PeerRecord(subkey, kind, envelope.issued_at, body)


def check_record_certificate(
    certificate: bytes,
    coordinator_key: PublicKey,
    run_id: str,
    *,
    peer_id: str,
    expires_at: float,
    now: float,
) -> PeerCertificate:
    """A record signed by ``peer_id`` to live until ``expires_at`` carries its signer's valid coordinator
    certificate for ``run_id``: returns it, verified; raises a SwarmError saying what is wrong with it."""
    if not certificate:
        raise CertificateError(f"carries no certificate of run {run_id!r}")
    verified = _verified_certificate(certificate, coordinator_key.raw, run_id)
    if verified.expires_at <= now:
        raise CertificateError(f"the certificate of {verified.peer_id} has expired")
    if verified.peer_id != peer_id:
        raise ProtocolError(f"carries the certificate of {verified.peer_id}")
    # A record outliving its certificate would turn invalid while stored, and one invalid entry makes
    # hivemind drop the whole dictionary a node returns.
    if expires_at > verified.expires_at + EXPIRY_SLACK_S:
        raise ProtocolError("was signed to outlive its certificate")
    return verified


def open_run_record(
    kind: str,
    run_id: str,
    value: object,
    expiration_time: float,
    coordinator_key: PublicKey | None,
    *,
    now: float | None = None,
) -> Envelope:
    """Check a coordinator-signed run record (checkpoint, ban list); raises a SwarmError if it is not one."""
    if not isinstance(value, bytes) or len(value) > MAX_RUN_RECORD_BYTES:
        raise ProtocolError("the value is not a signed record")
    envelope = open_envelope(value, purpose=RUN_KINDS[kind], run_id=run_id, signer=coordinator_key, what=kind)
    _check_expiration(kind, envelope, expiration_time, get_dht_time() if now is None else now)
    model = CheckpointRecordBody if kind == "checkpoint" else BanListBody
    body = parse_body(model, envelope.body, sender=envelope.sender, what=f"{kind} record")
    check_signed_expiry(kind, envelope.issued_at, body.expires_at, expiration_time)
    return envelope


class TrustValidator(RecordValidatorBase):
    """hivemind record validator for one run's signed records (``VALIDATED_KINDS``).

    It checks only its own keys and passes others: a DHT node runs it inside ``swarm.keyspace.RunValidator``,
    which routes every key the run uses to its check and refuses every other key.
    Picklable (plain attributes only): the DHT runs it in its spawned child process.
    """

    def __init__(self, run_id: str, coordinator_key: PublicKey | None):
        self.run_id = run_id
        self.coordinator_raw = coordinator_key.raw if coordinator_key is not None else None
        self.kinds = {
            DHTID.generate(source=record_key(run_id, kind)).to_bytes(): kind for kind in VALIDATED_KINDS
        }

    def validate(self, record: DHTRecord) -> bool:
        kind = self.kinds.get(record.key)
        return True if kind is None else self.check(record, kind, self.run_id)

    def check(self, record: DHTRecord, kind: str, run_id: str) -> bool:
        """Whether ``record`` is a valid ``kind`` record signed for ``run_id`` (the run, or a stage prefix
        for a stage's checkpoint record)."""
        coordinator_key = PublicKey(self.coordinator_raw) if self.coordinator_raw is not None else None
        try:
            if len(record.value) > MAX_RUN_RECORD_BYTES + 64:
                raise ProtocolError("the value is too large")
            value = MSGPackSerializer.loads(record.value)
            if kind in RUN_KINDS:
                if record.subkey != _REGULAR_SUBKEY:
                    raise ProtocolError("a run record has no subkeys")
                open_run_record(kind, run_id, value, record.expiration_time, coordinator_key)
            else:
                if record.subkey == _REGULAR_SUBKEY:
                    raise ProtocolError("a per-peer record needs a subkey")
                subkey = MSGPackSerializer.loads(record.subkey)
                open_peer_record(kind, run_id, subkey, value, record.expiration_time, coordinator_key)
        except Exception as e:  # anything a stranger's bytes can raise: refuse the record, never crash
            logger.debug(f"refusing a {kind} record of {run_id!r}: {e}")
            return False
        return True


class LogOnce:
    """Logs each (record, reason) once, remembering a bounded number of them."""

    def __init__(self, limit: int = 1024):
        self.limit, self.seen = limit, OrderedDict()

    def warning(self, what: str, reason: str, *, level: int = logging.WARNING) -> None:
        marker = (what[:96], reason[:96])
        if marker in self.seen:
            return
        self.seen[marker] = None
        if len(self.seen) > self.limit:
            self.seen.popitem(last=False)
        logger.log(level, f"ignoring {what}: {reason}")


@dataclass
class RecordTrust:
    """What a reader needs to judge per-peer records: the run, the coordinator key, the ban list."""

    run_id: str
    coordinator_key: PublicKey | None = None
    is_banned: Callable[[str], bool] = lambda peer_id: False  # reads the holder's current ban list
    log: LogOnce = field(default_factory=LogOnce)

    def open_dictionary(self, kind: str, found: object) -> dict[str, PeerRecord]:
        """The valid, unbanned entries of a per-peer dictionary read with ``dht.get``; others logged once."""
        items = getattr(found, "value", None)
        if not isinstance(items, dict):
            if found is not None:
                self.log.warning(
                    f"the {kind} key in the DHT", "it holds a single value, not per-peer records"
                )
            return {}
        records: dict[str, PeerRecord] = {}
        now = get_dht_time()
        for subkey, item in items.items():
            what = f"{kind} record {str(subkey)[:64]!r} in the DHT"
            try:
                record = open_peer_record(
                    kind, self.run_id, subkey, item.value, item.expiration_time, self.coordinator_key, now=now
                )
            except (SwarmError, AttributeError, TypeError, ValueError) as e:
                self.log.warning(what, str(e))
                continue
            if self.is_banned(record.peer_id):
                self.log.warning(what, "its signer is banned")
                continue
            records[record.peer_id] = record
        return records


class RecordSigner:
    """Signs this peer's per-peer records with its key and its current certificate (renewed in place)."""

    def __init__(self, key: SigningKey, certificate: bytes = b""):
        self.key, self.certificate = key, certificate

    @property
    def peer_id(self) -> str:
        return self.key.peer_id

    def certificate_expiry(self, run_id: str) -> float | None:
        """When this peer's certificate for ``run_id`` expires (None: it holds none)."""
        return _certificate_expiry(self.certificate, run_id)

    def seal(self, kind: str, run_id: str, body: dict[str, Any], *, ttl_s: float) -> tuple[bytes, float]:
        """(the signed record, its expiry): ``ttl_s`` from now, within the kind's limit and never past
        this peer's certificate."""
        expires_at = get_dht_time() + record_ttl_s(kind, ttl_s)
        certificate_expiry = self.certificate_expiry(run_id)
        if certificate_expiry is not None:
            expires_at = min(expires_at, certificate_expiry)
        return seal_peer_record(
            self.key, kind, run_id, body, self.certificate, expires_at=expires_at
        ), expires_at

    async def publish(
        self, dht: hivemind.DHT, kind: str, run_id: str, body: dict[str, Any], *, ttl_s: float
    ) -> bool:
        """Seal ``body`` and store it in the DHT under the run's ``kind`` key, subkey this peer's ID."""
        record, expires_at = self.seal(kind, run_id, body, ttl_s=ttl_s)
        return bool(
            await dht.store(
                record_key(run_id, kind), record, expiration_time=expires_at, subkey=self.peer_id,
                return_future=True,
            )
        )  # fmt: skip


@functools.lru_cache(maxsize=16)
def _certificate_expiry(certificate: bytes, run_id: str) -> float | None:
    """When this peer's own certificate expires (read, not verified: it is our own), or None."""
    if not certificate:
        return None
    try:
        return float(
            open_envelope(certificate, purpose=CERTIFICATE_PURPOSE, run_id=run_id).body["expires_at"]
        )
    except (SwarmError, KeyError, TypeError, ValueError):
        return None
