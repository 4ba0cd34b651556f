"""Sender checks: a groupmate's contribution recomputed from its public batch seeds, and the evidence of a lie.

In process, with the real model, dataset, codec and signatures: an honest contribution is recomputed
bit for bit and a lie (flipped, scaled, other labels, a sample count no loop signs) is not; evidence
whose signatures or round binding fail convicts its accuser; the coordinator's judge bans the liar,
the false accuser, or nobody when the state is not served. The swarm's own run is in
``tests/test_byzantine.py``.
"""

from __future__ import annotations

import asyncio
import hashlib

import pytest
import torch
from helpers import ServedStates

from coordinator.accusations import run_layouts
from coordinator.contributions import judge_contribution
from lab.localswarm import tiny_run
from protocols.errors import ConfigError, ProtocolError, SwarmError
from protocols.keys import SigningKey
from swarm.averaging.allreduce import RoundResult
from swarm.averaging.compression import get_codec
from swarm.averaging.evidence import SignedInput, contribution_message, layout_chunk_values, round_digest
from swarm.averaging.groups import GroupEntryBody, make_entry
from swarm.config import resets_inner_state, sender_checks_on, window_replay_obstacle
from swarm.data import derive_seed
from swarm.models import build_model
from swarm.training.collaboration import EveryStep
from swarm.training.diloco import DilocoSync
from swarm.training.microbatch import MicroBatchRunner
from swarm.training.replay import public_dataset
from swarm.training.sendercheck import (
    WrongContributionEvidence,
    chunk_slice,
    compare,
    drawn_sender,
    recompute,
)
from swarm.training.state import DecodedState, build_optimizer, state_hash, state_tensors

# Every part validated and a sender drawn at every check, so a round's draw is easy to arrange.
RUN = tiny_run("sender-checks", verify_probability=1.0, sender_check_probability=1.0)
PREFIX = RUN.run_id.replace(".", "_")
CODEC = get_codec(RUN.training.compression)
STEP = 3


def _nonce(i: int) -> bytes:
    return hashlib.sha256(b"nonce" + bytes([i])).digest()


@pytest.fixture(scope="module")
def world():
    """Three members' keys, the state at ``STEP`` and member 1's honest contribution from it."""
    torch.manual_seed(0)
    keys = [SigningKey.generate() for _ in range(3)]
    model = build_model(RUN.model.name, RUN.model.config, seed=RUN.training.seed)
    tensors = state_tensors(model, build_optimizer(model, RUN.optimizer))
    honest = recompute(RUN, tensors, keys[1].peer_id, STEP, 2, device="cpu")  # 2 micro-batches of 4
    return keys, tensors, state_hash(STEP, tensors), honest


def drawn_group(
    members: tuple[str, ...], commits: tuple[bytes, ...], part: int, prefix: str = PREFIX
) -> bytes:
    """A group ID whose round (with the ``_nonce`` reveals) draws member 0 to check chunk 0 of ``part``
    and member 1 as the sender to replay."""
    from swarm.averaging.evidence import draw_seed, drawn_validator

    for i in range(10_000):
        group_id = b"group-%d" % i
        seed = draw_seed(
            round_digest(prefix, group_id, members, commits), [_nonce(j) for j in range(len(members))]
        )
        if drawn_validator(seed, part, len(members)) == 0 and drawn_sender(seed, part, 0, [1, 2], 1.0) == 1:
            return group_id
    raise AssertionError("no group ID draws that")


def _evidence(
    keys, vector, *, weight=8.0, step=STEP, hash_=None, entry_key=None, commit=None, part=1, run=RUN
):
    """Member 1's signed input to chunk 0 of ``part`` (``vector`` encoded) and its signed group entry, in
    a round of ``run`` that drew member 0 to check it; the round's reveals included."""
    prefix, codec = run.run_id.replace(".", "_"), get_codec(run.training.compression)
    members = tuple(k.peer_id for k in keys)
    commits = tuple(hashlib.sha256(_nonce(i)).digest() for i in range(len(keys)))
    group_id = drawn_group(members, commits, part, prefix)
    digest = round_digest(prefix, group_id, members, commits)
    numel = sum(p.numel() for p in build_model(run.model.name, run.model.config).parameters())
    lo, hi = chunk_slice(numel, len(keys), part, 0, layout_chunk_values(len(keys), codec.bytes_per_value))
    data = codec.encode_contribution(vector[lo:hi])
    signature = keys[1].sign(contribution_message(digest, part, 0, members[1], weight, data))
    body = GroupEntryBody(
        schema_hash=bytes(32), weight=min(weight, 1e6), commit=commit or commits[1],
        extra={"step": step, "state_hash": hash_ or ""},
    )  # fmt: skip
    entry = make_entry(entry_key or keys[1], prefix, body)
    return WrongContributionEvidence(
        prefix=prefix, group_id=group_id, members=members, commitments=commits, part=part, chunk=0,
        item=SignedInput(1, data, signature, weight), entry=entry,
        reveals=tuple(_nonce(i) for i in range(len(keys))),
    )  # fmt: skip


def _judge(evidence: WrongContributionEvidence, tensors, run=RUN) -> str | None:
    numel = run_layouts(run)[evidence.prefix]
    codec = get_codec(run.training.compression)
    return evidence.judge(run, tensors, codec, vector_numel=numel, device="cpu")


def test_an_honest_contribution_is_recomputed_bit_for_bit_and_lies_are_not(world):
    keys, tensors, hash_, honest = world
    honest_lie = _evidence(keys, honest, hash_=hash_)
    assert honest_lie.facts() == (STEP, hash_)
    assert _judge(honest_lie, tensors) is None
    assert _judge(_evidence(keys, honest, hash_=hash_, part=2), tensors) is None
    # Rounding of another device kind stays within the tolerance.
    noise = honest + 1e-4 * honest.abs().mean() * torch.randn(
        honest.shape, generator=torch.Generator().manual_seed(1)
    )
    assert _judge(_evidence(keys, noise, hash_=hash_), tensors) is None
    for name, lie in {"flipped": -honest, "scaled": 1.5 * honest, "shrunk": 0.5 * honest}.items():
        verdict = _judge(_evidence(keys, lie, hash_=hash_), tensors)
        assert verdict is not None and "recomputed from its public batch seeds" in verdict, name
    # The gradient of another peer's batches (or of other labels) is another vector.
    other = recompute(RUN, tensors, keys[2].peer_id, STEP, 2, device="cpu")
    assert "relative L2" in _judge(_evidence(keys, other, hash_=hash_), tensors)
    # The same batches one step earlier: a stale gradient.
    stale = recompute(RUN, tensors, keys[1].peer_id, STEP - 1, 2, device="cpu")
    assert _judge(_evidence(keys, stale, hash_=hash_), tensors) is not None
    # A claim of samples the built-in loop never signs.
    assert "not a whole number" in _judge(_evidence(keys, honest, hash_=hash_, weight=6.0), tensors)
    assert "target batch" in _judge(_evidence(keys, honest, hash_=hash_, weight=64.0), tensors)


def test_evidence_whose_signatures_or_round_binding_fail_does_not_hold(world):
    keys, _, hash_, honest = world
    with pytest.raises(SwarmError, match="signed by"):
        _evidence(keys, honest, hash_=hash_, entry_key=keys[2]).facts()
    with pytest.raises(ProtocolError, match="not the one it joined this round with"):
        _evidence(keys, honest, hash_=hash_, commit=hashlib.sha256(b"another round").digest()).facts()
    with pytest.raises(ProtocolError, match="64 hex digits"):
        _evidence(keys, honest, hash_="ab").facts()
    forged = _evidence(keys, honest, hash_=hash_)
    altered = SignedInput(1, forged.item.data[:-1] + b"\x00", forged.item.signature, forged.item.weight)
    with pytest.raises(SwarmError):
        WrongContributionEvidence(**{**forged.__dict__, "item": altered}).facts()
    # Evidence round-trips through its wire form, and a malformed one names what is wrong.
    again = WrongContributionEvidence.from_body(__import__("msgpack").unpackb(forged.to_bytes()))
    assert again == forged
    with pytest.raises(ProtocolError, match="malformed"):
        WrongContributionEvidence.from_body({"kind": "wrong_contribution", "members": ["a", "b"], "part": 0})


def test_the_coordinator_bans_the_liar_or_the_false_accuser_and_nobody_without_the_state(world):
    keys, tensors, hash_, honest = world
    accuser, accused = keys[0].peer_id, keys[1].peer_id
    served = ServedStates(DecodedState(STEP, tensors, {}, hash_))

    def judge(evidence, states, run=RUN):
        return asyncio.run(
            judge_contribution(
                run,
                lambda: run_layouts(run),
                evidence.to_bytes(),
                accused,
                accuser,
                states=states,
                judging=asyncio.Lock(),
                timeout_s=30,
            )  # fmt: skip
        )

    found, guilty = judge(_evidence(keys, -honest, hash_=hash_), served)
    assert guilty == accused and "public batch seeds" in found
    assert served.asked == [(accuser, STEP, hash_)], "the state is downloaded from the accuser, by its hash"
    found, guilty = judge(_evidence(keys, honest, hash_=hash_), served)
    assert guilty == accuser and "what its public batch seeds give" in found
    found, guilty = judge(_evidence(keys, -honest, hash_=hash_), ServedStates(None))
    assert guilty is None and "did not serve the state" in found
    found, guilty = judge(_evidence(keys, -honest, hash_=hash_, entry_key=keys[2]), served)
    assert guilty == accuser and "does not hold" in found
    off = RUN.model_copy(deep=True)
    off.training.sender_check_probability = 0.0
    found, guilty = judge(_evidence(keys, -honest, hash_=hash_), served, run=off)
    assert guilty == accuser and "does not recompute senders" in found


def test_the_round_draws_one_sender_per_checked_chunk_without_the_validator():
    seed = hashlib.sha256(b"round").digest()
    draws = [drawn_sender(seed + bytes([i]), 0, 0, [0, 2, 3], 1.0) for i in range(200)]
    assert set(draws) == {0, 2, 3}, "every sender can be drawn"
    assert drawn_sender(seed, 0, 0, [0, 2, 3], 1.0) == drawn_sender(seed, 0, 0, [3, 2, 0], 1.0)
    assert drawn_sender(seed, 0, 0, [0, 2, 3], 0.0) is None and drawn_sender(seed, 0, 0, [], 1.0) is None
    share = sum(drawn_sender(seed + bytes([i]), 1, 2, [1], 0.3) is not None for i in range(256)) / 256
    assert 0.2 < share < 0.4


def test_compare_accepts_the_same_bytes_and_measures_the_rest_relative_to_the_larger():
    values = torch.linspace(-1, 1, 4096)
    assert compare(CODEC.encode_contribution(values), values, CODEC, 0.0, sender="x") is None
    assert compare(CODEC.encode_contribution(torch.zeros(4096)), values, CODEC, 0.5, sender="x") is not None
    assert "does not decode" in compare(b"\x00", values, CODEC, 0.5, sender="x")


def test_a_loop_on_its_own_data_is_refused_a_run_that_checks_senders():
    with pytest.raises(ConfigError, match="sender_check_probability"):
        EveryStep().check(tiny_run("checks"))
    EveryStep().check(tiny_run("own-data", sender_check_probability=0.0))


# --- diloco: a window of inner steps with a fresh inner optimizer, replayed from the synced state ------

DILOCO = tiny_run(
    "sender-checks-diloco", sync="diloco", inner_steps=3, compression="int8", verify_probability=1.0,
    sender_check_probability=1.0,
)  # fmt: skip


def _live_windows(run, peer_id: str, windows: int):
    """A peer's DiLoCo strategy driven as the built-in loop drives it, for ``windows`` outer steps (each
    round's result stands in as the peer's own pseudo-gradient): its synced state at the last outer step
    and the pseudo-gradient it sends there."""
    model = build_model(run.model.name, run.model.config, seed=run.training.seed)
    strategy = DilocoSync(model, build_optimizer(model, run.optimizer), run)
    runner = MicroBatchRunner(model)
    dataset = public_dataset(run.dataset.name, run.dataset.config)
    batch, seq_len = run.training.micro_batch_size, int(run.model.config["seq_len"])
    for step in range(windows):
        for micro in range(run.training.inner_steps):
            inputs, targets = dataset.sample_batch(
                derive_seed(run.run_id, peer_id, step, micro), batch, seq_len
            )
            runner.run(inputs, targets)
            strategy.absorb(batch, step=step, mean=False)
        sent = strategy.contribution(batch * run.training.inner_steps)
        if step < windows - 1:
            strategy.apply(RoundResult(sent.clone(), True), step)
    return state_tensors(strategy.synced_model, strategy.synced_optimizer), sent


def test_a_diloco_window_with_a_fresh_inner_optimizer_is_replayed_bit_for_bit_and_a_lie_is_caught():
    keys = [SigningKey.generate() for _ in range(3)]
    peer = keys[1].peer_id
    assert sender_checks_on(DILOCO) and resets_inner_state(DILOCO.training)
    # The third window: the inner optimizer has been through two windows before it, and starts afresh.
    tensors, sent = _live_windows(DILOCO, peer, 3)
    replayed = recompute(DILOCO, tensors, peer, 2, DILOCO.training.inner_steps, device="cpu")
    assert torch.equal(replayed, sent), "a validator replays the window to the last bit"
    hash_, weight = (
        state_hash(2, tensors),
        float(DILOCO.training.inner_steps * DILOCO.training.micro_batch_size),
    )

    def judge(vector, **fields):
        fields = {"weight": weight, "step": 2, "hash_": hash_, "run": DILOCO, **fields}
        return _judge(_evidence(keys, vector, **fields), tensors, run=DILOCO)

    assert judge(sent) is None
    verdict = judge(-sent)
    assert (
        verdict is not None and "window's pseudo-gradient recomputed from its public batch seeds" in verdict
    )
    assert judge(2.0 * sent) is not None
    assert "a window ends after 3 inner steps" in judge(sent, weight=4.0 * DILOCO.training.micro_batch_size)
    # The window one outer step earlier (stale) is another vector.
    _, stale = _live_windows(DILOCO, peer, 2)
    assert judge(stale) is not None


def test_diloco_windows_are_checked_only_where_public_facts_make_them():
    """The inner optimizer's carried state, topk's error feedback and outer_overlap's windows are each
    peer's own: such a run has no sender checks (the peer logs why), and its evidence is refused."""
    keep = tiny_run("keep", sync="diloco", inner_steps=3, inner_optimizer_state="keep")
    assert not sender_checks_on(keep)
    assert "inner_optimizer_state 'keep'" in window_replay_obstacle(keep.training)
    topk = tiny_run("topk", sync="diloco", inner_steps=3, compression="topk")
    assert not sender_checks_on(topk) and not resets_inner_state(topk.training)
    assert "error feedback" in window_replay_obstacle(topk.training)
    overlap = tiny_run("overlap", sync="diloco", inner_steps=3, outer_overlap=True)
    assert not sender_checks_on(overlap) and "outer_overlap" in window_replay_obstacle(overlap.training)
    assert not resets_inner_state(tiny_run("off", sync="diloco", sender_check_probability=0.0).training)
    with pytest.raises(ProtocolError, match="cannot be replayed"):
        recompute(keep, {}, "peer", 0, 1, device="cpu")
    # With the carried state, the window that the same seeds give differs from a fresh optimizer's.
    peer = SigningKey.generate().peer_id
    fresh_run = keep.model_copy(
        update={"training": keep.training.model_copy(update={"inner_optimizer_state": "reset"})}
    )
    _, carried = _live_windows(keep, peer, 2)
    _, fresh = _live_windows(fresh_run, peer, 2)
    assert not torch.equal(carried, fresh)
