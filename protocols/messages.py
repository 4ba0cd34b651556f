"""The bodies of the signed messages between peers and the coordinator, checked field by field.

Each body is a pydantic model in strict mode that forbids unknown fields, so a malformed message is
refused with the name of the offending field before anything in it is used.
"""

from __future__ import annotations

import hashlib
import hmac
import math
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from protocols.errors import ProtocolError

JOIN = "join"
JOIN_ANSWER = "join-answer"
HEARTBEAT = "heartbeat"
LEAVE = "leave"
RUN_STATE = "run-state"
ACCUSE = "accuse"
BAN_LIST = "ban-list"
# Signed DHT records (see swarm/records.py): one purpose per record kind, so none passes for another.
PROGRESS_RECORD = "progress-record"
PIPELINE_RECORD = "pipeline-record"
MEMBER_RECORD = "member-record"
CHECKPOINT_RECORD = "checkpoint-record"
# A matchmaking declaration: "this peer leads/looks for a group under this key until then" (swarm.averaging.declarations).
GROUP_DECLARATION = "group-declaration"

CHALLENGE_BYTES = 32
# A ban list page stays under 16 KiB (see swarm.bans); 128 pages hold 25,600 peer IDs.
BAN_PAGE_ENTRIES = 200
MAX_BAN_PAGES = 128
MAX_METRICS = 64
# Peers a heartbeat may name as ones its sender avoids for breaking rounds (``PeerPolicy`` suspects).
MAX_SUSPECT_REPORTS = 16
# Rounds a heartbeat may carry as witnessed (the signed group entries of rounds its sender applied),
# members per round, and bytes per signed entry (an honest entry with its certificate is about 900 bytes,
# 1,401 with every field an honest peer fills at its bound: a 64-character run ID and name of 4-byte
# characters, a 256-character data address; a member's entry beyond the bound is left out by the
# witness, so that it cannot get a heartbeat refused): at most 216 KiB in all, within the envelope's 256 KiB.
MAX_WITNESSED_ROUNDS = 3
MAX_ROUND_ENTRIES = 48
MAX_ENTRY_BYTES = 1536
# Peers the coordinator names in a heartbeat answer's standing (their credited samples), at most: about
# 33 KiB, sent only to a peer whose copy is older than the coordinator's (``RunStateBody.standing``).
MAX_STANDING = 512
#: A pipeline trainer's highest attempt number for one micro-batch at one step (a sanity bound).
MAX_ATTEMPT = 1 << 16
#: Retried micro-batches a stage replica announces per step at most (about 140 bytes each).
MAX_RETRIED_CLAIMS = 64
# How long the coordinator may spend judging one accusation's recomputation (a sender's step, or a whole
# DiLoCo window, replayed on its CPU), past which it gives up and bans nobody; an accuser waits this long
# beyond its call's own deadline for the verdict.
JUDGING_BUDGET_S = 300.0
PEER_STATES = ("online", "offline", "left", "banned")
REQUESTED_ROLES = ("auto", "data", "stage", "trainer")

Name = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[^\x00-\x1f\x7f]+$")]
# A libp2p peer ID as base58 text (its form is checked, not that any peer holds it).
PeerIdText = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[1-9A-HJ-NP-Za-km-z]+$")]


class _Body(BaseModel):
    """Base of every body: strict types, no unknown fields, immutable once parsed."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


class JoinBody(_Body):
    """A peer's join request to the coordinator (purpose ``join``): the challenge it answers, its name,
    device and requested role and, under token admission, its proof of the join token."""

    challenge: bytes = Field(min_length=CHALLENGE_BYTES, max_length=CHALLENGE_BYTES)
    name: Name
    device: Name
    role: Literal["auto", "data", "stage", "trainer"]
    token_proof: bytes = Field(default=b"", max_length=32)


class JoinAnswerBody(_Body):
    """The coordinator's answer to a join (purpose ``join-answer``, signed by its key): the challenge it
    answers, the peer's certificate, the run spec, the DHT's bootstrap addresses, the heartbeat interval
    and whether the coordinator holds a checkpoint."""

    challenge: bytes = Field(min_length=CHALLENGE_BYTES, max_length=CHALLENGE_BYTES)
    certificate: bytes = Field(max_length=4096)
    run_spec: dict[str, Any]
    dht_initial_peers: list[Annotated[str, Field(max_length=512)]] = Field(max_length=64)
    heartbeat_interval_s: float = Field(gt=0, le=3600)
    # False: the coordinator holds no checkpoint, so a fresh run's peers need not look for one in the DHT
    # before training from step 0. A coordinator that does not say (older) is taken to hold one.
    holds_checkpoint: bool = True


class RunStateBody(_Body):
    """The run's state in the coordinator's answer to a heartbeat (purpose ``run-state``, signed by its
    key): the heartbeat's sequence number it answers, so it cannot be replayed to another heartbeat, the
    run's ``max_steps`` now (0: no limit), and the step of the final checkpoint once the run has
    finished (0: not finished)."""

    seq: int = Field(gt=0)
    max_steps: int = Field(ge=0, lt=2**63)
    finished_step: int = Field(ge=0, lt=2**63)
    # The run's standing when the coordinator last computed it (``standing_at``, its clock), sent only when
    # the heartbeat's copy is older: the credited samples of the online, unbanned peers with the most,
    # which weigh their votes in catch-up (``swarm.training.catchup``). Empty: nothing new.
    standing_at: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    standing: dict[PeerIdText, Annotated[float, Field(ge=0, allow_inf_nan=False)]] = Field(
        default_factory=dict, max_length=MAX_STANDING
    )


class HeartbeatBody(_Body):
    """A peer's periodic heartbeat to the coordinator (purpose ``heartbeat``): a sequence number that must
    grow, its state, step, parameter hash and metrics, the peers it suspects and the rounds it witnessed."""

    seq: int = Field(gt=0)
    state: Literal["online", "paused"]
    step: int = Field(default=0, ge=0, lt=2**63)
    param_hash: str = Field(default="", pattern=r"^([0-9a-f]{64})?$")
    metrics: dict[Annotated[str, Field(max_length=64)], float] = Field(
        default_factory=dict, max_length=MAX_METRICS
    )
    # The peers its sender avoids now for breaking its rounds in ways nobody can prove (a reducer that
    # took a part and never delivered it, a member that denied a round); the coordinator shows the count.
    suspects: list[PeerIdText] = Field(default_factory=list, max_length=MAX_SUSPECT_REPORTS)
    # When the coordinator computed the standing its sender holds (0: none): a newer one comes back.
    standing_at: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    # The rounds its sender applied lately, each as the signed group entries of its kept members (the
    # sender's own among them): the coordinator credits each other member the weight it signed.
    rounds: list[
        Annotated[
            list[Annotated[bytes, Field(max_length=MAX_ENTRY_BYTES)]], Field(max_length=MAX_ROUND_ENTRIES)
        ]
    ] = Field(default_factory=list, max_length=MAX_WITNESSED_ROUNDS)

    @field_validator("metrics")
    @classmethod
    def _finite(cls, metrics: dict[str, float]) -> dict[str, float]:
        bad = [k for k, v in metrics.items() if not math.isfinite(v)]
        if bad:
            raise ValueError(f"metric {bad[0]!r} is not a finite number")
        return metrics


class LeaveBody(_Body):
    """A peer's notice to the coordinator that it leaves the run (purpose ``leave``), with a sequence
    number that must grow and an optional reason."""

    seq: int = Field(gt=0)
    reason: str = Field(default="", max_length=256)


class AccuseBody(_Body):
    """The signed first part of a peer's accusation to the coordinator (purpose ``accuse``): whom it
    accuses and why, and the SHA-256 and size of the evidence streamed after it."""

    accused: str = Field(min_length=1, max_length=128)
    reason: str = Field(max_length=512)
    evidence_sha256: bytes = Field(min_length=32, max_length=32)
    evidence_bytes: int = Field(gt=0, le=64 << 20)


class BanListBody(_Body):
    """One page of the coordinator's ban list (see ``swarm.bans``): pages of one list share
    ``list_sha256`` (of the whole sorted list), ``pages`` and ``changed_at``."""

    banned: list[Annotated[str, Field(max_length=128)]] = Field(max_length=BAN_PAGE_ENTRIES)
    page: int = Field(ge=0, lt=MAX_BAN_PAGES)
    pages: int = Field(ge=1, le=MAX_BAN_PAGES)
    list_sha256: bytes = Field(min_length=32, max_length=32)
    changed_at: float = Field(ge=0, allow_inf_nan=False)
    expires_at: float = Field(ge=0, allow_inf_nan=False)


Hash = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
# When a DHT record expires, as its signer set it: a record stored to expire later than this is refused,
# so nobody can keep an old signed record alive past the newer ones its signer publishes.
Expiry = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Count = Annotated[int, Field(ge=0, lt=2**63)]
Rate = Annotated[float, Field(ge=0, le=1e12, allow_inf_nan=False)]
# A per-peer DHT record carries its signer's certificate, so a reader checks admission offline.
CertificateBytes = Annotated[bytes, Field(max_length=4096)]


class ProgressRecordBody(_Body):
    """A peer's progress record in the DHT (purpose ``progress-record``, signed by the peer): its step,
    samples, throughput and state hash."""

    step: Count
    samples: Count
    samples_per_s: Rate
    state_hash: Hash
    certificate: CertificateBytes = b""
    expires_at: Expiry


class MemberRecordBody(_Body):
    """A peer's member record in the DHT (purpose ``member-record``, signed by the peer): its coordinator
    certificate."""

    certificate: CertificateBytes
    expires_at: Expiry


class StageRecordBody(_Body):
    """A stage replica's pipeline record in the DHT (purpose ``pipeline-record``, signed by the replica):
    the stage it serves, its step, throughput, load and hashes, and whether it serves, sits out or has
    closed the step."""

    role: Literal["stage"]
    stage: int = Field(ge=0, le=1024)
    step: Count
    samples_per_s: Rate
    load: float = Field(ge=0, le=1, allow_inf_nan=False)
    state_hash: Hash
    param_hash: Hash
    # False while the replica loads its stage's state or drains before it leaves: it averages, it serves no one.
    serving: bool = True
    # True while it holds its new stage's state but sits out the current step: it takes no round.
    joining: bool = False
    # True once the replica closed ``step``: what it counted there is final.
    closing: bool = False
    # [trainer, micro-batch ID, attempt, the trainer's signature of the attempt] of the micro-batches it
    # counted at ``step`` on a retry (attempt > 1); replicas check the signature before acting on one.
    retried: list[Annotated[list[str | int | bytes], Field(min_length=4, max_length=4)]] = Field(
        default=[], max_length=MAX_RETRIED_CLAIMS
    )
    certificate: CertificateBytes = b""
    expires_at: Expiry

    @field_validator("retried")
    @classmethod
    def _retried_claims(cls, claims: list[list[Any]]) -> list[list[Any]]:
        for i, (trainer, microbatch_id, attempt, signature) in enumerate(claims):
            if not (isinstance(trainer, str) and 1 <= len(trainer) <= 128 and trainer.isalnum()):
                raise ValueError(f"retried[{i}]: the trainer must be a peer ID")
            if not (isinstance(microbatch_id, int) and 0 <= microbatch_id < 2**63):
                raise ValueError(f"retried[{i}]: the micro-batch ID must be an integer in [0, 2**63)")
            if not (isinstance(attempt, int) and 2 <= attempt <= MAX_ATTEMPT):
                raise ValueError(f"retried[{i}]: the attempt must be an integer in [2, {MAX_ATTEMPT}]")
            if not (isinstance(signature, bytes) and len(signature) == 64):
                raise ValueError(f"retried[{i}]: the signature must be 64 bytes")
        return claims


class TrainerRecordBody(_Body):
    """A pipeline trainer's record in the DHT (purpose ``pipeline-record``, signed by the trainer): its
    step, the samples it completed there and its micro-batches in flight."""

    role: Literal["trainer"]
    step: Count
    samples: Count
    in_flight: Count
    certificate: CertificateBytes = b""
    expires_at: Expiry


class CheckpointRecordBody(_Body):
    """The checkpoint record in the DHT (purpose ``checkpoint-record``, signed by the coordinator): the
    step and state hash of the latest checkpoint the coordinator serves."""

    step: Count
    state_hash: Hash
    expires_at: Expiry


class DeclarationBody(_Body):
    """A matchmaking declaration in the DHT (purpose ``group-declaration``, signed by the declaring peer,
    bound to the matchmaking key): whether it still looks for a group, until when, and the declaring peer's
    coordinator certificate (empty only in a run without a coordinator)."""

    looking: bool
    expires_at: Expiry
    certificate: CertificateBytes = b""


Body = TypeVar("Body", bound=_Body)


def parse_body(model: type[Body], body: dict[str, Any], *, sender: str, what: str) -> Body:
    """Validate a decoded body; ProtocolError names the field and the sender."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or "body"
        raise ProtocolError(f"{what} from {sender}: field {field!r}: {first['msg']}") from None


def token_proof(join_token: str, challenge: bytes, public_key: bytes) -> bytes:
    """Proof of knowing the run's join token, bound to one challenge and key; the token never crosses the wire."""
    return hmac.new(
        join_token.encode(), b"swarm/join-token/v1" + challenge + public_key, hashlib.sha256
    ).digest()
