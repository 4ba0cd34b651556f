"""Stage evidence is judged at any recent step, not only at the coordinator's checkpoint of the stage.

In process with the real classes: ``StageReplica`` replicas of stage 0 behind real ``StageServicer``
handlers (one mounting the registry's ``stage_poison``), the trainer's real ``StageCheck``, each honest
replica's kept states (``StateHistory``) served by the real ``StateServicer`` on a hivemind P2P daemon
on loopback, and the real ``CoordinatorService`` over gRPC, which holds a checkpoint of step 0 only and
fetches the state of later steps with the real ``RecentStageStates``. The stage's view of signed
records is handed to ``RecentStageStates`` as ``fetch_view`` would return it.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import torch
from hivemind.p2p import P2P
from test_stage_verification import (
    RUN,
    Held,
    Replica,
    accuse_at_coordinator,
    checker,
    grad_outputs,
    run_config,
    trainer_key,
)

from coordinator.stagestates import RecentStageStates
from protocols import pipeline_pb2 as ppb
from protocols.errors import ProtocolError
from swarm.byzantine.attacks import make_attack
from swarm.config import RunConfig
from swarm.keyspace import stage_prefix
from swarm.pipeline.check import StageCall
from swarm.pipeline.history import StateHistory
from swarm.pipeline.layout import stage_bytes
from swarm.pipeline.records import PipelineView, StageRecord
from swarm.pipeline.replica import StageReplica
from swarm.pipeline.verify import check_reply
from swarm.pipeline.wire import encode_ids
from swarm.training.state import state_tensors
from swarm.training.sync import StateServicer, download_limit, download_state, state_namespace

pytestmark = pytest.mark.timeout(90)


async def step_on(replica: StageReplica, history: StateHistory | None = None) -> None:
    """Close the replica's step as its worker does: keep the state, apply the (here zero) gradient, hash."""
    if history is not None:
        history.keep_current(replica)
    replica.apply(torch.zeros(replica.numel))
    await replica.commit()


async def through_at(replica: Replica, trainer, run: RunConfig, mb: int, step: int) -> StageCall:
    """Micro-batch ``mb``'s forward and backward at stage 0 and ``step``, each reply checked."""
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(mb))
    forward = ppb.ForwardRequest(run_id=run.run_id, stage=0, step=step, microbatch_id=mb, attempt=1,
                                 inputs=encode_ids(ids))  # fmt: skip
    reply = await replica.call(trainer, "rpc_forward", forward)
    assert reply.code == ppb.OK, reply.error
    check_reply(replica.key.peer_id, run.run_id, 0, trainer.peer_id, reply, forward)
    backward = ppb.BackwardRequest(run_id=run.run_id, stage=0, step=step, microbatch_id=mb, attempt=1,
                                   grad_outputs=grad_outputs(run, mb))  # fmt: skip
    back = await replica.call(trainer, "rpc_backward", backward)
    check_reply(replica.key.peer_id, run.run_id, 0, trainer.peer_id, back, forward, backward)
    return StageCall(replica.key.peer_id, forward, reply, backward, back)


async def state_holder(run: RunConfig, replica: StageReplica, history: StateHistory) -> P2P:
    """A P2P daemon serving ``replica``'s current and kept states to anyone, as a stage worker does."""
    p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])

    async def admit(requester: str) -> str | None:
        return None

    servicer = StateServicer(
        run.run_id, lambda: history.current(replica), admit=admit,
        find=lambda state_hash: history.find(replica, state_hash),
    )  # fmt: skip
    await servicer.add_p2p_handlers(p2p, namespace=state_namespace(stage_prefix(run.run_id, 0)))
    return p2p


def view_of(positions: dict[str, tuple[int, str]]) -> PipelineView:
    """The view ``fetch_view`` returns when each peer's signed stage record shows (step, state hash)."""
    records = [StageRecord(peer, 0, step, 1.0, 0.0, state_hash, "", time.time())
               for peer, (step, state_hash) in positions.items()]  # fmt: skip
    return PipelineView(stages={0: records}, holders={0: list(records)})


def test_evidence_at_a_step_without_a_checkpoint_convicts_the_poisoner_from_a_kept_state(tmp_path: Path):
    """The coordinator holds a checkpoint of step 0; the poisoner is caught at step 1, and by the time the
    coordinator judges, every replica is at step 2. It downloads the state of step 1 by the replies' hash
    from an honest replica that kept it, recomputes, and bans the poisoner: never the honest replica,
    also when the trainer checked (and so accused) the honest one first."""
    run = run_config()
    trainer = trainer_key()
    honest = Replica(run, 0)
    poison = Replica(run, 0, attack=make_attack("stage_poison", group_size=3, attackers=1))
    checkpoint = Held(honest.replica)  # step 0
    history = StateHistory(RUN, run.pipeline.kept_states)
    check = checker(run, trainer, {r.key.peer_id: r for r in (honest, poison)})

    async def scenario() -> None:
        for r in (honest, poison):
            await step_on(r.replica)
        filed = {}  # the replica checked first (and accused) -> the evidence
        for mb, (first, second) in enumerate(((poison, honest), (honest, poison))):
            evidence = await check.check(
                0, second.key.peer_id, 2, await through_at(first, trainer, run, mb, 1)
            )
            assert evidence is not None and evidence.step == 1
            filed[first] = evidence
        for r in (honest, poison):  # the poisoner keeps nothing: the state need not come from it
            await step_on(r.replica, history if r is honest else None)
            assert r.replica.step == 2
        holder = await state_holder(run, honest.replica, history)
        coordinator = await P2P.create(
            host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=await holder.get_visible_maddrs()
        )
        now = {holder.peer_id.to_base58(): (2, honest.replica.state_hash)}

        async def refresh() -> PipelineView:
            return view_of(now)

        try:
            for i, (accused, evidence) in enumerate(filed.items()):
                states = RecentStageStates(run, coordinator, refresh=refresh, banned=set)  # nothing cached
                answer, banned = await accuse_at_coordinator(
                    tmp_path / str(i), run, checkpoint, trainer, [honest.key, poison.key], accused, evidence,
                    states,
                )  # fmt: skip
                assert answer.banned_peer == poison.key.peer_id, answer.verdict
                assert "at step 1 wrongly" in answer.verdict and "false accusation" not in answer.verdict
                assert banned == {poison.key.peer_id}
        finally:
            for p2p in (coordinator, holder):
                await p2p.shutdown()

    asyncio.run(scenario())


def test_a_replica_on_a_forked_state_is_judged_by_that_state_an_honest_one_is_not_convicted(tmp_path: Path):
    """Under load a replica can take a round alone and fork: at step 1 it holds another state than its
    stage-mates, names it in its replies and answers correctly for it. A check against the honest
    replica finds a mismatch; the coordinator downloads both named states by hash and bans nobody (it
    used to convict the forked replica on its state hash alone: the rehearsal banned an honest replica
    so). A poisoner on a forked state is recomputed from the state it named, and banned."""
    run = run_config()
    trainer = trainer_key()
    honest, forked = Replica(run, 0), Replica(run, 0)
    poison = Replica(run, 0, attack=make_attack("stage_poison", group_size=3, attackers=1))
    checkpoint = Held(honest.replica)  # step 0
    replicas = (honest, forked, poison)
    histories = [StateHistory(RUN, run.pipeline.kept_states) for _ in replicas]
    check = checker(run, trainer, {r.key.peer_id: r for r in replicas})

    async def scenario() -> None:
        for r in replicas:
            await step_on(r.replica)
        for r in (forked, poison):  # each took a different round alone
            with torch.no_grad():
                r.replica.params[0].add_(0.01 if r is forked else -0.01)
            await r.replica.commit()
        assert len({r.replica.state_hash for r in replicas}) == 3
        filed = []
        for mb, other in enumerate((forked, poison)):
            evidence = await check.check(
                0, other.key.peer_id, 2, await through_at(honest, trainer, run, mb, 1)
            )
            assert evidence is not None  # the trainer accuses the honest replica it checked first
            filed.append(evidence)
        for r, history in zip(replicas, histories, strict=True):
            await step_on(r.replica, history)
        # One daemon serves the three replicas' kept states (each replica serves its own in a swarm).
        holder = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])

        async def find(state_hash: str):
            for r, history in zip(replicas, histories, strict=True):
                if (state := await history.find(r.replica, state_hash)) is not None:
                    return state
            return None

        async def admit(requester: str) -> str | None:
            return None

        servicer = StateServicer(RUN, lambda: histories[0].current(honest.replica), admit=admit, find=find)
        await servicer.add_p2p_handlers(holder, namespace=state_namespace(stage_prefix(RUN, 0)))
        coordinator = await P2P.create(
            host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=await holder.get_visible_maddrs()
        )

        async def refresh() -> PipelineView:
            return view_of({holder.peer_id.to_base58(): (2, honest.replica.state_hash)})

        try:
            states = RecentStageStates(run, coordinator, refresh=refresh, banned=set)
            peers = [r.key for r in replicas]
            with pytest.raises(ProtocolError, match="nobody banned.*what the states they name compute"):
                await accuse_at_coordinator(tmp_path / "fork", run, checkpoint, trainer, peers, honest, filed[0],
                                            states)  # fmt: skip
            answer, banned = await accuse_at_coordinator(
                tmp_path / "poison", run, checkpoint, trainer, peers, honest, filed[1], states
            )
            assert (
                answer.banned_peer == poison.key.peer_id
                and "wrongly for the state it named" in answer.verdict
            )
            assert banned == {poison.key.peer_id}
        finally:
            for p2p in (coordinator, holder):
                await p2p.shutdown()

    asyncio.run(scenario())


def test_a_state_request_by_hash_serves_a_kept_state_and_refuses_an_unknown_hash():
    """A replica at step 3 that keeps 2 states serves the states of steps 1 and 2 by their hashes (and its
    current one); step 0's, pushed out, and a hash it never held are refused with an error naming the
    hash; a malformed hash is refused naming the field; a request by step alone still gets the current
    state."""
    run = run_config()
    replica = StageReplica(run, 0)
    history = StateHistory(RUN, keep=2)
    namespace = state_namespace(stage_prefix(RUN, 0))

    async def scenario() -> None:
        await replica.commit()
        hashes, tensors = [], []
        for _ in range(3):
            hashes.append(replica.state_hash)
            tensors.append(state_tensors(replica.model, replica.optimizer))
            await step_on(replica, history)
        hashes.append(replica.state_hash)
        holder = await state_holder(run, replica, history)
        asker = await P2P.create(
            host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=await holder.get_visible_maddrs()
        )

        def fetch(step: int, state_hash: str, exact: bool = True):
            return download_state(
                asker, holder.peer_id, namespace=namespace, run_id=RUN, min_step=step, expected_hash=state_hash,
                max_bytes=download_limit(stage_bytes(run, 0)), timeout_s=30.0, exact=exact,
            )  # fmt: skip

        try:
            for step in (1, 2):
                kept = await fetch(step, hashes[step])
                assert (kept.step, kept.state_hash) == (step, hashes[step])
                assert all(torch.equal(kept.tensors[k], t) for k, t in tensors[step].items())
            assert (await fetch(3, hashes[3])).step == 3
            assert (await fetch(3, hashes[3], exact=False)).step == 3  # a caller that names no hash
            with pytest.raises(ProtocolError, match=f"no state of hash {hashes[0][:12]} at step 0"):
                await fetch(0, hashes[0])
            with pytest.raises(ProtocolError, match=f"no state of hash {'e' * 12} at step 2"):
                await fetch(2, "e" * 64)
            with pytest.raises(ProtocolError, match="field 'state_hash'.*not 64 hex digits"):
                await fetch(2, "not a hash")
        finally:
            await asker.shutdown()
            await holder.shutdown()
            replica.close()

    asyncio.run(scenario())


async def daemon_as(key, path: Path, replica: StageReplica, history: StateHistory, initial_peers=()) -> P2P:
    """``key``'s own P2P daemon (its peer ID is the replica's signing identity), serving its states."""
    path.write_bytes(key.to_libp2p_bytes())
    p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], identity_path=str(path),
                           initial_peers=initial_peers, check_if_identity_free=False)  # fmt: skip

    async def admit(requester: str) -> str | None:
        return None

    servicer = StateServicer(
        RUN, lambda: history.current(replica), admit=admit, find=lambda h: history.find(replica, h)
    )
    await servicer.add_p2p_handlers(p2p, namespace=state_namespace(stage_prefix(RUN, 0)))
    return p2p


@pytest.mark.parametrize(
    "stage_at, in_view", [(2, True), (3, True), (2, False)], ids=["within", "too-old", "not-a-replica"]
)
def test_a_poisoner_naming_a_state_it_cannot_show_is_banned_within_the_kept_window(
    tmp_path: Path, stage_at: int, in_view: bool
):
    """A poisoner names a made-up state hash in its signed replies at step 1, so no replica serves that
    state. The coordinator asks the poisoner itself, which cannot show it: banned while an honest replica
    would still hold a state of step 1 (the stage at step 2, 2 states kept), also when the trainer
    accused the honest replica. Evidence older than the kept window (the stage at step 3), or a signer
    that is not a current replica of the stage, bans nobody, and the verdict says why."""
    run = run_config()
    trainer = trainer_key()
    honest = Replica(run, 0)
    poison = Replica(run, 0, attack=make_attack("stage_poison", group_size=3, attackers=1))
    checkpoint = Held(honest.replica)  # step 0
    histories = {r: StateHistory(RUN, run.pipeline.kept_states) for r in (honest, poison)}
    check = checker(run, trainer, {r.key.peer_id: r for r in (honest, poison)})

    async def scenario() -> None:
        for r in (honest, poison):
            await step_on(r.replica, histories[r])
        poison.replica.state_hash = "ab" * 32  # a state it never held
        orders = ((poison, honest), (honest, poison)) if stage_at == 2 and in_view else ((poison, honest),)
        filed = {}
        for mb, (first, second) in enumerate(orders):
            evidence = await check.check(
                0, second.key.peer_id, 2, await through_at(first, trainer, run, mb, 1)
            )
            assert evidence is not None and evidence.step == 1
            filed[first] = evidence
        for _ in range(stage_at - 1):
            for r in (honest, poison):
                await step_on(r.replica, histories[r])
        holder = await state_holder(run, honest.replica, histories[honest])
        liar = await daemon_as(poison.key, tmp_path / "poison.key", poison.replica, histories[poison],
                               await holder.get_visible_maddrs())  # fmt: skip
        coordinator = await P2P.create(
            host_maddrs=["/ip4/127.0.0.1/tcp/0"],
            initial_peers=[*await holder.get_visible_maddrs(), *await liar.get_visible_maddrs()],
        )
        now = {holder.peer_id.to_base58(): (stage_at, honest.replica.state_hash)}
        if in_view:
            now[poison.key.peer_id] = (stage_at, poison.replica.state_hash)

        async def refresh() -> PipelineView:
            return view_of(now)

        try:
            for i, (accused, evidence) in enumerate(filed.items()):
                states = RecentStageStates(run, coordinator, refresh=refresh, banned=set)
                accuse = accuse_at_coordinator(tmp_path / str(i), run, checkpoint, trainer,
                                               [honest.key, poison.key], accused, evidence, states)  # fmt: skip
                if stage_at == 2 and in_view:
                    answer, banned = await accuse
                    assert answer.banned_peer == poison.key.peer_id, answer.verdict
                    assert f"naming state {'ab' * 6} and does not serve it" in answer.verdict
                    assert banned == {poison.key.peer_id}
                    continue
                why = "keep the states of only the last 2 steps" if in_view else "not a current replica"
                with pytest.raises(ProtocolError, match=f"nobody banned.*did not show state.*{why}"):
                    await accuse
        finally:
            for p2p in (coordinator, liar, holder):
                await p2p.shutdown()

    asyncio.run(scenario())


def test_a_replica_keeps_every_state_it_answered_with_in_the_window_also_one_a_catch_up_replaced():
    """A replica answers at step 1 and at step 2 from a forked state, then catches up to the stage's state
    of step 2 (the download replaces the forked one) and steps on. At step 3 every state it answered
    with in the last 2 steps is still served by hash: the one the catch-up replaced, and step 1's, which
    the extra kept state must not push out."""
    run = run_config()
    replica, other = StageReplica(run, 0), StageReplica(run, 0)
    history = StateHistory(RUN, keep=2)

    async def scenario() -> None:
        for r in (replica, other):
            await r.commit()
        history.advance(replica, torch.zeros(replica.numel))
        other.apply(torch.zeros(other.numel))
        step1 = replica.state_hash
        history.advance(replica, torch.zeros(replica.numel))
        other.apply(torch.zeros(other.numel))
        with torch.no_grad():
            replica.params[0].add_(0.01)  # a round it took alone
        await replica.commit()
        forked = replica.state_hash
        history.replace(replica, 2, state_tensors(other.model, other.optimizer))
        await other.commit()
        assert (replica.step, replica.hashed_step, replica.state_hash) == (2, 2, other.state_hash)
        step2 = replica.state_hash
        history.advance(replica, torch.zeros(replica.numel))
        assert replica.step == replica.hashed_step == 3
        for state_hash, step in ((step1, 1), (forked, 2), (step2, 2), (replica.state_hash, 3)):
            found = await history.find(replica, state_hash)
            assert found is not None and found.step == step, (state_hash[:12], step)

    try:
        asyncio.run(scenario())
    finally:
        replica.close()
        other.close()
