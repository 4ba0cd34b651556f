"""Contribution scores pick senders to replay beside the draw, and the coordinator checks that pick again.

In process, with the real model, dataset, codec and signatures: honest gradients of one state on public
batches are never flagged, while a reversed, a random and a made-up-weight contribution are; a validator
that replays a flagged sender the draw did not name is judged as if drawn (the liar banned), and one that
files against an undrawn sender who does not stand out, or that leaves an input out of the chunk, is the
false accuser. The swarm's own runs are in docs/robustness.md ("Rounds to a ban").
"""

from __future__ import annotations

import asyncio
import hashlib

import msgpack
import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from helpers import ServedStates, signed_entries

from coordinator.accusations import run_layouts
from coordinator.contributions import judge_contribution
from lab.localswarm import tiny_run
from protocols.errors import ProtocolError
from protocols.keys import SigningKey
from swarm.averaging.compression import get_codec
from swarm.averaging.evidence import (
    BadAggregateEvidence,
    SignedInput,
    aggregate_message,
    contribution_message,
    draw_seed,
    drawn_validator,
    input_entries,
    layout_chunk_values,
    round_digest,
)
from swarm.averaging.scores import LENIENCY, flagged, scores
from swarm.models import build_model
from swarm.training.sendercheck import (
    WrongContributionEvidence,
    chunk_slice,
    drawn_sender,
    flagged_senders,
    recompute,
)
from swarm.training.state import DecodedState, build_optimizer, state_hash, state_tensors

# Every part validated; a sender drawn at every check, so that the draw names someone other than the liar.
RUN = tiny_run("scored-senders", verify_probability=1.0, sender_check_probability=1.0)
PREFIX = RUN.run_id.replace(".", "_")
CODEC = get_codec(RUN.training.compression)
STEP, MEMBERS, PART = 2, 4, 1
LIAR, HONEST = 1, 3  # member indices; member 0 validates, member 2 is the one the draw names


def _nonce(i: int) -> bytes:
    return hashlib.sha256(b"scored" + bytes([i])).digest()


@pytest.fixture(scope="module")
def world():
    """Four members' keys, the state at ``STEP`` and each member's honest gradient from it."""
    torch.manual_seed(0)
    # Fixed identities: their public batch seeds, so their gradients, are the same in every run.
    keys = [
        SigningKey(Ed25519PrivateKey.from_private_bytes(hashlib.sha256(b"scored-member-%d" % i).digest()))
        for i in range(MEMBERS)
    ]
    model = build_model(RUN.model.name, RUN.model.config, seed=RUN.training.seed)
    tensors = state_tensors(model, build_optimizer(model, RUN.optimizer))
    honest = [recompute(RUN, tensors, k.peer_id, STEP, 2, device="cpu") for k in keys]  # 8 samples each
    return keys, tensors, state_hash(STEP, tensors), honest


def test_honest_inputs_stand_out_nowhere_and_lies_do(world):
    keys, _, _, honest = world
    numel = honest[0].numel()
    bounds = [numel * p // MEMBERS for p in range(MEMBERS + 1)]
    weights = [8.0] * MEMBERS
    for p in range(MEMBERS):  # every part of the vector, as the chunks of a round of four
        part = [h[bounds[p] : bounds[p + 1]] for h in honest]
        assert flagged(part, weights, candidates=range(MEMBERS)) == ([], []), (
            f"an honest input flagged in part {p}"
        )
        assert min(s.cosine for s in scores(part)) > 0.3
        noise = torch.randn(part[1].shape, generator=torch.Generator().manual_seed(p))
        lies = {
            "reversed": -part[1],
            "random, 10x the norm": noise * 10 * part[1].norm() / noise.norm(),
            "random, the same norm": noise * part[1].norm() / noise.norm(),
            "scaled 10x": 10 * part[1],
        }
        for name, lie in lies.items():
            values = [part[0], lie, part[2], part[3]]
            assert flagged(values, weights, candidates=range(MEMBERS)) == ([], [1]), (name, p)
        # A weight no loop signs is flagged first, whatever the values; the validator itself never is.
        claim = flagged(part, [8.0, 6.0, 8.0, 8.0], candidates=[1, 2, 3], claim_ok=lambda w: w % 4 == 0)
        assert claim == ([1], [])
        assert flagged([part[0], -part[1], part[2], part[3]], weights, candidates=[0, 2, 3]) == ([], [])
    # Two inputs tell nobody apart, and non-finite ones are not scored.
    assert flagged([honest[0], -honest[1]], [8.0, 8.0], candidates=[0, 1]) == ([], [])
    nan = torch.full_like(honest[1], float("nan"))
    assert not scores([honest[0], nan, honest[2]])[1].finite


def test_the_coordinators_lenient_flag_covers_a_validators_strict_one():
    """An input exactly at a threshold: the validator (strict) does not flag it, the coordinator (lenient)
    would, so float64 rounding on another machine never makes a validator's flag a false accusation."""
    base = torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    values = [base, base, base, torch.tensor([4.0, 0.0, 0.0, 0.0], dtype=torch.float64)]
    assert flagged(values, [1.0] * 4, candidates=range(4)) == ([], [])  # a norm ratio of exactly 4
    assert flagged(values, [1.0] * 4, candidates=range(4), lenient=True) == ([], [3])
    assert LENIENCY < 1e-3


def _drawn_group(members, commits, *, sender: int) -> bytes:
    """A group ID whose round draws member 0 to check chunk 0 of ``PART`` and names ``sender`` to replay."""
    for i in range(10_000):
        group_id = b"scored-%d" % i
        seed = draw_seed(
            round_digest(PREFIX, group_id, members, commits), [_nonce(j) for j in range(MEMBERS)]
        )
        if (
            drawn_validator(seed, PART, MEMBERS) == 0
            and drawn_sender(seed, PART, 0, [1, 2, 3], 1.0) == sender
        ):
            return group_id
    raise AssertionError("no group ID draws that")


def _chunk(world, sent: dict[int, torch.Tensor], *, drop: int | None = None):
    """Chunk 0 of ``PART`` in a round whose draw names member 2: every member's signed input (``sent``
    overrides honest ones), the reducer's signed aggregate of them, and each member's group entry."""
    keys, _, hash_, honest = world
    members = tuple(k.peer_id for k in keys)
    commits = tuple(hashlib.sha256(_nonce(i)).digest() for i in range(MEMBERS))
    group_id = _drawn_group(members, commits, sender=2)
    digest = round_digest(PREFIX, group_id, members, commits)
    lo, hi = chunk_slice(
        honest[0].numel(), MEMBERS, PART, 0, layout_chunk_values(MEMBERS, CODEC.bytes_per_value)
    )
    inputs = []
    for i, key in enumerate(keys):
        data = CODEC.encode_contribution(sent.get(i, honest[i])[lo:hi])
        inputs.append(
            SignedInput(i, data, key.sign(contribution_message(digest, PART, 0, members[i], 8.0, data)), 8.0)
        )
    aggregated = [item for item in inputs if item.sender_index != drop]
    entries = input_entries([(item.sender_index, item.weight, item.data) for item in aggregated])
    output = CODEC.encode(torch.stack([honest[i][lo:hi] for i in range(MEMBERS)]).mean(0))
    reducer = keys[PART]
    signature = reducer.sign(aggregate_message(digest, PART, 0, members[PART], entries, output, 1))
    scored = BadAggregateEvidence(
        prefix=PREFIX, group_id=group_id, members=members, commitments=commits, part=PART, chunk=0,
        numel=hi - lo, inputs=tuple(aggregated), output=output, output_signature=signature, entries=entries,
        signed_at_ms=1,
    )  # fmt: skip
    entry = dict(
        enumerate(signed_entries(keys, PREFIX, commits, step=STEP, state_hash=hash_, weights=[8.0] * MEMBERS))
    )
    return scored, inputs, entry


def _accusation(
    scored, inputs, entry, accused: int, *, with_scores: bool = True
) -> WrongContributionEvidence:
    return WrongContributionEvidence(
        prefix=PREFIX, group_id=scored.group_id, members=scored.members, commitments=scored.commitments,
        part=PART, chunk=0, item=inputs[accused], entry=entry[accused],
        reveals=tuple(_nonce(i) for i in range(MEMBERS)), scored=scored if with_scores else None,
    )  # fmt: skip


def _judge(world, evidence: WrongContributionEvidence, run=RUN):
    keys, tensors, hash_, _ = world
    return asyncio.run(
        judge_contribution(
            run,
            lambda: run_layouts(run),
            evidence.to_bytes(),
            evidence.accused,
            keys[0].peer_id,
            states=ServedStates(DecodedState(STEP, tensors, {}, hash_)),
            judging=asyncio.Lock(),
            timeout_s=30,
        )  # fmt: skip
    )


def test_a_liar_the_draw_did_not_name_is_replayed_for_standing_out_and_banned(world):
    keys, _, _, honest = world
    scored, inputs, entry = _chunk(world, {LIAR: -honest[LIAR]})
    numel = honest[0].numel()
    decoded = scored.checked_inputs(CODEC, numel)
    assert flagged_senders(RUN, scored.inputs, decoded, validator=0) == ([], [LIAR])
    # The draw named member 2, so without the chunk's scores the accusation is refused (the accuser banned).
    found, guilty = _judge(world, _accusation(scored, inputs, entry, LIAR, with_scores=False))
    assert guilty == keys[0].peer_id and "did not draw" in found
    evidence = _accusation(scored, inputs, entry, LIAR)
    again = WrongContributionEvidence.from_body(msgpack.unpackb(evidence.to_bytes()))
    assert again == evidence, "the scored chunk round-trips through the wire form"
    found, guilty = _judge(world, evidence)
    assert guilty == keys[LIAR].peer_id and "public batch seeds" in found


def test_a_liar_that_withholds_its_nonce_is_still_banned_when_it_stands_out(world):
    """A liar that withholds its nonce in the rounds whose draw would replay it leaves every validator to
    draw from its own randomness, which the coordinator cannot check: a drawn-sender accusation without
    the reveals is refused. Scores need no draw, so the same lie with the chunk's scores bans the liar."""
    keys, _, _, honest = world
    scored, inputs, entry = _chunk(world, {LIAR: -honest[LIAR]})
    unrevealed = _accusation(scored, inputs, entry, LIAR)
    unrevealed = WrongContributionEvidence(**{**unrevealed.__dict__, "reveals": ()})
    found, guilty = _judge(world, unrevealed)
    assert guilty == keys[LIAR].peer_id and "public batch seeds" in found
    found, guilty = _judge(world, WrongContributionEvidence(**{**unrevealed.__dict__, "scored": None}))
    assert guilty == keys[0].peer_id and "needs every member's reveal" in found
    # Reveals that are there must be every member's, each matching its commitment.
    partial = WrongContributionEvidence(**{**unrevealed.__dict__, "reveals": (_nonce(0), _nonce(1))})
    found, guilty = _judge(world, partial)
    assert guilty == keys[0].peer_id and "reveals for 4 members" in found


def test_an_undrawn_sender_that_does_not_stand_out_cannot_be_put_to_the_coordinator(world):
    keys, _, _, honest = world
    # An honest member the draw did not name, with every input shown: it stands out nowhere.
    scored, inputs, entry = _chunk(world, {LIAR: -honest[LIAR]})
    found, guilty = _judge(world, _accusation(scored, inputs, entry, HONEST))
    assert guilty == keys[0].peer_id and "does not stand out" in found
    # Inputs left out of the chunk (so that the median moves) do not match what the reducer signed.
    partial = BadAggregateEvidence(**{**scored.__dict__, "inputs": scored.inputs[:2] + scored.inputs[3:]})
    found, guilty = _judge(world, _accusation(partial, inputs, entry, HONEST))
    assert guilty == keys[0].peer_id and "the reducer aggregated" in found
    # An input of the accused other than the one in the chunk is refused.
    swapped = _accusation(scored, inputs, entry, LIAR)
    other = SignedInput(LIAR, inputs[HONEST].data, inputs[HONEST].signature, 8.0)
    found, guilty = _judge(world, WrongContributionEvidence(**{**swapped.__dict__, "item": other}))
    assert guilty == keys[0].peer_id
    # The sender the draw named, accused with the chunk's scores, is judged by them: it stands out nowhere.
    found, guilty = _judge(world, _accusation(scored, inputs, entry, 2))
    assert guilty == keys[0].peer_id and "does not stand out" in found
    # A run that does not replay outliers accepts only drawn senders.
    off = RUN.model_copy(deep=True)
    off.training.replay_outliers = False
    found, guilty = _judge(world, _accusation(scored, inputs, entry, LIAR), run=off)
    assert guilty == keys[0].peer_id and "replays only the senders its rounds draw" in found


def test_a_scored_chunk_with_extra_fields_names_what_is_wrong(world):
    _, _, _, honest = world
    scored, inputs, entry = _chunk(world, {LIAR: -honest[LIAR]})
    body = msgpack.unpackb(_accusation(scored, inputs, entry, LIAR).to_bytes())
    body["scored"]["extra"] = 1
    with pytest.raises(ProtocolError, match="scored chunk"):
        WrongContributionEvidence.from_body(body)
    body["scored"] = [1, 2]
    with pytest.raises(ProtocolError, match="scored chunk"):
        WrongContributionEvidence.from_body(body)
