"""A group that ends its first tier after the step's other groups combined adopts their round instead of
forming a second-tier round of its own (``SecondTier._combined_without``), and a peer adopts only a round
that holds most of the peers showing the step (``tiers.holds_the_step``): a round a few identities formed
among themselves is nobody's step.

In-process with the real ``SecondTier`` and ``TierCheck``; the network around them is the stand-in of
``tests/test_tier_redteam.py`` (``make_tier``) and a ``fetch_tier_result`` that hands over a real signed
second-tier round (``tests/test_tiers.py``'s ``second_tier``).
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch
from test_tier_redteam import MINE, NUMEL, first_tier, make_tier, posted
from test_tiers import PREFIX, SCHEMA, second_tier

from protocols.keys import SigningKey
from swarm.averaging.allreduce import RoundResult
from swarm.averaging.tiers import TierCheck, covered_peers, holds_the_step, signed_peers
from swarm.training import tiered
from swarm.training.tiered import adopt_order

pytestmark = pytest.mark.timeout(30)


def _searches(calls):
    """A stand-in second-tier ``average`` that records each search and forms nothing."""

    async def average(vector, weight, extra, *, failed_tries, **kwargs):
        calls.append(failed_tries)
        return None

    return average


def _admitting(tier, admitted=None):
    """Every signature counts (``admitted``: only these) in the tier's view of the run."""
    tier.averager.policy = SimpleNamespace(
        listed_refusal=lambda peer: None,
        certificate_refusal=lambda peer, cert: None,
        certified=lambda peer: admitted is None or peer in admitted,
    )
    return tier


def _headers(monkeypatch, header, asked=None):
    """A stand-in for ``tierserve.fetch_tier_header``: every holder shows ``header`` (None: nothing kept),
    checked with the caller's own ``check`` as over the wire."""

    async def fetch(p2p, holder, namespace, request, *, timeout_s, check):
        if asked is not None:
            asked.append(str(holder))
        if header is None:
            raise ConnectionError("no combined result kept")
        return check(header)

    monkeypatch.setattr(tiered, "fetch_tier_header", fetch)


def test_a_late_group_adopts_the_steps_round_instead_of_searching(monkeypatch):
    """Peers a step ahead hold the step's combined round, which holds most of the peers showing the step:
    the representative reads its header, searches no second-tier round (which would apply a second update
    at the step) and tells its members nothing (each adopts it from the peers ahead)."""
    group_input = torch.randn(NUMEL)
    header, _, _ = second_tier(group_input=group_input, mine=MINE)
    probe = TierCheck(header, prefix=PREFIX, schema_hash=SCHEMA, numel=NUMEL, mine=MINE, representative=None,
                      contribution=None, weight=0.0, max_age_s=60.0, certify=None, refusal=None)  # fmt: skip
    held = sorted(signed_peers(probe.groups, lambda peer: True))  # 6: two signers in each group of 3
    holders = [SigningKey.generate().peer_id for _ in range(2)]
    asked = []
    _headers(monkeypatch, header, asked)

    async def scenario(others):
        keys, group, rep = first_tier(4)
        vector, calls = torch.randn(NUMEL), []
        tier = _admitting(make_tier(keys, group, rep, vector, _searches(calls)))
        applied = await tier.combine(group, RoundResult(vector, True), me=keys[rep].peer_id, extra=MINE,
                                     fits=None, peers_at_step=12, run_peers=12, ahead=lambda: holders,
                                     here=lambda: set(others), showing=lambda: {*others, *holders})  # fmt: skip
        told = await posted(tier, group, keys[(rep + 1) % 4].peer_id)
        return calls, applied, told

    # 6 signers + 2 holders + 4 of its own group = 12 showing the step: half, the step's round.
    calls, applied, told = asyncio.run(scenario(held))
    assert calls == [], "no second-tier search: a round of its own would be a second update at the step"
    assert applied is None and told is None, "its members are told nothing, and adopt"
    assert sorted(asked) == sorted(holders), "both peers ahead asked at once"
    # One more at the step, 6 of 13: a minority's round, so the group searches its own.
    calls, _, _ = asyncio.run(scenario([*held, "other"]))
    assert calls, "a round that does not hold the step is not the step's"


def test_a_record_a_step_ahead_with_nothing_that_holds_behind_it_costs_the_check_not_the_search(monkeypatch):
    """Whoever shows the next step without a round that holds the step (a Sybil's record, a peer that
    downloaded the state) does not stop a group from combining: it searches as before."""
    _headers(monkeypatch, None)

    async def searches(ahead):
        keys, group, rep = first_tier(4)
        vector, calls = torch.randn(NUMEL), []
        tier = make_tier(keys, group, rep, vector, _searches(calls))
        await tier.combine(group, RoundResult(vector, True), me=keys[rep].peer_id, extra=MINE, fits=None,
                           peers_at_step=12, run_peers=12, ahead=lambda: ahead, here=lambda: ())  # fmt: skip
        return calls

    assert asyncio.run(searches([])) == [1, 2], "nobody ahead: it searches, and again with its result"
    sybil = SigningKey.generate().peer_id
    assert asyncio.run(searches([sybil])) == [1, 2], "a peer ahead with nothing that holds: as if nobody were"


def _serving(header, chunks):
    """A stand-in for ``tierserve.fetch_tier_result``: a holder that hands over ``header`` and ``chunks``,
    checked with the caller's own ``check`` as over the wire."""

    async def fetch(p2p, holder, namespace, request, *, timeout_s, check, chunk_timeout_s, traffic):
        checked = check(header)
        for (part, chunk), message in zip(checked.expected(), chunks, strict=True):
            checked.take(part, chunk, message)
        return checked

    return fetch


def test_a_peer_adopts_only_a_round_that_holds_most_of_the_peers_showing_the_step(monkeypatch):
    """A signed, well-formed second-tier round of 3 groups of 3, each certified by 2 of its members, holds
    the 6 peers that signed (the third member of each group is listed, not signed). A peer adopts it while
    they are at least half of the peers showing the step or a later one, not once more peers show it (the
    round is then a minority's, such as one that a few identities formed among themselves), and a
    certificate signed by keys the peer's view does not admit holds nobody."""
    group_input = torch.randn(NUMEL)
    header, chunks, keys = second_tier(group_input=group_input, mine=MINE)
    holder = SigningKey.generate().peer_id
    monkeypatch.setattr(tiered, "fetch_tier_result", _serving(header, chunks))
    probe = TierCheck(header, prefix=PREFIX, schema_hash=SCHEMA,
                      numel=NUMEL, mine=MINE, representative=None, contribution=None, weight=0.0, max_age_s=60.0,
                      certify=None, refusal=None)  # fmt: skip
    held = signed_peers(probe.groups, lambda peer: True)
    listed = covered_peers(probe.groups, lambda peer: True) - held
    assert len(held) == 6 and len(listed) == 3
    others = [f"other-{i}" for i in range(7)]

    def adopted(showing, admitted=None):
        group_keys, group, rep = first_tier(4)
        tier = _admitting(make_tier(group_keys, group, rep, group_input, _searches([])), admitted)
        return asyncio.run(tier.adopt(MINE, [holder], showing=showing))

    result = adopted(held | set(others[:5]))
    assert result is not None and result.complete, "6 of 11: the step's round"
    assert adopted(held | set(others[:6])) is not None, "6 of 12: half"
    assert adopted(held | set(others)) is None, "6 of 13: a minority's round"
    assert adopted(held | listed | set(others[:4])) is None, (
        "6 of 13: listed members that signed nothing count not"
    )
    assert adopted(held | set(others[:5]), admitted=set()) is None, "signed by keys it does not admit: nobody"
    assert holds_the_step(probe.groups, lambda peer: True, held | set(others[:5]))
    assert not holds_the_step(probe.groups, lambda peer: True, set(others)), (
        "listed peers it does not see count not"
    )


def test_peers_that_fell_behind_spread_their_asks_over_the_peers_ahead():
    """Each peer asks the peers ahead in an order of its own, so that the hundreds that missed a round do
    not all download the combined result from the same few."""
    ahead = [f"ahead-{i}" for i in range(100)]
    firsts = {adopt_order(f"behind-{i}", ahead)[0] for i in range(200)}
    assert len(firsts) > 50
    assert sorted(adopt_order("behind-0", ahead)) == sorted(ahead)
    assert adopt_order("behind-0", reversed(ahead)) == adopt_order("behind-0", ahead), (
        "no holder places itself"
    )
