"""Evidence a framer cannot forge: sizes from the run's layout, inputs bound by the reducer's signature.

Each test builds a round's signed evidence exactly as a round does (every member signs with its own
key) and plays one of the tricks an accuser could use to frame an honest reducer; the judge must clear
the reducer and hold the evidence against the accuser. Two different inputs signed by one sender for
the same chunk convict that sender. A live coordinator judges the same evidence and bans accordingly.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib

import pytest
import torch

from coordinator.roundinputs import RoundInputs, judge_unshown
from lab.localswarm import FAST_MEMBERSHIP, running_coordinator
from protocols.errors import ProtocolError, SignatureError
from protocols.keys import SigningKey
from swarm.averaging.aggregators import get_aggregator
from swarm.averaging.compression import get_codec
from swarm.averaging.evidence import (
    INPUT_DEMAND_WINDOW_S,
    MAX_MEMBERS,
    BadAggregateEvidence,
    EquivocationEvidence,
    SignedInput,
    UnshownInputEvidence,
    aggregate_message,
    aggregation_seed,
    chunk_numel,
    contribution_message,
    draw_seed,
    drawn_validator,
    input_entries,
    layout_chunk_values,
    parse_evidence,
    reduce_chunk,
    round_digest,
)
from swarm.config import RunConfig, TrainingConfig
from swarm.coordinator_client import CoordinatorClient
from swarm.models import build_model

SIGNED_AT_MS = 1_795_000_000_000  # when the reducers in these tests sign (Unix ms)

pytestmark = pytest.mark.timeout(120)

RUN = "evidence-run"
PREFIX = RUN.replace(".", "_")
CODEC = get_codec("fp16")
RULE = get_aggregator("centered_clip")
VECTOR = 3001  # values averaged in the rehearsed run: three parts of 1000 or 1001 values


def nonce(i: int, salt: bytes = b"") -> bytes:
    """Member ``i``'s round nonce (32 bytes, as a peer draws them)."""
    return hashlib.sha256(b"nonce" + salt + i.to_bytes(4, "big")).digest()


def commitments(count: int, salt: bytes = b"") -> tuple[bytes, ...]:
    return tuple(hashlib.sha256(nonce(i, salt)).digest() for i in range(count))


def signed_round(
    keys: list[SigningKey],
    *,
    part: int = 0,
    shift: float = 0.0,
    vector: int = VECTOR,
    salt: bytes = b"",
    reducers: tuple[bool, ...] = (),
    nonces: list[bytes] | None = None,
    signed_at_ms: int = SIGNED_AT_MS,
    group_id: bytes = b"group-0001",
    seed: int = 1,
) -> BadAggregateEvidence:
    """Chunk 0 of part ``part`` as its reducer ``keys[part]`` aggregates it (its output shifted by ``shift``)
    at ``signed_at_ms``; the members commit to ``nonces`` (default: ``nonce(i, salt)``)."""
    members = tuple(k.peer_id for k in keys)
    if nonces is None:
        commits = commitments(len(keys), salt)
    else:
        commits = tuple(hashlib.sha256(n).digest() for n in nonces)
    digest = round_digest(PREFIX, group_id, members, commits, reducers)
    chunk_values = layout_chunk_values(len(keys), CODEC.bytes_per_value)
    numel = chunk_numel(vector, len(keys), part, 0, chunk_values, reducers)
    generator = torch.Generator().manual_seed(seed)
    inputs = []
    for index, key in enumerate(keys):
        data = CODEC.encode(torch.randn(numel, generator=generator))
        signature = key.sign(contribution_message(digest, part, 0, members[index], 8.0, data))
        inputs.append(SignedInput(index, data, signature, 8.0))
    decoded = [CODEC.decode(i.data, numel, sender="x") for i in inputs]
    output = reduce_chunk(RULE, CODEC, decoded, [8.0] * len(keys), aggregation_seed(group_id, part, 0))
    if shift:
        output = CODEC.encode(CODEC.decode(output, numel, sender="x") + shift)
    entries = input_entries([(i.sender_index, i.weight, i.data) for i in inputs])
    signature = keys[part].sign(
        aggregate_message(digest, part, 0, members[part], entries, output, signed_at_ms)
    )
    return BadAggregateEvidence(
        prefix=PREFIX, group_id=group_id, members=members, commitments=commits, part=part, chunk=0,
        numel=numel, inputs=tuple(inputs), output=output, output_signature=signature,
        signed_at_ms=signed_at_ms, entries=entries, reducers=reducers,
    )  # fmt: skip


def resign(evidence: BadAggregateEvidence, key: SigningKey, index: int, data: bytes) -> SignedInput:
    """Member ``index`` signs a second, different contribution to the same chunk."""
    message = contribution_message(
        evidence.digest, evidence.part, evidence.chunk, evidence.members[index], 8.0, data
    )
    return SignedInput(index, data, key.sign(message), 8.0)


def judge(evidence, vector: int = VECTOR) -> str | None:
    return parse_evidence(evidence.to_bytes()).judge(RULE, CODEC, vector_numel=vector)


@pytest.fixture(scope="module")
def keys() -> list[SigningKey]:
    return [SigningKey.generate() for _ in range(3)]


def test_a_true_accusation_convicts_the_reducer(keys):
    assert judge(signed_round(keys)) is None
    assert "differs from the rule's result" in judge(signed_round(keys, shift=0.5))


def test_the_judge_takes_the_layout_of_a_round_with_a_member_that_reduces_nothing(keys):
    # Member 1 could not be dialed: its part is empty and members 0 and 2 reduce half the vector each.
    mask = (True, False, True)
    honest = signed_round(keys, reducers=mask)
    assert honest.numel == VECTOR // 2
    assert judge(honest) is None
    assert "differs from the rule's result" in judge(signed_round(keys, reducers=mask, shift=0.5))
    # The mask is part of what every member signed: evidence cannot claim the plain layout, or another.
    for other in ((), (True, True, False)):
        numel = chunk_numel(VECTOR, 3, 0, 0, 1 << 18, other)
        with pytest.raises((ProtocolError, SignatureError)):
            judge(dataclasses.replace(honest, reducers=other, numel=numel))
    with pytest.raises(ProtocolError, match="reducer flags"):
        judge(dataclasses.replace(honest, reducers=(False, False, False)))


def test_a_chunk_size_other_than_the_layouts_convicts_the_accuser(keys):
    # Before: numel was the accuser's word, so numel + 1 made every honest input "invalid" and the
    # honest reducer was banned for aggregating them.
    honest = signed_round(keys)
    for numel in (honest.numel + 1, honest.numel - 1):
        with pytest.raises(ProtocolError, match="layout"):
            judge(dataclasses.replace(honest, numel=numel))
    # The layout is the run's: evidence of a run with another vector length does not hold either.
    with pytest.raises(ProtocolError, match="layout"):
        judge(honest, vector=VECTOR + 3)


def test_a_second_contribution_for_the_accusers_own_slot_convicts_the_accuser(keys):
    # Before: the reducer signed only who it aggregated, so the accuser (member 1) could sign other
    # values for its own slot, substitute them, and the honest aggregate "differed from the rule's result".
    honest = signed_round(keys)
    forged = resign(honest, keys[1], 1, CODEC.encode(torch.full((honest.numel,), 3.0)))
    framed = dataclasses.replace(honest, inputs=(honest.inputs[0], forged, honest.inputs[2]))
    with pytest.raises(ProtocolError, match="not the one the reducer aggregated"):
        judge(framed)
    # Editing another member's input fails that member's signature, as before.
    other = dataclasses.replace(honest.inputs[2], data=forged.data)
    with pytest.raises(SignatureError):
        judge(dataclasses.replace(honest, inputs=(*honest.inputs[:2], other)))


def test_inputs_of_a_replayed_group_id_do_not_hold(keys):
    # A leader that reuses a group ID with the same members still names a new round: the members'
    # fresh nonce commitments are part of what everyone signs.
    first, second = signed_round(keys), signed_round(keys, salt=b"next round")
    assert first.digest != second.digest
    mixed = dataclasses.replace(second, inputs=(first.inputs[0], *second.inputs[1:]))
    with pytest.raises(SignatureError):
        judge(mixed)


def test_two_signed_inputs_for_one_slot_convict_their_sender(keys):
    honest = signed_round(keys)
    second = resign(honest, keys[2], 2, CODEC.encode(torch.zeros(honest.numel)))
    proof = EquivocationEvidence(
        prefix=PREFIX, group_id=honest.group_id, members=honest.members, commitments=honest.commitments,
        part=honest.part, chunk=0, first=honest.inputs[2], second=second,
    )  # fmt: skip
    assert parse_evidence(proof.to_bytes()).accused == keys[2].peer_id
    assert "signed two different contributions" in judge(proof)
    with pytest.raises(ProtocolError, match="same contribution twice"):
        judge(dataclasses.replace(proof, second=honest.inputs[2]))
    with pytest.raises(ProtocolError, match="two different members"):
        judge(dataclasses.replace(proof, second=honest.inputs[1]))
    forged = dataclasses.replace(second, signature=honest.inputs[1].signature)
    with pytest.raises(SignatureError):
        judge(dataclasses.replace(proof, second=forged))


def test_a_reducer_that_shows_another_own_input_than_it_aggregated_is_convicted(keys):
    honest = signed_round(keys)  # part 0: keys[0] reduces and contributes to it
    second = resign(honest, keys[0], 0, CODEC.encode(torch.zeros(honest.numel)))
    proof = EquivocationEvidence(
        prefix=PREFIX, group_id=honest.group_id, members=honest.members, commitments=honest.commitments,
        part=0, chunk=0, first=second, second=None, entries=honest.entries, output=honest.output,
        output_signature=honest.output_signature, signed_at_ms=honest.signed_at_ms,
    )  # fmt: skip
    assert parse_evidence(proof.to_bytes()).accused == keys[0].peer_id
    assert "other than the one it aggregated" in judge(proof)
    with pytest.raises(ProtocolError, match="the one it aggregated"):
        judge(dataclasses.replace(proof, first=honest.inputs[0]))
    with pytest.raises(ProtocolError, match="reducer's own"):
        judge(dataclasses.replace(proof, first=honest.inputs[1]))


def test_evidence_of_the_largest_group_a_run_allows_is_judged():
    # Before: evidence was refused above 256 members while max_group_size allowed 1024.
    TrainingConfig(max_group_size=MAX_MEMBERS)  # the largest group a run allows is judged
    with pytest.raises(ValueError):
        TrainingConfig(max_group_size=MAX_MEMBERS + 1)
    many = [SigningKey.generate() for _ in range(300)]
    evidence = signed_round(many, part=7, shift=0.25, vector=300 * 40)
    assert "differs" in judge(evidence, vector=300 * 40)


def test_the_coordinator_bans_framers_and_equivocators_not_the_honest_reducer(tmp_path, keys):
    run = RunConfig(run_id=RUN, model={"name": "gpt", "config": {"d_model": 32, "n_layer": 1, "n_head": 2,
                    "seq_len": 32}}, membership=FAST_MEMBERSHIP)  # fmt: skip
    reducer, third, _ = keys
    model = build_model(run.model.name, run.model.config, seed=run.training.seed)
    vector = sum(p.numel() for p in model.parameters() if p.requires_grad)
    numel_framer, slot_framer, equivocator = (SigningKey.generate() for _ in range(3))

    async def scenario():
        async with (
            running_coordinator(run, tmp_path / "coordinator") as node,
            CoordinatorClient(node.address) as client,
        ):
            for i, key in enumerate([reducer, third, numel_framer, slot_framer, equivocator]):
                await client.join(key, RUN, name=f"peer{i}", device="cpu")
            verdicts = {}
            # The numel trick, by a member of a round the honest reducer led.
            honest = signed_round([reducer, numel_framer, third], vector=vector)
            lie = dataclasses.replace(honest, numel=honest.numel + 1)
            answer = await client.accuse(
                numel_framer, RUN, accused=reducer.peer_id, reason="x", evidence=lie.to_bytes()
            )
            verdicts["numel"] = answer
            # The substituted-slot trick.
            honest = signed_round([reducer, slot_framer, third], vector=vector)
            forged = resign(honest, slot_framer, 1, CODEC.encode(torch.full((honest.numel,), 3.0)))
            lie = dataclasses.replace(honest, inputs=(honest.inputs[0], forged, honest.inputs[2]))
            answer = await client.accuse(
                slot_framer, RUN, accused=reducer.peer_id, reason="x", evidence=lie.to_bytes()
            )
            verdicts["slot"] = answer
            # An equivocator's two signed inputs for one slot, filed by a groupmate, convict it alone.
            honest = signed_round([reducer, equivocator, third], vector=vector)
            second = resign(honest, equivocator, 1, CODEC.encode(torch.zeros(honest.numel)))
            proof = EquivocationEvidence(
                prefix=PREFIX, group_id=honest.group_id, members=honest.members,
                commitments=honest.commitments, part=0, chunk=0, first=honest.inputs[1], second=second,
            )  # fmt: skip
            verdicts["equivocation"] = await client.accuse(
                third, RUN, accused=equivocator.peer_id, reason="x", evidence=proof.to_bytes()
            )
            status = await client.status(RUN)
            return verdicts, {p.peer_id: p.state for p in status.peers}

    verdicts, states = asyncio.run(scenario())
    assert "false accusation" in verdicts["numel"].verdict and "layout" in verdicts["numel"].verdict
    assert verdicts["numel"].banned_peer == numel_framer.peer_id
    assert verdicts["slot"].banned_peer == slot_framer.peer_id
    assert verdicts["equivocation"].banned_peer == equivocator.peer_id
    assert "two different contributions" in verdicts["equivocation"].verdict
    assert states[reducer.peer_id] != "banned" and states[third.peer_id] != "banned"


class ReducerAnswers(RoundInputs):
    """The reducer the coordinator asks: it shows the inputs of ``full`` it holds, or nothing."""

    can_ask = True

    def __init__(self, full: BadAggregateEvidence | None):
        self.full, self.asked = full, []

    async def fetch(self, evidence, sender_index):
        self.asked.append(sender_index)
        if self.full is None:
            return None
        return next(i for i in self.full.inputs if i.sender_index == sender_index)


def unshown(full: BadAggregateEvidence, missing: tuple[int, ...] = (0,)) -> UnshownInputEvidence:
    """``full`` as a validator files it when nobody showed the inputs of ``missing``."""
    fields = {f: getattr(full, f) for f in BadAggregateEvidence.__dataclass_fields__}
    shown = tuple(i for i in full.inputs if i.sender_index not in missing)
    reveals = tuple(nonce(i) for i in range(len(full.members)))
    return UnshownInputEvidence(**{**fields, "inputs": shown}, missing=missing, reveals=reveals)


def test_unshown_input_evidence_convicts_only_a_reducer_that_will_not_show_in_time(keys):
    run = RunConfig(run_id=RUN, model={"name": "gpt", "config": {"d_model": 32, "n_layer": 1}},
                    training={"compression": "fp16", "aggregator": "centered_clip"})  # fmt: skip
    honest, lying = signed_round(keys), signed_round(keys, shift=0.5)
    reducer, signed_s = keys[0].peer_id, SIGNED_AT_MS / 1000
    drawn = drawn_validator(draw_seed(honest.digest, unshown(honest).reveals), 0, len(keys))
    accuser, bystander = keys[drawn].peer_id, keys[3 - drawn].peer_id  # the members other than the reducer

    def verdict(evidence, answers, *, online=True, age_s=10.0, accuser=accuser, joined_s=signed_s - 600):
        async def joined_at(peer_id):
            return joined_s if online else None

        return asyncio.run(
            judge_unshown(
                run, lambda: {PREFIX: VECTOR}, evidence.to_bytes(), reducer, accuser, inputs=answers,
                joined_at=joined_at, judging=asyncio.Lock(), now=lambda: signed_s + age_s,
            )
        )  # fmt: skip

    # It will not show its own input to the coordinator either: convicted, while online and in time.
    found, guilty = verdict(unshown(honest), ReducerAnswers(None))
    assert guilty == reducer and "did not show the coordinator" in found
    assert verdict(unshown(honest), ReducerAnswers(None), online=False)[1] is None
    # One that joined again after it signed lost what it held: a restart is no lie.
    assert verdict(unshown(honest), ReducerAnswers(None), joined_s=signed_s + 5)[1] is None
    assert verdict(unshown(honest), ReducerAnswers(None), age_s=INPUT_DEMAND_WINDOW_S + 1)[1] is None
    # Shown: the aggregate is recomputed; right bans nobody, wrong convicts the reducer.
    answers = ReducerAnswers(honest)
    assert verdict(unshown(honest, (0, 2)), answers) == (
        "the reducer showed the coordinator every input, and its aggregate is what the rule gives",
        None,
    )
    assert answers.asked == [0, 2]
    found, guilty = verdict(unshown(lying), ReducerAnswers(lying))
    assert guilty == reducer and "differs from the rule's result" in found
    # Evidence that does not hold convicts its accuser: a reveal off its commitment, nothing missing.
    forged = dataclasses.replace(unshown(honest), reveals=(b"x", *unshown(honest).reveals[1:]))
    assert verdict(forged, ReducerAnswers(None))[1] == accuser
    assert verdict(unshown(honest, ()), ReducerAnswers(None))[1] == accuser
    # Only the member the round drew to check the part may demand its inputs.
    assert verdict(unshown(honest), ReducerAnswers(None), accuser=bystander)[1] == bystander
    # Without a way to ask peers, nobody is banned.
    assert verdict(unshown(honest), RoundInputs())[1] is None
