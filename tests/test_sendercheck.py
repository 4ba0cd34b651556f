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

from coordinator.accusations import run_layouts
from coordinator.contributions import ContributionStates, judge_contribution
from lab.localswarm import tiny_run
from protocols.errors import ConfigError, ProtocolError, SwarmError
from protocols.keys import SigningKey
from swarm.averaging.compression import get_codec
from swarm.averaging.evidence import SignedInput, contribution_message, layout_chunk_values, round_digest
from swarm.averaging.groups import GroupEntryBody, make_entry
from swarm.models import build_model
from swarm.training.collaboration import EveryStep
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


def drawn_group(members: tuple[str, ...], commits: tuple[bytes, ...], part: int) -> bytes:
    """A group ID whose round (with the ``_nonce`` reveals) draws member 0 to check chunk 0 of ``part``
    and member 1 as the sender to replay."""
    from swarm.averaging.evidence import draw_seed, drawn_validator

    for i in range(10_000):
        group_id = b"group-%d" % i
        seed = draw_seed(
            round_digest(PREFIX, group_id, members, commits), [_nonce(j) for j in range(len(members))]
        )
        if drawn_validator(seed, part, len(members)) == 0 and drawn_sender(seed, part, 0, [1, 2], 1.0) == 1:
            return group_id
    raise AssertionError("no group ID draws that")


def _evidence(keys, vector, *, weight=8.0, step=STEP, hash_=None, entry_key=None, commit=None, part=1):
    """Member 1's signed input to chunk 0 of ``part`` (``vector`` encoded) and its signed group entry, in
    a round that drew member 0 to check it; the round's reveals included."""
    members = tuple(k.peer_id for k in keys)
    commits = tuple(hashlib.sha256(_nonce(i)).digest() for i in range(len(keys)))
    group_id = drawn_group(members, commits, part)
    digest = round_digest(PREFIX, group_id, members, commits)
    numel = sum(p.numel() for p in build_model(RUN.model.name, RUN.model.config).parameters())
    lo, hi = chunk_slice(numel, len(keys), part, 0, layout_chunk_values(len(keys), CODEC.bytes_per_value))
    data = CODEC.encode_contribution(vector[lo:hi])
    signature = keys[1].sign(contribution_message(digest, part, 0, members[1], weight, data))
    body = GroupEntryBody(
        schema_hash=bytes(32), weight=min(weight, 1e6), commit=commit or commits[1],
        extra={"step": step, "state_hash": hash_ or ""},
    )  # fmt: skip
    entry = make_entry(entry_key or keys[1], PREFIX, body)
    return WrongContributionEvidence(
        prefix=PREFIX, group_id=group_id, members=members, commitments=commits, part=part, chunk=0,
        item=SignedInput(1, data, signature, weight), entry=entry,
        reveals=tuple(_nonce(i) for i in range(len(keys))),
    )  # fmt: skip


def _judge(evidence: WrongContributionEvidence, tensors) -> str | None:
    numel = run_layouts(RUN)[PREFIX]
    return evidence.judge(RUN, tensors, CODEC, vector_numel=numel, device="cpu")


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


class _Served(ContributionStates):
    def __init__(self, state: DecodedState | None):
        self.state, self.asked = state, []

    async def fetch(self, holder, step, state_hash):
        self.asked.append((holder, step, state_hash))
        return self.state if self.state is not None and self.state.state_hash == state_hash else None


def test_the_coordinator_bans_the_liar_or_the_false_accuser_and_nobody_without_the_state(world):
    keys, tensors, hash_, honest = world
    accuser, accused = keys[0].peer_id, keys[1].peer_id
    served = _Served(DecodedState(STEP, tensors, {}, hash_))

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
    found, guilty = judge(_evidence(keys, -honest, hash_=hash_), _Served(None))
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
