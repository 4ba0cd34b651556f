"""Butterfly all-reduce among real hivemind DHT peers on loopback: bit-identical results, faults."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
import torch
from helpers import VanishingAllReduce

from protocols.errors import ConfigError
from swarm.averaging.allreduce import ButterflyAllReduce
from swarm.averaging.averager import Averager
from swarm.averaging.evidence import contribution_message, round_digest
from swarm.averaging.sender import PartSender

pytestmark = pytest.mark.timeout(120)

NUMEL = 300_007  # not a multiple of the group size or the chunk size


class TruncatingSender(PartSender):
    def encode_contribution(self, part: int, chunk: int) -> bytes:
        return super().encode_contribution(part, chunk)[:-2]


class TruncatingAllReduce(ButterflyAllReduce):
    """A groupmate that sends one value too few in every chunk it contributes to others' parts."""

    sender_type = TruncatingSender


class ReplayingSender(PartSender):
    def contribution(self, part, chunk):
        message = super().contribution(part, chunk)
        r = self.round
        digest = round_digest("another-run", r.group_id, r.members)
        signed = contribution_message(digest, part, chunk, r.members[r.index], r.weight, message.data)
        message.signature = r.key.sign(signed)
        return message


class ReplayingAllReduce(ButterflyAllReduce):
    """A groupmate that sends contributions signed for another run (as if replayed from there)."""

    sender_type = ReplayingSender


class UnsignedSender(PartSender):
    def contribution(self, part, chunk):
        message = super().contribution(part, chunk)
        message.signature = b""
        return message


class UnsignedAllReduce(ButterflyAllReduce):
    """A groupmate that sends its contributions unsigned."""

    sender_type = UnsignedSender


class NegativeWeightSender(PartSender):
    def contribution(self, part, chunk):
        self.round.weight = -5.0
        return super().contribution(part, chunk)


class NegativeWeightAllReduce(ButterflyAllReduce):
    """A groupmate that claims (and signs) a negative weight, to pull the average away from itself."""

    sender_type = NegativeWeightSender


@pytest.fixture
def dhts(keyed_dhts):
    return [d for d, _ in keyed_dhts]


@pytest.fixture
def keys(keyed_dhts, request):
    keys = {d.peer_id.to_base58(): k for d, k in keyed_dhts}
    keys["prefix"] = "run-" + "".join(c if c.isalnum() else "-" for c in request.node.name)[-60:]
    return keys


def make(d, keys, **kwargs):
    """An averager that signs with the peer's key, over libp2p only unless told otherwise."""
    kwargs.setdefault("matchmaking_time_s", 1.0)
    kwargs.setdefault("prefix", keys["prefix"])
    kwargs.setdefault("data_plane", False)
    return Averager(d, numel=NUMEL, signing_key=keys[d.peer_id.to_base58()], **kwargs)


def vectors(count: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(NUMEL, generator=generator) for _ in range(count)]


async def average_all(averagers, inputs, weights):
    for averager in averagers:
        await averager.start()
    return await asyncio.gather(
        *[a.average(v, w) for a, v, w in zip(averagers, inputs, weights, strict=True)]
    )


async def settled_bytes_sent(averagers) -> list[int]:
    """What each averager's last round sent once its tasks ended: a round's result counts the bytes of the
    moment its vector was complete, when a reducer may still be sending its part to a slower groupmate."""
    runners = [next(reversed(a.rounds.recent.values())) for a in averagers]
    await asyncio.gather(*(r.revealed for r in runners if r.revealed is not None))
    return [r.bytes_sent for r in runners]


def test_peers_end_bit_identical_at_the_weighted_mean(dhts, keys):
    averagers = [make(d, keys) for d in dhts]
    inputs, weights = vectors(3), [1.0, 2.0, 5.0]

    async def scenario():
        outcomes = await average_all(averagers, inputs, weights)
        return outcomes, await settled_bytes_sent(averagers)

    outcomes, sent = asyncio.run(scenario())

    # No sender weighs more than the lower median of the claims: 5 counts as 2 (a fair share).
    fair = [1.0, 2.0, 2.0]
    expected = sum(w * v for w, v in zip(fair, inputs, strict=True)) / sum(fair)
    first = outcomes[0][1].vector
    for group, result in outcomes:
        assert len(group.peer_ids) == 3 and result.complete and not result.dropped
        assert torch.equal(result.vector, first), "every peer must hold exactly the same bits"
    assert torch.allclose(first, expected, atol=2e-3), "fp16 on the wire keeps the mean within fp16 precision"
    # Each peer sends (n-1)/n of its vector and the reduced part back to n-1 peers, 2 bytes a value.
    assert sent[0] == pytest.approx(2 * 2 * NUMEL * 2 / 3, rel=0.01)


def test_validators_need_signed_round_inputs(keyed_dhts):
    # Unsigned inputs fail every validator's check: each reducer would be suspected and the run would stall.
    with pytest.raises(ConfigError, match="verify_probability 0.25 needs signed round inputs"):
        Averager(keyed_dhts[0][0], prefix="unsigned", numel=NUMEL, verify_probability=0.25)


def test_rounds_over_the_tcp_data_path_are_bit_identical(keyed_dhts):
    averagers = [
        Averager(d, prefix="tcp-run", numel=NUMEL, matchmaking_time_s=1.0, signing_key=k)
        for d, k in keyed_dhts
    ]
    inputs, weights = vectors(3), [1.0, 2.0, 5.0]

    async def scenario():
        outcomes = await average_all(averagers, inputs, weights)
        accepted = [a.data_plane.accepted for a in averagers]
        # A peer announcing a data address nobody can reach is still averaged with, through libp2p.
        averagers[2].data_plane.address = "127.0.0.1:1"
        retry = await asyncio.gather(*[a.average(v, 1.0) for a, v in zip(averagers, inputs, strict=True)])
        for averager in averagers:
            await averager.shutdown()
        return outcomes, accepted, retry

    outcomes, accepted, retry = asyncio.run(scenario())
    fair = [1.0, 2.0, 2.0]  # weights clipped to the lower median claim
    expected = sum(w * v for w, v in zip(fair, inputs, strict=True)) / sum(fair)
    for group, result in outcomes:
        assert len(group.peer_ids) == 3 and result.complete and not result.dropped
        assert torch.equal(result.vector, outcomes[0][1].vector)
    assert torch.allclose(outcomes[0][1].vector, expected, atol=2e-3)
    assert accepted == [2, 2, 2], "every part stream went over the data path"
    assert all(result.complete for _, result in retry)
    assert all(torch.equal(result.vector, retry[0][1].vector) for _, result in retry)
    assert torch.allclose(retry[0][1].vector, sum(inputs) / 3, atol=2e-3)


def test_a_member_nobody_can_dial_reduces_no_part_and_the_round_is_bit_identical(keyed_dhts):
    # Peer 2 is behind NAT (client mode): it leads no group, announces no data address and gets an empty
    # part; it sends its whole vector to the two reducers and gets the result back on streams it opened.
    averagers = [
        Averager(d, prefix="nat-run", numel=NUMEL, matchmaking_time_s=1.0, signing_key=k, client_mode=i == 2)
        for i, (d, k) in enumerate(keyed_dhts)
    ]
    inputs = vectors(3)

    async def scenario():
        outcomes = await average_all(averagers, inputs, [1.0, 1.0, 1.0])
        sent = await settled_bytes_sent(averagers)
        accepted = [a.data_plane.accepted for a in averagers]
        for averager in averagers:
            await averager.shutdown()
        return outcomes, sent, accepted

    outcomes, sent, accepted = asyncio.run(scenario())
    natted = keyed_dhts[2][0].peer_id
    for group, result in outcomes:
        assert result.complete and not result.dropped
        assert torch.equal(result.vector, outcomes[0][1].vector)
        assert group.reducers == [p != natted for p in group.peer_ids]
    assert torch.allclose(outcomes[0][1].vector, sum(inputs) / 3, atol=2e-3)
    assert accepted == [2, 2, 0], "each reducer took the other two peers' streams; nobody dialed peer 2"
    # fp16: peer 2 sends all of its vector (half to each reducer) and nothing else; a reducer sends the
    # other reducer's half, then its own half back to two peers.
    assert sent[2] == 2 * NUMEL
    assert sent[0] == pytest.approx(2 * NUMEL * 3 / 2, abs=4)


def test_a_group_without_enough_members_that_can_be_dialed_is_left_by_all(keyed_dhts, caplog):
    settings = dict(
        prefix="nat-few", numel=NUMEL, matchmaking_time_s=1.0, min_reducers=2, averaging_timeout_s=5.0
    )
    averagers = [
        Averager(d, signing_key=k, client_mode=i > 0, **settings) for i, (d, k) in enumerate(keyed_dhts)
    ]
    with caplog.at_level(logging.WARNING):
        outcomes = asyncio.run(average_all(averagers, vectors(3), [1.0, 1.0, 1.0]))
    assert outcomes == [None, None, None]
    assert caplog.text.count("only 1 of its 3 members can be dialed to reduce a part; the run needs 2") == 3


@pytest.mark.parametrize(
    "runner, reason",
    [
        ("truncating", "bytes"),
        ("replaying", "signature does not verify"),
        ("unsigned", "signature"),
        ("negative-weight", "a weight is a finite number >= 0"),
    ],
)
def test_a_bad_contribution_is_dropped_and_the_round_completes(dhts, keys, caplog, runner, reason):
    bad = {
        "truncating": TruncatingAllReduce, "replaying": ReplayingAllReduce, "unsigned": UnsignedAllReduce,
        "negative-weight": NegativeWeightAllReduce,
    }  # fmt: skip
    averagers = [make(d, keys) for d in dhts[:2]]
    averagers.append(make(dhts[2], keys, runner_type=bad[runner]))
    inputs = vectors(3)
    with caplog.at_level(logging.WARNING):
        outcomes = asyncio.run(average_all(averagers, inputs, [1.0, 1.0, 1.0]))

    bad_peer = dhts[2].peer_id.to_base58()
    results = [result for _, result in outcomes]
    assert all(r.complete for r in results), "the honest reducers finish without the bad contribution"
    assert all(torch.equal(r.vector, results[0].vector) for r in results)
    assert bad_peer in results[0].dropped and reason in results[0].dropped[bad_peer]
    assert f"dropped {bad_peer}" in caplog.text
    # Parts reduced by honest peers hold the mean of the two honest inputs only.
    honest_mean = (inputs[0] + inputs[1]) / 2
    group = outcomes[0][0]
    part = [p.to_base58() for p in group.peer_ids].index(dhts[0].peer_id.to_base58())
    lo, hi = NUMEL * part // 3, NUMEL * (part + 1) // 3
    assert torch.allclose(results[0].vector[lo:hi], honest_mean[lo:hi], atol=2e-3)


def test_a_peer_vanishing_mid_round_does_not_stall_the_survivors(dhts, keys):
    averagers = [make(d, keys, sender_timeout_s=1.0) for d in dhts[:2]]
    averagers.append(make(dhts[2], keys, sender_timeout_s=1.0, runner_type=VanishingAllReduce))

    async def scenario():
        for averager in averagers:
            await averager.start()
        inputs = vectors(3)
        loop = asyncio.get_running_loop()
        started = loop.time()
        tasks = [asyncio.create_task(a.average(v, 1.0)) for a, v in zip(averagers, inputs, strict=True)]
        first_round = await asyncio.gather(*tasks[:2])
        tasks[2].cancel()
        elapsed = loop.time() - started
        # The vanished reducer's part is re-reduced by its substitute: the survivors complete the round,
        # bit-identical, in bounded time.
        assert all(result.complete for _, result in first_round)
        assert torch.equal(first_round[0][1].vector, first_round[1][1].vector)
        assert elapsed < 10, f"the round took {elapsed:.1f}s"
        # The survivors average again without it. On a loaded machine one of them can give up its search as the
        # other's group forms (then the round is incomplete and the caller tries again, as a peer does).
        for _ in range(3):
            retry = await asyncio.gather(
                *[a.average(v, 1.0) for a, v in zip(averagers[:2], inputs[:2], strict=True)]
            )
            if all(o is not None and o[1].complete for o in retry):
                break
        assert all(o is not None and o[1].complete and len(o[0].peer_ids) == 2 for o in retry), retry
        assert torch.equal(retry[0][1].vector, retry[1][1].vector)
        assert torch.allclose(retry[0][1].vector, (inputs[0] + inputs[1]) / 2, atol=2e-3)

    asyncio.run(scenario())


def test_a_peer_alone_applies_exactly_its_encoded_vector(dhts, keys):
    averager = make(dhts[0], keys, prefix="solo")

    async def scenario():
        await averager.start()
        vector = vectors(1)[0]
        group, result = await averager.average(vector, 4.0, alone=True)
        assert result.complete and len(group.peer_ids) == 1
        assert torch.equal(result.vector, vector.to(torch.float16).to(torch.float32))

    asyncio.run(scenario())


def test_an_upload_limit_holds_a_peer_to_its_rate(dhts, keys):
    from swarm.ratelimit import RateLimiter

    rate, burst = 200_000, 50_000  # bytes/s; each peer of two sends half its vector, then its reduced half
    limited = make(dhts[0], keys, prefix="slow", upload_limiter=RateLimiter(rate, burst_bytes=burst))
    other = make(dhts[1], keys, prefix="slow")

    async def scenario():
        for averager in (limited, other):
            await averager.start()
        inputs = vectors(2)
        loop = asyncio.get_running_loop()
        done = {}

        async def timed_average(name, averager, vector):
            outcome = await averager.average(vector, 1.0)
            done[name] = loop.time()
            return outcome

        started = loop.time()
        outcomes = await asyncio.gather(
            timed_average("limited", limited, inputs[0]), timed_average("other", other, inputs[1])
        )
        for _ in range(200):  # the limited reducer may still be sending its part back
            if limited.traffic.sent >= 2 * NUMEL:
                break
            await asyncio.sleep(0.05)
        return outcomes, {k: v - started for k, v in done.items()}, loop.time() - started

    outcomes, done, drained = asyncio.run(scenario())
    (_, mine), (_, theirs) = outcomes
    assert mine.complete and theirs.complete and torch.equal(mine.vector, theirs.vector)
    half = NUMEL  # half of the vector in fp16 bytes
    assert limited.traffic.sent == pytest.approx(2 * half, rel=0.01)
    # The other peer needs the limited peer's half before it can reduce: no sooner than the rate allows.
    assert done["other"] >= (half - burst) / rate
    assert drained >= (2 * half - burst) / rate


def test_a_slow_uplink_with_a_large_part_is_not_dropped_as_a_straggler(dhts, keys):
    # 10 Mbit/s, the limit of a home uplink: each of two peers sends 4 MB (half its vector, then its reduced
    # half back), about 3.2 s for the limited one. The fixed 2 s round deadline of before cut the round off
    # and every retry failed the same way; a deadline from the bytes and the rate lets it finish, and the
    # peer comes out of it knowing its measured uplink.
    from swarm.ratelimit import RateLimiter

    numel = 2_000_000
    settings = dict(prefix="slow-large", numel=numel, sender_timeout_s=2.0, averaging_timeout_s=2.0)
    limited, other = (
        Averager(
            d,
            signing_key=keys[d.peer_id.to_base58()],
            matchmaking_time_s=1.0,
            upload_limiter=limiter,
            **settings,
        )
        for d, limiter in ((dhts[0], RateLimiter.from_mbps(10)), (dhts[1], None))
    )
    generator = torch.Generator().manual_seed(0)
    inputs = [torch.randn(numel, generator=generator) for _ in range(2)]

    async def scenario():
        for averager in (limited, other):
            await averager.start()
        outcomes = await asyncio.gather(limited.average(inputs[0], 1.0), other.average(inputs[1], 1.0))
        for averager in (limited, other):
            await averager.shutdown()
        return outcomes

    (group, mine), (_, theirs) = asyncio.run(scenario())
    assert len(group.peer_ids) == 2 and mine.complete and theirs.complete and not mine.dropped
    assert torch.equal(mine.vector, theirs.vector)
    # A measure that errs low: half of what the peer sent (its contributions) over the whole round.
    assert 2 <= limited.link.mbit <= 10.5, (
        f"measured {limited.link.mbit:.1f} Mbit/s through a 10 Mbit/s limit"
    )
    assert limited.transfer_deadline_s(50_000_000) > 2.0 + 50_000_000 * 8 / 11e6, "state downloads wait too"


def test_a_search_that_failed_before_waits_long_enough_for_a_peer_that_comes_late(dhts, keys):
    # On a loaded machine a groupmate's search starts seconds after this one's: after failed searches at
    # the step, the window widens (0.5 s doubled three times: 4 s, a 14 s search), so a peer that comes
    # 5 s later still finds this one, where a first search (3.5 s in all) would have given up.
    early, late = make(dhts[0], keys, matchmaking_time_s=0.5), make(dhts[1], keys, matchmaking_time_s=0.5)
    assert [early.matchmaking_window_s(n) for n in range(5)] == [0.5, 1.0, 2.0, 4.0, 4.0]
    inputs = vectors(2)

    async def scenario():
        await early.start()
        await late.start()
        waiting = asyncio.create_task(early.average(inputs[0], 1.0, failed_tries=3))
        await asyncio.sleep(5.0)
        assert not waiting.done(), "the widened search is still on"
        return await asyncio.gather(waiting, late.average(inputs[1], 1.0))

    outcomes = asyncio.run(scenario())
    assert all(o is not None and len(o[0].peer_ids) == 2 and o[1].complete for o in outcomes)
    assert torch.equal(outcomes[0][1].vector, outcomes[1][1].vector)


def test_failed_searches_count_per_step_and_start_again_after_a_group():
    from swarm.averaging.matchmaking import FailedSearches

    searches = FailedSearches()
    searches.record(4, formed=False)
    searches.record(4, formed=False)
    assert searches.failed(4) == 2 and searches.failed(5) == 0, "a new step starts from the run's window"
    searches.record(4, formed=True)
    assert searches.failed(4) == 0
    searches.record(5, formed=False)
    assert searches.failed(5) == 1 and searches.failed(4) == 0


def test_a_leader_assembles_once_its_closing_rule_holds_instead_of_waiting_out_a_long_window(dhts, keys):
    # A second tier's window may last until its members' wait leaves room for the round (``second_window_s``,
    # up to a minute at the run's defaults): a leader whose gathered entries already hold every peer it
    # waits for (``closes_when``) begins at once, as at ``expected_size``.
    window_s = 20.0
    averagers = [make(d, keys, matchmaking_time_s=0.5, averaging_timeout_s=60.0) for d in dhts]
    inputs = vectors(3)
    seen: list[int] = []

    def all_three(followers) -> bool:  # the leader and both others
        seen.append(len(followers))
        return len(followers) == 2

    async def scenario():
        for averager in averagers:
            averager.longest_search_s = 60.0
            await averager.start()
        started = time.monotonic()
        outcomes = await asyncio.gather(
            *[
                a.average(v, 1.0, window_s=window_s, closes_when=all_three)
                for a, v in zip(averagers, inputs, strict=True)
            ]
        )
        return outcomes, time.monotonic() - started

    outcomes, took_s = asyncio.run(scenario())
    assert all(o is not None and len(o[0].peer_ids) == 3 and o[1].complete for o in outcomes)
    assert torch.equal(outcomes[0][1].vector, outcomes[2][1].vector)
    assert 2 in seen and took_s < window_s / 2, f"assembled after {took_s:.1f}s of a {window_s:.0f}s window"
