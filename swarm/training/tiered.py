"""A data-parallel peer's second tier: every group of a step applies one update (``swarm.averaging.tiers``).

``SecondTier.combine`` takes a complete first-tier round and returns what the peer applies. The group's
representative (``tiers.representative``) decides: when the peers at its step (by its signed progress
view, counting those a step or more behind: a record lags its peer) fit in its group, the group is the step's only one and applies its own result (``alone``);
otherwise it averages the group's result, at the group's total signed weight, with the other groups'
representatives in a second-tier round under ``tiers.tier_prefix`` and hands the signed output to its
members, who check it (``tiers.TierCheck``). When no second-tier round forms, a group that holds a strict
majority of the step's peers applies its own result (the others then catch up to it, as the majority
rule always moved them); a smaller one applies nothing and tries again.

Example::

    tiers = SecondTier(run, dht, numel=n, policy=policy, signing_key=key)
    await tiers.start()
    applied = await tiers.combine(group, result, me=peer_id, extra=extra, fits=fits, peers_at_step=12)
    if applied is not None:
        strategy.apply(applied, step)
"""

from __future__ import annotations

import dataclasses
import logging
import math

import hivemind
from hivemind.p2p import PeerID

from protocols.errors import ProtocolError
from protocols.keys import SigningKey
from swarm.averaging.allreduce import RoundResult
from swarm.averaging.averager import GroupRound
from swarm.averaging.factory import build_averager
from swarm.averaging.groups import EntryFit
from swarm.averaging.hooks import RoundHooks
from swarm.averaging.matchmaking import FailedSearches
from swarm.averaging.policy import PeerPolicy
from swarm.averaging.tiers import (
    TIER_COMPRESSION,
    TierBoard,
    TierCheck,
    TierOutcome,
    TierServicer,
    fetch_tier_result,
    representative,
    signed_outcome,
    tier_prefix,
)
from swarm.averaging.verification import Accuser
from swarm.config import RunConfig
from swarm.ratelimit import RateLimiter
from swarm.records import RecordSigner

logger = logging.getLogger(__name__)


class SecondTier:
    """The second tier of one data-parallel peer: its averager, and what it hands its groups as their
    representative. The arguments are the first tier's (``TrainingPeer``)."""

    def __init__(
        self,
        run: RunConfig,
        dht: hivemind.DHT,
        *,
        numel: int,
        policy: PeerPolicy,
        signing_key: SigningKey | None,
        record_signer: RecordSigner | None = None,
        upload_limiter: RateLimiter | None = None,
        accuse: Accuser | None = None,
        hooks: RoundHooks | None = None,
        client_mode: bool = False,
    ):
        self.numel = numel
        # Part streams ride libp2p: a volunteer's forwarded data port is the first tier's. Every member is
        # a representative, which can be dialed; one reducer suffices.
        self.averager = build_averager(
            run, dht, prefix=tier_prefix(run.run_id), numel=numel, signing_key=signing_key, policy=policy,
            upload_limiter=upload_limiter, accuse=accuse, hooks=hooks, client_mode=client_mode,
            record_signer=record_signer, compression=TIER_COMPRESSION, min_reducers=1, data_plane=False,
        )  # fmt: skip
        self.board = TierBoard()
        self._searches = FailedSearches()

    @property
    def wait_s(self) -> float:
        """How long a member waits for its representative's outcome: the second tier's search (at most
        ``averaging_timeout_s``) and its round (the same floor, grown for slow links), with a margin."""
        return 3 * self.averager.averaging_timeout_s

    async def start(self) -> None:
        await self.averager.start()
        policy, window_s = self.averager.policy, self.averager.matchmaking_time_s
        servicer = TierServicer(
            self.board,
            wait_s=lambda: self.wait_s,
            admission=lambda peer: policy.admission(peer, timeout_s=window_s / 4),
            traffic=self.averager.traffic,
        )
        await servicer.add_p2p_handlers(self.averager.p2p, namespace=self.averager.prefix)

    async def shutdown(self) -> None:
        await self.averager.shutdown()

    async def combine(
        self,
        group: GroupRound,
        result: RoundResult,
        *,
        me: str,
        extra: dict,
        fits: EntryFit | None,
        peers_at_step: int,
    ) -> RoundResult | None:
        """What this peer applies of the complete first-tier round ``result`` of ``group``: the step's
        combined result, its group's own (``alone``), or None (nothing this time; keep the gradient)."""
        members = [str(p) for p in group.peer_ids]
        if len(members) < 2:
            return result
        rep = members[representative(group.group_id, members, group.reducers)]
        weight = math.fsum(group.weights)
        if rep == me:
            return await self._represent(group, result, members, weight, extra, fits, peers_at_step)
        return await self._follow(group, result, rep, weight)

    async def _represent(
        self, group: GroupRound, result: RoundResult, members: list[str], weight: float, extra: dict,
        fits: EntryFit | None, peers_at_step: int,
    ) -> RoundResult | None:  # fmt: skip
        short = group.group_id.hex()[:8]
        self.board.open(group.group_id, members)
        outcome: TierOutcome | None = None
        applied: RoundResult | None = None
        try:
            groups = math.ceil(peers_at_step / len(members))
            if groups <= 1:
                logger.debug(f"group {short}: the step's {peers_at_step} peers fit in it; no second tier")
                outcome, applied = TierOutcome(alone=True), result
                return applied
            step = extra.get("step")
            tried = await self.averager.average(
                result.vector, weight, extra, expected_size=groups, fits=fits,
                failed_tries=self._searches.failed(step), keep_signed=True,
            )  # fmt: skip
            self._searches.record(step, formed=tried is not None)
            if tried is not None and tried[1].complete and tried[1].signed is not None:
                tier_group, tier_result = tried
                index = [str(p) for p in tier_group.peer_ids].index(str(self.averager.peer_id))
                outcome = signed_outcome(
                    tier_group.group_id, tier_group.signed_entries, index, tier_result.signed
                )
                applied = dataclasses.replace(result, vector=tier_result.vector, signed=None)
                logger.info(
                    f"group {short}: second tier with {len(tier_group.peer_ids)} groups, "
                    f"{math.fsum(tier_group.weights):.0f} samples"
                )
            elif 2 * len(members) > peers_at_step:
                logger.info(
                    f"group {short}: no second tier formed; it holds most of the step's peers, applying its own"
                )
                outcome, applied = TierOutcome(alone=True), result
            else:
                logger.info(
                    f"group {short}: no second tier formed; {len(members)} of {peers_at_step} peers apply nothing"
                )
            return applied
        finally:
            self.board.post(group.group_id, outcome)

    async def _follow(
        self, group: GroupRound, result: RoundResult, rep: str, weight: float
    ) -> RoundResult | None:
        averager = self.averager

        def check(first) -> TierCheck:
            return TierCheck(
                first, prefix=averager.prefix, schema_hash=averager.schema_hash, numel=self.numel,
                contribution=result.vector, weight=weight, max_age_s=averager.entry_max_age_s,
                certify=averager.policy.certificate_refusal,
            )  # fmt: skip

        short = group.group_id.hex()[:8]
        try:
            checked = await fetch_tier_result(
                averager.p2p, PeerID.from_base58(rep), averager.prefix, group.group_id, timeout_s=self.wait_s,
                check=check, chunk_timeout_s=2 * averager.sender_timeout_s, traffic=averager.traffic,
            )  # fmt: skip
        except ProtocolError as e:  # it signed or forwarded what does not hold
            logger.warning(
                f"group {short}: representative {rep} sent a second-tier result that does not hold: {e}"
            )
            averager.policy.suspect(rep, f"sent a second-tier result that does not hold: {e}")
            return None
        except Exception as e:  # refused, timed out, or its stream broke: nothing proves a fault
            logger.info(f"group {short}: no second-tier result from representative {rep}: {e!r}")
            return None
        if checked is None:
            return result
        return dataclasses.replace(result, vector=checked.output, signed=None)


__all__ = ["SecondTier"]
