"""Ways into the sender checks found by an attacker's read of their first version (8ee9416); each test
failed there (it was written to pass while the defect was present) and passes on its fix. In process,
with the real model, dataset, codec and signatures, reusing the patterns of ``tests/test_sendercheck.py``.
"""

from __future__ import annotations

import asyncio
import hashlib
from types import SimpleNamespace

import pytest
import torch
from helpers import ServedStates

import coordinator.contributions as contributions
from coordinator.accusations import run_layouts
from coordinator.contributions import judge_contribution
from lab.localswarm import tiny_run
from protocols.errors import ConfigError, ProtocolError
from protocols.keys import SigningKey
from swarm.averaging.compression import get_codec
from swarm.averaging.evidence import (
    BadAggregateEvidence,
    SignedInput,
    contribution_message,
    draw_seed,
    drawn_validator,
    layout_chunk_values,
    round_digest,
)
from swarm.averaging.groups import GroupEntryBody, make_entry
from swarm.config import RunConfig
from swarm.models import build_model
from swarm.training.filings import KEEP_S
from swarm.training.progress import step_misfit
from swarm.training.sendercheck import (
    SenderChecks,
    WrongContributionEvidence,
    chunk_slice,
    drawn_sender,
    recompute,
    whole_micro_batches,
)
from swarm.training.state import DecodedState, build_optimizer, state_hash, state_tensors

pytestmark = pytest.mark.timeout(60)

STEP = 3
KEYS = [SigningKey.generate() for _ in range(3)]
MEMBERS = tuple(k.peer_id for k in KEYS)


def _run(run_id: str, **training) -> RunConfig:
    """A tiny run that validates every part and replays a sender at every check."""
    return tiny_run(run_id, **{"verify_probability": 1.0, "sender_check_probability": 1.0, **training})


def _nonce(i: int) -> bytes:
    return hashlib.sha256(b"redteam-nonce" + bytes([i])).digest()


COMMITS = tuple(hashlib.sha256(_nonce(i)).digest() for i in range(3))
REVEALS = tuple(_nonce(i) for i in range(3))


def _state(run: RunConfig):
    model = build_model(run.model.name, run.model.config, seed=run.training.seed)
    tensors = state_tensors(model, build_optimizer(model, run.optimizer))
    return tensors, state_hash(STEP, tensors)


def _numel(run: RunConfig) -> int:
    return run_layouts(run)[run.run_id.replace(".", "_")]


def _group(run: RunConfig, *, validator: int, sender: int, part: int) -> bytes:
    """A group ID whose draw (from ``REVEALS``) names ``validator`` for chunk 0 of ``part`` and ``sender``."""
    prefix = run.run_id.replace(".", "_")
    for i in range(10_000):
        group_id = b"redteam-%d" % i
        seed = draw_seed(round_digest(prefix, group_id, MEMBERS, COMMITS), REVEALS)
        others = [j for j in range(3) if j != validator]
        if drawn_validator(seed, part, 3) == validator and drawn_sender(seed, part, 0, others, 1.0) == sender:
            return group_id
    raise AssertionError("no group ID draws that")


def _evidence(run, vector, *, weight=8.0, hash_="", part=1, group_id=None) -> WrongContributionEvidence:
    """Member 1's signed input to chunk 0 of ``part`` and its signed group entry naming (STEP, ``hash_``),
    in a round whose draw names member 0 to check it (unless ``group_id`` names another round)."""
    prefix = run.run_id.replace(".", "_")
    codec = get_codec(run.training.compression)
    group_id = group_id or _group(run, validator=0, sender=1, part=part)
    digest = round_digest(prefix, group_id, MEMBERS, COMMITS)
    lo, hi = chunk_slice(_numel(run), 3, part, 0, layout_chunk_values(3, codec.bytes_per_value))
    data = codec.encode_contribution(vector[lo:hi])
    signature = KEYS[1].sign(contribution_message(digest, part, 0, MEMBERS[1], weight, data))
    body = GroupEntryBody(
        schema_hash=bytes(32), weight=8.0, commit=COMMITS[1], extra={"step": STEP, "state_hash": hash_}
    )
    return WrongContributionEvidence(
        prefix=prefix, group_id=group_id, members=MEMBERS, commitments=COMMITS, part=part, chunk=0,
        item=SignedInput(1, data, signature, weight), entry=make_entry(KEYS[1], prefix, body), reveals=REVEALS,
    )  # fmt: skip


def _judge(run, evidence, state: DecodedState, accuser: str = MEMBERS[0]):
    return asyncio.run(
        judge_contribution(
            run,
            lambda: run_layouts(run),
            evidence.to_bytes(),
            MEMBERS[1],
            accuser,
            states=ServedStates(state),
            judging=asyncio.Lock(),
            timeout_s=30,
        )  # fmt: skip
    )


def test_a_run_with_dropout_or_fp16_cannot_check_senders_and_says_which_setting():
    """Before: the built-in GPT's ``dropout`` > 0 was accepted in a run that checks senders, and every
    replay drew other dropout masks than the sender's, so honest senders were accused and banned; and an
    fp16 run's coordinator could not replay at all on CPU (ConfigError), which banned the honest accuser
    and freed the liar. Now such a run is refused when its config is read, naming the setting and the way
    out; with sender checks off it is accepted."""
    data = tiny_run("dropout").model_dump(mode="json")
    data["model"]["config"]["dropout"] = 0.1
    with pytest.raises(ConfigError, match=r"model.config.dropout = 0.1.*sender_check_probability = 0"):
        RunConfig.parse(data)
    RunConfig.parse({**data, "training": {**data["training"], "sender_check_probability": 0.0}})
    fp16 = tiny_run("fp16").model_dump(mode="json")
    fp16["training"]["precision"] = "fp16"
    with pytest.raises(ConfigError, match=r"precision 'fp16'.*sender_check_probability = 0"):
        RunConfig.parse(fp16)


def test_a_replay_the_coordinator_cannot_run_bans_nobody(monkeypatch):
    """Before: any SwarmError of the coordinator's replay (fp16 on its CPU) banned the accuser. Now a
    replay that cannot run (here: past its time limit) bans nobody."""
    run = _run("replay-limit")
    tensors, hash_ = _state(run)
    honest = recompute(run, tensors, MEMBERS[1], STEP, 2, device="cpu")
    monkeypatch.setattr(contributions, "REPLAY_TIMEOUT_S", -1.0)
    found, guilty = _judge(run, _evidence(run, -honest, hash_=hash_), DecodedState(STEP, tensors, {}, hash_))
    assert guilty is None and "could not replay" in found


def test_a_member_that_signs_another_state_at_the_step_is_left_out_of_a_checked_round():
    """Before: a groupmate whose signed entry named this round's step was admitted whatever state hash it
    named, and the validator then skipped it ("joined at another state; not checked"): a liar signing a
    made-up hash was never replayed. Now, in a run that checks senders, a member at another state is
    excluded from the round (unblamed: either side may be the one apart; catch-up moves the minority)."""
    mine = {"step": STEP, "state_hash": "a" * 64}
    misfit = step_misfit({"step": STEP, "state_hash": "f" * 64}, mine, state=True)
    assert misfit is not None and not misfit.blamed and "another state" in misfit.reason
    assert step_misfit({"step": STEP, "state_hash": "a" * 64}, mine, state=True) is None
    # Pipeline stages and runs without sender checks keep comparing steps only.
    assert step_misfit({"step": STEP, "state_hash": "f" * 64}, mine) is None


def _round(run, lie: WrongContributionEvidence, seed):
    """Member 0's view of the round of ``lie`` (its runner, and the bad-aggregate outcome of the part it
    validated, holding member 1's input), with the shared draw ``seed`` (None: a reveal was withheld)."""
    runner = SimpleNamespace(
        group_id=lie.group_id, members=list(MEMBERS), peer_ids=list(MEMBERS), index=0, shared_seed=seed,
        revealed=None, reveals=dict(enumerate(REVEALS)), codec=get_codec(run.training.compression),
        numel=_numel(run), part_chunks=[[0, 1]] * 3, reducers=(), reduces=lambda part: False,
    )  # fmt: skip
    evidence = BadAggregateEvidence(
        prefix=run.run_id.replace(".", "_"), group_id=lie.group_id, members=MEMBERS, commitments=COMMITS,
        part=1, chunk=0, numel=1, inputs=(lie.item,), output=b"", output_signature=b"", entries=b"",
        signed_at_ms=0,
    )  # fmt: skip
    return runner, SimpleNamespace(evidence=evidence)


def _validator(run, tensors, hash_, lie: WrongContributionEvidence, *, seed):
    """Member 0 as a validator of a round holding member 1's ``item``: what it accuses and suspects."""
    accused, suspected = [], []

    async def accuse(peer, evidence, verdict):
        accused.append(peer)

    checks = SenderChecks(
        run, device="cpu", state=lambda: (STEP, hash_, tensors), accuse=accuse,
        suspect=lambda peer, reason: suspected.append(peer),
    )  # fmt: skip
    runner, outcome = _round(run, lie, seed)

    async def scenario():
        await checks.keep(runner, [b"", lie.entry, b""])
        await checks.check(runner, [outcome])
        await checks.filed()

    asyncio.run(scenario())
    return accused, suspected, checks


def test_a_liar_that_withholds_its_reveal_is_still_replayed_and_avoided(monkeypatch):
    """Before: without every member's reveal the round's seed was None and the sender checks returned at
    once, while aggregate validation fell back to local randomness; the liar was never replayed. Now the
    validator draws from its own randomness, replays, and avoids a liar in matchmaking; it files nothing,
    since the coordinator could not tell the liar was drawn."""
    run = _run("withheld")
    tensors, hash_ = _state(run)
    honest = recompute(run, tensors, MEMBERS[1], STEP, 2, device="cpu")
    lie = _evidence(run, -honest, hash_=hash_)
    # This member's own draw (os.urandom), fixed here to one that names member 1 rather than member 2.
    own = next(s for s in (bytes([i]) * 32 for i in range(256)) if drawn_sender(s, 1, 0, [1, 2], 1.0) == 1)
    monkeypatch.setattr("swarm.training.sendercheck.os.urandom", lambda n: own)
    accused, suspected, checks = _validator(run, tensors, hash_, lie, seed=None)
    assert checks.checked == 1 and checks.caught == 1
    assert suspected == [MEMBERS[1]] and accused == [] and checks.find(hash_) is None
    # With every reveal the same lie is accused, and the state it was replayed on is served by its hash.
    seed = draw_seed(lie.digest, REVEALS)
    accused, suspected, checks = _validator(run, tensors, hash_, lie, seed=seed)
    assert accused == [MEMBERS[1]] and suspected == [MEMBERS[1]]
    served = checks.find(hash_)
    assert served is not None and (served.step, served.state_hash) == (STEP, hash_)


def test_a_validator_serves_the_state_of_its_accusation_while_the_accusation_is_in_flight(monkeypatch):
    """Before: the state a lie was found on was served for ``KEEP_S`` (900 s) after filing, while the
    coordinator downloads it only when the accusation's recompute gets its turn, which Sybils of three
    addresses holding 420 s recomputes put past that: "did not serve the state; nobody banned". Now it is
    served for as long as the accusation is in flight, and ``KEEP_S`` after."""
    run = _run("in-flight")
    tensors, hash_ = _state(run)
    honest = recompute(run, tensors, MEMBERS[1], STEP, 2, device="cpu")
    lie = _evidence(run, -honest, hash_=hash_)
    clock = {"now": 1000.0}
    monkeypatch.setattr("swarm.training.filings.time.monotonic", lambda: clock["now"])
    served_while_waiting = []

    async def accuse(peer, evidence, verdict):  # the coordinator's queue: an hour before its turn
        clock["now"] += 3600.0
        served_while_waiting.append(checks.find(hash_))

    checks = SenderChecks(run, device="cpu", state=lambda: (STEP, hash_, tensors), accuse=accuse)
    runner, outcome = _round(run, lie, draw_seed(lie.digest, REVEALS))

    async def scenario():
        await checks.keep(runner, [b"", lie.entry, b""])
        await checks.check(runner, [outcome])
        await checks.filed()

    asyncio.run(scenario())
    assert checks.caught == 1 and served_while_waiting and served_while_waiting[0] is not None
    assert served_while_waiting[0].state_hash == hash_
    clock["now"] += KEEP_S - 1
    assert checks.find(hash_) is not None, "kept KEEP_S after the verdict"
    clock["now"] += 2
    assert checks.find(hash_) is None


def test_a_lie_caught_while_the_validators_accusation_waits_is_avoided_and_holds_no_state():
    """Before: each lie a validator caught was filed from its round's check, which waited for the answer
    holding that round's state copy; the coordinator takes one accusation of a peer at a time, so a liar
    caught every round while the first accusation queued held a state copy a round (a model and its
    optimizer each) for as long as the accusation waited. Now one accusation is filed at a time, in a task
    of its own; the same liar's lie caught meanwhile is avoided, and its copy dropped with its round (another
    liar's waits its turn, on a bounded number of states: ``tests/test_decoy_filings.py``)."""
    run = _run("one-at-a-time")
    tensors, hash_ = _state(run)
    honest = recompute(run, tensors, MEMBERS[1], STEP, 2, device="cpu")
    lie = _evidence(run, -honest, hash_=hash_)
    accused, suspected, answered = [], [], asyncio.Event()

    async def accuse(peer, evidence, verdict):  # the coordinator's queue: answered only at the end
        accused.append(peer)
        await answered.wait()

    checks = SenderChecks(
        run, device="cpu", state=lambda: (STEP, hash_, tensors), accuse=accuse,
        suspect=lambda peer, reason: suspected.append(peer),
    )  # fmt: skip
    runner, outcome = _round(run, lie, draw_seed(lie.digest, REVEALS))

    async def scenario():
        for _ in range(3):  # the same liar, caught in three rounds while the first accusation waits
            await checks.keep(runner, [b"", lie.entry, b""])
            await asyncio.wait_for(checks.check(runner, [outcome]), 60)
        assert accused == [MEMBERS[1]] and len(checks.accusations.kept) == 1 and not checks.pending
        answered.set()
        await checks.filed()

    asyncio.run(scenario())
    assert checks.caught == 3 and suspected == [MEMBERS[1]] * 3


@pytest.mark.parametrize("weight", [float("nan"), float("inf"), -8.0])
def test_a_signed_weight_that_is_no_sample_count_is_refused_by_name(weight):
    """Before: a NaN or infinite signed weight reached ``int()`` in the judge, whose ValueError or
    OverflowError escaped the accusation RPC. Now evidence holding it does not parse, and the sample rule
    names it."""
    run = _run("weights")
    tensors, hash_ = _state(run)
    evidence = _evidence(run, torch.zeros(_numel(run)), hash_=hash_, weight=weight)
    with pytest.raises(ProtocolError, match="weight"):
        WrongContributionEvidence.from_body(__import__("msgpack").unpackb(evidence.to_bytes()))
    with pytest.raises(ProtocolError, match="not a whole number"):
        whole_micro_batches(run, weight)


def test_a_lie_of_a_few_percent_in_a_chosen_direction_is_caught_in_fp32():
    """Before: any chunk within 0.05 (relative L2) of the replay passed, though a replay on the same kind
    of device agrees to about 1e-9: a sender could push every chunk 4.5% toward a target of its choice,
    every step, and an accuser was banned for it. fp32 runs now allow 0.01 (bf16 0.05)."""
    run = _run("tolerance")
    tensors, hash_ = _state(run)
    honest = recompute(run, tensors, MEMBERS[1], STEP, 2, device="cpu")
    codec = get_codec(run.training.compression)
    lo, hi = chunk_slice(_numel(run), 3, 1, 0, layout_chunk_values(3, codec.bytes_per_value))
    target = torch.ones_like(honest)
    push = target / target[lo:hi].norm() * honest[lo:hi].norm() * 0.045
    found, guilty = _judge(
        run, _evidence(run, honest + push, hash_=hash_), DecodedState(STEP, tensors, {}, hash_)
    )
    assert guilty == MEMBERS[1] and "beyond the tolerance 0.01" in found, found


def test_a_member_that_validates_no_part_copies_no_state():
    """Before: the state was copied before the round's reveals, so every member copied the whole model and
    optimizer every round, whatever the chance that it validates. Now the copy waits for the reveals
    (briefly) and is skipped when the draw gives this member no part to check."""
    run = _run("copies", verify_probability=1e-9)
    tensors, hash_ = _state(run)
    reads = []
    checks = SenderChecks(run, device="cpu", state=lambda: reads.append(1) or (STEP, hash_, tensors))

    async def scenario():
        revealed = asyncio.get_running_loop().create_future()
        revealed.set_result(None)
        for i in range(5):
            runner = SimpleNamespace(
                group_id=bytes([i]), members=list(MEMBERS), peer_ids=list(MEMBERS), index=0, revealed=revealed,
                shared_seed=hashlib.sha256(bytes([i])).digest(), part_chunks=[[0, 1]] * 3, reducers=(), reduces=lambda part: False,
            )  # fmt: skip
            await checks.keep(runner, [b"", b"", b""])

    asyncio.run(scenario())
    assert reads == [] and not checks.pending


def test_evidence_of_a_sender_or_chunk_the_round_did_not_draw_convicts_its_accuser():
    """Before: the coordinator did not check the draw, so a reducer holding every sender's inputs to its
    part could pick the sender and chunk that looked worst (any gap between device kinds becomes a choice).
    Now the evidence carries the round's reveals and must be the chunk the round drew the accuser to check,
    and the sender it drew to replay."""
    run = _run("draws")
    tensors, hash_ = _state(run)
    honest = recompute(run, tensors, MEMBERS[1], STEP, 2, device="cpu")
    state = DecodedState(STEP, tensors, {}, hash_)
    drawn = _evidence(run, -honest, hash_=hash_)
    assert _judge(run, drawn, state)[1] == MEMBERS[1], "the drawn liar is convicted"
    other = _group(run, validator=0, sender=2, part=1)  # a round that drew member 2, not 1
    found, guilty = _judge(run, _evidence(run, -honest, hash_=hash_, group_id=other), state)
    assert guilty == MEMBERS[0] and "did not draw" in found
    found, guilty = _judge(run, drawn, state, accuser=MEMBERS[2])  # not the part's validator
    assert guilty == MEMBERS[2] and "did not draw the accuser" in found
    bare = WrongContributionEvidence(**{**drawn.__dict__, "reveals": ()})
    found, guilty = _judge(run, bare, state)
    assert guilty == MEMBERS[0] and "reveal" in found
