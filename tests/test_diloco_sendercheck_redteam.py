"""An attacker's read of the DiLoCo sender checks (windows replayed from a fresh inner optimizer), each
way in it found now a regression test: honest bf16 peers (or their validators) banned because rounding
grows over a window; a liar choosing a window so long that nobody can replay it in time; a validator's
replays without a deadline, piling up; a proven lie that banned nobody because the coordinator judged it
inside the accuser's short call. In process, with the real model, dataset, codec, signatures,
``DilocoSync`` (driven as the built-in loop drives it), the validator's ``SenderChecks`` and the
coordinator's service over gRPC on loopback.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from types import SimpleNamespace

import pytest
from helpers import ServedStates

import swarm.training.contribution as contribution
from coordinator.accusations import run_layouts
from coordinator.contributions import judge_contribution
from lab.localswarm import tiny_run
from protocols.errors import ProtocolError
from protocols.keys import SigningKey
from protocols.messages import JUDGING_BUDGET_S
from swarm.averaging.compression import get_codec
from swarm.averaging.evidence import (
    SignedInput,
    chunk_bounds,
    contribution_message,
    draw_seed,
    drawn_validator,
    layout_chunk_values,
    round_digest,
    split_bounds,
)
from swarm.averaging.groups import GroupEntryBody, make_entry
from swarm.averaging.verification import Assignment, assignments
from swarm.config import (
    RunConfig,
    resets_inner_state,
    sender_checks_on,
    sender_tolerance,
    window_replay_obstacle,
)
from swarm.data import derive_seed
from swarm.models import build_model
from swarm.training.diloco import DilocoSync
from swarm.training.microbatch import MicroBatchRunner
from swarm.training.replay import public_dataset
from swarm.training.sendercheck import (
    SenderChecks,
    StateCopy,
    WrongContributionEvidence,
    chunk_slice,
    compare,
    drawn_sender,
    whole_micro_batches,
)
from swarm.training.state import DecodedState, build_optimizer, state_hash, state_tensors

# --- helpers: a live window, and evidence of any member, part and chunk in a group of any size ---------


def _live_window(
    run: RunConfig, peer_id: str, micro_batches: int, *, step: int = 0, chunk: int | None = None
):
    """The window ``peer_id`` computes at outer ``step`` from the run's initial synced state, driven as
    ``Trainer._micro_step`` drives ``TrainingPeer.absorb`` (seeds ``derive_seed(run, peer, step, micro)``,
    the gradient of the summed loss, one inner step each). ``chunk``: the micro-batch runs in chunks of
    that many samples, as ``MicroBatchRunner`` does after an out-of-memory (``_shrink`` halves it; with
    ``fit_memory``/``--max-gpu-memory`` this happens by itself). Returns (synced state tensors, sent)."""
    model = build_model(run.model.name, run.model.config, seed=run.training.seed)
    strategy = DilocoSync(model, build_optimizer(model, run.optimizer), run)
    runner = MicroBatchRunner(model, precision=run.training.precision)
    runner.chunk_size = chunk
    dataset = public_dataset(run.dataset.name, run.dataset.config)
    batch, seq_len = run.training.micro_batch_size, int(run.model.config["seq_len"])
    tensors = state_tensors(strategy.synced_model, strategy.synced_optimizer)
    model.train()
    for micro in range(micro_batches):
        inputs, targets = dataset.sample_batch(derive_seed(run.run_id, peer_id, step, micro), batch, seq_len)
        runner.run(inputs, targets)
        strategy.absorb(batch, step=step, mean=False)
    return tensors, strategy.contribution(batch * micro_batches)


def _nonce(i: int) -> bytes:
    return hashlib.sha256(b"diloco-redteam-nonce" + i.to_bytes(4, "big")).digest()


def _chunks(run: RunConfig, members: int) -> list[tuple[int, int, int, int]]:
    """Every (part, chunk, lo, hi) of the run's layout in a group of ``members``."""
    codec = get_codec(run.training.compression)
    numel = run_layouts(run)[run.run_id.replace(".", "_")]
    values = layout_chunk_values(members, codec.bytes_per_value)
    bounds = split_bounds(numel, members)
    out = []
    for part in range(members):
        cb = chunk_bounds(bounds[part + 1] - bounds[part], values)
        out += [(part, c, bounds[part] + cb[c], bounds[part] + cb[c + 1]) for c in range(len(cb) - 1)]
    return out


def _evidence(
    run: RunConfig, keys, vector, *, sender: int, part: int, chunk: int, weight: float, step: int, hash_: str
) -> tuple[WrongContributionEvidence, int]:
    """``sender``'s signed input (``vector`` encoded) to ``chunk`` of ``part`` and its signed group entry
    naming (``step``, ``hash_``), in a round whose draw (all reveals included) names some validator for
    that chunk and ``sender`` as the one to replay; (evidence, the drawn validator's index)."""
    prefix, codec = run.run_id.replace(".", "_"), get_codec(run.training.compression)
    members = tuple(k.peer_id for k in keys)
    n = len(members)
    nonces = tuple(_nonce(i) for i in range(n))
    commits = tuple(hashlib.sha256(r).digest() for r in nonces)
    numel = run_layouts(run)[prefix]
    values = layout_chunk_values(n, codec.bytes_per_value)
    bounds = split_bounds(numel, n)
    chunks = [len(chunk_bounds(bounds[p + 1] - bounds[p], values)) - 1 for p in range(n)]
    training = run.training
    for i in range(100_000):
        group_id = b"diloco-redteam-%d" % i
        seed = draw_seed(round_digest(prefix, group_id, members, commits), nonces)
        validator = drawn_validator(seed, part, n)
        if validator == sender:
            continue
        drawn = assignments(seed, n, validator, training.verify_probability, chunks)
        others = [j for j in range(n) if j != validator]
        if (
            Assignment(part, chunk) in drawn
            and drawn_sender(seed, part, chunk, others, training.sender_check_probability) == sender
        ):
            break
    else:
        raise AssertionError("no group ID draws that")
    digest = round_digest(prefix, group_id, members, commits)
    lo, hi = chunk_slice(numel, n, part, chunk, values)
    data = codec.encode_contribution(vector[lo:hi])
    signature = keys[sender].sign(contribution_message(digest, part, chunk, members[sender], weight, data))
    body = GroupEntryBody(
        schema_hash=bytes(32), weight=min(weight, 1e6), commit=commits[sender],
        extra={"step": step, "state_hash": hash_},
    )  # fmt: skip
    evidence = WrongContributionEvidence(
        prefix=prefix, group_id=group_id, members=members, commitments=commits, part=part, chunk=chunk,
        item=SignedInput(sender, data, signature, weight), entry=make_entry(keys[sender], prefix, body),
        reveals=nonces,
    )  # fmt: skip
    return evidence, validator


def _coordinator(run: RunConfig, evidence: WrongContributionEvidence, accuser: str, state: DecodedState):
    """The coordinator's verdict on ``evidence`` filed by ``accuser``: (what it found, whom it bans)."""
    return asyncio.run(
        judge_contribution(
            run,
            lambda: run_layouts(run),
            evidence.to_bytes(),
            evidence.accused,
            accuser,
            states=ServedStates(state),
            judging=asyncio.Lock(),
            timeout_s=30,
        )  # fmt: skip
    )


# --- 1. bf16 windows are not checked: their rounding grows past the tolerance over a window ------------

BF16 = tiny_run(
    "diloco-redteam-bf16", sync="diloco", precision="bf16", verify_probability=1.0,
    sender_check_probability=1.0,
)  # fmt: skip
GROUP = 16  # a group of 16 splits the vector into chunks of about 1.4k values
H = BF16.training.inner_steps


def _worst_chunk(run, sent, replayed, members):
    codec = get_codec(run.training.compression)
    worst = 0.0
    for _, _, lo, hi in _chunks(run, members):
        verdict = compare(codec.encode_contribution(sent[lo:hi]), replayed[lo:hi], codec, 0.0, sender="s")
        worst = max(worst, 0.0 if verdict is None else float(verdict.split(" away")[0].split()[-1]))
    return worst


@pytest.mark.timeout(180)
def test_a_bf16_diloco_run_does_not_check_windows_whose_rounding_outgrows_the_tolerance():
    """Was CRITICAL (honest peers banned): a fresh Adam moves every weight by about lr times the sign of its
    gradient, so a bf16 rounding flip of a small gradient's sign grows over the window. One honest window of
    50 inner steps computed with micro-batches of 4 whole and in chunks of 2 (what ``MicroBatchRunner``
    does after running out of memory; another device kind or core count rounds the same way) lay 0.18
    apart in its worst chunk, against the tolerance 0.05, and the coordinator banned whichever honest side
    rounded unlike its CPU. Now bf16 (any precision but fp32) is a replay obstacle: such a run keeps its
    inner optimizer, checks no windows, and evidence filed in it convicts its filer."""
    assert not sender_checks_on(BF16) and not resets_inner_state(BF16.training)
    assert "bf16 rounding grows" in window_replay_obstacle(BF16.training)
    # Why: the same honest window, rounded two ways, from a fresh inner optimizer.
    reset = BF16.model_copy(
        update={"training": BF16.training.model_copy(update={"inner_optimizer_state": "reset"})}
    )
    keys = [SigningKey.generate() for _ in range(GROUP)]
    tensors, chunked = _live_window(reset, keys[1].peer_id, H, chunk=2)
    _, whole = _live_window(reset, keys[1].peer_id, H)
    assert _worst_chunk(BF16, chunked, whole, GROUP) > sender_tolerance(BF16.training) == 0.05
    hash_ = state_hash(0, tensors)
    evidence, validator = _evidence(
        BF16, keys, chunked, sender=1, part=0, chunk=0, weight=float(H * BF16.training.micro_batch_size),
        step=0, hash_=hash_,
    )  # fmt: skip
    found, guilty = _coordinator(BF16, evidence, keys[validator].peer_id, DecodedState(0, tensors, {}, hash_))
    assert guilty == keys[validator].peer_id and "does not recompute senders" in found


# --- 2. a checked window is the run's window: no claim makes its replay longer -------------------------

LONG = tiny_run(
    "diloco-redteam-long", sync="diloco", inner_steps=20, window_stretch=100.0, compression="int8",
    verify_probability=1.0, sender_check_probability=1.0,
)  # fmt: skip


@pytest.mark.timeout(120)
def test_a_claim_longer_than_the_runs_window_is_a_lie_found_without_a_replay():
    """Was HIGH (a provable liar escaped the ban): the replay was as long as the sender's signed claim,
    up to ``ceil(window_stretch * inner_steps)`` (100 windows here), and a replay past the coordinator's
    300 s bans nobody: the same lie claimed as 100 windows went unpunished. Now a run whose windows are
    replayed trains every window exactly ``inner_steps`` (``swarm.config.window_stretch`` is 1 there),
    so a longer claim is itself the lie, found from the signed weight alone."""
    keys = [SigningKey.generate() for _ in range(3)]
    liar = keys[1].peer_id
    tensors, honest = _live_window(LONG, liar, LONG.training.inner_steps)
    hash_, micro = state_hash(0, tensors), LONG.training.micro_batch_size
    state = DecodedState(0, tensors, {}, hash_)
    model = build_model(LONG.model.name, LONG.model.config, seed=LONG.training.seed)
    assert DilocoSync(model, build_optimizer(model, LONG.optimizer), LONG).stretch == 1.0
    longest = 100 * LONG.training.inner_steps
    with pytest.raises(ProtocolError, match="a window ends after 20 inner steps"):
        whole_micro_batches(LONG, float(longest * micro))
    evidence, validator = _evidence(
        LONG, keys, -honest, sender=1, part=2, chunk=0, weight=float(longest * micro), step=0, hash_=hash_
    )
    started = time.monotonic()
    found, guilty = _coordinator(LONG, evidence, keys[validator].peer_id, state)
    assert guilty == liar and "a window ends after 20 inner steps" in found, found
    assert time.monotonic() - started < 30


# --- 3. a validator replays one window at a time, within the judging budget ----------------------------


@pytest.mark.timeout(120)
def test_a_validator_replays_one_window_at_a_time_and_within_the_judging_budget(monkeypatch):
    """Was MEDIUM (resource abuse): ``SenderChecks._check_one`` replayed with no deadline, and two rounds'
    checks replayed side by side, each holding a state copy, a model, its synced twin and an inner
    optimizer. Now a replay stops at ``JUDGING_BUDGET_S`` (what the coordinator could judge), one runs
    at a time, one more waits its turn, and a check that comes due beyond that is skipped and counted."""
    keys = [SigningKey.generate() for _ in range(3)]
    liar = keys[1].peer_id
    tensors, honest = _live_window(LONG, liar, LONG.training.inner_steps)
    hash_, micro = state_hash(0, tensors), LONG.training.micro_batch_size
    evidence, _ = _evidence(
        LONG, keys, -honest, sender=1, part=2, chunk=0, weight=float(LONG.training.inner_steps * micro),
        step=0, hash_=hash_,
    )  # fmt: skip
    calls = []

    def spy(run, tensors, peer_id, step, micro_batches, *, device, deadline=None):
        started = time.monotonic()
        time.sleep(0.5)  # the later rounds' checks come due meanwhile
        calls.append((micro_batches, deadline - started, started, time.monotonic()))
        raise RuntimeError("stopped here")

    monkeypatch.setattr(contribution, "recompute", spy)
    checks = SenderChecks(LONG, device="cpu", state=lambda: (0, hash_, tensors))
    runner = SimpleNamespace(
        group_id=evidence.group_id, codec=get_codec(LONG.training.compression),
        numel=run_layouts(LONG)[evidence.prefix],
    )  # fmt: skip

    async def three_rounds():  # three rounds' checks (each its own verification task), all drawing the liar
        tasks = []
        for _ in range(3):
            tasks.append(
                asyncio.create_task(checks._check_one(runner, evidence, StateCopy(0, hash_, tensors, {})))
            )
            await asyncio.sleep(0.1)
        await asyncio.gather(*tasks)

    asyncio.run(three_rounds())
    assert len(calls) == 2 and checks.skipped == 1, (calls, checks.skipped)
    (first_micro, first_budget, _, first_end), (_, second_budget, second_start, _) = calls
    assert second_start >= first_end, "one replay at a time"
    assert (
        first_micro == LONG.training.inner_steps and 0 < min(first_budget, second_budget) <= JUDGING_BUDGET_S
    )


# --- 4. a judgment outlives the accuser's call ---------------------------------------------------------

RPC = tiny_run(
    "diloco-redteam-rpc", sync="diloco", inner_steps=300, compression="int8", verify_probability=1.0,
    sender_check_probability=1.0,
)  # fmt: skip


@pytest.mark.timeout(120)
def test_a_window_replay_longer_than_the_accusers_call_still_bans_the_liar(tmp_path, monkeypatch):
    """Was HIGH (a proven lie banned nobody): the coordinator judged inside the accuser's ``Accuse`` call,
    whose deadline (10 s) a window's replay outlasts; gRPC cancelled the handler, nobody was banned, the
    accuser filed again, and the orphaned replay ran on beside the next judgment. Now the judgment runs
    in a task of its own that the call only waits for (the accuser waits ``JUDGING_BUDGET_S`` beyond its
    call's deadline): an accuser that stops waiting still gets the liar banned, and asking again while it
    is judged starts no second replay. Scaled down: a 300-step window of the tiny model against a client
    that waits 0.3 s."""
    import grpc

    import swarm.coordinator_client as coordinator_client
    from coordinator.service import CoordinatorService
    from coordinator.store import Store
    from protocols.errors import NetworkError
    from swarm.coordinator_client import CoordinatorClient
    from swarm.rpc import CHANNEL_OPTIONS

    keys = [SigningKey.generate() for _ in range(3)]
    liar = keys[1].peer_id
    tensors, honest = _live_window(RPC, liar, RPC.training.inner_steps)
    hash_ = state_hash(0, tensors)
    weight = float(RPC.training.inner_steps * RPC.training.micro_batch_size)  # the run's own window
    evidence, validator = _evidence(
        RPC, keys, -honest, sender=1, part=2, chunk=0, weight=weight, step=0, hash_=hash_
    )
    replays = []
    real_judge = WrongContributionEvidence.judge

    def judge(self, *args, **kwargs):
        replays.append(time.monotonic())
        return real_judge(self, *args, **kwargs)

    monkeypatch.setattr(WrongContributionEvidence, "judge", judge)
    monkeypatch.setattr(coordinator_client, "JUDGING_BUDGET_S", 0.0)  # an accuser that does not wait

    async def scenario():
        store = Store.open_sync(tmp_path / "coordinator.db", RPC.run_id)
        service = CoordinatorService(
            RPC, SigningKey.generate(), store, [], None,
            contribution_states=ServedStates(DecodedState(0, tensors, {}, hash_)),
        )  # fmt: skip
        server = grpc.aio.server(options=CHANNEL_OPTIONS)
        server.add_generic_rpc_handlers((service.generic_handler(),))
        address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        await server.start()
        try:
            async with CoordinatorClient(address) as client:
                for i, key in enumerate(keys):
                    await client.join(key, RPC.run_id, name=f"peer{i}", device="cpu")
            async with CoordinatorClient(address, timeout_s=0.3) as client:
                for _ in range(2):  # the second call finds the first still being judged
                    with pytest.raises(NetworkError, match="deadline_exceeded|in flight"):
                        await client.accuse(
                            keys[validator],
                            RPC.run_id,
                            accused=liar,
                            reason="lie",
                            evidence=evidence.to_bytes(),
                        )
            deadline = time.monotonic() + 90
            while service._judgments and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            return await store.ban_reason(liar), await store.ban_reason(keys[validator].peer_id)
        finally:
            await server.stop(grace=0.5)
            store.close()

    liar_banned, accuser_banned = asyncio.run(scenario())
    assert liar_banned is not None and "recomputed from its public batch seeds" in liar_banned, liar_banned
    assert accuser_banned is None
    assert len(replays) == 1, "asking again while the first is judged starts no second replay"
