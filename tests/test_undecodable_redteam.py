"""Red team of the no-draw filing of a sender whose validly signed input does not decode (commit 7c6f2e8:
``PartReducer.undecodable``, ``SenderChecks._refused``, ``WrongContributionEvidence.undecodable`` and
``check_draw``'s early ``True``): two ways in, each shown by a test here on 7c6f2e8 (asserting the bad
outcome) and now checking its fix. In process, with the real
model, dataset, fp16 codec, signatures, ``SenderChecks`` and the coordinator's ``judge_contribution``; the
world is a tiny run in a group of four, each member the reducer of its own part's one chunk
(``tests/ownpart.py``). A reducer that refused a sender's input never reads that sender's nonce
reveal (``PartReducer.consume`` returns before ``check_reveal``), so it holds no shared draw: the worlds
below are the ones the change itself creates, with ``shared_seed`` None and that sender's reveal missing.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from ownpart import (
    MEMBERS,
    STEP,
    WEIGHT,
    chunk_of,
    judge,
    make_world,
    one_round,
    reducer_holding,
    sender_checks,
    signed_input,
)

import swarm.training.contribution as contribution
from lab.localswarm import tiny_run
from protocols.errors import ProtocolError
from swarm.averaging.compression import get_codec
from swarm.averaging.verification import round_of
from swarm.config import sender_tolerance
from swarm.models import build_model
from swarm.training import sendercheck
from swarm.training.contribution import WrongContributionEvidence
from swarm.training.peer import TrainingPeer
from swarm.training.sendercheck import compare, recompute
from swarm.training.state import build_optimizer, state_tensors

pytestmark = pytest.mark.timeout(120)

RUN = tiny_run("undecodable-redteam", verify_probability=1e-9, sender_check_probability=1e-9)
CODEC = get_codec(RUN.training.compression)  # fp16, the default
# What another device gives for the same gradient (summation order, fused or TF32 kernels): a relative
# difference of 2^-12, far inside the run's tolerance (``sender_tolerance``: 0.01 relative L2 in fp32).
DEVICE_ROUNDING = 2.0**-12
# The NaN a CUDA kernel writes (its canonical NaN, sign bit clear); x86 CPUs write 0xFFC00000 (sign set).
CUDA_NAN = torch.tensor([0x7FFFFFFF], dtype=torch.int32).view(torch.float32)[0]


@pytest.fixture(scope="module")
def base_tensors():
    model = build_model(RUN.model.name, RUN.model.config, seed=RUN.training.seed)
    return state_tensors(model, build_optimizer(model, RUN.optimizer))


def _check_round(w, runner) -> list:
    """One round's sender checks at ``runner`` (it validated no part); what it filed: (peer, lie, verdict)."""
    accused = []
    one_round(w, sender_checks(w, accused), runner)
    return accused


# --- 1. an honest sender (or its honest validator) banned for a gradient that is not finite ---------------


@pytest.fixture(scope="module")
def unstable(base_tensors):
    """A finite state (it passes ``load_state_tensors``) on which some members' own micro-batches blow up:
    the final layer norm's gain at 1.2e37, a run on the edge of diverging. Other members' gradients stay
    finite (asserted), so rounds complete and a blown-up sender is refused only where its values are not
    finite. Found: a sender ``h`` and a part ``p`` whose chunk of ``h``'s CPU replay holds NaNs and also
    finite values of ordinary size, which fp16 does not saturate."""
    tensors = {k: v.clone() for k, v in base_tensors.items()}
    tensors["model/head.ln.weight"] = tensors["model/head.ln.weight"] * 1.2e37
    w = make_world(RUN, tensors)
    replays = w.honest  # each member's CPU replay on this state
    assert any(torch.isfinite(r).all() for r in replays), "every member's gradient blew up on this state"
    for h, replay in enumerate(replays):
        for p in range(MEMBERS):
            lo, hi = chunk_of(w, p)
            chunk = replay[lo:hi]
            ordinary = torch.isfinite(chunk) & (chunk != 0) & (chunk.abs() < 1.0)
            if p != h and torch.isnan(chunk).any() and int(ordinary.sum()) >= 16:
                w.h, w.p, w.lo, w.hi, w.replay = h, p, lo, hi, replay
                w.base = base_tensors
                return w
    pytest.fail("no member's replay is partly non-finite on this state")


def _device(values: torch.Tensor, *, rounding: bool, cuda_nan: bool) -> torch.Tensor:
    """``values`` (a CPU replay) as another device computes them: its finite values off by that device's
    rounding, and/or its NaNs with the sign bit a CUDA kernel writes."""
    out = values.clone()
    finite = torch.isfinite(out)
    if rounding:
        out[finite] = out[finite] * (1 + DEVICE_ROUNDING)
    if cuda_nan:
        out[torch.isnan(out)] = CUDA_NAN
    return out


@pytest.mark.parametrize("case", ["sender_rounding", "sender_cuda_nan", "validator_on_gpu"])
def test_an_honest_peer_whose_gradient_is_not_finite_signs_nothing_and_nobody_is_banned_for_it(
    unstable, monkeypatch, case
):
    """Was MEDIUM. Fault, no attacker needed: an honest peer whose own micro-batches gave a gradient holding
    a NaN (a loss spike on a run near divergence) signed and sent it; each reducer refused it, replayed it
    and filed with no draw, and ``compare`` gave a chunk that does not decode no tolerance: (a) a GPU sender
    whose finite values differ from the CPU's by rounding ``compare`` accepts, (b) one whose NaN bits are
    CUDA's, not x86's, were banned, and (c) an honest GPU reducer was banned as a false accuser of a CPU
    sender. Now an honest peer never signs a contribution that is not finite (``TrainingPeer.
    _own_contribution`` stops it: the model has diverged, as fp16's loss scaling reports), and a replay
    whose chunk is not finite convicts nobody, at the reducer (it files nothing) and at the coordinator."""
    w = unstable
    h, p, lo, hi = w.h, w.p, w.lo, w.hi
    tolerance = sender_tolerance(RUN.training)
    finite = recompute(RUN, w.base, w.members[h], STEP, 2, device="cpu")[lo:hi]
    rounded = _device(finite, rounding=True, cuda_nan=False)
    assert compare(CODEC.encode_contribution(rounded), finite, CODEC, tolerance, sender="h") is None

    # The honest sender stops instead of signing it.
    stand_in = SimpleNamespace(
        step=STEP, samples=WEIGHT, strategy=SimpleNamespace(contribution=lambda s: w.replay)
    )
    with pytest.raises(FloatingPointError, match="not finite"):
        TrainingPeer._own_contribution(stand_in)

    # And were such an input signed (an older peer, a device that blew up where the CPU did not), neither
    # the reducer nor the coordinator convicts anyone on a replay that is not finite.
    if case == "validator_on_gpu":
        sent = w.replay
        real = contribution.recompute

        def gpu_replay(*args, **kwargs):  # the reducer's own replay, on another device
            return _device(real(*args, **kwargs), rounding=True, cuda_nan=True)

        monkeypatch.setattr(contribution, "recompute", gpu_replay)
    else:
        sent = _device(w.replay, rounding=case == "sender_rounding", cuda_nan=case == "sender_cuda_nan")
    data = CODEC.encode_contribution(sent[lo:hi])
    with pytest.raises(ProtocolError):
        CODEC.decode_contribution(data, hi - lo, sender="h")
    others = [q for q in range(MEMBERS) if q != h]
    clean = {q: torch.zeros(hi - lo) for q in others}
    inputs = [signed_input(w, q, p, CODEC.encode_contribution(clean[q])) for q in others]
    runner = reducer_holding(w, p, inputs, [clean[q] for q in others], heard=set(range(MEMBERS)) - {h})
    item = signed_input(w, h, p, data)
    runner.reducer.undecodable = {h: (0, item)}
    monkeypatch.setattr(sendercheck.os, "urandom", lambda n: bytes(n))  # the reducer replays it
    assert _check_round(w, runner) == []  # the reducer files nothing
    monkeypatch.undo()
    lie = WrongContributionEvidence(**round_of(runner, p, 0), item=item, entry=w.entries[h], reveals=())
    found, guilty = judge(w, lie, w.members[p])
    assert guilty is None and "not finite" in found, (found, guilty)


# --- 2. an undecodable decoy uses up every reducer's one stand-out replay of the round ----------------------


@pytest.fixture(scope="module")
def stable(base_tensors):
    return make_world(RUN, base_tensors)


def test_an_undecodable_decoy_no_longer_shields_a_liar_that_stands_out(stable, monkeypatch):
    """Was LOW. A colluder D sent every reducer a validly signed NaN chunk while a liar L sent a reversed
    gradient (it stands out in every chunk). The replay of D's refused input took the round's one stand-out
    replay at every reducer, so L was replayed by nobody in each round it brought a fresh decoy. Now the
    refused input's replay is one of its own: both are replayed and filed. (Without the decoy's reveal a
    reducer replays its refused input by its own randomness, ``tests/test_decoy_filings.py``; here it does.)"""
    w = stable
    monkeypatch.setattr(sendercheck.os, "urandom", lambda n: bytes(n))
    liar, dcy, reducer = 1, 3, 0
    lo, hi = chunk_of(w, reducer)
    values = {0: w.honest[0][lo:hi], 1: -w.honest[liar][lo:hi], 2: w.honest[2][lo:hi]}
    inputs = [signed_input(w, q, reducer, CODEC.encode_contribution(v)) for q, v in values.items()]
    decoded = [CODEC.decode_contribution(x.data, hi - lo, sender="x") for x in inputs]
    runner = reducer_holding(w, reducer, inputs, decoded, heard=set(range(MEMBERS)) - {dcy})
    nan = CODEC.encode_contribution(torch.full((hi - lo,), float("nan")))
    runner.reducer.undecodable = {dcy: (0, signed_input(w, dcy, reducer, nan))}
    filed = _check_round(w, runner)
    assert sorted(a[0] for a in filed) == sorted([w.members[dcy], w.members[liar]]), filed
