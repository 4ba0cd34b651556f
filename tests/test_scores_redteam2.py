"""An attacker's read of drawless scored evidence (2d0c34d: ``WrongContributionEvidence.check_draw`` takes
a ``scored`` chunk from any member of the round, with every reveal or none; ``SenderChecks._check_one``
files a sender that stands out even in a round whose reveals were withheld) found one way in; the test
here showed it on 2d0c34d and now checks its fix. In process, with the real model, dataset, codec,
signatures, ``SenderChecks``, ``check_group`` and the coordinator's ``judge_contribution``.

The world: a tiny run (every part validated, a sender practically never drawn, so only the outlier path
replays), a group of four whose member ``LIAR`` sends its gradient reversed (it stands out in every part),
and honest members 0, 2 and 3, each a validator of some part.
"""

from __future__ import annotations

import asyncio
import hashlib
from types import SimpleNamespace

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from helpers import ServedStates, signed_entries

from coordinator.accusations import run_layouts
from coordinator.contributions import judge_contribution
from lab.localswarm import tiny_run
from protocols.keys import SigningKey
from swarm.averaging.compression import get_codec
from swarm.averaging.evidence import (
    BadAggregateEvidence,
    SignedInput,
    aggregate_message,
    contribution_message,
    input_entries,
    layout_chunk_values,
    round_digest,
)
from swarm.averaging.groups import GroupRefused, check_group
from swarm.models import build_model
from swarm.training.sendercheck import SenderChecks, chunk_slice, flagged_senders, recompute
from swarm.training.state import DecodedState, build_optimizer, state_hash, state_tensors

pytestmark = pytest.mark.timeout(300)

MEMBERS, STEP, LIAR = 4, 2, 1
# The run's groups hold at most three: a leader that breaks the rule lists a fourth member.
RUN = tiny_run(
    "scores-redteam2", verify_probability=1.0, sender_check_probability=1e-9, max_group_size=MEMBERS - 1
)
PREFIX = RUN.run_id.replace(".", "_")
CODEC = get_codec(RUN.training.compression)
# Each honest member and the part it validates (never its own); the liar's reversed input stands out in each.
CHECKS = {0: 2, 2: 3, 3: 0}


def _nonce(i: int) -> bytes:
    return hashlib.sha256(b"scores-redteam2-nonce" + bytes([i])).digest()


@pytest.fixture(scope="module")
def world():
    """Four members' keys, the state at ``STEP``, each member's honest gradient and signed group entry, and
    the round (group ID, members, commitments) of a group one member larger than the run allows."""
    keys = [
        SigningKey(Ed25519PrivateKey.from_private_bytes(hashlib.sha256(b"redteam2-member-%d" % i).digest()))
        for i in range(MEMBERS)
    ]
    torch.manual_seed(0)
    model = build_model(RUN.model.name, RUN.model.config, seed=RUN.training.seed)
    tensors = state_tensors(model, build_optimizer(model, RUN.optimizer))
    hash_ = state_hash(STEP, tensors)
    honest = [recompute(RUN, tensors, k.peer_id, STEP, 2, device="cpu") for k in keys]  # 8 samples each
    members = tuple(k.peer_id for k in keys)
    commits = tuple(hashlib.sha256(_nonce(i)).digest() for i in range(MEMBERS))
    entries = signed_entries(keys, PREFIX, commits, step=STEP, state_hash=hash_, weights=[8.0] * MEMBERS)
    return SimpleNamespace(
        keys=keys, tensors=tensors, hash=hash_, honest=honest, numel=run_layouts(RUN)[PREFIX],
        members=members, commits=commits, entries=entries, group_id=b"redteam2-oversized",
    )  # fmt: skip


def _chunk(w, part: int) -> BadAggregateEvidence:
    """Chunk 0 of ``part`` as its validator holds it after the round: every member's signed input (the
    liar's reversed) and the part's reducer's signed aggregate over them."""
    digest = round_digest(PREFIX, w.group_id, w.members, w.commits)
    lo, hi = chunk_slice(w.numel, MEMBERS, part, 0, layout_chunk_values(MEMBERS, CODEC.bytes_per_value))
    inputs = []
    for i, key in enumerate(w.keys):
        vector = -w.honest[i] if i == LIAR else w.honest[i]
        data = CODEC.encode_contribution(vector[lo:hi])
        signature = key.sign(contribution_message(digest, part, 0, w.members[i], 8.0, data))
        inputs.append(SignedInput(i, data, signature, 8.0))
    entries = input_entries([(x.sender_index, x.weight, x.data) for x in inputs])
    output = CODEC.encode(torch.stack([w.honest[i][lo:hi] for i in range(MEMBERS)]).mean(0))
    signature = w.keys[part].sign(aggregate_message(digest, part, 0, w.members[part], entries, output, 1))
    return BadAggregateEvidence(
        prefix=PREFIX, group_id=w.group_id, members=w.members, commitments=w.commits, part=part, chunk=0,
        numel=hi - lo, inputs=tuple(inputs), output=output, output_signature=signature, entries=entries,
        signed_at_ms=1,
    )  # fmt: skip


def _validate(w, index: int, evidence: BadAggregateEvidence, run=RUN) -> list:
    """Honest member ``index``'s sender checks of the round, whose reveals the liar withheld (no shared
    seed: the member checks from its own randomness); the accusations it files."""
    accused = []

    async def accuse(peer, lie, verdict):
        accused.append((peer, lie, verdict))

    checks = SenderChecks(run, device="cpu", state=lambda: (STEP, w.hash, w.tensors), accuse=accuse)
    runner = SimpleNamespace(
        group_id=w.group_id, members=list(w.members), peer_ids=list(w.members), index=index,
        shared_seed=None, revealed=None, reveals={index: _nonce(index)},
        codec=CODEC, numel=w.numel, part_chunks=[[0, 1]] * MEMBERS, reducers=(), reduces=lambda part: False,
    )  # fmt: skip

    async def scenario():
        await checks.keep(runner, w.entries)
        await checks.check(runner, [SimpleNamespace(evidence=evidence)])
        await checks.filed()

    asyncio.run(scenario())
    return accused


def _judge(w, lie, accuser: str, run=RUN):
    states = ServedStates(DecodedState(STEP, w.tensors, {}, w.hash))
    found, guilty = asyncio.run(
        judge_contribution(
            run,
            lambda: run_layouts(run),
            lie.to_bytes(),
            lie.accused,
            accuser,
            states=states,
            judging=asyncio.Lock(),
            timeout_s=30,
        )  # fmt: skip
    )
    return found, guilty, states.asked


def test_an_oversized_group_is_refused_and_a_validator_files_no_evidence_the_coordinator_would_refuse(world):
    """Was HIGH. ``check_draw`` refuses a ``scored`` chunk of a group larger than the run's
    ``max_group_size`` and ``judge_contribution`` then bans the accuser, but no honest member refused such a
    group (``check_group`` bounded no size; only an honest leader stops at its target) and ``SenderChecks``
    filed without running the coordinator's checks. A leader that listed one member more than the run
    allows, with a liar whose lie stands out, got every honest validator that replayed the liar banned as a
    false accuser (with 2d0c34d, every member: the liar withholds its nonce and each member files without
    the reveals), and the liar was never replayed by the coordinator. Now members leave such a group,
    blaming its leader, and a validator runs the coordinator's checks (the draw or the scores) before it
    files, only avoiding a liar whose evidence would not hold."""
    w = world
    with pytest.raises(GroupRefused) as refused:
        check_group(
            w.members, [b""] * MEMBERS, me=w.members[0], my_entry=b"", leader=w.members[3], prefix=PREFIX,
            schema_hash=bytes(32), signed=True, refusal=lambda peer: None, max_age_s=60.0,
            max_members=RUN.training.max_group_size,
        )  # fmt: skip
    assert refused.value.culprit == w.members[3] and "at most 3" in refused.value.reason
    for validator, part in CHECKS.items():
        evidence = _chunk(w, part)
        decoded = evidence.checked_inputs(CODEC, w.numel)
        assert flagged_senders(RUN, evidence.inputs, decoded, validator=validator) == ([], [LIAR]), part
        # The honest member replays the liar and finds the lie, but files nothing the coordinator refuses.
        assert _validate(w, validator, evidence) == [], validator

    # In a run whose groups may hold four, the same lie is filed and convicts the liar.
    wide = RUN.model_copy(deep=True)
    wide.training.max_group_size = MEMBERS
    accused = _validate(w, 0, _chunk(w, CHECKS[0]), run=wide)
    assert [a[0] for a in accused] == [w.members[LIAR]]
    lie = accused[0][1]
    assert lie.reveals == () and lie.scored is not None
    found, guilty, _ = _judge(w, lie, w.members[0], run=wide)
    assert guilty == w.members[LIAR] and "public batch seeds" in found, (found, guilty)
