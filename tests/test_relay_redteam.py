"""What an attacker's read of the second tier's relay tree (commit 9b10f41) found, each now a regression test
over real libp2p peers on 127.0.0.1 (as tests/test_tier_relay.py); each failed on that commit.

A relayer is any member that is not the representative and has children in the tree (``relay_parent``):
with fanout 4 about a quarter of a group's members, so an admitted peer (or a Sybil with a few members in a
group) is one with good odds, and nothing it does as a relayer is provable unless it alters a byte."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from types import SimpleNamespace
from typing import AsyncIterator as TypingAsyncIterator  # noqa: UP035 - hivemind reads typing hints

import pytest
import torch
from hivemind.p2p import P2PContext
from test_tiers import PREFIX
from tier_relay_helpers import Node, handoff, peers, serving, shutdown

from protocols import averaging_pb2 as apb
from protocols.errors import StaleError, SwarmError
from swarm.averaging import tierserve
from swarm.averaging.averager import Averager
from swarm.averaging.tiers import TierOutcome
from swarm.averaging.tierserve import fetch_down_the_tree, fetch_tier_result
from swarm.inbound import BoundedServicer
from swarm.training.tiered import SecondTier


class TierServicer(tierserve.TierServicer):
    """A hostile relayer's handler: same class name, so the honest stubs (``TierServicer.get_stub``) reach it;
    it answers whatever ``script(request)`` yields, when it likes."""

    script = None

    async def rpc_tier_result(
        self, request: apb.TierRequest, context: P2PContext
    ) -> TypingAsyncIterator[apb.TierAnswer]:
        async for answer in self.script(request):
            yield answer


BoundedServicer.registered.remove(TierServicer)  # a test double, not a servicer of the project


async def serve_hostile(node: Node, script) -> None:
    """``node`` answers every caller whatever ``script(request)`` yields, when it likes."""
    servicer = TierServicer(
        node.board, known=lambda group_id, asker: True, wait_s=lambda: 20.0, admission=_admit_all,
        traffic=node.traffic,
    )  # fmt: skip
    servicer.script = script
    await servicer.add_p2p_handlers(node.p2p, namespace=PREFIX)


async def _admit_all(peer: str) -> str | None:
    return None


async def _fetch(node: Node, group_id: bytes, *, rep: Node, parent: Node, check, timeout_s: float,
                 chunk_timeout_s: float):  # fmt: skip
    return await fetch_down_the_tree(
        node.p2p, PREFIX, apb.TierRequest(group_id=group_id, attestation=b""),
        representative=rep.p2p.peer_id, parent=parent.p2p.peer_id, check=check, timeout_s=timeout_s,
        chunk_timeout_s=chunk_timeout_s, traffic=node.traffic, suspect=node.suspect,
    )  # fmt: skip


@pytest.mark.timeout(120)
def test_a_dripping_relayer_is_cut_off_at_half_the_wait_and_the_honest_representative_is_not_blamed():
    """HIGH on 9b10f41. Only a relayer's first message was bounded by the wait; each later chunk had its own
    chunk timeout, so a relayer that sent the real header and then dripped chunks held its child far past
    ``SecondTier.wait_s``, until the representative's own hand-off was too old to check, and the child
    suspected the honest representative for the stale entry. Now the relayer gets half the wait in all, and
    an entry dated out of bounds (``StaleError``) blames nobody."""
    dripped: dict = {}

    async def drip(request: apb.TierRequest):
        answers = list(dripped["outcome"].answers())
        yield answers[0]
        for answer in answers[1:-1]:
            await asyncio.sleep(1.4)
            yield answer

    async def scenario():
        rep, relayer, child = nodes = await peers(3)
        try:
            members = [n.id for n in nodes]
            await rep.serve(members)
            await serve_hostile(relayer, drip)
            outcome, expected, check = handoff()
            dripped["outcome"] = outcome
            group_id = os.urandom(20)
            rep.board.open(group_id, members, holds=lambda who, signature: True)
            rep.board.post(group_id, outcome)
            started = time.monotonic()
            got = await _fetch(child, group_id, rep=rep, parent=relayer, check=check(60.0), timeout_s=4.0,
                               chunk_timeout_s=2.0)  # fmt: skip
            elapsed = time.monotonic() - started
            assert torch.equal(got.output, expected), "the representative's hand-off, after half the wait"
            assert elapsed < 4.0, f"held {elapsed:.1f}s, more than the wait (4 s)"
            assert not child.suspected, child.suspected

            # Entries that are too old by the time the representative answers: nothing to apply, nobody blamed.
            group_id = os.urandom(20)
            rep.board.open(group_id, members, holds=lambda who, signature: True)
            rep.board.post(group_id, outcome)
            with pytest.raises(StaleError):
                await _fetch(child, group_id, rep=rep, parent=relayer, check=check(0.5), timeout_s=4.0,
                             chunk_timeout_s=2.0)  # fmt: skip
            assert not child.suspected, child.suspected
        finally:
            await shutdown(nodes)

    asyncio.run(scenario())


@pytest.mark.timeout(120)
def test_a_silent_relayer_costs_half_the_wait_and_a_member_waits_no_longer_than_before_the_tree():
    """MEDIUM on 9b10f41. A child waited the whole wait on a silent relayer, then a fresh wait on the
    representative: an outcome ready at once arrived after ``wait_s``, and a member could wait twice as
    long as the direct hand-off allowed. Now the relayer gets half of one wait, the representative the rest."""
    outcome, expected, check = handoff()

    async def scenario():
        nodes, members = await serving(3)
        rep, relayer, child = nodes
        try:
            group_id = os.urandom(20)
            rep.board.open(group_id, members, holds=lambda who, signature: True)
            rep.board.post(group_id, outcome)
            relayer.board.relay(group_id, [child.id])
            started = time.monotonic()
            got = await _fetch(child, group_id, rep=rep, parent=relayer, check=check(60.0), timeout_s=2.0,
                               chunk_timeout_s=2.0)  # fmt: skip
            elapsed = time.monotonic() - started
            assert torch.equal(got.output, expected)
            assert 0.9 <= elapsed < 2.0, f"an outcome ready at once took {elapsed:.1f}s"

            group_id = os.urandom(20)  # posted after 1.8 waits: given up on, as the direct hand-off did
            rep.board.open(group_id, members, holds=lambda who, signature: True)
            relayer.board.relay(group_id, [child.id])
            asyncio.get_running_loop().call_later(2.7, rep.board.post, group_id, outcome)
            started = time.monotonic()
            with pytest.raises((asyncio.TimeoutError, SwarmError)):
                await _fetch(child, group_id, rep=rep, parent=relayer, check=check(60.0), timeout_s=1.5,
                             chunk_timeout_s=2.0)  # fmt: skip
            assert time.monotonic() - started < 2.6
            assert not child.suspected
        finally:
            await shutdown(nodes)

    asyncio.run(scenario())


@pytest.mark.timeout(120)
def test_a_relayer_that_forwards_just_in_time_gets_nobody_honest_suspected():
    """MEDIUM on 9b10f41 (runs whose ``SecondTier.wait_s`` exceeds ``entry_max_age_s``, e.g.
    averaging_timeout_s = 120). A hostile grandparent sent an honest relayer the real hand-off just before
    its entries' age limit; the relayer's children then found a stale entry and suspected the honest
    relayer, then the honest representative, and nobody suspected the grandparent. Entries dated out of
    bounds now blame nobody. (Since the second tier's entries stay fresh for the members' wait,
    ``Averager.longest_search_s``, its own entries no longer age out first; a first tier's bound still can.)"""
    slow = SimpleNamespace(averaging_timeout_s=120.0, matchmaking_time_s=2.0, longest_search_s=None)
    assert SecondTier.wait_s.fget(SimpleNamespace(averager=slow)) > Averager.entry_max_age_s.fget(slow)

    async def scenario():
        rep, hostile, relayer, child = nodes = await peers(4)
        try:
            members = [n.id for n in nodes]
            await rep.serve(members)
            await relayer.serve(members)
            outcome, _, check = handoff()
            signed_at = time.monotonic()

            async def just_in_time(request: apb.TierRequest):
                answers = list(outcome.answers())
                await asyncio.sleep(max(0.0, signed_at + 2.5 - time.monotonic()))
                yield answers[0]
                for answer in answers[1:]:
                    await asyncio.sleep(1.0)
                    yield answer

            await serve_hostile(hostile, just_in_time)
            group_id = os.urandom(20)
            rep.board.open(group_id, members, holds=lambda who, signature: True)
            rep.board.post(group_id, outcome)

            async def honest_relayer():  # SecondTier._follow, for the relayer
                relayer.board.relay(group_id, [child.id])
                relayed = None
                try:
                    checked = await _fetch(relayer, group_id, rep=rep, parent=hostile, check=check(4.0),
                                           timeout_s=8.0, chunk_timeout_s=2.0)  # fmt: skip
                    relayed = TierOutcome(alone=True) if checked is None else checked.outcome()
                finally:
                    relayer.board.post(group_id, relayed)

            task = asyncio.create_task(honest_relayer())
            await asyncio.sleep(0.1)
            with contextlib.suppress(StaleError):
                await _fetch(child, group_id, rep=rep, parent=relayer, check=check(4.0), timeout_s=8.0,
                             chunk_timeout_s=2.0)  # fmt: skip
            with contextlib.suppress(StaleError):
                await task
            assert not child.suspected and not relayer.suspected, (child.suspected, relayer.suspected)
        finally:
            await shutdown(nodes)

    asyncio.run(scenario())


@pytest.mark.timeout(120)
def test_a_relayer_serves_only_its_children_in_the_tree():
    """LOW on 9b10f41. A relayer served any member of the group, so one member could make it upload the
    outcome far more than fanout times. It now serves only the members below it (``TierBoard.relay``); each
    of those may still ask again while its streams last, as any member may ask its representative."""
    outcome, expected, check = handoff()

    async def scenario():
        relayer, child, other = nodes = await peers(3)
        try:
            await relayer.serve([n.id for n in nodes])
            group_id = os.urandom(20)
            relayer.board.relay(group_id, [child.id])
            relayer.board.post(group_id, outcome)
            got = await fetch_tier_result(
                child.p2p, relayer.p2p.peer_id, PREFIX, apb.TierRequest(group_id=group_id), timeout_s=5.0,
                check=check(60.0), chunk_timeout_s=5.0, traffic=child.traffic,
            )  # fmt: skip
            assert torch.equal(got.output, expected)
            with pytest.raises(SwarmError, match="NOT_IN_GROUP"):
                await fetch_tier_result(
                    other.p2p, relayer.p2p.peer_id, PREFIX, apb.TierRequest(group_id=group_id), timeout_s=5.0,
                    check=check(60.0), chunk_timeout_s=5.0, traffic=other.traffic,
                )  # fmt: skip
            one = sum(len(c.data) for part in outcome.chunks for c in part)
            assert relayer.traffic.sent == one, "one upload, to its child"
        finally:
            await shutdown(nodes)

    asyncio.run(scenario())


@pytest.mark.timeout(120)
def test_a_child_whose_representative_opens_late_still_gets_its_attestation_counted():
    """LOW on 9b10f41. ``attest_to`` gave up after the chunk timeout (2 * sender_timeout_s), while a
    representative that finishes its first tier later has ``OPEN_WAIT_S`` to open its group: with a short
    sender timeout a late representative counted none of its relayed members. The attestation now waits as
    long as the representative may take to open, beside the relayed fetch."""

    async def scenario():
        nodes, members = await serving(3)
        rep, relayer, child = nodes
        try:
            outcome, expected, check = handoff()
            group_id = os.urandom(20)
            relayer.board.relay(group_id, [child.id])
            asyncio.get_running_loop().call_later(2.0, relayer.board.post, group_id, outcome)
            asyncio.get_running_loop().call_later(
                1.5, lambda g=group_id: rep.board.open(g, members, holds=lambda who, sig: sig == who.encode())
            )
            got = await fetch_down_the_tree(
                child.p2p, PREFIX, apb.TierRequest(group_id=group_id, attestation=child.id.encode()),
                representative=rep.p2p.peer_id, parent=relayer.p2p.peer_id, check=check(60.0), timeout_s=8.0,
                chunk_timeout_s=0.5, traffic=child.traffic, suspect=child.suspect,
            )  # fmt: skip
            assert torch.equal(got.output, expected), "the child applies the outcome"
            assert 2 in rep.board._posted[group_id].signed, "the child's attestation counted"
        finally:
            await shutdown(nodes)

    asyncio.run(scenario())
