"""Red-team demonstrations against the sender checks (commit 8ee9416).

Each test PASSES while the defect it names is present: it asserts the bad behaviour (an honest peer
convicted, a liar not checked, a judge that crashes). In process, with the real model, dataset, codec
and signatures, reusing the patterns of ``tests/test_sendercheck.py``.
"""

from __future__ import annotations

import asyncio
import hashlib
from types import SimpleNamespace

import pytest
import torch

from coordinator.accusations import run_layouts
from coordinator.contributions import ContributionStates, judge_contribution
from lab.localswarm import tiny_run
from protocols.errors import SwarmError
from protocols.keys import SigningKey
from swarm.averaging.compression import get_codec
from swarm.averaging.evidence import (
    BadAggregateEvidence,
    SignedInput,
    contribution_message,
    layout_chunk_values,
    round_digest,
)
from swarm.averaging.groups import GroupEntryBody, make_entry
from swarm.config import RunConfig
from swarm.models import build_model
from swarm.training.progress import step_misfit
from swarm.training.sendercheck import (
    SenderChecks,
    WrongContributionEvidence,
    chunk_slice,
    drawn_sender,
    recompute,
)
from swarm.training.state import DecodedState, build_optimizer, state_hash, state_tensors

STEP = 3
GROUP = b"group-redteam"


def _run(run_id: str, *, model: dict | None = None, **training) -> RunConfig:
    run = tiny_run(run_id, **training)
    if model is None:
        return run
    data = run.model_dump(mode="json")
    data["model"]["config"].update(model)
    return RunConfig.model_validate(data)


def _nonce(i: int) -> bytes:
    return hashlib.sha256(b"redteam-nonce" + bytes([i])).digest()


def _state(run: RunConfig):
    model = build_model(run.model.name, run.model.config, seed=run.training.seed)
    tensors = state_tensors(model, build_optimizer(model, run.optimizer))
    return tensors, state_hash(STEP, tensors)


def _numel(run: RunConfig) -> int:
    return run_layouts(run)[run.run_id.replace(".", "_")]


def _round(run: RunConfig, keys, vector, *, sender=1, weight=8.0, hash_="", part=0, chunk=0):
    """Member ``sender``'s signed input to ``chunk`` of ``part`` (``vector`` encoded), its signed group
    entry naming (STEP, ``hash_``), and the round's fields."""
    prefix = run.run_id.replace(".", "_")
    codec = get_codec(run.training.compression)
    members = tuple(k.peer_id for k in keys)
    commits = tuple(hashlib.sha256(_nonce(i)).digest() for i in range(len(keys)))
    digest = round_digest(prefix, GROUP, members, commits)
    values = layout_chunk_values(len(keys), codec.bytes_per_value)
    lo, hi = chunk_slice(_numel(run), len(keys), part, chunk, values)
    data = codec.encode_contribution(vector[lo:hi])
    signature = keys[sender].sign(contribution_message(digest, part, chunk, members[sender], weight, data))
    body = GroupEntryBody(
        schema_hash=bytes(32), weight=8.0, commit=commits[sender], extra={"step": STEP, "state_hash": hash_}
    )
    entry = make_entry(keys[sender], prefix, body)
    fields = dict(prefix=prefix, group_id=GROUP, members=members, commitments=commits, part=part, chunk=chunk)
    return fields, SignedInput(sender, data, signature, weight), entry


def _evidence(run, keys, vector, **kw) -> WrongContributionEvidence:
    fields, item, entry = _round(run, keys, vector, **kw)
    return WrongContributionEvidence(**fields, item=item, entry=entry)


class _Served(ContributionStates):
    """The accuser serves the state by its hash (as an honest validator that kept it does)."""

    def __init__(self, state: DecodedState):
        self.state = state

    async def fetch(self, holder, step, state_hash):
        return self.state if self.state.state_hash == state_hash else None


def _judge(run, evidence, keys, state: DecodedState):
    return asyncio.run(
        judge_contribution(
            run, lambda: run_layouts(run), evidence.to_bytes(), keys[1].peer_id, keys[0].peer_id,
            states=_Served(state), judging=asyncio.Lock(), timeout_s=30,
        )  # fmt: skip
    )


@pytest.mark.timeout(60)
def test_dropout_in_the_builtin_gpt_gets_every_honest_sender_banned():
    """The built-in GPT accepts ``dropout`` > 0 (swarm/models/gpt.py) and nothing refuses it in a run that
    checks senders, but ``honest_gradients`` replays in train mode from whatever torch RNG state the judge
    happens to have. The honest sender's gradient (its own dropout masks) is never what the validator or the
    coordinator replays, so an honest validator accuses an honest sender and the coordinator bans it."""
    run = _run("redteam-dropout", model={"dropout": 0.1})
    keys = [SigningKey.generate() for _ in range(3)]
    tensors, hash_ = _state(run)
    torch.manual_seed(1234)  # the sender's own process RNG
    honest = recompute(run, tensors, keys[1].peer_id, STEP, 8.0, device="cpu")  # exactly its loop's gradient
    evidence = _evidence(run, keys, honest, hash_=hash_)
    # The validator's own replay (another RNG state) already disagrees beyond the tolerance ...
    verdict = evidence.judge(run, tensors, get_codec(run.training.compression), vector_numel=_numel(run), device="cpu")
    assert verdict is not None and "relative L2" in verdict
    # ... and the coordinator bans the honest sender.
    found, guilty = _judge(run, evidence, keys, DecodedState(STEP, tensors, {}, hash_))
    assert guilty == keys[1].peer_id, found
    assert "public batch seeds" in found


@pytest.mark.timeout(60)
def test_fp16_run_bans_the_honest_validator_and_frees_the_liar():
    """``precision = "fp16"`` is a valid every-step run with sender checks on (GPU peers), but the
    coordinator recomputes on ``device="cpu"`` (coordinator/contributions.py), where ``check_precision``
    raises ConfigError, a SwarmError: ``judge_contribution`` reads that as "the evidence does not hold"
    and bans the accuser. A validator that caught a flipped gradient is banned; the liar stays."""
    run = _run("redteam-fp16", precision="fp16")
    keys = [SigningKey.generate() for _ in range(3)]
    tensors, hash_ = _state(run)
    fp32 = _run("redteam-fp16", precision="fp32")
    honest = recompute(fp32, tensors, keys[1].peer_id, STEP, 8.0, device="cpu")
    lie = _evidence(run, keys, -honest, hash_=hash_)  # an obvious lie: the flipped gradient
    found, guilty = _judge(run, lie, keys, DecodedState(STEP, tensors, {}, hash_))
    assert guilty == keys[0].peer_id, found  # the accuser, not the liar
    assert "does not hold" in found and "fp16" in found


def _validator(run, keys, tensors, hash_, accused_entry: bytes, item: SignedInput, seed: bytes | None):
    """Member 0 as a validator whose round holds member 1's ``item`` and signed entry; returns the
    accusations it files and its SenderChecks."""
    accused: list = []

    async def accuse(peer, evidence, verdict):
        accused.append((peer, verdict))

    checks = SenderChecks(run, device="cpu", state=lambda: (STEP, hash_, tensors), accuse=accuse)
    prefix = run.run_id.replace(".", "_")
    members = tuple(k.peer_id for k in keys)
    commits = tuple(hashlib.sha256(_nonce(i)).digest() for i in range(len(keys)))
    runner = SimpleNamespace(
        group_id=GROUP, members=list(members), index=0, shared_seed=None,
        codec=get_codec(run.training.compression), numel=_numel(run),
    )  # fmt: skip
    entries = [b"", accused_entry, b""]
    checks.keep(runner, entries)  # run() returns before the reveals: the copy is taken with no seed yet
    runner.shared_seed = seed
    evidence = BadAggregateEvidence(
        prefix=prefix, group_id=GROUP, members=members, commitments=commits, part=0, chunk=0,
        numel=item.data.__len__() // 2, inputs=(item,), output=b"", output_signature=b"", entries=b"",
        signed_at_ms=0,
    )  # fmt: skip
    asyncio.run(checks.check(runner, [SimpleNamespace(evidence=evidence)]))
    return accused, checks


def _seed_drawing(sender: int) -> bytes:
    for i in range(1000):
        seed = hashlib.sha256(b"redteam-seed" + i.to_bytes(4, "big")).digest()
        if drawn_sender(seed, 0, 0, [sender], 1.0) == sender:
            return seed
    raise AssertionError("no seed draws the sender")


@pytest.mark.timeout(60)
def test_a_liar_that_signs_a_wrong_state_hash_is_never_checked():
    """``step_misfit`` (swarm/training/progress.py) admits a groupmate whose entry has this round's step
    whatever ``state_hash`` it names, and ``_group_usable`` checks only steps, so the round is applied with
    it. But ``SenderChecks._check_one`` skips ("joined at another state; not checked") any sender whose
    signed (step, state_hash) differs from the validator's copy: a liar that signs a made-up hash sends a
    flipped gradient that no validator ever recomputes (and no honest peer could serve that state)."""
    run = _run("redteam-hash", verify_probability=1.0, sender_check_probability=1.0)
    keys = [SigningKey.generate() for _ in range(3)]
    tensors, hash_ = _state(run)
    honest = recompute(run, tensors, keys[1].peer_id, STEP, 8.0, device="cpu")
    seed = _seed_drawing(1)
    # Control: the same lie under its true hash is caught and accused.
    _, item, entry = _round(run, keys, -honest, hash_=hash_)
    accused, checks = _validator(run, keys, tensors, hash_, entry, item, seed)
    assert [p for p, _ in accused] == [keys[1].peer_id] and checks.checked == 1
    # The liar names another hash in its entry: the round still admits it ...
    fake = "f" * 64
    assert step_misfit({"step": STEP, "state_hash": fake}, {"step": STEP, "state_hash": hash_}) is None
    _, item, entry = _round(run, keys, -honest, hash_=fake)
    accused, checks = _validator(run, keys, tensors, hash_, entry, item, seed)
    # ... and the validator skips it: no check, no accusation.
    assert accused == [] and checks.checked == 0 and checks.caught == 0


@pytest.mark.timeout(60)
def test_a_liar_that_withholds_its_reveal_disables_every_sender_check_of_the_round():
    """``ButterflyAllReduce.run`` returns the round complete before the reveal phase, so the round is
    applied even if a member never reveals its nonce; then ``shared_seed`` is None and
    ``SenderChecks.check`` returns at once (sendercheck.py: ``if copy is None or seed is None``). Aggregate
    validation falls back to local randomness, the sender checks do not: the liar is never recomputed."""
    run = _run("redteam-reveal", verify_probability=1.0, sender_check_probability=1.0)
    keys = [SigningKey.generate() for _ in range(3)]
    tensors, hash_ = _state(run)
    honest = recompute(run, tensors, keys[1].peer_id, STEP, 8.0, device="cpu")
    _, item, entry = _round(run, keys, -honest, hash_=hash_)
    accused, checks = _validator(run, keys, tensors, hash_, entry, item, _seed_drawing(1))
    assert accused and checks.checked == 1  # control: with every reveal the flipped gradient is caught
    accused, checks = _validator(run, keys, tensors, hash_, entry, item, None)  # a reveal withheld
    assert accused == [] and checks.checked == 0
    # The copy was still taken (keep() runs before the reveals, so its draw gate never applies) and is
    # dropped unchecked.
    assert not checks.pending


@pytest.mark.timeout(60)
@pytest.mark.parametrize("weight", [float("nan"), float("inf")])
def test_a_non_finite_signed_weight_crashes_the_coordinator_judge(weight):
    """``signed_input`` takes ``float(weight)`` unchecked and ``whole_micro_batches`` calls
    ``int(samples)``, which raises ValueError (NaN) or OverflowError (inf): not a SwarmError, so it escapes
    ``judge_contribution`` (its ``except SwarmError`` around ``evidence.judge``) and the accusation RPC
    fails instead of judging. Two colluders (one signs, the other files and serves the public state) do
    it at will: nobody is banned, and the coordinator's handler raises."""
    run = _run("redteam-weight")
    keys = [SigningKey.generate() for _ in range(3)]
    tensors, hash_ = _state(run)
    honest = recompute(run, tensors, keys[1].peer_id, STEP, 8.0, device="cpu")
    evidence = _evidence(run, keys, -honest, hash_=hash_, weight=weight)
    assert evidence.facts() == (STEP, hash_)  # the evidence holds up to the recompute
    with pytest.raises((ValueError, OverflowError)) as raised:
        _judge(run, evidence, keys, DecodedState(STEP, tensors, {}, hash_))
    assert not isinstance(raised.value, SwarmError)
