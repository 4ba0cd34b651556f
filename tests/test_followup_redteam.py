"""What an attacker's read of 610cc9d (the all-reduce's per-chunk work on worker threads) and 73533f8 (the
second tier: ``covers(fewest=)``, ``holds_the_step`` at half, validation after an adopted step) found, each
now a regression test that failed on them.

All run in-process with the real ``SecondTier``, ``TierCheck``, ``EarlyClose`` and ``PartReducer``; the
network around them is the stand-in of ``tests/test_tier_redteam.py`` (``make_tier``) and
``tests/test_late_groups.py`` (``_headers``, ``_serving``). One finding stays open (docs/scale.md): a
member that never attests adds ``TierBoard.majority``'s ``rest_s`` (a sender timeout) to its group's step.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch
from hivemind.p2p import PeerID
from test_late_groups import _admitting, _headers, _searches, _serving
from test_tier_redteam import MINE, NUMEL, certified, first_tier, handoff, make_tier
from test_tiers import PREFIX, SCHEMA, _group, second_tier

from protocols import averaging_pb2 as apb
from protocols.keys import SigningKey
from swarm.averaging.aggregators import get_aggregator
from swarm.averaging.allreduce import ButterflyAllReduce, RoundResult, RoundSettings
from swarm.averaging.compression import get_codec
from swarm.averaging.evidence import contribution_message
from swarm.averaging.groups import GroupEntryBody
from swarm.averaging.tiers import EarlyClose, TierCheck, covered_peers
from swarm.training import tiered
from swarm.training.tiered import adopt_order

pytestmark = pytest.mark.timeout(60)


def _listed(peer_id: str):
    """A listed member that signs nothing: only its name is needed."""
    return SimpleNamespace(peer_id=peer_id)


def _sybil_round(sybils, listed, evil):
    """The Sybils' own second-tier round: two entries (sybils[0], sybils[1]); the first's certificate is signed
    by every Sybil and also lists ``listed`` (honest peers that signed nothing), the second's reuses the same
    signers (it does not count toward coverage, but TierCheck needs two entries)."""
    certs = {
        0: certified(sybils[0], 64.0, evil[0], cosigners=[*sybils[1:], *map(_listed, listed)],
                     signers=len(sybils)),
        1: certified(sybils[1], 64.0, evil[1], cosigners=[sybils[0], *sybils[2:]], signers=len(sybils)),
    }  # fmt: skip
    return handoff(evil, keys=[sybils[0], sybils[1]], certs=certs)


# --- F1 (73533f8): a round holding exactly half is adopted; 3 Sybils poison a late group of a 7-peer step ---


def test_f1_three_sybils_do_not_get_their_own_round_adopted_by_a_late_group(monkeypatch):
    """HIGH on 73533f8. 7 honest peers at the step: a late group G of 4 and 3 others O. 3 admitted Sybils
    publish records at step+1 and serve a second-tier round of their own with an update of their choosing;
    its first certificate is signed by all three and lists two of O (who signed nothing). G counted the
    listed members: 5 of the 10 peers it sees, exactly half, so it skipped its search and every member
    applied the Sybils' update. Now a round holds only the peers that signed it: 3 of 10."""
    keys, group, rep = first_tier(4)  # the late honest group
    others = [SigningKey.generate().peer_id for _ in range(3)]
    sybils = [SigningKey.generate() for _ in range(3)]
    sybil_ids = [s.peer_id for s in sybils]
    evil = [torch.full((NUMEL,), 5.0), torch.full((NUMEL,), 7.0)]  # the Sybils' chosen update: 6.0
    header, chunks, _ = _sybil_round(sybils, others[:2], evil)
    _headers(monkeypatch, header)
    monkeypatch.setattr(tiered, "fetch_tier_result", _serving(header, chunks))
    members = {k.peer_id for k in keys}
    showing = members | set(others) | set(sybil_ids)
    assert len(showing) == 10

    async def represent():
        calls, vector = [], torch.randn(NUMEL)
        tier = _admitting(make_tier(keys, group, rep, vector, _searches(calls)))
        await tier.combine(
            group, RoundResult(vector, True), me=keys[rep].peer_id, extra=MINE, fits=None, peers_at_step=7,
            run_peers=10, ahead=lambda: sybil_ids, here=lambda: set(others), showing=lambda: showing,
        )  # fmt: skip
        return calls, tier

    calls, tier = asyncio.run(represent())
    assert calls, "the group searched a round of its own: the Sybils' round is not the step's"
    assert asyncio.run(tier.adopt(dict(MINE), sybil_ids, showing=showing)) is None, "and nobody adopts it"


# --- F2 (73533f8): two rounds each pass; which one a late peer applies depends on whom it asks first ------


def test_f2_a_sybil_round_listing_the_honest_rounds_peers_passes_for_nobody(monkeypatch):
    """HIGH on 73533f8. The step's honest round holds 9 peers (3 groups of 3). 4 Sybils at step+1 serve their
    own round whose certificate lists 3 of those 9. A late peer saw 9 + itself + 4 Sybils = 14: the honest
    round held 9, the Sybils' 4 + 3 listed = 7, exactly half, so both passed, and each late peer adopted the
    first that checked in its own ``adopt_order``: the step split, partly poisoned. Now a round holds only
    its signers (4 of 14 for the Sybils'): whatever order a late peer asks in, it never applies their
    update. (The fixture's honest certificates carry a bare majority, 6 signers of 14: the peers adopt
    nothing here and try again; an honest representative keeps the attestations that come within a
    sender timeout of its majority, ``rest_s``.)"""
    honest_input = torch.randn(NUMEL)
    h_header, h_chunks, _ = second_tier(group_input=honest_input, mine=MINE)
    probe = TierCheck(h_header, prefix=PREFIX, schema_hash=SCHEMA, numel=NUMEL, mine=MINE, representative=None,
                      contribution=None, weight=0.0, max_age_s=60.0, certify=None, refusal=None)  # fmt: skip
    held = sorted(covered_peers(probe.groups, lambda peer: True))
    assert len(held) == 9
    sybils = [SigningKey.generate() for _ in range(4)]
    evil = [torch.full((NUMEL,), 3.0), torch.full((NUMEL,), 5.0)]
    s_header, s_chunks, _ = _sybil_round(sybils, held[:3], evil)
    honest_holder, sybil_holder = held[5], sybils[0].peer_id  # each a peer a step ahead
    serve = {honest_holder: _serving(h_header, h_chunks), sybil_holder: _serving(s_header, s_chunks)}

    async def fetch(p2p, holder, *args, **kwargs):
        return await serve[holder.to_base58()](p2p, holder, *args, **kwargs)

    monkeypatch.setattr(tiered, "fetch_tier_result", fetch)
    holders = [honest_holder, sybil_holder]
    # Two late peers whose own ask orders differ (names found by trying: the order is a hash of both names).
    names = [SigningKey.generate().peer_id for _ in range(64)]
    late_s = next(n for n in names if adopt_order(n, holders)[0] == sybil_holder)
    late_h = next(n for n in names if adopt_order(n, holders)[0] == honest_holder)

    def adopt(me):
        keys, group, rep = first_tier(4)
        tier = _admitting(make_tier(keys, group, rep, torch.randn(NUMEL), _searches([])))
        showing = {*held, me, *(s.peer_id for s in sybils)}
        assert len(showing) == 14
        return asyncio.run(tier.adopt(dict(MINE), adopt_order(me, holders), showing=showing))

    got_s, got_h = adopt(late_s), adopt(late_h)
    sybils_update = torch.full((NUMEL,), 4.0)
    assert all(got is None or not torch.allclose(got.vector, sybils_update) for got in (got_s, got_h))
    assert (got_s is None) == (got_h is None), "both late peers do the same: no split by ask order"


# --- F3 (73533f8): covers(fewest=) closes out a real group when one of its members shows no record at the step


def test_f3_a_group_whose_member_shows_a_record_a_step_behind_is_not_closed_out():
    """MEDIUM on 73533f8. min_group_size 4. Group G2 = 3 honest peers + attacker A, a valid group of 4; A kept
    its record at step-1 (records lag), so the leader's ``here`` showed only G2's 3 honest members, fewer
    than could form a group: the search closed without G2, whose honest gradients were dropped every step.
    Now peers whose records show the step before count toward a group that could still come."""
    g2_honest = [SigningKey.generate().peer_id for _ in range(3)]
    attacker = SigningKey.generate().peer_id
    g3 = [SigningKey.generate() for _ in range(4)]
    admitted = {k.peer_id for k in g3} | set(g2_honest)
    here = {k.peer_id for k in g3} | set(g2_honest)  # less the leader's own group; A shows step-1
    body = GroupEntryBody(
        schema_hash=bytes(32), weight=12.0, commit=bytes(32),
        extra={**MINE, "group": _group(g3, 0, signers=[0, 1, 2, 3], mine=MINE)},
    )  # fmt: skip

    def rule(lagging):
        return EarlyClose(waiting=lambda: here, fits=lambda body, signer: None, counts=admitted.__contains__,
                          step=MINE["step"], state_hash=MINE["state_hash"], min_members=4,
                          lagging=lambda: lagging)  # fmt: skip

    waiting = rule({attacker})
    assert not waiting({g3[0].peer_id: body}) and not waiting.closed, "G2 may still come: the window waits"
    alone = rule(set())
    assert alone({g3[0].peer_id: body}), "with nobody behind, 3 peers in no group could form none of 4"


# --- F5 (pre-existing, the reducer 610cc9d moved to threads): a second stream resets a sender's weight ---------


class _Queue:
    """A part stream whose messages the test feeds; silent until fed."""

    def __init__(self):
        self.q: asyncio.Queue = asyncio.Queue()

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await self.q.get()


def test_f5_a_sender_cannot_change_its_weight_mid_round_over_a_second_stream():
    """LOW, older than 610cc9d. ``serve`` takes more than one stream from a member, and each stream's chunk 0
    reset the sender's weight: attacker A sent chunk 0 at weight 1 on one stream (aggregated), then chunks 0
    and 1 at weight 100 on a second, and chunk 1 was aggregated at weight 100. Now a sender's weight is
    fixed on first sight: the second stream's chunk 0 is refused and A is dropped."""
    me, attacker, honest = (SigningKey.generate() for _ in range(3))
    peers = [PeerID.from_base58(k.peer_id) for k in (me, attacker, honest)]
    codec, chunk = get_codec("fp16"), 1024
    settings = RoundSettings(
        p2p=SimpleNamespace(peer_id=peers[0]), servicer_type=None, prefix="p", aggregator=get_aggregator("mean"),
        codec=codec, sender_timeout_s=5.0, key=me, chunk_values=chunk,
    )  # fmt: skip

    async def scenario():
        runner = ButterflyAllReduce(settings, group_id=b"g" * 20, peer_ids=peers, weight=1.0,
                                    local=torch.zeros(3 * 2 * chunk))  # fmt: skip
        assert runner.chunk_count(0) == 2

        def chunk_msg(key, index, c, weight):
            lo, hi = runner.chunk_range(0, c)
            data = codec.encode_contribution(torch.full((hi - lo,), float(index)))
            sig = key.sign(contribution_message(runner.digest, 0, c, key.peer_id, weight, data))
            return apb.PartChunk(part_index=0, chunk_index=c, data=data, weight=weight, signature=sig)

        async def drain(gen):
            async for _ in gen:
                pass

        reducer = runner.reducer
        tasks = [asyncio.create_task(reducer.reduce_own_part())]
        h = _Queue()
        h.q.put_nowait(chunk_msg(honest, 2, 1, 1.0))
        tasks.append(asyncio.create_task(drain(reducer.serve(chunk_msg(honest, 2, 0, 1.0), h, 2))))
        a1 = _Queue()  # stream 1: chunk 0 at weight 1, then silence
        tasks.append(asyncio.create_task(drain(reducer.serve(chunk_msg(attacker, 1, 0, 1.0), a1, 1))))
        while reducer.results[0] is None:
            await asyncio.sleep(0.01)
        a2 = _Queue()  # stream 2: chunk 0 again and chunk 1, at weight 100
        a2.q.put_nowait(chunk_msg(attacker, 1, 1, 100.0))
        tasks.append(asyncio.create_task(drain(reducer.serve(chunk_msg(attacker, 1, 0, 100.0), a2, 1))))
        for _ in range(300):
            if reducer.results[1] is not None:
                break
            await asyncio.sleep(0.01)
        weights = [{s.sender_index: s.weight for s in reducer.evidence[c]} for c in range(2)]
        stale = dict(reducer._inputs[0])
        dropped = dict(runner.dropped)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return weights, stale, dropped

    weights, stale, dropped = asyncio.run(scenario())
    assert all(w.get(1, 1.0) == 1.0 for w in weights), f"A's weight changed mid-round: {weights}"
    assert attacker.peer_id in dropped and "weight" in dropped[attacker.peer_id], dropped
