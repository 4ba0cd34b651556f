"""Reducers score the inputs of their own part: a sender whose input stands out is replayed by two reducers
a round, with no validator draw (``SenderChecks._own_part``, ``replays_own_part``), and a sender whose
replay found it honest is replayed again for standing out only in a share of the next ``CLEARED_ROUNDS``
rounds (``still_replayed``).

In process, with the real model, dataset, codec, signatures, ``SenderChecks`` and the coordinator's
``judge_contribution``. The world: a tiny run whose validators practically never draw a part or a sender
(so only a reducer's scores of its own part replay anyone), a group of four, each member the reducer of
its own part, holding the signed inputs of that part's one chunk and its own signed aggregate over them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
from types import SimpleNamespace

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from helpers import ServedStates, signed_entries

from coordinator.accusations import run_layouts
from coordinator.contributions import judge_contribution
from lab.localswarm import tiny_run
from protocols import averaging_pb2 as apb
from protocols.keys import SigningKey
from swarm.averaging.compression import get_codec
from swarm.averaging.evidence import (
    SignedInput,
    aggregate_message,
    contribution_message,
    draw_seed,
    input_entries,
    layout_chunk_values,
    round_digest,
)
from swarm.models import build_model
from swarm.training.contribution import WrongContributionEvidence
from swarm.training.sendercheck import (
    CLEARED_ROUNDS,
    SenderChecks,
    chunk_slice,
    recompute,
    replays_own_part,
    still_replayed,
)
from swarm.training.state import DecodedState, build_optimizer, state_hash, state_tensors

pytestmark = pytest.mark.timeout(300)

MEMBERS, STEP, LIAR = 4, 2, 1
RUN = tiny_run("own-part-scores", verify_probability=1e-9, sender_check_probability=1e-9)
PREFIX = RUN.run_id.replace(".", "_")
CODEC = get_codec(RUN.training.compression)
GROUP_ID = b"own-part-round"


def _nonce(i: int) -> bytes:
    return hashlib.sha256(b"own-part-nonce" + bytes([i])).digest()


@pytest.fixture(scope="module")
def world():
    keys = [
        SigningKey(Ed25519PrivateKey.from_private_bytes(hashlib.sha256(b"own-part-member-%d" % i).digest()))
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
    digest = round_digest(PREFIX, GROUP_ID, members, commits)
    return SimpleNamespace(
        keys=keys, tensors=tensors, hash=hash_, honest=honest, numel=run_layouts(RUN)[PREFIX], members=members,
        commits=commits, entries=entries, digest=digest, seed=draw_seed(digest, [_nonce(i) for i in range(MEMBERS)]),
    )  # fmt: skip


def _runner(w, index: int, sent: list[torch.Tensor]):
    """Member ``index`` after a complete round in which member ``i`` sent ``sent[i]``: the reducer of part
    ``index`` (one chunk), holding every member's signed input to it and its own signed aggregate."""
    values = layout_chunk_values(MEMBERS, CODEC.bytes_per_value)
    lo, hi = chunk_slice(w.numel, MEMBERS, index, 0, values)
    inputs = []
    for i, key in enumerate(w.keys):
        data = CODEC.encode_contribution(sent[i][lo:hi])
        signature = key.sign(contribution_message(w.digest, index, 0, w.members[i], 8.0, data))
        inputs.append(SignedInput(i, data, signature, 8.0))
    entries = input_entries([(x.sender_index, x.weight, x.data) for x in inputs])
    output = CODEC.encode(torch.stack([v[lo:hi] for v in sent]).mean(0))
    signature = w.keys[index].sign(
        aggregate_message(w.digest, index, 0, w.members[index], entries, output, 1)
    )
    result = apb.PartChunk(data=output, signature=signature, included=entries, signed_at_ms=1)
    return SimpleNamespace(
        prefix=PREFIX, group_id=GROUP_ID, members=list(w.members), peer_ids=list(w.members), index=index,
        commitments=list(w.commits), shared_seed=w.seed, revealed=None,
        reveals={i: _nonce(i) for i in range(MEMBERS)}, codec=CODEC, numel=w.numel,
        part_chunks=[[0, 1]] * MEMBERS, reducers=(), signers={}, reduces=lambda part: True,
        chunk_count=lambda part: 1, chunk_range=lambda part, chunk: (lo, hi),
        reducer=SimpleNamespace(results=[result], evidence=[inputs], undecodable={}),
    )  # fmt: skip


def _round(w, checks: SenderChecks, runner) -> None:
    async def scenario():
        await checks.keep(runner, w.entries)
        await checks.check(runner, [])  # this member validated no part
        await checks.filed()

    asyncio.run(scenario())


def _checks(w, accused: list):
    async def accuse(peer, lie, verdict):
        accused.append((peer, lie, verdict))

    return SenderChecks(RUN, device="cpu", state=lambda: (STEP, w.hash, w.tensors), accuse=accuse)


def test_one_reducer_a_round_replays_a_liar_that_stands_out_in_its_own_part_and_the_coordinator_bans_it(
    world,
):
    """Before, only a member drawn to validate a part scored its inputs (``verify_probability``, 0.25 by
    default, a part each), so a liar that stands out in every chunk was replayed only in rounds whose draw
    gave some honest member a part holding it. Now every reducer scores its own part's drawn chunk, and
    the round's draw names one reducer (never the liar) to replay it: the liar is filed against at once."""
    w = world
    sent = [-w.honest[i] if i == LIAR else w.honest[i] for i in range(MEMBERS)]
    designated = replays_own_part(w.seed, _runner(w, 0, sent), LIAR)
    assert len(designated) == 2 and set(designated) <= {0, 2, 3}
    filed = {}
    for index in (0, 2, 3):  # every honest reducer, each holding its own part's inputs
        accused = []
        checks = _checks(w, accused)
        _round(w, checks, _runner(w, index, sent))
        filed[index] = accused
        assert checks.checked == (1 if index in designated else 0), index
    assert all([a[0] for a in filed[i]] == [w.members[LIAR]] for i in designated)
    assert not any(filed[i] for i in (0, 2, 3) if i not in designated)
    first = designated[0]
    lie = filed[first][0][1]
    assert lie.scored is not None and lie.scored.part == first

    states = ServedStates(DecodedState(STEP, w.tensors, {}, w.hash))
    found, guilty = asyncio.run(
        judge_contribution(
            RUN,
            lambda: run_layouts(RUN),
            lie.to_bytes(),
            lie.accused,
            w.members[first],
            states=states,
            judging=asyncio.Lock(),
            timeout_s=30,
        )  # fmt: skip
    )
    assert guilty == w.members[LIAR] and "public batch seeds" in found, (found, guilty)


def test_the_designated_reducer_is_never_the_sender_nor_a_member_that_reduces_nothing(world):
    runner = _runner(world, 0, world.honest)
    runner.reduces = lambda part: part != 3  # member 3 cannot be dialed: it reduces no part
    picks = {s: set() for s in range(MEMBERS)}
    for n in range(200):
        seed = hashlib.sha256(b"seed-%d" % n).digest()
        for sender in range(MEMBERS):
            named = replays_own_part(seed, runner, sender)
            assert len(named) == min(2, len({0, 1, 2} - {sender})) == len(set(named)), (sender, named)
            picks[sender].update(named)
    for sender, picked in picks.items():
        assert picked == {0, 1, 2} - {sender}, (sender, picked)  # each one that may, over the draws


def test_an_honest_sender_made_to_stand_out_is_replayed_once_then_seldom_for_a_while(world, monkeypatch):
    """Colluders that move a chunk's median can make an honest sender stand out among a reducer's inputs.
    Its replay clears it; without a memory of that, the same colluders would cost its designated reducers
    a replay (a step, or a window) in every round. In the next ``CLEARED_ROUNDS`` rounds it is replayed
    for standing out only where the round's draw says so (``still_replayed``), here in none of them."""
    w = world
    target = 2
    # Members 1 and 3 send the target's gradient reversed: the median follows them, the target stands out.
    sent = [w.honest[0], -w.honest[target], w.honest[target], -w.honest[target]]
    reducer = 0
    seeds = (hashlib.sha256(b"round-%d" % n).digest() for n in range(400))
    seed = next(
        d
        for d in seeds
        if reducer in replays_own_part(d, _runner(w, 0, sent), target) and not still_replayed(d, target)
    )

    def runner():
        r = _runner(w, reducer, sent)
        r.shared_seed = seed
        return r

    replayed = []
    judge = WrongContributionEvidence.judge

    def recording_judge(self, *args, **kwargs):
        replayed.append(self.accused)
        return judge(self, *args, **kwargs)

    monkeypatch.setattr(WrongContributionEvidence, "judge", recording_judge)
    accused = []
    checks = _checks(w, accused)
    _round(w, checks, runner())
    assert replayed == [w.members[target]] and accused == []  # replayed, found honest, nobody filed
    for _ in range(CLEARED_ROUNDS):
        _round(w, checks, runner())
    assert replayed.count(w.members[target]) == 1, replayed
    _round(w, checks, runner())  # the memory has run out
    assert replayed.count(w.members[target]) == 2, replayed


@pytest.mark.parametrize("reveals", ["all", "withheld"])
def test_a_sender_whose_signed_input_does_not_decode_is_banned_without_a_draw(world, reveals):
    """A reducer refuses an input with non-finite values (the ``nan`` attack) and, before, nobody could
    file it: the refused input was in no chunk's evidence, and only a drawn sender's could be filed. The
    reducer now keeps each sender's first validly signed input that does not decode
    (``PartReducer.undecodable``); one the draw names for that sender (any, without every reveal) replays
    the sender and files, with no draw (``WrongContributionEvidence.undecodable``), and the coordinator
    bans the sender once its own replay shows the input is not what its batch seeds give."""
    w = world
    heard = set(range(MEMBERS)) if reveals == "all" else set(range(MEMBERS)) - {LIAR}
    probe = _runner(w, 0, w.honest)
    reducer = replays_own_part(w.seed, probe, LIAR)[0] if reveals == "all" else 0
    runner = _runner(w, reducer, w.honest)
    if reveals == "withheld":
        runner.shared_seed, runner.reveals = None, {i: _nonce(i) for i in heard}
    lo, hi = runner.chunk_range(reducer, 0)
    data = CODEC.encode_contribution(torch.full((hi - lo,), float("nan")))
    signature = w.keys[LIAR].sign(contribution_message(w.digest, reducer, 0, w.members[LIAR], 8.0, data))
    runner.reducer.undecodable = {LIAR: (0, SignedInput(LIAR, data, signature, 8.0))}
    accused = []
    checks = _checks(w, accused)
    _round(w, checks, runner)
    assert [a[0] for a in accused] == [w.members[LIAR]], accused
    lie, verdict = accused[0][1], accused[0][2]
    assert "does not decode" in verdict and lie.scored is None
    assert bool(lie.reveals) == (reveals == "all")

    states = ServedStates(DecodedState(STEP, w.tensors, {}, w.hash))
    found, guilty = asyncio.run(
        judge_contribution(
            RUN,
            lambda: run_layouts(RUN),
            lie.to_bytes(),
            lie.accused,
            w.members[reducer],
            states=states,
            judging=asyncio.Lock(),
            timeout_s=30,
        )  # fmt: skip
    )
    assert guilty == w.members[LIAR] and "does not decode" in found, (found, guilty)
    # An input that decodes, filed the same way with no draw behind it, does not hold: the accuser pays.
    decodes = CODEC.encode_contribution(w.honest[LIAR][lo:hi])
    resigned = w.keys[LIAR].sign(contribution_message(w.digest, reducer, 0, w.members[LIAR], 8.0, decodes))
    honest = dataclasses.replace(lie, item=SignedInput(LIAR, decodes, resigned, 8.0))
    found, guilty = asyncio.run(
        judge_contribution(
            RUN,
            lambda: run_layouts(RUN),
            honest.to_bytes(),
            honest.accused,
            w.members[reducer],
            states=states,
            judging=asyncio.Lock(),
            timeout_s=30,
        )  # fmt: skip
    )
    assert guilty == w.members[reducer] and "does not hold" in found, (found, guilty)
