"""An attacker's read of the outlier replays (5bf97dc: ``swarm.averaging.scores``, ``SenderChecks._outlier``,
``WrongContributionEvidence.scored``) found four ways in; each test here showed one on 5bf97dc and now
checks its fix. In process, with the real model, dataset, codec, signatures, ``SenderChecks`` and the
coordinator's ``judge_contribution``.

The world: a tiny run (fp32 codec, every part validated, a sender drawn at every check), a group of five
(member 0 validates part ``PART``), and a state whose per-batch gradients are noisy enough that a sender that
signs for a single micro-batch honestly stands out now and then (as it does in any run whose honest senders
hold many micro-batches each; here found by trying identities, as an attacker who mints them can).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import threading
from types import SimpleNamespace

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from helpers import ServedStates, signed_entries

import swarm.training.picks as picks
import swarm.training.sendercheck as sendercheck
from coordinator.accusations import run_layouts
from coordinator.contributions import ContributionStates, judge_contribution
from lab.localswarm import tiny_run
from protocols.keys import SigningKey
from swarm.averaging.compression import get_codec
from swarm.averaging.evidence import (
    BadAggregateEvidence,
    SignedInput,
    aggregate_message,
    chunk_numel,
    contribution_message,
    draw_seed,
    drawn_validator,
    input_entries,
    layout_chunk_values,
    round_digest,
)
from swarm.averaging.scores import flagged, scores
from swarm.models import build_model
from swarm.training.sendercheck import (
    SenderChecks,
    chunk_slice,
    compare,
    drawn_sender,
    flagged_senders,
    recompute,
)
from swarm.training.state import DecodedState, build_optimizer, state_hash, state_tensors

pytestmark = pytest.mark.timeout(300)

RUN = tiny_run("scores-redteam", verify_probability=1.0, sender_check_probability=1.0, compression="none")
# The same run's prefix, with (almost) no drawn sender: only the outlier path replays.
RUN_RARE = tiny_run(
    "scores-redteam", verify_probability=1.0, sender_check_probability=1e-9, compression="none"
)
PREFIX = RUN.run_id.replace(".", "_")
CODEC = get_codec(RUN.training.compression)
STEP, MEMBERS = 2, 5
VALIDATOR, DECOY, OTHER = (
    0,
    2,
    3,
)  # member 2 signs for one micro-batch; member 3 is the liar of the decoy test
FULL, ONE = 32.0, 4.0  # an honest weight of 8 micro-batches, and of one


def _key(tag: bytes, i: int) -> SigningKey:
    return SigningKey(Ed25519PrivateKey.from_private_bytes(hashlib.sha256(tag + b"-%d" % i).digest()))


def _nonce(i: int) -> bytes:
    return hashlib.sha256(b"scores-redteam-nonce" + bytes([i])).digest()


@contextlib.contextmanager
def _threads(n: int):
    """Replays with ``n`` CPU threads (a volunteer's ``max_cpu_threads``; the coordinator's default)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _chunk(vector: torch.Tensor, numel: int, part: int) -> torch.Tensor:
    lo, hi = chunk_slice(numel, MEMBERS, part, 0, layout_chunk_values(MEMBERS, CODEC.bytes_per_value))
    return vector[lo:hi]


@pytest.fixture(scope="module")
def world():
    """The state, five members' keys (member 2's found by trying identities), their honest contributions,
    the part whose chunk 0 member 0 validates, and a group ID whose draw names member 0 to validate it and
    an honest member (1 or 4) as its drawn sender."""
    with _threads(1):
        model = build_model(RUN.model.name, RUN.model.config, seed=RUN.training.seed)
        noise = torch.Generator().manual_seed(1)
        with torch.no_grad():  # a state whose per-batch gradients disagree more than at initialization
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=noise))
        tensors = state_tensors(model, build_optimizer(model, RUN.optimizer))
        hash_ = state_hash(STEP, tensors)
        numel = run_layouts(RUN)[PREFIX]
        keys = [_key(b"member", i) for i in range(MEMBERS)]
        full = {i: recompute(RUN, tensors, keys[i].peer_id, STEP, 8, device="cpu") for i in (0, 1, 3, 4)}
        found = None
        for attempt in range(200):  # an identity whose one-micro-batch gradient stands out (about 1 in 4)
            key = _key(b"decoy", attempt)
            one = recompute(RUN, tensors, key.peer_id, STEP, 1, device="cpu")
            for part in range(1, MEMBERS):
                chunks = {i: _chunk(v, numel, part) for i, v in {**full, DECOY: one}.items()}
                honest = [chunks[i] for i in range(MEMBERS)]
                liar = [5 * chunks[i] if i == OTHER else chunks[i] for i in range(MEMBERS)]
                weights = [ONE if i == DECOY else FULL for i in range(MEMBERS)]
                candidates = [i for i in range(MEMBERS) if i != VALIDATOR]
                decoy = scores(honest)[DECOY]
                median = sorted(s.cosine for s in scores(honest))[MEMBERS // 2]
                if (
                    flagged(honest, weights, candidates=candidates) == ([], [DECOY])
                    and flagged(liar, weights, candidates=candidates) == ([], [DECOY, OTHER])
                    and decoy.cosine < 0.4 * median  # well inside the flag, so a 1% push keeps it
                ):
                    found = key, one, part
                    break
            if found:
                break
        assert found, "no identity's one-micro-batch gradient stands out at this state"
        keys[DECOY], one, part = found
        full[DECOY] = recompute(RUN, tensors, keys[DECOY].peer_id, STEP, 8, device="cpu")
    members = tuple(k.peer_id for k in keys)
    commits = tuple(hashlib.sha256(_nonce(i)).digest() for i in range(MEMBERS))
    nonces = tuple(_nonce(i) for i in range(MEMBERS))
    for i in range(10_000):
        group_id = b"scores-redteam-%d" % i
        seed = draw_seed(round_digest(PREFIX, group_id, members, commits), nonces)
        drawn = drawn_sender(seed, part, 0, [1, 2, 3, 4], 1.0)
        if drawn_validator(seed, part, MEMBERS) == VALIDATOR and drawn in (1, 4):
            break
    entries = signed_entries(
        keys,
        PREFIX,
        commits,
        step=STEP,
        state_hash=hash_,
        weights=[ONE if i == DECOY else FULL for i in range(MEMBERS)],
    )
    return SimpleNamespace(
        tensors=tensors, hash=hash_, numel=numel, keys=keys, members=members, commits=commits, nonces=nonces,
        full=full, one=one, part=part, group_id=group_id, seed=seed, drawn=drawn, entries=entries,
    )  # fmt: skip


def _evidence(w, part: int, sent: dict[int, tuple[bytes, float]]) -> BadAggregateEvidence:
    """Chunk 0 of ``part`` as its validator holds it: every member's signed input (``sent``: data and
    weight), and the reducer's signed aggregate over them (its value is not what the outlier path reads)."""
    digest = round_digest(PREFIX, w.group_id, w.members, w.commits)
    inputs = tuple(
        SignedInput(
            i, data, w.keys[i].sign(contribution_message(digest, part, 0, w.members[i], weight, data)), weight
        )
        for i, (data, weight) in sorted(sent.items())
    )
    entries = input_entries([(x.sender_index, x.weight, x.data) for x in inputs])
    output = inputs[0].data
    signature = w.keys[part].sign(aggregate_message(digest, part, 0, w.members[part], entries, output, 1))
    numel = chunk_numel(w.numel, MEMBERS, part, 0, layout_chunk_values(MEMBERS, CODEC.bytes_per_value))
    return BadAggregateEvidence(
        prefix=PREFIX, group_id=w.group_id, members=w.members, commitments=w.commits, part=part, chunk=0,
        numel=numel, inputs=inputs, output=output, output_signature=signature, entries=entries, signed_at_ms=1,
    )  # fmt: skip


def _honest(w, part: int, **changes: tuple[torch.Tensor | bytes, float]) -> dict[int, tuple[bytes, float]]:
    """Every member's honest input to chunk 0 of ``part`` (member 2 signing for one micro-batch), with
    ``changes`` (member index as ``m<i>``) in place of some."""
    sent = {i: (w.one if i == DECOY else w.full[i], ONE if i == DECOY else FULL) for i in range(MEMBERS)}
    for name, (value, weight) in changes.items():
        sent[int(name[1:])] = (value, weight)
    return {
        i: (v if isinstance(v, bytes) else CODEC.encode_contribution(_chunk(v, w.numel, part)), weight)
        for i, (v, weight) in sent.items()
    }


def _runner(w, seed):
    return SimpleNamespace(
        group_id=w.group_id, members=list(w.members), peer_ids=list(w.members), index=VALIDATOR,
        shared_seed=seed, revealed=None, reveals=dict(enumerate(w.nonces)), codec=CODEC, numel=w.numel,
        part_chunks=[[0, 1]] * MEMBERS, reducers=(), reduces=lambda part: False,
    )  # fmt: skip


def _validate(w, evidences, *, run=RUN, seed="shared", threads=1):
    """Member 0's sender checks of a round in which it validated ``evidences``: (accusations, checks)."""
    accused = []

    async def accuse(peer, lie, verdict):
        accused.append((peer, lie, verdict))

    checks = SenderChecks(run, device="cpu", state=lambda: (STEP, w.hash, w.tensors), accuse=accuse)
    runner = _runner(w, w.seed if seed == "shared" else seed)

    async def scenario():
        await checks.keep(runner, w.entries)
        await checks.check(runner, [SimpleNamespace(evidence=e) for e in evidences])
        await checks.filed()

    with _threads(threads):
        asyncio.run(scenario())
    return accused, checks


def _judge(w, lie, *, threads=2, served=True, judging=None):
    states = ServedStates(DecodedState(STEP, w.tensors, {}, w.hash)) if served else ContributionStates()
    with _threads(threads):
        return asyncio.run(
            judge_contribution(
                RUN,
                lambda: run_layouts(RUN),
                lie.to_bytes(),
                lie.accused,
                w.members[VALIDATOR],
                states=states,
                judging=judging or asyncio.Lock(),
                timeout_s=30,
            )  # fmt: skip
        )


def test_a_sender_at_the_tolerance_edge_that_stands_out_does_not_get_its_honest_validator_banned(world):
    """Was HIGH. The outlier path lets a sender choose to be replayed: one that signs for one micro-batch
    honestly stands out in some chunks (a noisy gradient), so every validator that checks such a chunk
    replays it. It sent its replay as the coordinator's CPU computes it, moved to just inside the tolerance
    (relative L2 0.01) away from how a validator's replay rounds (here a volunteer's ``max_cpu_threads = 1``
    against the coordinator's 2 threads); ``compare`` had one threshold on both sides, so the validator
    filed a lie 0.01 + 1e-8 away and the coordinator banned it as a false accuser. Now a validator files
    only beyond ``(1 + ACCUSE_MARGIN)`` times the tolerance, the coordinator convicts beyond it."""
    w = world
    part = w.part
    with _threads(2):  # the coordinator's replay, which the attacker computes
        coordinator_view = _chunk(
            recompute(RUN, w.tensors, w.members[DECOY], STEP, 1, device="cpu"), w.numel, part
        )
    with _threads(1):  # the validator's
        validator_view = _chunk(
            recompute(RUN, w.tensors, w.members[DECOY], STEP, 1, device="cpu"), w.numel, part
        )
    delta = validator_view.double() - coordinator_view.double()
    # Where the two replays are bit for bit the same, the push goes along a fixed direction instead: the
    # validator's verdict must still leave the edge alone.
    away = -delta / delta.norm() if delta.any() else torch.ones_like(delta) / delta.numel() ** 0.5
    scale = coordinator_view.double().norm()

    def sent(alpha: float) -> bytes:
        return CODEC.encode_contribution((coordinator_view.double() + alpha * scale * away).float())

    low, high = 0.0, 0.05
    with _threads(2):
        for _ in range(80):  # the largest push the coordinator still finds within the tolerance
            mid = (low + high) / 2
            if compare(sent(mid), coordinator_view, CODEC, 0.01, sender="x") is None:
                low = mid
            else:
                high = mid
    edge = sent(low)
    assert low > 0.009, "a push of about 1% of the chunk's norm"

    evidence = _evidence(w, part, _honest(w, part, m2=(edge, ONE)))
    decoded = evidence.checked_inputs(CODEC, w.numel)
    assert flagged_senders(RUN, evidence.inputs, decoded, validator=VALIDATOR) == ([], [DECOY])
    assert w.drawn != DECOY, "the draw named an honest member, not the attacker"
    accused, checks = _validate(w, [evidence], threads=1)
    assert checks.outliers == 1 and checks.checked >= 1 and accused == [], accused

    # A lie past the margin is still filed, and the coordinator convicts it.
    far = sent(0.02 * (1 + sendercheck.ACCUSE_MARGIN))
    accused, _ = _validate(w, [_evidence(w, part, _honest(w, part, m2=(far, ONE)))], threads=1)
    assert [a[0] for a in accused] == [w.members[DECOY]]
    found, guilty = _judge(w, accused[0][1], threads=2)
    assert guilty == w.members[DECOY], (found, guilty)


def test_an_honest_decoy_that_stands_out_more_does_not_shield_a_flagged_liar(world):
    """Was LOW. A validator replayed only the most suspect flagged sender, ranked by cosine first: a colluder
    sending its honest one-micro-batch gradient ranked ahead of a liar that scales its gradient 5x (flagged
    for its norm), so the decoy was replayed, passed, and the liar was never replayed for standing out. Now
    the round's draw picks among the flagged (``outlier_to_replay``): a decoy halves the liar's odds in a
    round, no more."""
    w = world
    part = w.part
    liar = _chunk(5 * w.full[OTHER], w.numel, part)
    evidence = _evidence(w, part, _honest(w, part, m3=(CODEC.encode_contribution(liar), FULL)))
    decoded = evidence.checked_inputs(CODEC, w.numel)
    assert flagged_senders(RUN_RARE, evidence.inputs, decoded, validator=VALIDATOR) == ([], [DECOY, OTHER])
    picks = [
        sendercheck.outlier_to_replay([], [DECOY, OTHER], seed=b"seed-%d" % i, part=part, chunk=0, drawn=None)
        for i in range(400)
    ]
    assert 0.4 < picks.count(OTHER) / len(picks) < 0.6, "the draw picks the liar about half the time"
    assert sendercheck.outlier_to_replay([OTHER], [DECOY], seed=b"", part=part, chunk=0, drawn=None) == OTHER
    # A round whose draw makes member 0 a validator and picks the liar among the flagged.
    seed = next(
        b"seed-%d" % i
        for i, pick in enumerate(picks)
        if pick == OTHER and drawn_validator(b"seed-%d" % i, part, MEMBERS) == VALIDATOR
    )
    accused, checks = _validate(w, [evidence], run=RUN_RARE, seed=seed)
    assert checks.outliers == 1 and [a[0] for a in accused] == [w.members[OTHER]]


def test_a_validator_scores_at_most_a_few_chunks_a_round_and_never_on_its_event_loop(world, monkeypatch):
    """Was MEDIUM. ``SenderChecks._outlier`` decoded a chunk's inputs on a worker thread but scored them
    (a stack of every input, a coordinate median, a norm and a dot product per input) on the event loop,
    for every chunk the validator checked until one stood out: 0.8 s a chunk for a group of 64 on this
    machine, and a member that withholds its reveal makes every member check about 16 chunks a round. Now
    scoring runs on the worker thread too, in at most ``MAX_SCORED_CHUNKS`` chunks a round."""
    w = world
    loop_thread, calls = [], []
    real = picks.flagged

    def spy(*args, **kwargs):
        calls.append(threading.get_ident())
        return real(*args, **kwargs)

    monkeypatch.setattr(picks, "flagged", spy)
    parts = [p for p in range(1, MEMBERS)] * 2  # more checked chunks than a round scores
    evidences = [_evidence(w, p, _honest(w, p, m2=(w.full[DECOY], FULL))) for p in parts]
    accused = []
    checks = SenderChecks(
        RUN_RARE, device="cpu", state=lambda: (STEP, w.hash, w.tensors), accuse=lambda *a: accused.append(a)
    )
    runner = _runner(w, None)

    async def scenario():
        loop_thread.append(threading.get_ident())
        await checks.keep(runner, w.entries)
        await checks.check(runner, [SimpleNamespace(evidence=e) for e in evidences])

    asyncio.run(scenario())
    assert checks.checked == 0 and accused == []  # nothing stands out: nothing replayed
    assert len(calls) == sendercheck.MAX_SCORED_CHUNKS < len(evidences)
    assert loop_thread[0] not in set(calls), "no score runs on the event loop's own thread"


def test_the_coordinator_scores_one_chunk_at_a_time_at_its_judging_turn_and_only_a_groups_worth(
    world, monkeypatch
):
    """Was MEDIUM. ``judge_contribution`` decoded, stacked and scored every input of a scored chunk before it
    took ``judging``, so accusations from different callers decoded their chunks at once (an int8 chunk
    costs about 8 times its wire size decoded and stacked; a round of 1,024 members minted by the accuser
    about 190 MiB each). Now the scoring waits for the judging turn, one at a time, and a scored chunk of a
    group larger than the run's ``max_group_size`` is refused before anything is decoded."""
    w = world
    part = w.part
    evidence = _evidence(w, part, _honest(w, part))  # member 2 stands out: a scored accusation holds
    lie = sendercheck.WrongContributionEvidence(
        prefix=PREFIX, group_id=w.group_id, members=w.members, commitments=w.commits, part=part, chunk=0,
        item=evidence.inputs[DECOY], entry=w.entries[DECOY], reveals=w.nonces, scored=evidence,
    )  # fmt: skip
    judging = asyncio.Lock()
    events, running = [], [0]
    real = picks.flagged

    def spy(*args, **kwargs):
        running[0] += 1
        events.append(running[0])
        try:
            return real(*args, **kwargs)
        finally:
            running[0] -= 1

    monkeypatch.setattr(picks, "flagged", spy)

    async def scenario():
        await judging.acquire()  # another judgment holds the lock for a while
        states = ContributionStates()  # nobody serves the state: after the scores, nobody is banned
        tasks = [
            asyncio.create_task(
                judge_contribution(
                    RUN,
                    lambda: run_layouts(RUN),
                    lie.to_bytes(),
                    lie.accused,
                    w.members[VALIDATOR],
                    states=states,
                    judging=judging,
                    timeout_s=5,
                )  # fmt: skip
            )
            for _ in range(2)
        ]
        await asyncio.sleep(1.0)
        scored_while_held = len(events)
        judging.release()
        return scored_while_held, await asyncio.gather(*tasks)

    scored_while_held, results = asyncio.run(scenario())
    assert scored_while_held == 0, "nothing is decoded and scored before the judging turn"
    assert events == [1, 1], "one chunk scored at a time"
    assert all(guilty is None and "did not serve" in found for found, guilty in results)

    small = RUN.model_copy(deep=True)
    small.training.max_group_size = MEMBERS - 1
    calls = len(events)
    found, guilty = asyncio.run(
        judge_contribution(
            small,
            lambda: run_layouts(small),
            lie.to_bytes(),
            lie.accused,
            w.members[VALIDATOR],
            states=ContributionStates(),
            judging=asyncio.Lock(),
            timeout_s=5,
        )  # fmt: skip
    )
    assert guilty == w.members[VALIDATOR] and "at most" in found and len(events) == calls


def test_a_validator_files_a_liar_that_stands_out_even_in_a_round_whose_nonces_were_withheld(world):
    """A liar that withholds its nonce in the rounds whose draw would replay it leaves each validator to
    check from its own randomness: a lie found by that draw is only avoided. One that stands out is filed
    all the same, with the chunk's scores and no reveals, and the coordinator bans the liar."""
    w = world
    part = w.part
    liar = _chunk(-w.full[OTHER], w.numel, part)
    evidence = _evidence(
        w, part, _honest(w, part, m2=(w.full[DECOY], FULL), m3=(CODEC.encode_contribution(liar), FULL))
    )
    accused, checks = _validate(w, [evidence], run=RUN_RARE, seed=None)
    assert checks.outliers == 1 and [a[0] for a in accused] == [w.members[OTHER]], accused
    lie = accused[0][1]
    assert lie.reveals == () and lie.scored is not None
    found, guilty = _judge(w, lie)
    assert guilty == w.members[OTHER], (found, guilty)
