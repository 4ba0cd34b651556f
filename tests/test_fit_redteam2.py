"""A second attacker's read of the fit scores, after d193521 and 6e87c78 (``fit_draw`` over the chunk's other
signed inputs, a drawn micro-batch every step, the first inner step in diloco). Each test PASSES while the
defect it names is present; its docstring gives the severity, the attack, and what should happen instead.
Same world as ``tests/test_fit_redteam.py`` (``tests/ownpart.py``: a group of four, each member the reducer
of its own part, one chunk a part, validators that practically never draw; the round is at ``STEP``, ``old``
the state one step before it).
"""

from __future__ import annotations

import pytest
import torch
from ownpart import (
    LIAR,
    MEMBERS,
    STEP,
    WEIGHT,
    make_world,
    reducer_after_round,
    trained,
)

from lab.localswarm import tiny_run
from swarm.averaging.scores import fits_poorly
from swarm.averaging.verification import own_part_evidence
from swarm.training.contribution import (
    fit_draw,
    fit_micro_batches,
    flagged_senders,
    micro_gradient,
    recompute,
)

pytestmark = pytest.mark.timeout(300)

RUN = tiny_run("fit-redteam", verify_probability=1e-9, sender_check_probability=1e-9)
#: How much of the sign of the last round's averaged gradient the stale liar adds (relative to its norm).
SHADE = 0.15


@pytest.fixture(scope="module")
def world():
    old, now, averaged = trained(RUN, [1])[1]
    w = make_world(RUN, now)
    w.old, w.averaged = old, averaged
    return w


def _stale(w) -> torch.Tensor:
    """The liar's honest contribution of the step before (two micro-batches at the old state): the
    ``delayed_gradient`` attack."""
    return recompute(w.run, w.old, w.members[LIAR], STEP - 1, 2, device="cpu")


def _shaded(stale: torch.Tensor, averaged: torch.Tensor) -> torch.Tensor:
    """The stale contribution plus a little of the sign of the last round's averaged gradient, which every
    member received: no gradient computed at all."""
    sign = torch.sign(averaged)
    return stale + SHADE * sign * (stale.norm() / sign.norm())


def _sending(w, liar_sends: torch.Tensor) -> list[torch.Tensor]:
    sent = list(w.honest)
    sent[LIAR] = liar_sends
    return sent


def _poor_and_flagged(w, sent: list[torch.Tensor]) -> tuple[int, int]:
    """(how many (reducer, micro-batch) pairs find the liar's fit poor, how many reducers flag it as standing
    out), over every other reducer's chunk and each of the liar's two micro-batches."""
    liar = w.members[LIAR]
    gradients = [micro_gradient(w.run, w.tensors, liar, STEP, m, device="cpu") for m in range(2)]
    poor = flagged = 0
    for part in range(MEMBERS):
        if part == LIAR:
            continue
        runner = reducer_after_round(w, part, sent)
        chunk = own_part_evidence(runner, 0)
        decoded = chunk.checked_inputs(w.codec, w.numel)
        lo, hi = runner.chunk_range(part, 0)
        poor += sum(fits_poorly(decoded, LIAR, g[lo:hi]) for g in gradients)
        flagged += LIAR in flagged_senders(w.run, chunk.inputs, decoded, validator=part)[1]
    return poor, flagged


def test_a_stale_sender_that_adds_the_sign_of_the_last_averaged_gradient_still_fits_poorly(world):
    """Was MEDIUM. The fit compared the sender's residual with the sign of its micro-batch's gradient, which
    shares much of the common direction's sign, while the other inputs' residuals share none: a stale
    sender (``delayed_gradient``) that added 15% of its norm of the sign of the last round's averaged
    gradient, which every member holds, passed every fit with no gradient computed (across 4 training
    depths the fit caught the plain stale input in 9 of 24 (reducer, micro-batch) pairs, the shaded one in
    0). Now the gradient's share of the inputs' common centre is taken out of the reference
    (``scores.fit``), so what is compared is what the batch adds: the shaded input fits poorly as often
    as the plain one, and honest fits stay above the median in nearly every pair."""
    w = world
    stale = _stale(w)
    assert _poor_and_flagged(w, _sending(w, _shaded(stale, w.averaged)))[0] >= 1
    plain = shaded = 0
    for old, now, averaged in trained(RUN, [2, 8, 16]).values():
        d = make_world(RUN, now)
        stale = recompute(RUN, old, d.members[LIAR], STEP - 1, 2, device="cpu")
        plain += _poor_and_flagged(d, _sending(d, stale))[0]
        shaded += _poor_and_flagged(d, _sending(d, _shaded(stale, averaged)))[0]
    assert shaded >= 6 and plain >= 6, (plain, shaded)  # measured: 9 and 11 of 18


def test_a_reducer_cannot_steer_the_fit_draw_by_re_signing_its_own_input(world):
    """Was LOW. ``fit_draw`` hashed the signatures of every other input, the reducer's own among them, which
    it signs last and may re-sign at will (a value nudged within tolerance, or a fresh Ed25519 nonce): in
    about R - 1 tries the draw named any groupmate it chose, to be put to the coordinator, which then
    downloaded a state for it. Now the reducer's own input is left out of the hash: no nudge of it moves
    the draw for any sender. (With the reveals, the chunk must also be the round's drawn chunk of the part,
    ``check_fit_scorer``.)"""
    w = world
    micro_batches = fit_micro_batches(w.run, WEIGHT)
    for accuser in range(MEMBERS):
        lo, _ = reducer_after_round(w, accuser, w.honest).chunk_range(accuser, 0)
        first = own_part_evidence(reducer_after_round(w, accuser, w.honest), 0)
        draws = {v: fit_draw(first, v, micro_batches) for v in range(MEMBERS) if v != accuser}
        for j in range(16):
            own = w.honest[accuser].clone()
            own[lo + j] *= 1.0001
            sent = list(w.honest)
            sent[accuser] = own
            chunk = own_part_evidence(reducer_after_round(w, accuser, sent), 0)
            assert {v: fit_draw(chunk, v, micro_batches) for v in draws} == draws, (accuser, j)
