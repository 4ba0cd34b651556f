"""Collaborative training among real peers (each with its own DHT process) on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import pytest
import torch
from helpers import KEYS, VanishingAllReduce, module_dht_fixtures, start_dhts

from lab.localswarm import running_coordinator, tiny_run
from protocols.certificates import issue_certificate
from protocols.keys import SigningKey
from swarm.averaging.allreduce import RoundResult
from swarm.coordinator_client import CoordinatorClient
from swarm.identity import load_identity
from swarm.records import RecordSigner, TrustValidator
from swarm.training.catchup import Position
from swarm.training.checkpoint import load_latest_checkpoint
from swarm.training.progress import PeerProgress
from swarm.training.readiness import ShownWork
from swarm.training.state import encode_state, state_tensors
from swarm.training.sync import EncodedState
from swarm.training.synced import SyncedState
from swarm.training.trainer import Trainer

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]


async def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        await asyncio.sleep(0.2)


# Four DHT nodes for the module's tests that need no coordinator; each test trains a run of its own.
module_nodes, nodes = module_dht_fixtures(4)


def trainers_for(run, dhts, **kwargs) -> list[Trainer]:
    torch.set_num_threads(1)
    return [
        Trainer(run, d, peer_id=d.peer_id.to_base58(), signing_key=KEYS[d.peer_id.to_base58()], **kwargs)
        for d in dhts
    ]


def shown_round(peer, others: list[PeerProgress], weight: float) -> ShownWork:
    """What a round of ``peer`` with ``others`` that brought it to its step showed, each at ``weight``."""
    members = [peer.peer_id, *(p.peer_id for p in others)]
    return ShownWork.of_round(
        step=peer.step, members=members, weights=[weight] * len(members), me=peer.peer_id,
        target=peer.config.training.target_batch_size,
    )  # fmt: skip


def test_late_joiner_and_a_peer_dying_mid_round(nodes):
    max_steps = 20  # room for the survivors to train on while the joiner loads on a busy machine
    run = tiny_run("faults", max_steps=max_steps, min_group_size=1)
    dhts = nodes[:3]
    trainers = trainers_for(run, dhts)
    stop = asyncio.Event()

    async def scenario() -> None:
        tasks = [asyncio.create_task(t.run(stop)) for t in trainers[:2]]
        await wait_for(lambda: trainers[0].step >= 3, 120, "two peers to reach step 3")
        # A late joiner downloads the agreed state and then trains in step with the others.
        tasks.append(asyncio.create_task(trainers[2].run(stop)))
        await wait_for(lambda: trainers[2].metrics()["resyncs"] >= 1, 60, "the late joiner to load the state")
        assert trainers[2].step >= 3
        # Fault injection: from its next round on, peer 2 vanishes after its group forms.
        trainers[2].averager.runner_type = VanishingAllReduce
        stalled_at = trainers[0].step
        # The survivors train on while the joiner loads; on a busy machine they may be near the end by now.
        assert stalled_at < max_steps, "the survivors finished before the fault: nothing left to test"
        target = min(stalled_at + 2, max_steps)
        started = time.monotonic()
        await wait_for(lambda: trainers[0].step >= target and trainers[1].step >= target, 120,
                       "the survivors to finish rounds without the vanished peer")  # fmt: skip
        assert time.monotonic() - started < 90, "a dead groupmate must not stall the run past its timeouts"
        tasks[2].cancel()
        await wait_for(lambda: all(t.finished for t in trainers[:2]), 120, "the survivors to reach max_steps")
        assert trainers[0].param_hash == trainers[1].param_hash, "survivors hold bit-identical parameters"
        assert trainers[0].state_hash == trainers[1].state_hash
        assert trainers[0].metrics()["val_loss"] < 5.4, "validation loss fell from about 5.5"
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(scenario())


@contextlib.asynccontextmanager
async def coordinated_swarm(run, data_dir: Path, peers: int):
    """A coordinator and ``peers`` training peers, each with its own DHT process; all stopped on exit.
    Yields the coordinator node and the trainers."""
    async with running_coordinator(run, data_dir) as node:
        coordinator_key = load_identity(data_dir / "identity.key")
        validator = TrustValidator(run.run_id, coordinator_key.public_key)
        dhts = start_dhts(peers, node.dht_initial_peers, validators=[validator])
        torch.set_num_threads(1)
        trainers = []
        for dht in dhts:  # admitted peers: each signs its records with a certificate from the coordinator
            key = KEYS[dht.peer_id.to_base58()]
            certificate = issue_certificate(coordinator_key, public_key=key.public_key, run_id=run.run_id,
                                            role="data", name="t", serial=1, ttl_s=600)  # fmt: skip
            trainers.append(Trainer(run, dht, peer_id=key.peer_id, coordinator_key=coordinator_key.public_key,
                                    signing_key=key, record_signer=RecordSigner(key, certificate.encoded)))  # fmt: skip
        stop = asyncio.Event()
        tasks = [asyncio.create_task(t.run(stop)) for t in trainers]
        try:
            yield node, trainers
        finally:
            stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)
            for dht in dhts:
                dht.shutdown()


async def told_of_a_checkpoint(node, run_id: str) -> bool:
    """What the coordinator tells a peer it admits: whether it holds a checkpoint to resume from."""
    async with CoordinatorClient(node.address) as client:
        return (await client.join(SigningKey.generate(), run_id, name="probe", device="cpu")).holds_checkpoint


def test_a_restarted_swarm_resumes_from_the_checkpoint_at_the_same_step_and_loss(tmp_path: Path):
    data_dir = tmp_path / "coordinator"

    async def scenario() -> None:
        async with coordinated_swarm(
            tiny_run("resume", max_steps=4, checkpoint_every_steps=2), data_dir, 2
        ) as (node, first):
            # A fresh run: peers are told there is no checkpoint, and train without looking for one.
            assert not await told_of_a_checkpoint(node, "resume")
            await wait_for(lambda: all(t.finished for t in first), 150, "step 4")
            await wait_for(lambda: (data_dir / "checkpoints" / f"ckpt-{4:08d}.safetensors").exists(), 30,
                           "the coordinator's checkpoint")  # fmt: skip
            assert first[0].state_hash == first[1].state_hash
            hash_at_4, loss_at_4 = first[0].state_hash, first[0].metrics()["val_loss"]
        checkpoint = load_latest_checkpoint(data_dir / "checkpoints")
        assert checkpoint.step == 4 and checkpoint.state_hash == hash_at_4

        # Everything restarts from nothing: new peer processes, new DHT, the same coordinator data dir.
        async with coordinated_swarm(
            tiny_run("resume", max_steps=6, checkpoint_every_steps=2), data_dir, 2
        ) as (node, second):
            assert await told_of_a_checkpoint(node, "resume")
            await wait_for(lambda: all(t.finished for t in second), 200, "step 6 after the restart")
            assert second[0].state_hash == second[1].state_hash
            # The resumed peers first evaluated the checkpoint's weights: the same step and loss as before.
            for trainer in second:
                assert trainer.peer.first_validation == (4, pytest.approx(loss_at_4, abs=1e-6))

    asyncio.run(scenario())


class TamperingState(SyncedState):
    """Serves its state with one weight changed, under the hash of the honest state."""

    async def encoded(self):
        honest = await super().encoded()
        model = self.model
        with torch.no_grad():
            original = model.embed.token.weight[0, 0].item()
            model.embed.token.weight[0, 0] += 1.0
            tampered = encode_state(self.step, state_tensors(model, self.optimizer), {"run_id": self.run_id})
            model.embed.token.weight[0, 0] = original
        return EncodedState(honest.step, honest.state_hash, tampered)


def test_a_state_that_fails_its_hash_is_discarded_and_fetched_elsewhere(nodes, caplog):
    run = tiny_run("tamper")
    dhts = nodes[:3]
    honest, liar = (t.peer for t in trainers_for(run, dhts[:2]))
    liar.synced.__class__ = TamperingState  # before start(), which serves liar.synced.encoded
    joiner = trainers_for(run, dhts[2:])[0].peer
    step_gradient = torch.randn(honest.numel, generator=torch.Generator().manual_seed(1))

    async def scenario() -> None:
        for trainer in (honest, liar, joiner):
            await trainer.start()
        for _ in range(2):  # every peer's signed record reaches the others: state goes to known peers only
            for trainer in (honest, liar, joiner):
                await trainer.exchange_progress()
        for trainer in (honest, liar):  # both take the same step 1; only the liar will misreport it
            await asyncio.to_thread(trainer._apply_round, RoundResult(step_gradient, True))
            await trainer._commit(1)
        assert honest.state_hash == liar.state_hash and joiner.step == 0
        liar_id, honest_id = liar.peer_id, honest.peer_id
        assert not await joiner.catchup.resync(1, honest.state_hash, [liar_id]), (
            "a tampered state must be refused"
        )
        assert joiner.step == 0, "and nothing of it loaded"
        assert await joiner.catchup.resync(1, honest.state_hash, [liar_id, honest_id, liar_id])
        assert joiner.step == 1 and joiner.state_hash == honest.state_hash

    asyncio.run(scenario())
    assert f"discarding state from {dhts[1].peer_id.to_base58()}" in caplog.text


def test_a_joiner_that_holders_have_not_seen_yet_asks_again_without_a_warning(nodes, caplog):
    """A peer that asks for state before the holder's view shows its first record is refused, as expected
    on every resume: that is a line at INFO ("will look again"), not a warning that discards the holder."""
    run = tiny_run("not-seen-yet")
    dhts = nodes[:2]
    holder, joiner = (t.peer for t in trainers_for(run, dhts))

    async def scenario() -> None:
        for trainer in (holder, joiner):
            await trainer.start()
        await holder.exchange_progress()  # the holder's view: itself only
        await asyncio.to_thread(
            holder._apply_round,
            RoundResult(torch.randn(holder.numel, generator=torch.Generator().manual_seed(2)), True),
        )
        await holder._commit(1)
        with caplog.at_level("INFO", logger="swarm.training.sync"):
            assert not await joiner.catchup.resync(1, holder.state_hash, [holder.peer_id])
        for trainer in (joiner, holder):  # the joiner's record reaches the holder's next view
            await trainer.exchange_progress()
        assert await joiner.catchup.resync(1, holder.state_hash, [holder.peer_id])
        assert joiner.state_hash == holder.state_hash

    asyncio.run(scenario())
    refusals = [r for r in caplog.records if "signed progress record" in r.getMessage()]
    assert refusals and all(r.levelname == "INFO" for r in refusals), [
        (r.levelname, r.getMessage()) for r in refusals
    ]
    assert "will look again" in refusals[0].getMessage()
    assert "discarding state" not in caplog.text


def test_a_peer_joins_a_round_only_with_samples_of_its_own_whatever_others_claim(nodes):
    """A peer whose groupmates already claim the whole batch still computes a micro-batch before its
    round. Before, a slow peer (or one whose view held an inflated claim) joined with weight 0: it counted
    toward the group's 2f + 1 but the rule left it out, so one attacker faced one honest sender (a
    whole-run rehearsal made no progress in such a step)."""
    run = tiny_run("own-samples")
    dhts = nodes[:1]
    (trainer,) = trainers_for(run, dhts)
    now = time.time()
    target = run.training.target_batch_size
    others = [PeerProgress(f"other{i}", 0, target, 1.0, trainer.state_hash, now) for i in range(2)]
    trainer.peer.progress_view.peers = {p.peer_id: p for p in others}
    trainer.peer.progress_view.count = trainer.peer._step_view + 1  # a view fetched after this step began
    # Its last round showed both doing as much work (so their claims count in full, ``readiness``).
    trainer.peer.shown = shown_round(trainer.peer, others, target)
    assert trainer.peer.samples == 0
    assert trainer.peer.wants_compute() and not trainer.peer.ready_for_round()
    trainer._micro_step()
    assert trainer.peer.samples == run.training.micro_batch_size
    assert trainer.peer.ready_for_round() and not trainer.peer.wants_compute()


def test_a_resumed_peer_rounds_only_on_a_view_read_after_the_others_published_again(nodes):
    """Paused peers publish no progress record. Peers resumed together used to take their first round on
    the first view read after the resume, which could lack the others' records (not published again yet):
    a leader then expected too few peers and assembled without them (in a rehearsal whose floor was 2 of
    3, two peers formed every group of the run without the third)."""
    run = tiny_run("resume-view")
    (trainer,) = trainers_for(run, nodes[:1])
    peer, now = trainer.peer, time.time()
    target = run.training.target_batch_size
    others = [PeerProgress(f"other{i}", 0, target, 1.0, trainer.state_hash, now) for i in range(2)]
    peer.progress_view.peers = {p.peer_id: p for p in others}
    peer.progress_view.count = peer._step_view + 1
    peer.shown = shown_round(peer, others, target)
    trainer._micro_step()
    assert peer.ready_for_round()
    peer.pause()
    peer.resume()
    assert not peer.ready_for_round(), "the view read before the resume"
    peer.progress_view.count += 1
    assert not peer.ready_for_round(), "the first view after it: the others may not have published yet"
    peer.progress_view.count += 1
    assert peer.ready_for_round()


def test_a_peer_computing_a_long_batch_is_not_stalled_and_one_key_ahead_does_not_move_it(nodes):
    """The catch-up rule's stall clock starts at a peer's first round attempt at its step, not at the
    step's start. Before, a peer still computing a batch that took longer than a matchmaking window plus a
    round timeout counted as stalled, let only the peers ahead vote, and followed one key's record of the
    next step."""
    run = tiny_run("stall-clock")
    dhts = nodes[:1]
    (trainer,) = trainers_for(run, dhts)
    now = time.time()
    honest = [PeerProgress(f"honest{i}", 0, 8, 1.0, trainer.state_hash, now) for i in range(2)]
    evil = PeerProgress("evil", 1, 32, 1.0, "e" * 64, now)
    trainer.peer.view = {p.peer_id: p for p in [*honest, evil]}
    window = run.training.matchmaking_time_s + run.training.averaging_timeout_s
    # The step began long ago and its batch is still being computed (``_step_since`` was the old clock).
    trainer.peer._started = trainer.peer._step_since = time.monotonic() - 10 * window
    assert trainer.peer.catchup.ahead_or_apart() is None, "one key ahead is no majority of the peers in view"
    # Once its rounds have failed for a whole window, a stalled peer asks the peers it completed rounds
    # with (``Groupmates``): "evil" never was one, so its record still moves nobody...
    trainer.peer.catchup.stalled_since = time.monotonic() - 2 * window
    assert trainer.peer.catchup.ahead_or_apart() is None
    trainer.peer.groupmates.record(["honest0", "honest1"], 0)
    assert trainer.peer.catchup.ahead_or_apart() is None
    # ...while the groupmates, once they moved on, do.
    for p in honest:
        trainer.peer.view[p.peer_id] = PeerProgress(p.peer_id, 1, 8, 1.0, "d" * 64, now)
    assert trainer.peer.catchup.ahead_or_apart() == (1, "d" * 64, ["honest0", "honest1"])


def test_a_leader_waits_for_its_last_groupmates_whose_records_still_show_the_step_before(nodes):
    """The members of the round that brought a peer to its step come to that step too, though its view may
    still show them a step behind: its search expects them, so that its group waits for them. Before, it
    expected only the peers its view showed at its step, and in a fast run the two of three whose records
    arrived first formed every group without the third. A peer a step behind that was not in that round
    is not expected (it may be stuck there)."""
    run = tiny_run("arriving")
    (trainer,) = trainers_for(run, nodes[:1])
    peer, now = trainer.peer, time.time()
    peer.synced.step = 3
    peer.groupmates.record(["mate"], 3)
    rows = [("mate", 2), ("stranger", 2), ("level", 3), ("far", 1)]
    peer.progress_view.peers = {n: PeerProgress(n, s, 8, 1.0, trainer.state_hash, now) for n, s in rows}
    expected: list[int] = []

    async def average(*_args, expected_size, **_kwargs):
        expected.append(expected_size)
        return None

    peer.averager.average = average
    trainer._micro_step()
    asyncio.run(peer._round())
    assert expected == [3], "itself, the peer at its step and the groupmate whose record lags"
    peer.groupmates.record(["mate"], 2)  # that round brought it to step 2: mate may be stuck at 2
    asyncio.run(peer._round())
    assert expected == [3, 2]


def test_a_peer_alone_one_step_ahead_goes_back_and_a_run_of_every_peer_trains_on(nodes, caplog):
    """Four peers in a run whose minimum group size is all four: one applied a round at step 1 that the
    other three did not (their part of it failed), so it is alone at step 2 and they cannot form a round at
    step 1 without it. Before, the run never moved again: one peer ahead is no majority to follow (and with
    more peers at their step than ahead, not even for the stalled), and nothing moved a peer back. Now the
    one ahead, once long stalled, goes back to the state it held before that round, which the three hold,
    and the four train on to the end with identical parameters."""
    run = tiny_run("step-back", max_steps=3, min_group_size=4, averaging_timeout_s=4.0)
    trainers = trainers_for(run, nodes[:4])
    names = [t.peer.peer_id for t in trainers]
    first, lone = (
        torch.randn(trainers[0].peer.numel, generator=torch.Generator().manual_seed(3)),
        trainers[3].peer,
    )
    stop = asyncio.Event()

    async def scenario() -> None:
        for trainer in trainers:  # step 0 -> 1 together, as one round of the four
            peer = trainer.peer
            await asyncio.to_thread(peer._apply_round, RoundResult(first, True))
            await peer._commit(1)
            peer.groupmates.record([n for n in names if n != peer.peer_id], 1)
        at_1 = Position(1, lone.state_hash)
        await asyncio.to_thread(lone._apply_round, RoundResult(-first, True))  # the round only it applied
        await lone._commit(2)
        lone.groupmates.record(names[:3], 2, moved=(at_1, Position(2, lone.state_hash)))
        tasks = [asyncio.create_task(t.run(stop)) for t in trainers]
        await wait_for(lambda: lone.catchup.resyncs >= 1, 90, "the peer ahead to go back")
        await wait_for(lambda: all(t.finished for t in trainers), 120, "the four peers to reach step 3")
        assert len({t.state_hash for t in trainers}) == 1, "one state, held by all four"
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)

    with caplog.at_level("INFO", logger="swarm.training.resync"):
        asyncio.run(scenario())
    assert "loaded the state of step 1 from" in caplog.text and "this peer step 2" in caplog.text
