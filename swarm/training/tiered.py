"""A data-parallel peer's second tier: every group of a step applies one update (``swarm.averaging.tiers``).

``SecondTier.combine`` takes a complete first-tier round and returns what the peer applies. The group's
representative (``tiers.representative``, the first of ``tiers.relay_order``) decides: when the other
peers at its step (by its signed progress view) could form no group of their own and the group holds most
of the run's online members (by their member records), the group is the step's only one and applies its
own result (``alone``, ``tiers.only_group``).
Otherwise it collects its members' attestations (``tiercert``: each member sends its own when it asks for
the outcome), and once a strict majority of the group has attested it averages the group's result, at the
group's total signed weight, with the other certified representatives in a second-tier round under
``tiers.tier_prefix``, and hands the signed output to its members, who check it (``tiers.TierCheck``);
in a group larger than ``training.relay_fanout + 1`` each member passes what it checked on to at most that
many others (``tiers.relay_parent``), so no member sends it more than ``relay_fanout`` times.
Its search waits for groups that end their first tier later (``tiers.second_window_s``) and closes once
the groups gathered hold the peers whose records show the step (``tiers.covers``, ``covered_peers``), less
those its own recent windows waited for in vain (``absent``). When no second-tier round forms, the representative
searches again with the same result, each window
wider, while its members' wait leaves room and no peer has moved on to the next step, short of the last
try; otherwise the group applies nothing, and its peers look for the step's combined result a step ahead
(``adopt``) before a new first-tier round. Only after ``ALONE_AFTER_TRIES`` such searches at one step does
it apply its own result: a claim nobody can check (records of peers said to be at this step) costs a few
windows, never the step. Every peer keeps the
combined result it applied (``tierserve.TierBoard.keep``), and a peer that finds the others a step ahead
``adopt``s it, checked, instead of downloading the whole state.

Example::

    tiers = SecondTier(run, dht, first=averager, numel=n, policy=policy, signing_key=key)
    await tiers.start()
    applied = await tiers.combine(group, result, me=peer_id, extra=extra, fits=fits, peers_at_step=12, run_peers=12)
    if applied is not None:
        strategy.apply(applied, step)
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import logging
import math
from collections.abc import Callable, Collection, Iterable

import hivemind
from hivemind.p2p import PeerID

from protocols import averaging_pb2 as apb
from protocols.errors import ProtocolError, StaleError
from protocols.keys import SigningKey
from swarm.averaging.allreduce import RoundResult
from swarm.averaging.averager import Averager, GroupRound
from swarm.averaging.factory import build_averager
from swarm.averaging.groups import EntryFit, GroupEntryBody, Misfit
from swarm.averaging.hooks import RoundHooks
from swarm.averaging.matchmaking import FailedSearches
from swarm.averaging.missed import MissedRounds
from swarm.averaging.policy import PeerPolicy
from swarm.averaging.tiercert import (
    attestation_holds,
    certificate,
    entry_misfit,
    result_digest,
    sign_attestation,
)
from swarm.averaging.tiers import (
    MAX_ABSENT_SHARE,
    MEMBER_WAIT_TIMEOUTS,
    TIER_COMPRESSION,
    EarlyClose,
    TierCheck,
    TierOutcome,
    covered_peers,
    holds_the_step,
    only_group,
    relay_order,
    relay_parent,
    second_window_s,
    signed_outcome,
    signed_peers,
    tier_prefix,
)
from swarm.averaging.tierserve import (
    TierBoard,
    TierServicer,
    fetch_down_the_tree,
    fetch_tier_header,
    fetch_tier_result,
)
from swarm.averaging.verification import Accuser
from swarm.config import RunConfig
from swarm.ratelimit import RateLimiter
from swarm.records import RecordSigner

logger = logging.getLogger(__name__)

#: Second-tier searches at one step that formed no round before a group applies its own result.
ALONE_AFTER_TRIES = 3
#: Peers ahead a peer that fell behind asks for the step's combined result before it downloads the state.
ADOPT_ASKS = 3


def adopt_order(me: str, holders: Iterable[str]) -> list[str]:
    """``holders`` (peers a step ahead) in the order ``me`` asks them for the step's combined result: by the
    SHA-256 of both names, so that the peers that missed a round spread their asks over the peers ahead
    instead of all asking the same few, and nobody can place itself first for everyone."""
    return sorted(holders, key=lambda holder: hashlib.sha256(f"{me}|{holder}".encode()).digest())


@dataclasses.dataclass(frozen=True)
class _Facts:
    """What a group's members attest: its round, their step and state, its representative, its weight, the
    digest of its result and its member list."""

    group_id: bytes
    step: int
    state_hash: str
    representative: str
    weight: float
    digest: bytes
    members: tuple[str, ...]


class SecondTier:
    """The second tier of one data-parallel peer: its averager, and what it hands its groups as their
    representative. ``first`` is the peer's first-tier averager (its recent rounds say who may ask); the
    other arguments are the first tier's (``TrainingPeer``)."""

    def __init__(
        self,
        run: RunConfig,
        dht: hivemind.DHT,
        *,
        first: Averager,
        numel: int,
        policy: PeerPolicy,
        signing_key: SigningKey | None,
        record_signer: RecordSigner | None = None,
        upload_limiter: RateLimiter | None = None,
        accuse: Accuser | None = None,
        hooks: RoundHooks | None = None,
        client_mode: bool = False,
    ):
        self.first, self.numel, self.signing_key = first, numel, signing_key
        self.min_group_size, self.relay_fanout = run.training.min_group_size, run.training.relay_fanout
        # Part streams ride libp2p: a volunteer's forwarded data port is the first tier's. Every member is
        # a representative, which can be dialed; one reducer suffices.
        self.averager = build_averager(
            run, dht, prefix=tier_prefix(run.run_id), numel=numel, signing_key=signing_key, policy=policy,
            upload_limiter=upload_limiter, accuse=accuse, hooks=hooks, client_mode=client_mode,
            record_signer=record_signer, compression=TIER_COMPRESSION, min_reducers=1, data_plane=False,
        )  # fmt: skip
        self.averager.counts_searches = False  # the first tier's searches count (``missed``)
        # Its window waits for groups that end their first tier later (``second_window_s``).
        self.averager.longest_search_s = self.wait_s
        self.board = TierBoard()
        self._searches = FailedSearches()
        # Peers whose records showed a step and that joined none of the groups of a round this peer led after
        # waiting its window out: not waited for again for a span of steps that doubles with each repeat,
        # forgiven by steps they take part in (``missed``).
        self.absent = MissedRounds()

    @property
    def wait_s(self) -> float:
        """How long a member waits for its representative's outcome (``MEMBER_WAIT_TIMEOUTS`` averaging
        timeouts): the attestations and the second tier's search (``second_window_s``), then its round (at
        least one timeout, more on slow links) and the hand-off (``ROUND_ROOM_TIMEOUTS`` for both)."""
        return MEMBER_WAIT_TIMEOUTS * self.averager.averaging_timeout_s

    async def start(self) -> None:
        await self.averager.start()
        policy, window_s = self.averager.policy, self.averager.matchmaking_time_s
        servicer = TierServicer(
            self.board,
            known=self._known,
            wait_s=lambda: self.wait_s,
            admission=lambda peer: policy.admission(peer, timeout_s=window_s / 4),
            traffic=self.averager.traffic,
        )
        await servicer.add_p2p_handlers(self.averager.p2p, namespace=self.averager.prefix)

    async def shutdown(self) -> None:
        await self.averager.shutdown()

    def _known(self, group_id: bytes, asker: str) -> bool:
        runner = self.first.rounds.lookup(group_id)
        return runner is not None and asker in runner.members

    async def combine(
        self,
        group: GroupRound,
        result: RoundResult,
        *,
        me: str,
        extra: dict,
        fits: EntryFit | None,
        peers_at_step: int,
        run_peers: int,
        ahead: Callable[[], list[str]] | None = None,
        here: Callable[[], Collection[str]] | None = None,
        showing: Callable[[], Collection[str]] | None = None,
        behind: Callable[[], Collection[str]] | None = None,
    ) -> RoundResult | None:
        """What this peer applies of the complete first-tier round ``result`` of ``group``: the step's
        combined result, its group's own (``alone``), or None (nothing this time; keep the gradient).
        ``peers_at_step``: the peers whose records show this step or the one before; ``run_peers``: the run's
        online members whatever their step (at least ``peers_at_step``); ``ahead``: the peers whose records
        show the next step, as the step's other groups would if they combined without this one (the
        representative then does not search, or stops searching, and the peers adopt what they applied,
        ``adopt``; None: never, as in an ``outer_overlap`` run); ``here``: the peers whose records show this
        step now (the representative's search closes once the groups in it hold all but a few,
        ``tiers.covers``; its window waited out in vain for some makes them ``absent``); ``showing``: those
        whose records show this step or a later one (default: ``here`` and ``ahead``), at least half of whom
        a round ahead must hold to be adopted (``holds_the_step``); ``behind``: those whose records show the
        step before (a group may hold some: the search waits for them as for ``here``, ``covers``)."""
        members = [str(p) for p in group.peer_ids]
        if len(members) < 2:
            return result
        here = here if here is not None else lambda: ()
        ahead = ahead if ahead is not None else list
        showing = showing if showing is not None else lambda: {*here(), *ahead()}
        behind = behind if behind is not None else tuple
        commitments = [c or b"" for c in group.commitments] or [b""] * len(members)
        order = relay_order(commitments, members, group.reducers)  # its first is the representative
        rep = members[order[0]]
        facts = _Facts(
            group.group_id, int(extra["step"]), str(extra["state_hash"]), rep, math.fsum(group.weights),
            result_digest(result.vector), tuple(members),
        )  # fmt: skip
        if rep == me:
            return await self._represent(
                group,
                result,
                members,
                facts,
                extra,
                fits,
                peers_at_step,
                run_peers,
                ahead,
                here,
                showing,
                behind,
            )
        parents = {i: relay_parent(order, i, group.reducers, self.relay_fanout) for i in order[1:]}
        mine = members.index(me)
        children = [members[i] for i, parent in parents.items() if parent == mine]
        return await self._follow(group, result, facts, extra, members[parents[mine]], children)

    def _tier_fits(self, first_fits: EntryFit | None, facts: _Facts) -> EntryFit:
        """A second-tier entry fits when it fits the first tier's rule (its step), holds this peer's state,
        and carries a certificate of a group that holds for its signer, at the weight that group signed."""
        policy = self.averager.policy

        def fits(entry: GroupEntryBody, signer: str) -> Misfit | None:
            misfit = first_fits(entry, signer) if first_fits is not None else None
            if misfit is not None:
                return misfit
            return entry_misfit(
                entry, signer, step=facts.step, state_hash=facts.state_hash, refusal=policy.listed_refusal,
                min_members=self.min_group_size,
            )  # fmt: skip

        return fits

    async def _represent(
        self, group: GroupRound, result: RoundResult, members: list[str], facts: _Facts, extra: dict,
        fits: EntryFit | None, peers_at_step: int, run_peers: int, ahead: Callable[[], list[str]],
        here: Callable[[], Collection[str]], showing: Callable[[], Collection[str]],
        behind: Callable[[], Collection[str]] = tuple,
    ) -> RoundResult | None:  # fmt: skip
        short = group.group_id.hex()[:8]

        def holds(member: str, signature: bytes) -> bool:
            return attestation_holds(member, signature, *dataclasses.astuple(facts))

        self.board.open(group.group_id, members, holds)
        loop = asyncio.get_running_loop()
        opened_at = loop.time()
        outcome: TierOutcome | None = None
        applied: RoundResult | None = None
        try:
            if only_group(
                len(members),
                peers_at_step=peers_at_step,
                run_peers=run_peers,
                min_group_size=self.min_group_size,
            ):
                logger.debug(f"group {short}: the step's other peers could form no group; no second tier")
                outcome, applied = TierOutcome(alone=True), result
                return applied
            tried, complete = None, False
            if await self._combined_without(facts, extra, ahead(), showing, members):
                return applied
            own = sign_attestation(self.signing_key, *dataclasses.astuple(facts))
            self.board.attest(group.group_id, facts.representative, own)
            # Members attest as soon as their own round ends; on a loaded machine that can take a while. Those
            # that come within a sender timeout of the majority sign too: a peer that later no longer counts a
            # signer or two (it left, its records lapsed) still counts the group (``holds_the_step``).
            signed = await self.board.majority(
                group.group_id, timeout_s=self.first.averaging_timeout_s, rest_s=self.first.sender_timeout_s
            )
            if signed is not None:
                cert = certificate(facts.group_id, members, facts.weight, facts.digest, signed)
                # Every group of the step belongs in one second-tier round: wait for as many as could exist
                # (each other group of at least 2), or until the groups gathered hold the step's peers (``covers``),
                # over a window that waits for groups that end their first tier later (``second_window_s``);
                # the leader takes whoever came by its end.
                most = 1 + (peers_at_step - len(members)) // 2
                # A search that formed no round is tried again with the same result, each window wider, while
                # the members' wait leaves room for a search and a round (each up to an averaging timeout): a
                # group that redid its first-tier round instead would cost every member a vector more. Never
                # up to the last try: the group applies its own result only after its peer has looked for
                # peers a step ahead to adopt from (``TrainingPeer._round``), since the step's other groups
                # may have combined without it.
                while True:
                    failed = self._searches.failed(facts.step) + 1
                    window_s = second_window_s(
                        run_window_s=self.averager.matchmaking_window_s(failed), waited_s=loop.time() - opened_at,
                        averaging_timeout_s=self.averager.averaging_timeout_s,
                    )  # fmt: skip
                    closing = EarlyClose(
                        waiting=lambda: self._waited_for(here) - set(members), fits=self._tier_fits(fits, facts),
                        counts=self._counts, step=facts.step, state_hash=facts.state_hash,
                        min_members=self.min_group_size, lagging=lambda: set(behind()) - set(members),
                    )  # fmt: skip
                    tried = await self.averager.average(
                        result.vector, facts.weight, {**extra, "group": cert}, expected_size=most,
                        fits=self._tier_fits(fits, facts), failed_tries=failed, keep_signed=True,
                        window_s=window_s, closes_when=closing,
                    )  # fmt: skip
                    complete = tried is not None and tried[1].complete and tried[1].signed is not None
                    # A round a substitute repaired is applied by nobody (``TierCheck``): not formed.
                    formed = complete and all(s == p for p, s in enumerate(tried[1].signed.signers))
                    self._searches.record(facts.step, formed=formed)
                    if complete or self._searches.failed(facts.step) >= ALONE_AFTER_TRIES - 1:
                        break
                    if loop.time() + 2 * self.averager.averaging_timeout_s > opened_at + self.wait_s:
                        break
                    if await self._combined_without(facts, extra, ahead(), showing, members):
                        break  # the others combined meanwhile: adopt, not search
                    logger.info(f"group {short}: no second tier formed; searching again with its result")
            else:
                logger.info(f"group {short}: fewer than half of its members attested its round")
                self._searches.record(facts.step, formed=False)
            if complete and all(s == p for p, s in enumerate(tried[1].signed.signers)):
                tier_group, tier_result = tried
                index = [str(p) for p in tier_group.peer_ids].index(str(self.averager.peer_id))
                outcome = signed_outcome(
                    tier_group.group_id, tier_group.signed_entries, index, tier_result.signed
                )
                self.board.keep(facts.step, outcome)  # for a peer that fell behind (``adopt``)
                # Only a leader that waited its window out itself (neither closed early nor full) saw who never came.
                led = self.averager.led_last_group
                certificates = [e["group"] for e in tier_group.extras]
                if led and not closing.closed and self.averager.last_form_s >= 0.9 * window_s:
                    self._observe(here, certificates, set(members))
                applied = dataclasses.replace(
                    result, vector=tier_result.vector, signed=None, tier_groups=certificates
                )
                logger.info(
                    f"group {short}: second tier with {len(tier_group.peer_ids)} groups, "
                    f"{math.fsum(tier_group.weights):.0f} samples"
                )
            elif complete:  # a substitute's part cannot be handed over (``TierCheck``): nobody applies it
                logger.info(f"group {short}: a second-tier part came from a substitute; trying again")
            elif self._searches.failed(facts.step) >= ALONE_AFTER_TRIES:
                logger.info(
                    f"group {short}: {ALONE_AFTER_TRIES} second-tier searches at this step formed no round; "
                    "applying its own result"
                )
                outcome, applied = TierOutcome(alone=True), result
            else:
                logger.info(
                    f"group {short}: no second tier formed; its {len(members)} members apply nothing yet"
                )
            return applied
        finally:
            self.board.post(group.group_id, outcome)

    async def _follow(
        self,
        group: GroupRound,
        result: RoundResult,
        facts: _Facts,
        extra: dict,
        parent: str,
        children: list[str],
    ) -> RoundResult | None:
        averager, rep = self.averager, facts.representative

        def check(first: apb.TierAnswer) -> TierCheck:
            return TierCheck(
                first, prefix=averager.prefix, schema_hash=averager.schema_hash, numel=self.numel, mine=extra,
                representative=rep, contribution=result.vector, weight=facts.weight,
                max_age_s=averager.entry_max_age_s, certify=averager.policy.certificate_refusal,
                refusal=averager.policy.listed_refusal,
            )  # fmt: skip

        short = group.group_id.hex()[:8]
        attestation = sign_attestation(self.signing_key, *dataclasses.astuple(facts))
        request = apb.TierRequest(group_id=group.group_id, attestation=attestation)
        self.board.relay(group.group_id, children)  # the members below this one in the tree ask here
        outcome: TierOutcome | None = None
        try:
            try:
                checked = await fetch_down_the_tree(
                    averager.p2p, averager.prefix, request, representative=PeerID.from_base58(rep),
                    parent=PeerID.from_base58(parent), check=check, timeout_s=self.wait_s,
                    chunk_timeout_s=2 * averager.sender_timeout_s, traffic=averager.traffic,
                    suspect=averager.policy.suspect,
                )  # fmt: skip
            except StaleError as e:  # dated out of bounds by its signers: nobody is suspected
                logger.info(f"group {short}: the second-tier result came too late to check: {e}")
                return None
            except ProtocolError as e:  # it signed or forwarded what does not hold (suspected)
                logger.warning(
                    f"group {short}: representative {rep} sent a second-tier result that does not hold: {e}"
                )
                return None
            except Exception as e:  # refused, timed out, or its stream broke: nothing proves a fault
                logger.info(f"group {short}: no second-tier result from representative {rep}: {e!r}")
                return None
            outcome = TierOutcome(alone=True) if checked is None else checked.outcome()
            if checked is None:
                return result
            self.board.keep(facts.step, outcome)
            return dataclasses.replace(result, vector=checked.output, signed=None, tier_groups=checked.groups)
        finally:
            self.board.post(group.group_id, outcome)  # to the members below this one: None sends them upward

    def _counts(self, peer: str) -> bool:
        """Whether ``peer``'s signature on a group certificate counts toward closing a search (``covered_peers``):
        admitted, as this peer's view of the run's members and records shows, and not banned."""
        policy = self.averager.policy
        return policy.listed_refusal(peer) is None and policy.certified(peer)

    def _waited_for(self, here: Callable[[], Collection[str]]) -> set[str]:
        """The peers whose records show the step now, less those ``absent`` from recent steps (unless that
        would leave out more than ``MAX_ABSENT_SHARE`` of them)."""
        showing = set(here())
        waited = {peer for peer in showing if self.absent.refusal(peer) is None}
        return waited if len(showing) - len(waited) <= MAX_ABSENT_SHARE * len(showing) else showing

    def _observe(self, here: Callable[[], Collection[str]], groups: list[dict], own: set[str]) -> None:
        """This peer led a second-tier round of ``groups`` (their checked certificates) and waited its window
        out: peers whose records still show the step and that neither its group (``own``) nor those hold
        missed it, the others took part (``absent``). Only a leader knows it waited; a round another led (or
        handed over) may have closed early, so members learn nothing from it."""
        covered = covered_peers(groups, self._counts) | own
        showing = set(here())
        missed = {
            peer: "showed the step in its records and joined none of its groups" for peer in showing - covered
        }
        if len(missed) > MAX_ABSENT_SHARE * len(showing | covered):
            missed = {}  # cut off from the swarm, not kept waiting by a few
        self.absent.round(delivered=covered, missed=missed, denied={})
        self.absent.search()

    def _holding(self, extra: dict, showing: Collection[str], outside: Collection[str]) -> Callable:
        """The check of a combined round's header that a peer which was in none of its groups adopts: as a
        member checks a hand-off but for its own input (``TierCheck``), and holding at least half of
        ``showing`` without the peers of ``outside`` (known to be in none of its groups: ``holds_the_step``)."""
        averager, showing, outside = self.averager, set(showing), set(outside)

        def check(first: apb.TierAnswer) -> TierCheck:
            checked = TierCheck(
                first, prefix=averager.prefix, schema_hash=averager.schema_hash, numel=self.numel, mine=extra,
                representative=None, contribution=None, weight=0.0, max_age_s=averager.entry_max_age_s,
                certify=averager.policy.certificate_refusal, refusal=averager.policy.listed_refusal,
            )  # fmt: skip
            if not holds_the_step(checked.groups, self._counts, showing, outside=outside):
                held = len((signed_peers(checked.groups, self._counts) - outside) & showing)
                raise ProtocolError(
                    f"its round holds {held} of the {len(showing)} peers that show the step or later: "
                    "not the step's combined result"
                )
            return checked

        return check

    async def _combined_without(
        self, facts: _Facts, extra: dict, holders: list[str], showing: Callable[[], Collection[str]],
        members: list[str],
    ) -> bool:  # fmt: skip
        """Whether the step's other groups already combined without this one (it ended its first tier later):
        one of the first ``ADOPT_ASKS`` peers a step ahead, asked at once, shows within a sender timeout the
        header of a round at this step and state that holds at least half of the peers showing the step or later,
        this group's members counted as in none of its groups (``_holding``). Then the group forms no
        second-tier round of its own, which would apply another result at the step: its representative
        tells its members nothing, and each adopts that round's result (``adopt``). Only headers are read,
        so a record a step ahead with nothing behind it (or a holder that answers slowly) costs each
        representative that sees it at most a sender timeout before its search, never the search."""
        if not holders:
            return False
        averager, view = self.averager, {*showing(), *members}
        check = self._holding(extra, view, outside=members)

        async def header(holder: str) -> TierCheck | None:
            with contextlib.suppress(Exception):  # none kept, another state's, a round that does not hold
                return await fetch_tier_header(
                    averager.p2p, PeerID.from_base58(holder), averager.prefix, apb.TierRequest(step=facts.step),
                    timeout_s=averager.sender_timeout_s, check=check,
                )  # fmt: skip
            return None

        asks = [asyncio.ensure_future(header(holder)) for holder in holders[:ADOPT_ASKS]]
        try:
            for answer in asyncio.as_completed(asks):
                if await answer is not None:
                    logger.info(
                        f"group {facts.group_id.hex()[:8]}: the step's other groups combined without it; "
                        "its members adopt their result"
                    )
                    return True
            return False
        finally:
            for ask in asks:
                ask.cancel()

    async def adopt(self, extra: dict, holders: list[str], *, showing: Collection[str]) -> RoundResult | None:
        """The combined result that ``holders`` (peers a step ahead) applied at this peer's step and state, checked
        as a member checks a hand-off but for its own input (it was in no group of that round), and holding
        at least half of ``showing`` (the peers whose records show the step or a later one, itself included:
        ``holds_the_step``; not a round of a few identities' own); None when none of the first ``ADOPT_ASKS``
        holds one that checks within the members' wait (``wait_s``) in all. Cheaper than the whole state: one
        fp16 vector."""
        averager, check = self.averager, self._holding(extra, showing, outside=())
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.wait_s):
                for holder in holders[:ADOPT_ASKS]:
                    try:
                        checked = await fetch_tier_result(
                            averager.p2p, PeerID.from_base58(holder), averager.prefix,
                            apb.TierRequest(step=extra["step"]), timeout_s=2 * averager.sender_timeout_s,
                            check=check, chunk_timeout_s=2 * averager.sender_timeout_s, traffic=averager.traffic,
                        )  # fmt: skip
                    except Exception as e:  # none kept, another state's, or its stream broke: ask the next
                        logger.info(
                            f"no combined result of step {extra['step']} to adopt from {holder}: {e!r}"
                        )
                        continue
                    if checked is not None:
                        self.board.keep(int(extra["step"]), checked.outcome())
                        return RoundResult(checked.output, True)
        return None


__all__ = ["ADOPT_ASKS", "ALONE_AFTER_TRIES", "SecondTier", "adopt_order"]
