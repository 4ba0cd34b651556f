"""Deadlines from the bytes a round moves and its slowest member's uplink: long enough for a slow link,
bounded against a member that claims a crawling one, and never below the configured floors."""

from __future__ import annotations

import pytest

from swarm.averaging.deadlines import (
    ASSUMED_MBIT,
    MAX_DEADLINE_S,
    MIN_MBIT,
    Throughput,
    round_deadlines,
    round_mbit,
    transfer_deadline_s,
)

pytestmark = pytest.mark.timeout(10)


def test_a_round_counts_on_its_slowest_member_within_bounds():
    assert round_mbit([100.0, 12.5, None]) == ASSUMED_MBIT  # one that measured nothing yet: 10 Mbit/s
    assert round_mbit([100.0, 12.5, 40.0]) == 12.5
    assert round_mbit([100.0, 0.001]) == MIN_MBIT, "a claimed crawl stretches deadlines a bounded amount"


def test_a_transfer_deadline_is_the_floor_plus_three_times_the_wire_time_capped():
    assert transfer_deadline_s(50_000_000, 10.0, floor_s=30.0) == pytest.approx(30 + 3 * 40)
    assert transfer_deadline_s(0, 10.0, floor_s=5.0) == 5.0
    assert transfer_deadline_s(10**12, 1.0, floor_s=30.0) == MAX_DEADLINE_S


def test_the_busiest_member_sets_the_round_and_peers_behind_nat_add_to_the_reducers_load():
    # 4M values in fp16 among 4 reducers: each sends 3 parts' worth of contributions and its part to 3.
    even = round_deadlines(
        [1_000_000] * 4, chunk_bytes=131072, bytes_per_value=2, mbit=10.0, silence_floor_s=5, round_floor_s=30
    )
    assert even.round_s == pytest.approx(30 + 3 * 12e6 * 8 / 10e6)
    # Two members behind NAT reduce nothing: the reducers send 16 MB each.
    nat = round_deadlines(
        [2_000_000, 0, 2_000_000, 0], chunk_bytes=131072, bytes_per_value=2, mbit=10.0, silence_floor_s=5,
        round_floor_s=30,
    )  # fmt: skip
    assert nat.round_s == pytest.approx(30 + 3 * 16e6 * 8 / 10e6)
    # Silence: one chunk on an uplink shared by 3 contribution and 3 aggregate streams, about 2.4 s more.
    assert even.silence_s == pytest.approx(5 + 3 * 131072 * 6 * 8 / 10e6)


def test_throughput_ignores_small_transfers_and_smooths_the_rest():
    link = Throughput()
    link.observe(1000, 0.001)  # a tiny transfer measures latency, not the link
    assert link.mbit is None
    link.observe(5_000_000, 4.0)
    assert link.mbit == pytest.approx(10.0)
    link.observe(5_000_000, 2.0)
    assert link.mbit == pytest.approx(15.0)
