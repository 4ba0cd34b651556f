"""A withholder (honest contributions, but never its own part back) cannot halt training.

Before, a member that never returned its part made every round it joined incomplete, and nothing
remembered it, so it joined every retry. Now each peer that waited in vain for a reducer avoids it in
matchmaking for a while (``PeerPolicy.suspect``): the retry forms without it and completes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import urllib.request

import pytest
import torch

from lab.localswarm import tiny_run, wait_until
from swarm.averaging.allreduce import ButterflyAllReduce, RoundSettings
from swarm.averaging.averager import Averager
from swarm.averaging.evidence import split_bounds
from swarm.averaging.sender import PartSender
from swarm.byzantine.attacks import make_attack

pytestmark = pytest.mark.timeout(180)

NUMEL = 30_011


@pytest.fixture
def peers(keyed_dhts):
    return keyed_dhts


def test_rounds_complete_without_a_withholder(peers):
    withholder = make_attack("withholder", group_size=3, attackers=1)
    generator = torch.Generator().manual_seed(0)
    vectors = [torch.randn(NUMEL, generator=generator) for _ in peers]
    culprit = peers[2][1].peer_id

    async def scenario():
        averagers = [
            Averager(
                dht,
                prefix="withholding",
                numel=NUMEL,
                signing_key=key,
                matchmaking_time_s=1.0,
                sender_timeout_s=1.0,
                data_plane=False,
                hooks=withholder if i == 2 else None,
            )  # fmt: skip
            for i, (dht, key) in enumerate(peers)
        ]
        for averager in averagers:
            await averager.start()
        rounds = []
        for _ in range(2):
            outcomes = await asyncio.gather(
                *[a.average(v, 1.0, expected_size=3) for a, v in zip(averagers, vectors, strict=True)]
            )
            rounds.append(outcomes)
        for averager in averagers:
            await averager.shutdown()
        return rounds, averagers

    rounds, averagers = asyncio.run(scenario())
    first = rounds[0][:2]
    # The withholder's part was re-reduced by its substitute in the same round: the first round completes,
    # and that part holds the honest peers' mean (the withholder sent its input only to its own part).
    assert all(o is not None and o[1].complete for o in first), "the first round completes despite it"
    assert torch.equal(first[0][1].vector, first[1][1].vector), "the honest peers hold the same bits"
    part = [p.to_base58() for p in first[0][0].peer_ids].index(culprit)
    lo, hi = split_bounds(NUMEL, 3)[part : part + 2]
    assert torch.allclose(first[0][1].vector[lo:hi], (vectors[0][lo:hi] + vectors[1][lo:hi]) / 2, atol=2e-3)
    # It is still reported and avoided (a strike: it sat out the next search): the next round forms without it.
    assert all(culprit in o[1].failed_reducers for o in first)
    assert all(a.policy.missed.strikes(culprit) == 1 for a in averagers[:2])
    second = rounds[1][:2]
    assert all(o is not None and o[1].complete for o in second)
    assert all(culprit not in [p.to_base58() for p in group.peer_ids] for group, _ in second)
    assert torch.equal(second[0][1].vector, second[1][1].vector)
    assert torch.allclose(second[0][1].vector, (vectors[0] + vectors[1]) / 2, atol=2e-3)


class KeepingAverager(Averager):
    """An averager that keeps its validation tasks, whose outcomes the tests read (done or not)."""

    def _verify_later(self, runner) -> None:
        super()._verify_later(runner)
        self.checks = list(self._verifications)


class SmallChunks(ButterflyAllReduce):
    """The run's all-reduce with many chunks per part, so that trimming has something to drop."""

    def __init__(self, settings: RoundSettings, **kwargs):
        super().__init__(dataclasses.replace(settings, chunk_values=1000), **kwargs)


def test_a_round_keeps_only_what_its_validators_can_ask_for(peers):
    # Before: each peer kept its whole vector, every aggregate it received and every input it
    # aggregated for 4 rounds (16-32 bytes per parameter). Now, once the draw is known, it keeps the
    # drawn chunk of each part only, and the validators' checks still succeed.
    generator = torch.Generator().manual_seed(1)
    vectors = [torch.randn(NUMEL, generator=generator) for _ in peers]

    async def scenario():
        averagers = [
            KeepingAverager(
                dht,
                prefix="trimming",
                numel=NUMEL,
                signing_key=key,
                matchmaking_time_s=1.0,
                # Every member is honest, so nothing waits out this deadline: it only has to be long
                # enough for a loaded machine (at 1 s this test failed once in CI).
                sender_timeout_s=5.0,
                data_plane=False,
                verify_probability=1.0,
                runner_type=SmallChunks,
            )  # fmt: skip
            for dht, key in peers
        ]
        for averager in averagers:
            await averager.start()
        outcomes = await asyncio.gather(
            *[a.average(v, 1.0, expected_size=3) for a, v in zip(averagers, vectors, strict=True)]
        )
        checks = [await asyncio.wait_for(asyncio.gather(*a.checks), 60) for a in averagers]
        runners = [next(iter(a.rounds.recent.values())) for a in averagers]
        for averager in averagers:
            await averager.shutdown()
        return outcomes, checks, runners

    outcomes, checks, runners = asyncio.run(scenario())
    assert all(o is not None and o[1].complete for o in outcomes)
    done = [outcome for per_peer in checks for per_task in per_peer for outcome in per_task]
    assert len(done) == 3 and all(o.verdict is None and o.evidence is not None for o in done)
    for runner in runners:
        assert runner.shared_seed is not None and runner.local is None
        assert sum(bool(inputs) for inputs in runner.reducer.evidence) == 1 < len(runner.reducer.evidence)
        assert all(len(got) <= 1 for got in runner.answers)
        held = sum(len(i.data) for i in runner.kept_inputs.values()) + sum(
            len(i.data) for inputs in runner.reducer.evidence for i in inputs
        )
        assert held <= 2 * 3 * 1000 * 2, "at most one chunk per part and one chunk's inputs, in fp16"


class HidesItsReveal(PartSender):
    """Reveals its nonce to every reducer but ``SelectiveReveal.victim``."""

    def reveals_to(self, part: int) -> bool:
        return self.round.members[part] != SelectiveReveal.victim


class SelectiveReveal(SmallChunks):
    """A member that reveals its nonce to every reducer but ``victim``, which then lacks the draw."""

    victim = ""
    sender_type = HidesItsReveal


def test_a_member_missing_the_draw_suspects_nobody(peers):
    # Member 0 never hears member 2's reveal: it checks every part at chunks of its own choosing, which
    # its groupmates, holding only the drawn chunks, rightly no longer show. Nobody is held at fault.
    generator = torch.Generator().manual_seed(2)
    vectors = [torch.randn(NUMEL, generator=generator) for _ in peers]
    SelectiveReveal.victim = peers[0][1].peer_id

    async def scenario():
        averagers = [
            KeepingAverager(
                dht,
                prefix="selective",
                numel=NUMEL,
                signing_key=key,
                matchmaking_time_s=1.0,
                sender_timeout_s=1.0,
                data_plane=False,
                verify_probability=1.0,
                runner_type=SelectiveReveal if i == 2 else SmallChunks,
            )  # fmt: skip
            for i, (dht, key) in enumerate(peers)
        ]
        for averager in averagers:
            await averager.start()
        outcomes = await asyncio.gather(
            *[a.average(v, 1.0, expected_size=3) for a, v in zip(averagers, vectors, strict=True)]
        )
        checks = [await asyncio.wait_for(asyncio.gather(*a.checks), 60) for a in averagers]
        runners = [next(iter(a.rounds.recent.values())) for a in averagers]
        for averager in averagers:
            await averager.shutdown()
        return outcomes, checks, runners, averagers

    outcomes, checks, runners, averagers = asyncio.run(scenario())
    assert all(o is not None and o[1].complete for o in outcomes)
    assert runners[0].shared_seed is None and runners[1].shared_seed is not None
    assert len([o for per_task in checks[0] for o in per_task]) == 2, "member 0 checks both other parts"
    others = [key.peer_id for _, key in peers]
    assert all(a.policy.refusal(p) is None for a in averagers for p in others)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_the_coordinator_is_told_who_withholds_and_the_dashboard_shows_it(swarm):
    """Real processes: 3 honest peers and a withholder. Withholding proves nothing to a third party, so
    it is no ban; each honest peer names the reducer it avoids in its heartbeats, and the coordinator's
    status (JSON and Prometheus) counts the distinct online peers that avoid it."""
    # Groups of 3 or 4: a withheld part is repaired (a group of 2 cannot), and two groups never train one
    # step apart. With groups of 2 among 4 peers the honest peers drifted hundreds of steps apart and
    # seldom met the withholder: this test timed out after 200 s in 2 runs of 2 (105 s when it passed),
    # against 29-35 s in 3 runs of 3 now, one of them beside two busy loops. In 2 of 4 full-suite runs of
    # 2026-11-28/29 it still timed out at 200 s (30-40 s alone, also beside two busy loops): the wait is
    # longer now, and a timeout shows the last status read.
    run = tiny_run("withheld", min_group_size=3)
    endpoint = swarm.start_coordinator(run, extra_args=["--dashboard-port", "0"], ready_timeout_s=90).extra
    rehearsal = ["--rehearse-attack", "withholder", "--rehearse-attackers", "1", "--rehearse-group-size", "4"]
    for i in range(4):
        swarm.start_peer(endpoint["address"], f"peer{i}", *(rehearsal if i == 3 else ()))

    def peers_now() -> dict[str, dict]:
        with urllib.request.urlopen(endpoint["dashboard_url"] + "api/status", timeout=10) as response:
            return {p["name"]: p for p in json.load(response)["peers"]}

    def singled_out(now: dict[str, dict]) -> bool:
        # An honest peer that was slow in one round on a loaded machine may be avoided for a while too
        # (and the withholder may name anyone); such a suspicion lapses, the withholder's is renewed.
        withholder = now.get("peer3", {}).get("suspected_by", 0)
        return withholder >= 2 and all(
            now.get(f"peer{i}", {}).get("suspected_by", 0) < withholder for i in range(3)
        )

    seen: list[dict] = []  # the last status read, shown if the wait times out

    def reported() -> dict | None:
        now = peers_now()
        seen[:] = [now]
        return now if singled_out(now) else None

    try:
        peers = wait_until(
            reported, timeout_s=320,
            what="two honest peers to report the withholder, and more than any honest peer",
        )  # fmt: skip
    except TimeoutError as e:
        last = {
            name: (p.get("state"), p.get("step"), p.get("suspected_by"), p.get("metrics"))
            for name, p in (seen[0] if seen else {}).items()
        }
        raise AssertionError(f"{e}; last status (state, step, suspected_by, metrics): {last}") from None
    assert peers["peer3"]["state"] == "online", "a withholder is avoided and shown, not banned"
    with urllib.request.urlopen(endpoint["dashboard_url"] + "metrics", timeout=10) as response:
        text = response.read().decode()
    assert any(
        line.startswith("swarm_peer_suspected_by{") and 'name="peer3"' in line for line in text.splitlines()
    ), text[-2000:]
