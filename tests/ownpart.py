"""A group of four after a complete round, as the reducers' own-part checks see it (``SenderChecks._own_part``,
``_refused``), for in-process tests: the real model, dataset, codec and signatures, and a stand-in round that
holds, for its member ``index``, the reducer's view of part ``index`` (one chunk): every member's signed input
to it and its own signed aggregate over them.

Example::

    w = make_world(RUN)
    accused = []
    one_round(w, sender_checks(w, accused), reducer_after_round(w, 0, w.honest))
"""

from __future__ import annotations

import asyncio
import hashlib
from types import SimpleNamespace

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from helpers import ServedStates, signed_entries

from coordinator.accusations import run_layouts
from coordinator.contributions import judge_contribution
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
from swarm.config import RunConfig
from swarm.models import build_model
from swarm.training import contribution, sendercheck
from swarm.training.contribution import WrongContributionEvidence
from swarm.training.sendercheck import SenderChecks, chunk_slice, recompute
from swarm.training.state import DecodedState, apply_flat_gradient, build_optimizer, state_hash, state_tensors

MEMBERS, STEP, LIAR = 4, 2, 1
WEIGHT = 8.0  # two micro-batches of the tiny run


def nonce(i: int) -> bytes:
    return hashlib.sha256(b"own-part-nonce" + bytes([i])).digest()


def make_world(run: RunConfig, tensors: dict[str, torch.Tensor] | None = None) -> SimpleNamespace:
    """The members' keys, the state at ``STEP`` (``tensors``, or the run's model as built), each member's
    honest gradient there (``honest``), their signed group entries, and the round's digest and draw ``seed``
    (every member's reveal in)."""
    keys, prefix, group_id, commits, digest, seed = round_draw(run)
    if tensors is None:
        torch.manual_seed(0)
        model = build_model(run.model.name, run.model.config, seed=run.training.seed)
        tensors = state_tensors(model, build_optimizer(model, run.optimizer))
    codec = get_codec(run.training.compression)
    hash_ = state_hash(STEP, tensors)
    members = tuple(k.peer_id for k in keys)
    return SimpleNamespace(
        run=run, prefix=prefix, group_id=group_id, codec=codec, values=layout_chunk_values(MEMBERS, codec.bytes_per_value), keys=keys,
        tensors=tensors, hash=hash_, members=members, commits=commits, digest=digest,
        honest=[recompute(run, tensors, k.peer_id, STEP, 2, device="cpu") for k in keys],
        entries=signed_entries(keys, prefix, commits, step=STEP, state_hash=hash_, weights=[WEIGHT] * MEMBERS),
        numel=run_layouts(run)[prefix], seed=seed,
    )  # fmt: skip


def round_draw(run: RunConfig) -> tuple[list[SigningKey], str, bytes, tuple[bytes, ...], bytes, bytes]:
    """The round of ``run`` every world of it holds: (the members' keys, the prefix, the group ID, the
    members' commitments, the round's digest, its draw seed with every reveal in)."""
    keys = [
        SigningKey(Ed25519PrivateKey.from_private_bytes(hashlib.sha256(b"own-part-member-%d" % i).digest()))
        for i in range(MEMBERS)
    ]
    prefix, group_id = run.run_id.replace(".", "_"), b"own-part-round"
    commits = tuple(hashlib.sha256(nonce(i)).digest() for i in range(MEMBERS))
    digest = round_digest(prefix, group_id, tuple(k.peer_id for k in keys), commits)
    return keys, prefix, group_id, commits, digest, draw_seed(digest, [nonce(i) for i in range(MEMBERS)])


def trained(run: RunConfig, depths: list[int]) -> dict[int, tuple[dict, dict, torch.Tensor]]:
    """depth -> (the state before the last step, the state after it, that step's averaged gradient): the
    run's model trained ``depth`` steps by four honest trainers, for each of ``depths`` (a stale sender
    computed at the first what it sends at the second)."""
    torch.manual_seed(0)
    model = build_model(run.model.name, run.model.config, seed=run.training.seed)
    optimizer = build_optimizer(model, run.optimizer)
    params, found = list(model.parameters()), {}
    for step in range(max(depths)):
        old = state_tensors(model, optimizer)
        averaged = torch.stack(
            [recompute(run, old, f"trainer-{k}", step, 2, device="cpu") for k in range(MEMBERS)]
        ).mean(0)
        apply_flat_gradient(model, params, optimizer, run.optimizer, step, averaged)
        if step + 1 in depths:
            found[step + 1] = (old, state_tensors(model, optimizer), averaged)
    return found


def force_fit_draws(monkeypatch, picks: dict[tuple[int, int], int]) -> None:
    """Make ``fit_draw`` (at the reducers and the coordinator) have the reducer of part ``p`` score sender
    ``s`` against micro-batch ``m`` for each ``(p, s): m`` of ``picks``, and nobody else. The real draw is a
    hash of the chunk's signed inputs, whose bits follow the machine's float sums (thread counts): a test
    of what a scorer does names its scorer; ``tests/test_fit_redteam.py`` tests the draw itself."""

    def forced(scored, sender: int, micro_batches: int) -> tuple[bool, int]:
        micro = picks.get((scored.part, sender))
        return (micro is not None, micro or 0)

    monkeypatch.setattr(sendercheck, "fit_draw", forced)
    monkeypatch.setattr(contribution, "fit_draw", forced)


def signed_input(w, sender: int, part: int, data: bytes, *, weight: float = WEIGHT) -> SignedInput:
    message = contribution_message(w.digest, part, 0, w.members[sender], weight, data)
    return SignedInput(sender, data, w.keys[sender].sign(message), weight)


def chunk_of(w, part: int) -> tuple[int, int]:
    """Where the one chunk of ``part`` lies in the run's vector."""
    return chunk_slice(w.numel, MEMBERS, part, 0, w.values)


def reducer_after_round(w, index: int, sent: list[torch.Tensor], *, heard: set[int] | None = None):
    """Member ``index`` after a complete round in which member ``i`` sent ``sent[i]``, holding every input to
    its part and its signed aggregate (``reducer_holding``)."""
    lo, hi = chunk_of(w, index)
    inputs = [signed_input(w, i, index, w.codec.encode_contribution(sent[i][lo:hi])) for i in range(MEMBERS)]
    return reducer_holding(w, index, inputs, [v[lo:hi] for v in sent], heard=heard)


def reducer_holding(
    w, index: int, inputs: list[SignedInput], decoded: list[torch.Tensor], *, heard: set[int] | None = None
):
    """Member ``index`` after a complete round, the reducer of part ``index`` holding the signed ``inputs``
    it aggregated (``decoded``: their values) and its signed aggregate over them; ``heard``: the members
    whose reveal reached it (all by default; without all, it holds no shared draw)."""
    heard = set(range(MEMBERS)) if heard is None else heard
    lo, hi = chunk_of(w, index)
    entries = input_entries([(x.sender_index, x.weight, x.data) for x in inputs])
    output = w.codec.encode(torch.stack(decoded).mean(0)) if decoded else b""
    signature = w.keys[index].sign(
        aggregate_message(w.digest, index, 0, w.members[index], entries, output, 1)
    )
    result = apb.PartChunk(data=output, signature=signature, included=entries, signed_at_ms=1)
    return SimpleNamespace(
        prefix=w.prefix, group_id=w.group_id, members=list(w.members), peer_ids=list(w.members), index=index,
        commitments=list(w.commits), shared_seed=w.seed if heard == set(range(MEMBERS)) else None,
        revealed=None, reveals={i: nonce(i) for i in heard}, codec=w.codec, numel=w.numel,
        part_chunks=[[0, 1]] * MEMBERS, reducers=(), signers={}, reduces=lambda part: True,
        chunk_count=lambda part: 1, chunk_range=lambda part, chunk: (lo, hi),
        reducer=SimpleNamespace(results=[result], evidence=[list(inputs)], undecodable={}),
    )  # fmt: skip


def sender_checks(w, accused: list) -> SenderChecks:
    """A member's sender checks; each accusation it files is appended to ``accused`` as (peer, lie, verdict)."""

    async def accuse(peer, lie, verdict):
        accused.append((peer, lie, verdict))

    return SenderChecks(w.run, device="cpu", state=lambda: (STEP, w.hash, w.tensors), accuse=accuse)


def weighted_round(w, index: int, sent: list[torch.Tensor], weights: list[float]):
    """(runner, signed entries) of a round in which member ``i`` sent ``sent[i]`` signed for ``weights[i]``
    samples (its group entry too), as member ``index``, the reducer of part ``index``, holds it."""
    lo, hi = chunk_of(w, index)
    inputs = [
        signed_input(w, i, index, w.codec.encode_contribution(sent[i][lo:hi]), weight=weights[i])
        for i in range(len(sent))
    ]
    entries = signed_entries(w.keys, w.prefix, w.commits, step=STEP, state_hash=w.hash, weights=weights)
    return reducer_holding(w, index, inputs, [v[lo:hi] for v in sent]), entries


def honest_but(w, sender: int, vector: torch.Tensor, weight: float = WEIGHT) -> tuple[list, list[float]]:
    """(what each member sends, the weights it signs) of a round of honest inputs but ``sender``'s, which
    sends ``vector`` signed for ``weight`` samples."""
    sent, weights = list(w.honest), [WEIGHT] * len(w.honest)
    sent[sender], weights[sender] = vector, weight
    return sent, weights


def pick_every_affordable(monkeypatch) -> None:
    """A member's own randomness picks every sender it can afford at all (``FitBudget.afford`` > 0): what
    it then scores is the budget's doing alone."""
    monkeypatch.setattr(sendercheck, "os", SimpleNamespace(urandom=lambda n: bytes(n)))


def one_round(w, checks: SenderChecks, runner, entries: list[bytes] | None = None) -> None:
    """One complete round's sender checks at ``runner`` (it validated no part); ``entries``: the members'
    signed group entries (``w.entries`` if None)."""

    async def scenario():
        await checks.keep(runner, w.entries if entries is None else entries)
        await checks.check(runner, [])
        await checks.filed()

    asyncio.run(scenario())


def record_replays(monkeypatch) -> list[str]:
    """The peers whose contributions ``WrongContributionEvidence.judge`` replays from now on, in order."""
    replayed = []
    real = WrongContributionEvidence.judge

    def recording(self, *args, **kwargs):
        replayed.append(self.accused)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(WrongContributionEvidence, "judge", recording)
    return replayed


def judge(w, lie, accuser: str) -> tuple[str, str | None]:
    """The coordinator's judgment of ``lie`` filed by ``accuser``, which serves the round's state."""
    return asyncio.run(
        judge_contribution(
            w.run,
            lambda: run_layouts(w.run),
            lie.to_bytes(),
            lie.accused,
            accuser,
            states=ServedStates(DecodedState(STEP, w.tensors, {}, w.hash)),
            judging=asyncio.Lock(),
            timeout_s=30,
        )  # fmt: skip
    )
