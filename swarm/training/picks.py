"""Which senders of a round a member replays, and which claims need no replay: the picks of sender checks.

``drawn_sender`` is the sender the round's draw names for a replay; ``flagged_senders`` the ones whose input
stands out among a chunk's (``swarm.averaging.scores``) and ``outlier_to_replay`` the one of those a
validator replays; ``own_part_replayers`` the reducers that replay a sender standing out in their own parts;
``fit_draw`` whether a reducer scores a sender's fit to one of its own micro-batches, and which
(``fit_micro_batches``); ``whole_micro_batches`` the micro-batches behind a signed sample count, or the
claim the built-in loop never signs. Pure functions of the round's signed bytes and the run's config, so a
validator and the coordinator compute them alike (``swarm.training.contribution``).

Example::

    sender = drawn_sender(seed, part, chunk, candidates, run.training.sender_check_probability)
    scores, micro = fit_draw(scored_chunk, sender, fit_micro_batches(run, weight))
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Callable, Sequence

import torch

from protocols.errors import ProtocolError
from swarm.averaging.evidence import BadAggregateEvidence, SignedInput
from swarm.averaging.scores import flagged
from swarm.config import RunConfig, window_stretch

#: Reducers that replay a sender standing out among the inputs of their own parts (``own_part_replayers``):
#: more than one, so a colluding reducer the draw names cannot shield a liar from every honest one.
OWN_PART_REPLAYERS = 2


def drawn_sender(
    seed: bytes, part: int, chunk: int, senders: Sequence[int], probability: float
) -> int | None:
    """The sender whose contribution to ``chunk`` of ``part`` the round's draw ``seed`` names for a
    recompute, among ``senders`` (member indices); None when the draw names nobody."""
    if not senders or probability <= 0:
        return None
    draw = hashlib.sha256(b"sender-check|" + seed + struct.pack(">II", part, chunk)).digest()
    if int.from_bytes(draw[:8], "big") / 2**64 >= probability:
        return None
    ordered = sorted(senders)
    return ordered[int.from_bytes(draw[8:16], "big") % len(ordered)]


def whole_micro_batches(run: RunConfig, samples: float) -> int:
    """The micro-batches behind a claim of ``samples``; ProtocolError for a claim the built-in loop never
    signs: not a whole number of micro-batches, or more than it holds before a round is due (every step:
    the target batch, less one sample; diloco: ``inner_steps`` inner steps, the whole window of a run
    whose windows are replayed, ``swarm.config.window_stretch``)."""
    training = run.training
    micro, target = training.micro_batch_size, training.target_batch_size
    if not (math.isfinite(samples) and samples == int(samples) and samples > 0 and int(samples) % micro == 0):
        raise ProtocolError(
            f"signed for {samples:g} samples, not a whole number of {micro}-sample micro-batches"
        )
    if training.sync == "diloco":
        most = math.ceil(window_stretch(training) * training.inner_steps)
        if samples > most * micro:
            raise ProtocolError(
                f"signed for {samples:g} samples; a window ends after {most} inner steps of {micro} samples"
            )
    elif samples >= target + micro:
        raise ProtocolError(
            f"signed for {samples:g} samples; a peer stops computing at the target batch {target}"
        )
    return int(samples) // micro


def flagged_senders(
    run: RunConfig,
    inputs: Sequence[SignedInput],
    decoded: Sequence[torch.Tensor],
    *,
    validator: int,
    lenient: bool = False,
) -> tuple[list[int], list[int]]:
    """The member indices of the senders among ``inputs`` (one chunk's, ``decoded`` their values) that
    stand out enough to be replayed (``swarm.averaging.scores.flagged``): those that signed a weight the
    loop never signs, and those whose values stand out; never the ``validator`` itself, and nobody when
    the run does not replay outliers."""
    if not run.training.replay_outliers:
        return [], []

    def claim_ok(weight: float) -> bool:
        try:
            whole_micro_batches(run, weight)
        except ProtocolError:
            return False
        return True

    claims, odd = flagged(
        decoded, [item.weight for item in inputs],
        candidates=[k for k, item in enumerate(inputs) if item.sender_index != validator],
        claim_ok=claim_ok, lenient=lenient,
    )  # fmt: skip
    return [inputs[k].sender_index for k in claims], [inputs[k].sender_index for k in odd]


def outlier_to_replay(
    claims: Sequence[int], odd: Sequence[int], *, seed: bytes, part: int, chunk: int, drawn: int | None
) -> int | None:
    """Which flagged sender (``flagged_senders``) a validator replays, other than the ``drawn`` one: a false
    weight first (judged without a replay), else one of those whose values stand out, by the round's draw
    ``seed``, so that an honest decoy that stands out more cannot shield a liar; None if none."""
    claims = [i for i in claims if i != drawn]
    if claims:
        return claims[0]
    odd = sorted(i for i in odd if i != drawn)
    if not odd:
        return None
    pick = hashlib.sha256(b"outlier-replay|" + seed + struct.pack(">II", part, chunk)).digest()
    return odd[int.from_bytes(pick[:8], "big") % len(odd)]


def own_part_replayers(
    seed: bytes, members: int, reduces: Callable[[int], bool], sender: int, count: int = OWN_PART_REPLAYERS
) -> tuple[int, ...]:
    """The reducers that replay ``sender`` when it stands out among a round's inputs to the reducers' own
    parts, by the round's draw ``seed``: ``count`` of the ``members`` that reduce a part (``reduces``),
    other than the sender (fewer if fewer do), in the draw's order."""
    reducers = _other_reducers(members, reduces, sender)

    def rank(member: int) -> bytes:
        return hashlib.sha256(b"own-part-replay|" + seed + struct.pack(">II", sender, member)).digest()

    return tuple(sorted(reducers, key=rank)[:count])


def own_part_replay_share(
    members: int, reduces: Callable[[int], bool], sender: int, count: int = OWN_PART_REPLAYERS
) -> float:
    """The share of the reducers other than ``sender`` that ``own_part_replayers`` names: the chance with
    which each replays ``sender`` by its own randomness where the round's draw is not shared."""
    return min(1.0, count / max(1, len(_other_reducers(members, reduces, sender))))


def _other_reducers(members: int, reduces: Callable[[int], bool], sender: int) -> list[int]:
    return [i for i in range(members) if i != sender and reduces(i)]


def fit_micro_batches(run: RunConfig, weight: float) -> int:
    """Among how many of a sender's micro-batches (signed ``weight``) its fit may be scored: every step,
    each of them (all at the round's state); in diloco, only the window's first inner step. Another inner
    step's batch was taken some steps in, and its gradient at the window's start fits an honest window
    too loosely (measured: honest fits below the others' median in about one chunk in five against the
    sixth or tenth inner step, none against the first). ProtocolError for a weight the loop never signs."""
    micro_batches = whole_micro_batches(run, weight)
    return 1 if run.training.sync == "diloco" else micro_batches


def fit_draw(scored: BadAggregateEvidence, sender: int, micro_batches: int) -> tuple[bool, int]:
    """Whether the reducer of ``scored``'s chunk scores the fit of ``sender``'s input to it, and against which
    of its ``micro_batches`` micro-batches (``fit_micro_batches``), by a hash of the round, the chunk, the
    sender and the signatures of the chunk's inputs from *other senders than it and the reducer*. The sender
    signs before it can know those (an Ed25519 signature needs its signer's key), so it cannot tell which
    micro-batch will be scored, or by whom, unless every other sender colludes with it; the reducer signs
    none of them, so it cannot re-sign its own input until the draw names a groupmate it wants put to the
    coordinator. No reveal is needed, so withholding one changes nothing; the coordinator recomputes it
    from the evidence.
    Each reducer that may score the sender does so with probability one over their number (the members that
    reduce a part, less the sender): one fit a sender a round, in expectation."""
    others = [
        x.signature for x in sorted(scored.inputs, key=lambda x: x.sender_index)
        if x.sender_index not in (sender, scored.part)
    ]  # fmt: skip
    pick = hashlib.sha256(
        b"fit|" + scored.digest + struct.pack(">III", scored.part, scored.chunk, sender) + b"".join(others)
    ).digest()
    reduces = scored.reducers or (True,) * len(scored.members)
    reducers = sum(1 for i, r in enumerate(reduces) if r and i != sender)
    scores = int.from_bytes(pick[:8], "big") < 2**64 // max(1, reducers)
    return scores, int.from_bytes(pick[8:16], "big") % max(1, micro_batches)


__all__ = [
    "OWN_PART_REPLAYERS",
    "drawn_sender",
    "fit_draw",
    "fit_micro_batches",
    "flagged_senders",
    "outlier_to_replay",
    "own_part_replay_share",
    "own_part_replayers",
    "whole_micro_batches",
]
