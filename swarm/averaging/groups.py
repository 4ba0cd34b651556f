"""Who may be in an averaging group: signed gathered entries and the checks on a group before its round.

Each member signs its own matchmaking entry (its weight, its nonce commitment, its data address, what
the caller adds, the averaging schema) with its peer key, in an envelope bound to the averaging prefix
and dated, so a leader can forward it but not rewrite it, and cannot pass it off in another run or
stage. Before a round every member checks the group the leader announced (``check_group``):

- every peer ID appears once (a repeated ID is the leader's doing: the group is left);
- this peer's own entry is the one it sent (else the leader altered it: the group is left);
- every other member is admitted: its entry carries its coordinator certificate, checked offline, so
  a member without a valid one (a made-up key a Sybil leader listed) is excluded by every member alike
  and the round goes on; one banned in this peer's view makes the group be left, blaming the leader only
  when the ban is older than a leader's ban list can lag (``PeerPolicy.leader_at_fault``), nobody
  otherwise. Membership is never judged from this peer's view of the DHT, which an honest leader's may
  not match (a member whose record just vanished). A member this peer merely suspects stays: the
  others, who may not suspect it, go on with the round, and a member that left would answer its part
  streams as a denier does and be suspected by them in turn (suspicion spread among honest peers so).
  Suspicion steers matchmaking (whom to lead and follow); a suspect's part that fails is repaired;
- every entry opens: signed by its member, fresh, with a 32-byte commitment and sane fields. A member
  whose entry fails is excluded from the round (every honest member excludes the same ones, since they
  all see the same bytes), not kept with weight 0;
- every entry fits the round (``fits``: in DiLoCo, the member's signed outer step is this peer's). A
  member whose signed entry does not fit is excluded, and suspected when its claim blames it (a step
  ahead: ``Misfit.blamed``) and the misfits are fewer than half of the group (``VerifiedGroup.suspects``),
  and the round goes on among the rest: every member at the round's step computes the same exclusion from the
  same signed bytes, so one member's claim no longer voids the round for all.

Each entry also says whether its member can be dialed. One that cannot (behind NAT) reduces no part of
the round (``evidence.split_bounds``). The flag is signed, so a leader cannot flip it; a member that
falsely claims it cannot be dialed only gives up its part, and one that falsely claims it can is a
reducer that fails, which the round's retry already handles. A group needs ``min_reducers`` members
that can be dialed (``enough_reducers``), else every member leaves it.

A group that is left raises ``GroupRefused`` with the culprit, whom the caller avoids in its retry.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from protocols.codec import pack, unpack
from protocols.envelope import open_envelope, seal
from protocols.errors import SwarmError
from protocols.keys import SigningKey
from swarm.averaging.transport import parse_address

GROUP_ENTRY = "group-entry"
COMMITMENT_BYTES = 32
MAX_EXTRA_KEYS = 32
MAX_CERTIFICATE_BYTES = 4096


class GroupEntryBody(BaseModel):
    """What one member declares for a round, signed by that member."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    schema_hash: bytes = Field(min_length=32, max_length=32, description="the averaging schema it joins")
    weight: float = Field(ge=0, allow_inf_nan=False, description="samples behind its contribution")
    commit: bytes = Field(
        min_length=COMMITMENT_BYTES, max_length=COMMITMENT_BYTES, description="SHA-256 of its round nonce"
    )
    data: str | None = Field(default=None, max_length=256, description="its TCP data address, if any")
    dialable: bool = Field(default=True, description="others can dial it, so it reduces a part")
    uplink_mbit: float | None = Field(
        default=None, ge=0, le=1e5, allow_inf_nan=False, description="its measured upload rate, if any"
    )
    extra: dict[str, Any] = Field(default_factory=dict, max_length=MAX_EXTRA_KEYS, description="caller's")
    certificate: bytes = Field(
        default=b"", max_length=MAX_CERTIFICATE_BYTES, description="its coordinator certificate, if any"
    )


@dataclass(frozen=True)
class Misfit:
    """Why a member's signed entry does not fit the round, and whether that blames its signer: a claim
    no honest member makes (a step ahead of the round's) does; one an honest member makes when it is
    behind, or that a leader can replay from an older round of the member (a step behind), does not."""

    reason: str
    blamed: bool = True


# Why a member's signed entry (and the member, its signer) does not fit the round (None: it does); see
# ``check_group``.
EntryFit = Callable[[GroupEntryBody, str], "Misfit | None"]


class GroupRefused(SwarmError):
    """The group as announced cannot be used; ``culprit`` is the peer to avoid in the retry (None: nobody
    can be blamed, as for a member banned so recently that the leader may not have the list yet)."""

    def __init__(self, culprit: str | None, reason: str):
        super().__init__(reason)
        self.culprit, self.reason = culprit, reason


@dataclass
class VerifiedGroup:
    """The members kept for the round, in the leader's order, with what each one signed."""

    peer_ids: list[str]
    entries: list[GroupEntryBody]
    excluded: dict[str, str] = field(default_factory=dict)
    misfits: dict[str, str] = field(default_factory=dict)  # signed entries that do not fit the round
    blamed: set[str] = field(default_factory=set)  # the misfits whose claim blames their signer
    signed: list[bytes] = field(default_factory=list)  # the kept members' entries as they signed them

    @property
    def suspects(self) -> dict[str, str]:
        """The misfits to suspect: those whose claim blames them, and only while the misfits are fewer
        than half of the group. With half or more this member may be the odd one out (behind, or apart,
        or padded by a Sybil at its step), and blaming the others would only make it avoid honest peers
        once it has caught up; it leaves the round or averages with those at its step."""
        listed = len(self.peer_ids) + len(self.excluded)
        if 2 * len(self.misfits) >= listed:
            return {}
        return {peer: reason for peer, reason in self.misfits.items() if peer in self.blamed}

    @property
    def reducers(self) -> list[bool]:
        """Which members reduce a part: those that can be dialed."""
        return [e.dialable for e in self.entries]

    @property
    def uplinks_mbit(self) -> list[float | None]:
        """Each member's declared upload rate (None: not measured yet); see ``deadlines``."""
        return [e.uplink_mbit for e in self.entries]


def enough_reducers(group: VerifiedGroup, min_reducers: int) -> str | None:
    """Why ``group`` cannot run a round for want of members that can be dialed; None if it can."""
    count = sum(group.reducers)
    if count >= max(1, min_reducers):
        return None
    return (
        f"only {count} of its {len(group.peer_ids)} members can be dialed to reduce a part; "
        f"the run needs {max(1, min_reducers)}"
    )


def make_entry(key: SigningKey | None, prefix: str, body: GroupEntryBody) -> bytes:
    """This peer's entry: signed when it has a key (every volunteer does), a bare map otherwise."""
    fields = body.model_dump()
    return pack(fields) if key is None else seal(key, GROUP_ENTRY, prefix, fields)


def open_entry(
    data: bytes, *, peer_id: str, prefix: str, schema_hash: bytes, signed: bool, max_age_s: float
) -> GroupEntryBody:
    """The entry of ``peer_id`` as gathered; raises a SwarmError saying what is wrong with it."""
    what = f"group entry of {peer_id}"
    if signed:
        envelope = open_envelope(data, purpose=GROUP_ENTRY, run_id=prefix, max_age_s=max_age_s, what=what)
        if envelope.sender != peer_id:
            raise SwarmError(f"{what} is signed by {envelope.sender}")
        fields = envelope.body
    else:
        fields = unpack(data, what=what)
        if not isinstance(fields, dict):
            raise SwarmError(f"{what} is not a map")
    try:
        body = GroupEntryBody.model_validate(fields)
    except ValidationError as e:
        first = e.errors()[0]
        raise SwarmError(f"{what}: field {'.'.join(map(str, first['loc']))!r}: {first['msg']}") from None
    if body.schema_hash != schema_hash:
        raise SwarmError(f"{what} is for another averaging schema")
    if body.data is not None:
        parse_address(body.data)
    return body


def check_group(
    peer_ids: Sequence[str],
    gathered: Sequence[bytes],
    *,
    me: str,
    my_entry: bytes,
    leader: str,
    prefix: str,
    schema_hash: bytes,
    signed: bool,
    refusal: Callable[[str], str | None],
    max_age_s: float,
    fits: EntryFit | None = None,
    certify: Callable[[str, bytes], str | None] | None = None,
    leader_at_fault: Callable[[str], bool] = lambda peer: True,
    max_members: int | None = None,
) -> VerifiedGroup:
    """Check a group as its leader announced it (see the module docstring); raises ``GroupRefused``.

    ``refusal``: why a listed member may not be in the round at all in this peer's view (banned); the
    group is then left, blaming the leader when ``leader_at_fault(member)``. ``certify``: why a member's
    entry does not prove it is admitted (its certificate); such a member is excluded like any bad entry,
    by every member alike, since all see the same bytes. ``max_members``: the most a group of the run holds;
    a larger one is left, blaming the leader."""
    if len(peer_ids) != len(gathered):
        raise GroupRefused(
            leader, f"leader {leader} sent {len(gathered)} entries for {len(peer_ids)} members"
        )
    if max_members is not None and len(peer_ids) > max_members:
        # No honest leader gathers more than the run's groups hold, and evidence of a larger round is
        # refused by the coordinator: a validator that filed it would be the one banned.
        raise GroupRefused(
            leader,
            f"leader {leader} listed {len(peer_ids)} members; the run's groups hold at most {max_members}",
        )
    seen: set[str] = set()
    for peer in peer_ids:
        if peer in seen:
            times = sum(1 for p in peer_ids if p == peer)
            raise GroupRefused(leader, f"leader {leader} listed {peer} {times} times in one group")
        seen.add(peer)
    if me not in seen:
        raise GroupRefused(leader, f"leader {leader} sent a group without this peer")
    if gathered[list(peer_ids).index(me)] != my_entry:
        raise GroupRefused(leader, f"leader {leader} altered this peer's signed entry")
    for peer in peer_ids:
        reason = None if peer == me else refusal(peer)
        if reason is not None:
            # Only the leader puts a member in the list: the blame is its, never the listed peer's (a
            # made-up key would otherwise take it), and only when the leader must have known.
            culprit = leader if peer == leader or leader_at_fault(peer) else None
            raise GroupRefused(culprit, f"leader {leader} listed group member {peer}: {reason}")
    group = VerifiedGroup([], [])
    for peer, data in zip(peer_ids, gathered, strict=True):
        try:
            entry = open_entry(
                data, peer_id=peer, prefix=prefix, schema_hash=schema_hash, signed=signed, max_age_s=max_age_s
            )
        except SwarmError as e:
            if peer == leader and peer != me:  # the leader signs its own entry: nobody else can spoil it
                raise GroupRefused(
                    leader, f"leader {leader} sent its own entry, which does not open: {e}"
                ) from None
            group.excluded[peer] = str(e)
            continue
        unproven = None if certify is None or peer == me else certify(peer, entry.certificate)
        if unproven is not None:
            group.excluded[peer] = f"its entry proves no admission: {unproven}"
            continue
        misfit = None if fits is None or peer == me else fits(entry, peer)
        if misfit is not None:
            group.misfits[peer] = group.excluded[peer] = f"its signed entry {misfit.reason}"
            if misfit.blamed:
                group.blamed.add(peer)
            continue
        group.peer_ids.append(peer)
        group.entries.append(entry)
        group.signed.append(data)
    return group
