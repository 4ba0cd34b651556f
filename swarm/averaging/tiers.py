"""The second tier of a step's round: one result for every group of a step (docs/scale.md).

When a step has more peers than one group holds, matchmaking forms several first-tier groups. Each runs
the butterfly round as before, so its members hold the group's aggregate ``R_g`` bit for bit, and does not
apply it. Each group's ``representative`` (by a hash of its members' nonce commitments and peer ID, among
the members that can be dialed; every member computes the same) averages ``R_g`` at weight ``W_g`` (the
members' signed weights) in a second-tier round with the other groups' representatives: the same signed,
robust, verified round under its own prefix (``tier_prefix``), in ``TIER_COMPRESSION``, which only a
representative certified by a strict majority of its group may join (``tiercert``). The representative
then hands the result to its group's members (``tierserve``): the second tier's signed entries and every
aggregate chunk as its reducer signed it, down a tree of the members (``relay_parent``: each passes on what
it checked to at most ``training.relay_fanout`` others). A member checks it (``TierCheck``) before applying it:

- every entry opens under the second tier's prefix, proves its member's admission, was signed at this
  member's step and state, and carries a group certificate that holds (so an old round, another state's
  or an uncertified identity's is refused);
- every chunk is signed by its part's own reducer over that round, covers more than half of its members,
  and lists the representative's input as exactly its group's ``R_g`` (which the member holds) at weight
  ``W_g``: a representative cannot pass off another input or weight for its group, nor another result,
  nor leave its group out; it can only withhold one (the group then applies nothing and tries again).

Every peer then decodes the same bytes, so every group of the step applies the same vector. A group that
the step's peers fit in whole needs no second tier: its representative says ``alone`` and its members apply
their own result, as one group always did.

Example::

    check = TierCheck(first, prefix=tier_averager.prefix, schema_hash=tier_averager.schema_hash, numel=n,
                      mine=extra, representative=rep, contribution=r_g, weight=w_g, max_age_s=60.0,
                      certify=policy.certificate_refusal, refusal=policy.listed_refusal)
    for part, chunk in check.expected():
        check.take(part, chunk, next_answer.chunk)
    combined = check.output
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace

import torch

from protocols import averaging_pb2 as apb
from protocols.envelope import MAX_CLOCK_SKEW_S, open_envelope
from protocols.errors import ProtocolError, ReplayError, StaleError, SwarmError
from protocols.version import MAX_ENVELOPE_BYTES
from swarm.averaging.allreduce import SignedOutput
from swarm.averaging.compression import Codec, get_codec
from swarm.averaging.evidence import (
    DEFAULT_CHUNK_VALUES,
    MAX_MEMBERS,
    chunk_bounds,
    layout_chunk_values,
    parse_entries,
    reducer_mask,
    round_digest,
    split_bounds,
)
from swarm.averaging.groups import GROUP_ENTRY, open_entry
from swarm.averaging.sender import check_answer
from swarm.averaging.tiercert import (
    certificate_misfit,
    certificate_shape_misfit,
    certified_signers,
    entry_misfit,
)
from swarm.config import RunConfig
from swarm.inbound import SMALL_REQUEST_BYTES

#: The second tier's wire encoding: its inputs are first-tier results, which top-k or int8 would cut again.
TIER_COMPRESSION = "fp16"
#: The largest answer message: the header with every member's signed entry, or one fp16 aggregate chunk
#: with its signed list of inputs.
MAX_TIER_ANSWER_BYTES = max(
    MAX_ENVELOPE_BYTES * 2 + SMALL_REQUEST_BYTES,
    get_codec(TIER_COMPRESSION).max_bytes(DEFAULT_CHUNK_VALUES) + 44 * MAX_MEMBERS + 4096,
)
#: Entries a header may list (the second tier's group, at most the run's ``max_group_size``).
MAX_TIER_MEMBERS = 1024


def tier_prefix(prefix: str) -> str:
    """The averaging prefix of the second tier of ``prefix``'s rounds (a run ID)."""
    return f"{prefix}.tier2"


def round_codec(run: RunConfig, prefix: str) -> Codec:
    """The wire encoding of rounds under averaging ``prefix`` (as averagers name it, "." as "_") in ``run``:
    the second tier's own, else the run's (what the coordinator decodes evidence with)."""
    if prefix == tier_prefix(run.run_id).replace(".", "_"):
        return get_codec(TIER_COMPRESSION)
    return get_codec(run.training.compression, topk_density=run.training.topk_density)


def relay_order(
    commitments: Sequence[bytes], members: Sequence[str], reducers: Sequence[bool] | None
) -> list[int]:
    """A group's members ranked by the SHA-256 of (every member's nonce commitment, its peer ID), those that
    can be dialed first: the first is the group's ``representative``, and the order is the tree its
    hand-off is relayed down (``relay_parent``). Every member computes the same, and no member can steer it:
    each commitment is fixed in its member's signed entry before the group forms, and they are hashed
    sorted, so neither the group ID nor the order the leader lists members in moves it (a leader could
    steer a draw on either); a leader can only choose whom to admit."""
    seed = hashlib.sha256(b"|".join([b"swarm-representative", *sorted(commitments)])).digest()

    def rank(i: int) -> tuple[bool, bytes]:
        dialable = reducers is None or bool(reducers[i])
        return (not dialable, hashlib.sha256(seed + members[i].encode()).digest())

    return sorted(range(len(members)), key=rank)


def representative(
    commitments: Sequence[bytes], members: Sequence[str], reducers: Sequence[bool] | None
) -> int:
    """The index of a group's representative: the first of ``relay_order``, the member with the smallest
    hash among those that can be dialed (all of them when none can)."""
    return relay_order(commitments, members, reducers)[0]


def relay_parent(order: Sequence[int], member: int, reducers: Sequence[bool] | None, fanout: int) -> int:
    """The member ``member`` asks for its group's outcome: its parent in the ``fanout``-ary tree over
    ``order`` (``relay_order``), or the representative (``order[0]``) when that parent cannot be dialed. Each
    member then sends the outcome to at most ``fanout`` others whatever the group's size, and it reaches
    every member in about log_fanout(size) hops."""
    at = order.index(member)
    if at == 0:
        return member
    parent = order[(at - 1) // fanout]
    if reducers is not None and not reducers[parent]:
        return order[0]
    return parent


def only_group(members: int, *, peers_at_step: int, run_peers: int, min_group_size: int) -> bool:
    """Whether a group of ``members`` peers is its step's only one, so that it applies its own result
    (``alone``) with no second tier. Both must hold, by its representative's view:

    - the step's other peers (``peers_at_step`` less the group: records at this step or one behind) are too
      few to form a group that could join a second tier: fewer than 2, or than the run's ``min_group_size``
      (a lone peer applies its own round and catches up; waiting for it cost every step three searches);
    - the group holds a strict majority of the run's online members (``run_peers``, by their member
      records), so no other group can hold one too: while peers start, progress views are thin, and groups
      that each thought themselves alone once split 24 peers at step 0."""
    return peers_at_step - members < max(2, min_group_size) and 2 * members > run_peers


#: A member waits this many averaging timeouts, from the end of its first tier, for its representative's
#: outcome (``SecondTier.wait_s``).
MEMBER_WAIT_TIMEOUTS = 4
#: Of the members' wait, the representative keeps this many averaging timeouts for the second-tier round
#: (whose deadline grows beyond one timeout on slow links) and the hand-off down its group's tree.
ROUND_ROOM_TIMEOUTS = 2


def second_window_s(*, run_window_s: float, waited_s: float, averaging_timeout_s: float) -> float:
    """How long a representative's second-tier search waits for the step's other groups, ``waited_s`` after
    its own first tier ended: until the members' wait leaves ``ROUND_ROOM_TIMEOUTS`` for the round and the
    hand-off, and never less than the run's window (``run_window_s``). A step's groups end their first tier
    up to about a round's deadline apart (a group slowed by a member that left waits out its silence
    deadline); a window of the run's few seconds split such a step into several updates beyond about
    128 peers (docs/scale.md). The search closes early once its groups hold the peers at the step, all but
    ``COVER_SLACK`` of them (``covers``), so the wait is paid only while some peer at the step is in no group yet."""
    room_s = (MEMBER_WAIT_TIMEOUTS - ROUND_ROOM_TIMEOUTS) * averaging_timeout_s - waited_s
    return max(run_window_s, room_s)


#: The share of the peers whose records show a step that a second-tier search may close without: admitted
#: peers that show the step and never join a group (Sybils, or peers gone before their records expire) would
#: otherwise hold every multi-group step for the whole window.
COVER_SLACK = 0.05


def covers(
    here: Collection[str], covered: Collection[str], *, fewest: int = 2, lagging: Collection[str] = ()
) -> bool:
    """Whether ``covered`` (the peers in the groups gathered, ``covered_peers``) holds the peers of ``here``
    (those whose records show the step, less the representative's own group), all but ``COVER_SLACK`` of
    them, or all but fewer than ``fewest`` (the run's smallest group, at least 2) with the ``lagging``
    peers (records a step behind: a group may hold some whose records have not caught up) not in it:
    peers that could not form a group of their own are not waited for. (A peer that missed the step's
    first-tier groups found nobody left to form one with: waiting for it held the step for the whole
    window, then it adopted.)"""
    here, covered = set(here), set(covered)
    missing = len(here - covered)
    short = missing + len(set(lagging) - covered)
    return missing <= int(COVER_SLACK * len(here)) or short < max(2, fewest)


def covered_peers(groups: Iterable[dict], counts: Callable[[str], bool]) -> set[str]:
    """The peers that the group certificates ``groups`` (checked: ``tiercert.certificate_misfit``) hold, for
    closing a search: a certificate's listed members count only while a strict majority of them signed it
    with identities that ``counts`` (admitted, not banned) and that signed no certificate counted before it.
    A peer is in one group of a step, so Sybils that list honest peers they do not speak for can make a
    leader believe fewer honest peers missing than they hold admitted identities, however they split them
    between certificates."""
    return {member for group, _ in counted_groups(groups, counts) for member in group["members"]}


def signed_peers(groups: Iterable[dict], counts: Callable[[str], bool]) -> set[str]:
    """The peers that signed the group certificates ``groups`` (checked: ``tiercert.certificate_misfit``) with
    identities ``counts`` admits, each once, in certificates that such signers are a strict majority of:
    what a round shows of the peers in it, unlike ``covered_peers`` without the listed members that signed
    nothing (a certificate signed by a majority of Sybils may list honest peers)."""
    return {signer for _, signers in counted_groups(groups, counts) for signer in signers}


def counted_groups(groups: Iterable[dict], counts: Callable[[str], bool]) -> Iterator[tuple[dict, list[str]]]:
    """Each certificate of ``groups`` that counts, with its counted signers: those ``counts`` admits that
    signed no certificate counted before it, when they are a strict majority of its listed members."""
    used: set[str] = set()
    for group in groups:
        signers = [m for m in dict.fromkeys(certified_signers(group)) if m not in used and counts(m)]
        if 2 * len(signers) > len(group["members"]):
            used.update(signers)
            yield group, signers


def holds_the_step(
    groups: Iterable[dict],
    counts: Callable[[str], bool],
    showing: Collection[str],
    *,
    outside: Collection[str] = (),
) -> bool:
    """Whether a second-tier round whose checked certificates are ``groups`` is the step's combined result for
    a peer that was in none of its groups: the peers that signed its certificates (``signed_peers``; an
    honest certificate carries nearly every member's attestation, ``TierBoard.majority``'s ``rest_s``) are at
    least half of ``showing``, the peers whose records show the step or a later one (in a small run a
    step's round often holds exactly half: two groups of a run of eight). Only signers the peer itself sees
    count, none of ``outside`` (peers it knows were in none of the round's groups: a late group's own), and
    a peer signs one group a step, so Sybils need as many admitted identities as the honest peers in view
    to pass a round of their own off as the step's, and two rounds hold half each only then."""
    showing = set(showing)
    return 2 * len((signed_peers(groups, counts) - set(outside)) & showing) >= len(showing)


#: The most of the peers a search would wait for that the absence book (``SecondTier.absent``) may leave
#: out, or that one search may add to it: beyond that a leader was cut off from the swarm, not kept waiting
#: by a few identities, and the book is not read (nor written).
MAX_ABSENT_SHARE = 0.25


class EarlyClose:
    """One second-tier search's rule for closing early (``Averager.find_group``'s ``closes_when``): the groups
    that joined hold the peers ``waiting()`` returns (those whose records show the step, less the leader's own
    group and the absent), all but ``COVER_SLACK`` of them (``covers``).

    It is first asked of the certificates as the followers' entries claim them (well formed:
    ``tiercert.certificate_shape_misfit``; every listed member counted, every claim once): if even that does
    not close the window, nothing is checked, and a join costs its entry's one signature. Only then is each
    claim checked, once per search: the signatures of its counted signers (``counts``: admitted, not banned)
    first, stopping at the first that does not hold, and only a certificate whose counted signers are a
    strict majority of its members gets the round's own check (``fits``, which verifies every signature).
    So a claim's checks cost at most the admitted identities that signed it, unless they are a majority of
    its group. ``closed``: whether it closed the window (the leader then did not wait it out)."""

    def __init__(
        self, *, waiting: Callable[[], Collection[str]], fits: Callable, counts: Callable[[str], bool], step: int,
        state_hash: str, min_members: int, lagging: Callable[[], Collection[str]] = tuple,
    ):  # fmt: skip
        self.waiting, self.fits, self.counts, self.lagging = waiting, fits, counts, lagging
        self.step, self.state_hash, self.min_members = step, state_hash, min_members
        self.closed = False
        self._checked: dict[str, dict | None] = {}

    def __call__(self, claims: dict) -> bool:
        waiting, lagging = set(self.waiting()), set(self.lagging())
        shaped = {
            name: body.extra["group"]
            for name, body in claims.items()
            if certificate_shape_misfit(body.extra, signer=name, min_members=self.min_members) is None
        }
        claimed = {member for group in shaped.values() for member in group["members"]}
        if not covers(waiting, claimed, fewest=self.min_members, lagging=lagging):
            return False
        verified = []
        for name, group in shaped.items():
            if name not in self._checked:
                self._checked[name] = group if self._holds(name, claims[name]) else None
            if self._checked[name] is not None:
                verified.append(self._checked[name])
        self.closed = covers(
            waiting, covered_peers(verified, self.counts), fewest=self.min_members, lagging=lagging
        )
        return self.closed

    def _holds(self, signer: str, body) -> bool:
        # The certificate's rule with only the counted signers' words: skipped unverified, the others checked
        # up to the first that does not hold; then the round's own check of every signature.
        def uncounted(member: str) -> str | None:
            return None if self.counts(member) else "not counted toward closing"

        misfit = certificate_misfit(
            body.extra, signer=signer, step=self.step, state_hash=self.state_hash, refusal=uncounted,
            min_members=self.min_members,
        )  # fmt: skip
        return misfit is None and self.fits(body, signer) is None


@dataclass
class TierOutcome:
    """What a representative hands its group: ``alone``, or the second tier's signed output."""

    alone: bool
    group_id: bytes = b""
    entries: list[bytes] = field(default_factory=list)
    representative: int = 0
    signers: list[int] = field(default_factory=list)  # per part: who signed its aggregate
    chunks: list[list[apb.PartChunk]] = field(default_factory=list)  # per part, in chunk order

    def answers(self) -> Iterator[apb.TierAnswer]:
        if self.alone:
            yield apb.TierAnswer(alone=True)
            return
        yield apb.TierAnswer(
            tier_group_id=self.group_id, entries=self.entries, representative=self.representative,
            signers=self.signers,
        )  # fmt: skip
        for part in self.chunks:
            for message in part:
                yield apb.TierAnswer(chunk=message)


def signed_outcome(
    group_id: bytes, entries: Sequence[bytes], index: int, signed: SignedOutput
) -> TierOutcome:
    """What a representative hands its group from its complete second-tier round: the round's group ID and
    signed entries, its own index in it, and the round's signed output (``RoundResult.signed``)."""
    return TierOutcome(False, group_id, list(entries), index, list(signed.signers), list(signed.chunks))


@dataclass
class _RoundView:
    """What ``sender.check_answer`` reads of a round, for a member that was not in it."""

    key: object
    members: list[str]
    digest: bytes
    index: int
    weight: float


class TierCheck:
    """A member's check of a second-tier hand-off (see the module docstring); raises ``ProtocolError`` naming
    what is wrong.

    ``mine``: this peer's round ``extra`` (its step and state hash): every second-tier member must have
    signed the same, so a round of another step or state is refused. ``representative``: the peer that
    handed it over, which must be the round's member whose input is listed in every chunk as exactly
    ``contribution`` (this group's first-tier result) at ``weight`` (its total signed weight).
    ``certify(peer, certificate)``: why an entry proves no admission; ``refusal(peer)``: why a member's
    signature does not count in a group certificate (``tiercert``). ``max_age_s``: how old an entry or an
    aggregate's date may be.
    """

    def __init__(
        self,
        first: apb.TierAnswer,
        *,
        prefix: str,
        schema_hash: bytes,
        numel: int,
        mine: dict,
        representative: str | None,
        contribution: torch.Tensor | None,
        weight: float,
        max_age_s: float,
        certify: Callable[[str, bytes], str | None] | None,
        refusal: Callable[[str], str | None] | None,
    ):
        entries = list(first.entries)
        if not 2 <= len(entries) <= MAX_TIER_MEMBERS:
            raise ProtocolError(f"the second tier lists {len(entries)} members")
        members, bodies = [], []
        for i, data in enumerate(entries):
            what = f"second-tier entry {i}"
            try:
                sender = open_envelope(
                    data, purpose=GROUP_ENTRY, run_id=prefix, max_age_s=max_age_s, what=what
                ).sender
                body = open_entry(
                    data,
                    peer_id=sender,
                    prefix=prefix,
                    schema_hash=schema_hash,
                    signed=True,
                    max_age_s=max_age_s,
                )
            except ReplayError as e:
                # Signed by its member and dated out of bounds: it proves nothing of whoever passed it on.
                raise StaleError(str(e)) from None
            except SwarmError as e:
                raise ProtocolError(str(e)) from None
            refused = certify(sender, body.certificate) if certify is not None else None
            if refused is not None:
                raise ProtocolError(f"second-tier member {sender} proves no admission: {refused}")
            if body.extra.get("step") != mine["step"] or body.extra.get("state_hash") != mine["state_hash"]:
                raise ProtocolError(
                    f"second-tier member {sender} signed another step or state than this round's"
                )
            misfit = entry_misfit(
                body, sender, step=mine["step"], state_hash=mine["state_hash"], refusal=refusal
            )
            if misfit is not None:
                raise ProtocolError(f"second-tier member {sender} {misfit.reason}")
            members.append(sender)
            bodies.append(body)
        #: Each member's group certificate (checked above): what the round holds (``holds_the_step``).
        self.groups = [body.extra["group"] for body in bodies]
        if len(set(members)) != len(members):
            raise ProtocolError("the second tier lists a member twice")
        n = len(members)
        if first.representative >= n or representative not in (None, members[first.representative]):
            raise ProtocolError(f"the hand-off names member {first.representative}, not {representative}")
        mask = reducer_mask([b.dialable for b in bodies])
        # Every part as its own reducer signed it: a part repaired by a substitute cannot be handed over,
        # since nothing shows a member that the reducer failed (the representative could name itself).
        if list(first.signers) != list(range(n)):
            raise ProtocolError("the hand-off names a signer other than a part's own reducer")
        self.codec = get_codec(TIER_COMPRESSION)
        self.round = _RoundView(
            key=True, members=members,
            digest=round_digest(prefix, first.tier_group_id, members, [b.commit for b in bodies], mask),
            index=first.representative, weight=float(weight),
        )  # fmt: skip
        self.skew_s = MAX_CLOCK_SKEW_S + max_age_s
        self.bounds = split_bounds(numel, n, mask)
        values = layout_chunk_values(n, self.codec.bytes_per_value)
        self.chunks = [
            chunk_bounds(hi - lo, values) if not mask or mask[p] else [0]
            for p, (lo, hi) in enumerate(zip(self.bounds[:-1], self.bounds[1:], strict=True))
        ]
        self.contribution = (
            None if contribution is None else contribution.detach().to(torch.float32).flatten()
        )
        if self.contribution is not None and self.contribution.numel() != numel:
            raise ValueError(f"the group's result has {self.contribution.numel()} values, not {numel}")
        # An adopter (no ``representative``) was in no group of the round: it checks who signed what, not
        # its own input, and gets exactly what the round's members applied.
        self.header, self.taken = first, []
        self.output = torch.empty(numel)

    def outcome(self) -> TierOutcome:
        """The checked round as its members hand it on (to a peer that adopts it), once every chunk is taken."""
        first, taken = self.header, iter(self.taken)
        chunks = [[next(taken) for _ in range(len(bounds) - 1)] for bounds in self.chunks]
        return TierOutcome(
            False, first.tier_group_id, list(first.entries), first.representative, list(first.signers), chunks
        )

    def expected(self) -> Iterator[tuple[int, int]]:
        """(part, chunk) of every aggregate chunk the answer must carry, in order."""
        for part, bounds in enumerate(self.chunks):
            for chunk in range(len(bounds) - 1):
                yield part, chunk

    def take(self, part: int, chunk: int, message: apb.PartChunk) -> None:
        """Check one aggregate chunk and decode it into ``output``."""
        if message.part_index != part or message.chunk_index != chunk:
            raise ProtocolError(
                f"sent part {message.part_index} chunk {message.chunk_index}, not {part}/{chunk}"
            )
        base = self.bounds[part]
        lo, hi = base + self.chunks[part][chunk], base + self.chunks[part][chunk + 1]
        r = self.round
        try:
            if self.contribution is None:
                check_answer(replace(r, index=-1), part, chunk, message, b"", skew_s=self.skew_s)
            else:
                sent = hashlib.sha256(self.codec.encode_contribution(self.contribution[lo:hi])).digest()
                check_answer(r, part, chunk, message, sent, skew_s=self.skew_s)
                if all(e.sender_index != r.index for e in parse_entries(message.included, len(r.members))):
                    raise ProtocolError("leaves out the input of this peer's group")
            self.output[lo:hi] = self.codec.decode(message.data, hi - lo, sender=r.members[part])
            self.taken.append(message)
        except StaleError as e:  # signed by its reducer, dated out of bounds: proves nothing of the sender
            raise StaleError(f"part {part} chunk {chunk}: {e}") from None
        except SwarmError as e:
            raise ProtocolError(f"part {part} chunk {chunk}: {e}") from None
        except Exception as e:  # a signature that does not verify
            raise ProtocolError(f"part {part} chunk {chunk}: {e!r}") from None


__all__ = [
    "COVER_SLACK",
    "EarlyClose",
    "MAX_ABSENT_SHARE",
    "MAX_TIER_ANSWER_BYTES",
    "MEMBER_WAIT_TIMEOUTS",
    "ROUND_ROOM_TIMEOUTS",
    "TIER_COMPRESSION",
    "TierCheck",
    "TierOutcome",
    "counted_groups",
    "covered_peers",
    "covers",
    "holds_the_step",
    "only_group",
    "relay_order",
    "relay_parent",
    "representative",
    "round_codec",
    "second_window_s",
    "signed_outcome",
    "signed_peers",
    "tier_prefix",
]
