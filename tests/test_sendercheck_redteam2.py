"""Ways into the sender checks left by their first fixes (3a1bd71), found by a second attacker's read; each
test failed there (it was written to pass while the defect was present) and passes on its fix. In
process, following ``tests/test_sendercheck_redteam.py``. A third finding stays open (docs/robustness.md,
"Checked senders"): a liar that reveals its nonce only in rounds whose draw spares it is never filed.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from types import SimpleNamespace

import pytest
import torch
from hivemind.p2p import PeerID

from coordinator.accusations import run_layouts
from lab.localswarm import tiny_run
from protocols.keys import SigningKey
from swarm.averaging.allreduce import ButterflyAllReduce, RoundSettings
from swarm.averaging.compression import get_codec
from swarm.averaging.evidence import (
    chunk_bounds,
    drawn_validator,
    layout_chunk_values,
    split_bounds,
)
from swarm.averaging.verification import assignments
from swarm.config import RunConfig
from swarm.models import build_model
from swarm.training.sendercheck import (
    SenderChecks,
    drawn_sender,
)
from swarm.training.state import build_optimizer, state_hash, state_tensors

pytestmark = pytest.mark.timeout(60)

STEP = 3
KEYS = [SigningKey.generate() for _ in range(3)]
MEMBERS = tuple(k.peer_id for k in KEYS)
LIAR, VALIDATOR, PART = 1, 0, 2  # the liar's flipped chunk lies in part 2, which member 0 validates


def _nonce(i: int, salt: bytes = b"") -> bytes:
    return hashlib.sha256(b"redteam2-nonce" + salt + bytes([i])).digest()


def _run(run_id: str, **training) -> RunConfig:
    return tiny_run(run_id, **{"verify_probability": 1.0, "sender_check_probability": 1.0, **training})


def _numel(run: RunConfig) -> int:
    return run_layouts(run)[run.run_id.replace(".", "_")]


def _chunks(run: RunConfig, members: int) -> list[int]:
    codec = get_codec(run.training.compression)
    bounds = split_bounds(_numel(run), members)
    values = layout_chunk_values(members, codec.bytes_per_value)
    return [len(chunk_bounds(bounds[p + 1] - bounds[p], values)) - 1 for p in range(members)]


def _provably_drawn(run: RunConfig, seed: bytes, sender: int, members: int = 3) -> list[tuple[int, int, int]]:
    """(validator, part, chunk) of every check the round's full draw ``seed`` gives where the replayed
    sender is ``sender``: the checks whose evidence the coordinator accepts (``check_draw``)."""
    t, chunks, found = run.training, _chunks(run, members), []
    for v in range(members):
        if v == sender:
            continue
        for a in assignments(seed, members, v, t.verify_probability, chunks):
            others = [i for i in range(members) if i != v]
            if drawn_sender(seed, a.part, a.chunk, others, t.sender_check_probability) == sender:
                found.append((v, a.part, a.chunk))
    return found


def test_a_withheld_reveal_no_longer_holds_every_round():
    """Before: ``SenderChecks.keep`` ran inside ``average()`` with the averager's lock held and waited up to a
    second for ``runner.revealed``; one member that kept its stream open without revealing made every
    member's round wait that second, every round. Now ``keep`` waits for nothing: without the draw it
    copies the state on a worker thread (``check`` drops the copy after the round's checks)."""
    run = _run("withhold-copies", verify_probability=1e-9)
    model = build_model(run.model.name, run.model.config, seed=run.training.seed)
    tensors = state_tensors(model, build_optimizer(model, run.optimizer))
    hash_ = state_hash(STEP, tensors)
    reads = []
    checks = SenderChecks(run, device="cpu", state=lambda: reads.append(1) or (STEP, hash_, tensors))

    async def scenario():
        never = asyncio.get_running_loop().create_future()  # the withholder's reveal never comes in time
        started = time.monotonic()
        for i in range(2):
            runner = SimpleNamespace(
                group_id=bytes([i]), members=list(MEMBERS), peer_ids=list(MEMBERS), index=0, revealed=never,
                shared_seed=None, part_chunks=[[0, 1]] * 3, reducers=(), reduces=lambda part: False,
            )  # fmt: skip
            await checks.keep(runner, [b"", b"", b""])
        return time.monotonic() - started

    waited = asyncio.run(scenario())
    assert waited < 0.5, waited  # was a second a round, with the averager's lock held
    assert len(reads) == 2 and len(checks.pending) == 2  # without the draw, a copy on a worker thread


def test_a_member_that_reduces_no_part_is_never_drawn_to_validate():
    """Before: a member nobody can dial reduces no part, so nobody streams to it and no reveal reaches it:
    its ``shared_seed`` is always None. Yet ``drawn_validator`` named it as a part's validator like any
    member, so the chunks drawn for it were never provably checked (the coordinator takes evidence only
    from the drawn validator). Now only members that reduce a part are drawn."""
    peers = [PeerID.from_base58(m) for m in MEMBERS]
    run = _run("client-mode")
    settings = RoundSettings(
        p2p=SimpleNamespace(peer_id=peers[0]), servicer_type=None, prefix="p", aggregator=None,
        codec=get_codec(run.training.compression), sender_timeout_s=1.0,
    )  # fmt: skip
    nonces = [_nonce(i) for i in range(3)]
    runner = ButterflyAllReduce(
        settings, group_id=b"g", peer_ids=peers, weight=8.0, local=torch.zeros(5000), nonce=nonces[0],
        commitments=[hashlib.sha256(n).digest() for n in nonces], reducers=[False, True, True],
    )  # fmt: skip
    assert runner.refusal is None and not runner.reduces(0)
    assert runner._senders == {0} and runner.heard == {0}  # no reveal is awaited, or can arrive
    assert runner.shared_seed is None  # so its draw is always its own: sender checks never file
    seeds = [hashlib.sha256(bytes([i])).digest() for i in range(64)]
    drawn = {drawn_validator(s, p, 3, runner.reducers) for s in seeds for p in (1, 2)}
    assert 0 not in drawn and drawn == {1, 2}, drawn  # each reducer checks the other's part
    assert runner.reducers == (False, True, True)
