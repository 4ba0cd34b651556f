"""A first-tier group's certificate: what lets a representative into the second tier (``tiers``).

After its first-tier round each member of a group signs an attestation for its representative: the
group's ID, the step and state hash it was at, the representative's peer ID, the group's total signed
weight, the SHA-256 of the group's result (float32; every member holds it bit for bit) and the group's
member list in its round's order (a certificate lists exactly the members who signed for it). The
representative puts those of a strict majority of its group in its second-tier entry
(``extra["group"]``, ``certificate``). Every second-tier member checks each other member's certificate
before the round (``certificate_misfit``, through the round's entry check) and every member of every
group checks them all in the hand-off (``tiers.TierCheck``). So an identity that represents no group its
admitted members signed for cannot join the second tier, a group counts once, with the weight its
members signed, and a certificate names the one representative it was given to.

Example::

    signature = sign_attestation(key, group_id, step, state_hash, rep, weight, result_digest(r_g), members)
    extra["group"] = certificate(group_id, members, weight, result_digest(r_g), {0: signature, 2: other})
    reason = certificate_misfit(extra, signer=rep, step=step, state_hash=state_hash, refusal=policy.listed_refusal)
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Callable, Mapping, Sequence

import torch

from protocols.keys import PublicKey, SigningKey
from swarm.averaging.groups import GroupEntryBody, Misfit

ATTESTATION = b"swarm-tier-attestation/2"
#: Members a certificate may list (a first-tier group: at most the run's ``max_group_size``).
MAX_CERTIFIED_MEMBERS = 1024
MAX_PEER_ID_CHARS = 128
MAX_GROUP_ID_BYTES = 64
SIGNATURE_BYTES = 64


def result_digest(vector: torch.Tensor) -> bytes:
    """SHA-256 of a group's result as float32 bytes (what every member of the group holds)."""
    return hashlib.sha256(vector.detach().to(torch.float32).contiguous().numpy().tobytes()).digest()


def attestation_message(
    group_id: bytes, step: int, state_hash: str, representative: str, weight: float, digest: bytes,
    members: Sequence[str],
) -> bytes:  # fmt: skip
    """What a member signs for its group's representative: the group's round, its step and state, its
    representative, total weight and result, and its member list in the round's order (so a certificate
    cannot list a peer its members did not see in their group)."""
    listed = hashlib.sha256("\n".join(members).encode()).digest()
    return b"|".join(
        [
            ATTESTATION,
            group_id,
            struct.pack(">Qd", step, weight),
            state_hash.encode(),
            representative.encode(),
            digest,
            listed,
        ]
    )


def sign_attestation(
    key: SigningKey,
    group_id: bytes,
    step: int,
    state_hash: str,
    representative: str,
    weight: float,
    digest: bytes,
    members: Sequence[str],
) -> bytes:
    return key.sign(attestation_message(group_id, step, state_hash, representative, weight, digest, members))


def attestation_holds(
    member: str, signature: bytes, group_id: bytes, step: int, state_hash: str, representative: str,
    weight: float, digest: bytes, members: Sequence[str],
) -> bool:  # fmt: skip
    """Whether ``signature`` is ``member``'s attestation of exactly these facts."""
    try:
        PublicKey.from_peer_id(member).verify(
            signature,
            attestation_message(group_id, step, state_hash, representative, weight, digest, members),
        )
    except Exception:  # a malformed key or signature: it does not hold
        return False
    return True


def certificate(
    group_id: bytes, members: Sequence[str], weight: float, digest: bytes, signed: Mapping[int, bytes]
) -> dict:
    """The certificate a representative puts in its second-tier entry's ``extra["group"]``."""
    return {
        "id": group_id,
        "members": list(members),
        "weight": float(weight),
        "digest": digest,
        "signed": [[index, signed[index]] for index in sorted(signed)],
    }


def certificate_shape_misfit(extra: object, *, signer: str, min_members: int = 2) -> str | None:
    """Why the second-tier entry ``extra`` of ``signer`` carries no well-formed group certificate, checking no
    signature: the fields, their types and bounds, and one signature item per listed member at most. None
    if it is well formed (its signatures still to check: ``certificate_misfit``)."""
    group = extra.get("group") if isinstance(extra, dict) else None
    if not isinstance(group, dict) or set(group) != {"id", "members", "weight", "digest", "signed"}:
        return "carries no group certificate"
    group_id, members, weight = group["id"], group["members"], group["weight"]
    digest, signed = group["digest"], group["signed"]
    if not (isinstance(group_id, bytes) and 0 < len(group_id) <= MAX_GROUP_ID_BYTES):
        return "certifies a group ID that is not 1 to 64 bytes"
    if not (isinstance(digest, bytes) and len(digest) == 32):
        return "certifies a result digest that is not 32 bytes"
    if not (isinstance(weight, float) and math.isfinite(weight) and weight >= 0):
        return "certifies a weight that is not a finite number >= 0"
    if not (
        isinstance(members, list)
        and max(2, min_members) <= len(members) <= MAX_CERTIFIED_MEMBERS
        and all(isinstance(m, str) and 0 < len(m) <= MAX_PEER_ID_CHARS for m in members)
        and len(set(members)) == len(members)
    ):
        return f"certifies a member list that is not {max(2, min_members)} to 1,024 distinct peer IDs"
    if signer not in members:
        return "carries the certificate of a group it is not in"
    if not isinstance(signed, list) or len(signed) > len(members):
        return "certifies more signatures than members"
    seen: set[int] = set()
    for item in signed:
        if not (
            isinstance(item, list) and len(item) == 2 and type(item[0]) is int and 0 <= item[0] < len(members)
            and isinstance(item[1], bytes) and len(item[1]) == SIGNATURE_BYTES and item[0] not in seen
        ):  # fmt: skip
            return "certifies a signature that is not one per listed member"
        seen.add(item[0])
    return None


def certificate_misfit(
    extra: object, *, signer: str, step: int, state_hash: str, refusal: Callable[[str], str | None] | None,
    min_members: int = 2,
) -> str | None:  # fmt: skip
    """Why the second-tier entry ``extra`` of ``signer`` carries no valid certificate of a group at ``step``
    and ``state_hash``; None if it does. ``refusal(peer)``: why a member may not be in a round at all in
    this peer's view (banned, not admitted); such a member's signature does not count. ``min_members``: the
    run's smallest group (``min_group_size``, at least 2), which a certified group must list.

    What it cannot show is that the group's round took place: admitted identities that are a majority of a
    made-up group can certify it, exactly as they could run a real round of their own; such a group is one
    input of the second tier, its weight capped like any input's (``validation.fair_weights``)."""
    shape = certificate_shape_misfit(extra, signer=signer, min_members=min_members)
    if shape is not None:
        return shape
    group = extra["group"]
    group_id, members, weight = group["id"], group["members"], group["weight"]
    digest, signed = group["digest"], group["signed"]
    counted: set[int] = set()
    for index, signature in signed:
        member = members[index]
        if refusal is not None and refusal(member) is not None:
            continue  # a banned or unadmitted member's word does not count
        if not attestation_holds(
            member, signature, group_id, step, state_hash, signer, weight, digest, members
        ):
            return f"carries a signature of {member[:64]} that does not hold"
        counted.add(index)
    if members.index(signer) not in counted:
        return "carries a certificate its representative did not sign"
    if 2 * len(counted) <= len(members):
        return f"is certified by {len(counted)} of its group's {len(members)} members, not a majority"
    return None


def certified_signers(group: dict) -> list[str]:
    """The members of a group certificate that signed it, as listed. Their signatures hold only once
    ``certificate_misfit`` found none to refuse; listed members that signed nothing are left out: a
    majority's signatures do not vouch for anyone else the certificate lists."""
    members = group["members"]
    return [members[index] for index, _ in group["signed"]]


def entry_misfit(
    entry: GroupEntryBody, signer: str, *, step: int, state_hash: str,
    refusal: Callable[[str], str | None] | None, min_members: int = 2,
) -> Misfit | None:  # fmt: skip
    """Why ``signer``'s second-tier ``entry`` does not fit a round at ``step`` and ``state_hash``: another
    state (not blamed: its group may be the one apart), no certificate that holds, or a declared weight other
    than the one its group signed. The second tier's members check it before the round, every group member
    in the hand-off (``tiers.TierCheck``)."""
    if entry.extra.get("state_hash") != state_hash:
        return Misfit("holds another state than this round's", blamed=False)
    unfit = certificate_misfit(
        entry.extra, signer=signer, step=step, state_hash=state_hash, refusal=refusal, min_members=min_members
    )
    if unfit is not None:
        return Misfit(unfit)
    if entry.weight != entry.extra["group"]["weight"]:
        return Misfit("declares another weight than its group signed")
    return None


__all__ = [
    "attestation_holds",
    "certificate",
    "certificate_misfit",
    "certificate_shape_misfit",
    "certified_signers",
    "entry_misfit",
    "result_digest",
    "sign_attestation",
]
