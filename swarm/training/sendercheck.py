"""Sender checks: a drawn validator recomputes a groupmate's contribution from public facts and proves a lie.

In ``every_step`` training on the built-in loop, what a peer sends to a round is a pure function of public
facts (``swarm.training.replay``): the state every member holds at the round's step, whose step and hash
the member signed into its group entry; the run's dataset; and the batch seeds of as many micro-batches
as the samples it signed for. So a groupmate can recompute it:

1. When a round completes, before the step's update, a member copies the state on a worker thread
   (``SenderChecks.keep``; one copy of the model and optimizer tensors, dropped after the round's checks;
   skipped when the draw is already known and gives this member no part to check).
2. After the round's reveals each validator collects the signed inputs of the chunk it was drawn to check
   (``swarm.averaging.verification``). The same draw names, with ``training.sender_check_probability``,
   one member other than the validator (``drawn_sender``); nobody knew who or which chunk when they
   signed. The validator replays that member's micro-batches on the copy, encodes the chunk with the
   round's codec and compares (``compare``): the same bytes, or decoded values within the run's
   tolerance (``swarm.config.sender_tolerance``: relative L2, 0.01 in fp32 and 0.05 in bf16).
3. A contribution beyond the tolerance is ``WrongContributionEvidence``: the sender's signed input, its
   signed group entry (the step and state hash it computed at, bound to the round by its nonce
   commitment), the round and its reveals (which fix the draw). The validator files it and keeps the
   state, served by its hash (``StateServicer``'s ``find``), while the accusation is in flight and for
   ``KEEP_S`` after (the coordinator downloads it at its recompute's turn). The coordinator checks the
   draw named this accuser, chunk and sender, downloads that state from the accuser, checks that it
   hashes to what the accused signed, recomputes the chunk itself and bans whoever the evidence proves
   wrong (``coordinator.contributions``). Without every member's reveal the validator draws from its own
   randomness and only avoids a liar it finds (``suspect``): the coordinator could not tell it was drawn.

What it covers: a sender that scales, flips, replaces, delays or computes on other labels any part of its
gradient is caught when the drawn chunk is one it changed; one that changes a fraction q of its chunks
is caught with probability about q per check. Rounding of other device kinds (GPU kernels, bf16, memory
chunking) stays within the tolerance, so a peer on another device is not accused; a lie smaller than the
tolerance is bounded by it and by the robust rule. In ``diloco`` the contribution is the window's
pseudo-gradient, replayed from the synced state at the outer step with a fresh inner optimizer
(``swarm.config.resets_inner_state``), every checked window exactly ``inner_steps`` long. Not covered:
diloco windows that are not public facts or that rounding could not tell from a lie (topk's error
feedback, ``outer_overlap``, a kept inner optimizer, bf16: ``swarm.config.window_replay_obstacle``),
bounded by the rule only, and runs whose peers train on their own data (``Collaboration`` refuses a run
that checks senders). Open: a reducer
holds the others' nonces before it sends its own, so a liar can withhold its nonce in just the rounds
whose draw would replay it (docs/robustness.md).

Example::

    checks = SenderChecks(run, device="cpu", state=lambda: (peer.step, peer.state_hash, tensors))
    averager.sender_checks = checks          # keep() at each complete round, check() after validation
    servicer = StateServicer(run_id, provider, admit=admit, find=checks.find)
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import os
import struct
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from protocols.codec import pack
from protocols.envelope import open_envelope
from protocols.errors import ProtocolError, SwarmError
from protocols.messages import JUDGING_BUDGET_S
from swarm.averaging.archive import KEEP_INPUTS_S
from swarm.averaging.compression import Codec
from swarm.averaging.evidence import (
    NONCE_BYTES,
    BadAggregateEvidence,
    RoundEvidence,
    SignedInput,
    bytes_field,
    chunk_bounds,
    draw_seed,
    layout_chunk_values,
    round_fields,
    signed_input,
    split_bounds,
)
from swarm.averaging.groups import GROUP_ENTRY, GroupEntryBody
from swarm.averaging.scores import flagged
from swarm.averaging.verification import Assignment, assignments, draw
from swarm.config import RunConfig, replayable_windows, sender_checks_on, sender_tolerance, window_stretch
from swarm.training.diloco import DilocoReplica, flat_params
from swarm.training.replay import honest_gradients, public_dataset, replay_window
from swarm.training.state import encode_state
from swarm.training.sync import EncodedState, is_state_hash

logger = logging.getLogger(__name__)

KIND = "wrong_contribution"
#: The fields of a scored chunk in ``wrong_contribution`` evidence (``BadAggregateEvidence``'s, less the
#: round fields it shares with the evidence) and the round fields it takes from the evidence.
SCORED_KEYS = ("signer", "numel", "inputs", "output", "output_signature", "entries", "signed_at_ms")
ROUND_KEYS = ("prefix", "group_id", "members", "commitments", "part", "chunk", "reducers")
#: How long a validator serves the state a lie was recomputed on once its accusation is answered (or given
#: up): as long as reducers keep their inputs.
KEEP_S = KEEP_INPUTS_S
#: States a validator holds at once for the coordinator (each one copy of the model and optimizer).
MAX_KEPT = 2
#: Rounds whose state awaits its check (a new round's copy pushes out the oldest).
MAX_PENDING = 2
#: Checked chunks a validator scores in a round, looking for a sender that stands out (``_outlier``).
MAX_SCORED_CHUNKS = 4
#: How far beyond the tolerance a validator's own replay must find a contribution before it files (as a share
#: of the tolerance): the coordinator convicts beyond the tolerance itself, so a lie placed at the edge, on
#: the side where the validator's replay rounds differently from the coordinator's, is only avoided.
ACCUSE_MARGIN = 0.1
#: Replays running or waiting their turn at once (each holds its round's state copy).
MAX_REPLAYS_DUE = 2
MAX_ENTRY_BYTES = 16 << 10

# (step, state hash, state tensors) of this peer now, read before the round's update is applied.
StateNow = Callable[[], tuple[int, str, dict[str, torch.Tensor]]]


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


def chunk_slice(
    vector_numel: int, members: int, part: int, chunk: int, chunk_values: int, reducers: Sequence[bool] = ()
) -> tuple[int, int]:
    """Where ``chunk`` of ``part`` lies in the averaged vector, by the run's layout; (0, 0) if nowhere."""
    bounds = split_bounds(vector_numel, members, reducers)
    chunks = chunk_bounds(bounds[part + 1] - bounds[part], chunk_values)
    if not 0 <= chunk < len(chunks) - 1:
        return 0, 0
    return bounds[part] + chunks[chunk], bounds[part] + chunks[chunk + 1]


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


def _scored(body: dict) -> BadAggregateEvidence | None:
    """The chunk evidence of a ``wrong_contribution`` body's ``scored`` map (None without one), with the
    round fields of the body itself."""
    scored = body.get("scored")
    if scored is None:
        return None
    if not isinstance(scored, dict) or not set(scored) <= set(SCORED_KEYS):
        raise ProtocolError(
            f"{KIND} evidence holds a scored chunk that is not a map of {', '.join(SCORED_KEYS)}"
        )
    return BadAggregateEvidence.from_body({**{k: v for k, v in body.items() if k in ROUND_KEYS}, **scored})


def recompute(
    run: RunConfig,
    tensors: dict[str, torch.Tensor],
    peer_id: str,
    step: int,
    micro_batches: int,
    *,
    device: str,
    deadline: float | None = None,
) -> torch.Tensor:
    """The flat contribution ``peer_id`` sends at ``step`` for ``micro_batches`` (``whole_micro_batches``)
    from the state ``tensors`` (``state_tensors``' names), replayed from its public batch seeds: the mean
    gradient every step, the window's pseudo-gradient in diloco (``tensors`` are then the synced model and
    outer optimizer, and the window starts with a fresh inner optimizer). A SwarmError when it cannot be
    (tensors that are not the run's state, a window nobody can replay, ``deadline`` passed)."""
    from swarm.models import build_model, model_config
    from swarm.training.state import build_optimizer, build_outer_optimizer, load_state_tensors

    training = run.training
    micro = training.micro_batch_size
    model = build_model(run.model.name, run.model.config, seed=training.seed).to(device)
    seq_len = int(model_config(run.model.name, run.model.config).seq_len)
    dataset = public_dataset(run.dataset.name, run.dataset.config)
    if training.sync == "diloco":
        if not replayable_windows(training):
            raise ProtocolError("this run's diloco windows cannot be replayed from public facts")
        load_state_tensors(model, build_outer_optimizer(model, run.outer_optimizer), tensors)
        replica = DilocoReplica(model, build_optimizer(model, run.optimizer), run)
        window = replay_window(
            replica, flat_params(replica.synced_params), dataset, run_id=run.run_id, peer_id=peer_id,
            step=step, micro_batches=micro_batches, seq_len=seq_len, precision=training.precision,
            device=device, deadline=deadline,
        )  # fmt: skip
        return window.detach().to("cpu", torch.float32)
    load_state_tensors(model, build_optimizer(model, run.optimizer), tensors)
    rows = honest_gradients(
        model, dataset, run_id=run.run_id, step=step, micro_batch=micro, seq_len=seq_len,
        peers={peer_id: micro_batches * micro}, precision=training.precision, device=device,
        deadline=deadline,
    )  # fmt: skip
    if rows is None:
        raise ProtocolError(f"no micro-batch of {peer_id} to replay")
    return rows[0].detach().to("cpu", torch.float32)


def compare(
    sent: bytes,
    expected: torch.Tensor,
    codec: Codec,
    tolerance: float,
    *,
    sender: str,
    what: str = "gradient",
) -> str | None:
    """Why ``sent`` (one chunk of ``sender``'s signed input) is not ``expected`` (the recomputed values of
    that chunk) as ``codec`` encodes it, or None if it is: the same bytes, or decoded values within
    ``tolerance`` of it, measured as ``|sent - expected| / max(|sent|, |expected|)`` (0 to 2)."""
    wanted = codec.encode_contribution(expected)
    if wanted == sent:
        return None
    numel = expected.numel()
    try:
        got = codec.decode_contribution(sent, numel, sender=sender).to(torch.float64)
    except ProtocolError as e:
        return f"sent a contribution that does not decode ({e})"
    ref = codec.decode_contribution(wanted, numel, sender="the recomputation").to(torch.float64)
    scale = max(float(torch.linalg.vector_norm(got)), float(torch.linalg.vector_norm(ref)))
    distance = float(torch.linalg.vector_norm(got - ref)) / scale if scale > 0 else 0.0
    if distance <= tolerance:
        return None
    return (
        f"sent a contribution {distance:.3g} away (relative L2) from its {what} recomputed from its public "
        f"batch seeds, beyond the tolerance {tolerance:g}"
    )


@dataclass(frozen=True)
class WrongContributionEvidence(RoundEvidence):
    """A sender's signed input to one chunk, and its signed group entry naming the state it computed at."""

    item: SignedInput
    entry: bytes
    # Every member's revealed nonce, in member order: they fix the round's draw, which must name the
    # accuser as the part's validator, this chunk, and the accused as the sender to replay.
    reveals: tuple[bytes, ...] = ()
    # For a sender replayed because its input stood out, not because the draw named it: the chunk's
    # signed aggregate and every input it aggregated, from which the coordinator scores the inputs again
    # (``swarm.averaging.scores``). Its round fields are this evidence's own.
    scored: BadAggregateEvidence | None = None

    kind = KIND

    @property
    def accused(self) -> str:
        return self.members[self.item.sender_index]

    def to_bytes(self) -> bytes:
        item = self.item
        return pack(
            {
                "kind": self.kind,
                **self._fields(),
                "item": [item.sender_index, item.data, item.signature, item.weight],
                "entry": self.entry,
                "reveals": list(self.reveals),
                **({"scored": self._scored_body()} if self.scored is not None else {}),
            }  # fmt: skip
        )

    def _scored_body(self) -> dict:
        body = self.scored._body()
        return {key: body[key] for key in SCORED_KEYS if key in body}

    @classmethod
    def from_body(cls, body: dict) -> WrongContributionEvidence:
        try:
            return cls(
                **round_fields(body), item=signed_input(body["item"]),
                entry=bytes_field(body["entry"], "the accused's group entry", MAX_ENTRY_BYTES),
                reveals=tuple(bytes_field(r, "a reveal", NONCE_BYTES) for r in body.get("reveals", ())),
                scored=_scored(body),
            )  # fmt: skip
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as e:
            raise ProtocolError(f"{KIND} evidence is malformed: {e!r}"[:300]) from None

    def facts(self) -> tuple[int, str]:
        """(step, state hash) the accused signed it computed its input at; ProtocolError (or a
        SecurityError) when the evidence does not hold: the input's signature, the entry's signature or
        signer, or an entry of another round (its nonce commitment is not the one the round names)."""
        if self.signer is not None:
            raise ProtocolError(f"{KIND} evidence names a substitute signer, which only aggregates have")
        accused = self.verify_input(self.item)
        envelope = open_envelope(
            self.entry, purpose=GROUP_ENTRY, run_id=self.prefix, what=f"group entry of {accused}"
        )
        if envelope.sender != accused:
            raise ProtocolError(
                f"the group entry in the evidence is signed by {envelope.sender}, not {accused}"
            )
        try:
            body = GroupEntryBody.model_validate(envelope.body)
        except Exception as e:  # pydantic's ValidationError: the entry's fields
            raise ProtocolError(f"the group entry of {accused} does not hold: {str(e)[:200]}") from None
        if not self.commitments or body.commit != self.commitments[self.item.sender_index]:
            raise ProtocolError(f"the group entry of {accused} is not the one it joined this round with")
        step, state_hash = body.extra.get("step"), body.extra.get("state_hash")
        if type(step) is not int or not 0 <= step < 2**62 or not isinstance(state_hash, str):
            raise ProtocolError(f"the group entry of {accused} names no step and state hash")
        if not is_state_hash(state_hash):
            raise ProtocolError(f"the group entry of {accused} names a state hash that is not 64 hex digits")
        return step, state_hash

    def check_draw(self, run: RunConfig, codec: Codec, vector_numel: int, accuser: str) -> bool:
        """That the round's draw (from ``reveals``) made ``accuser`` the validator of this chunk of this
        part and named the accused as the sender to replay (True); or, for evidence with a ``scored``
        chunk, that the draw named someone else and the chunk is one a group of the run can hold (False:
        the caller then runs ``check_stands_out``). ProtocolError otherwise. So an accuser replays only
        the chunk the round drew, and only the sender it drew or one whose input stands out there."""
        members = len(self.members)
        if len(self.reveals) != members or len(self.commitments) != members:
            raise ProtocolError(f"{KIND} evidence needs every member's commitment and reveal")
        if any(hashlib.sha256(r).digest() != c for r, c in zip(self.reveals, self.commitments, strict=True)):
            raise ProtocolError("evidence holds a reveal that does not match its member's commitment")
        if accuser not in self.members:
            raise ProtocolError("the accuser is not a member of the round")
        values = layout_chunk_values(members, codec.bytes_per_value)
        bounds = split_bounds(vector_numel, members, self.reducers)
        chunks = [len(chunk_bounds(bounds[p + 1] - bounds[p], values)) - 1 for p in range(members)]
        seed = draw_seed(self.digest, self.reveals)
        validator = self.members.index(accuser)
        drawn = assignments(
            seed, members, validator, run.training.verify_probability, chunks, reducers=self.reducers
        )
        if Assignment(self.part, self.chunk) not in drawn:
            raise ProtocolError(
                f"the round did not draw the accuser to check chunk {self.chunk} of part {self.part}"
            )
        candidates = [i for i in range(members) if i != validator]
        sender = drawn_sender(seed, self.part, self.chunk, candidates, run.training.sender_check_probability)
        if sender == self.item.sender_index:
            if self.scored is not None:  # a validator scores only for senders the draw did not name
                raise ProtocolError(f"{KIND} evidence against the drawn sender holds a scored chunk")
            return True
        if self.scored is None:
            raise ProtocolError(f"the round did not draw {self.accused} as the sender to replay")
        if not run.training.replay_outliers:
            raise ProtocolError("this run replays only the senders its rounds draw")
        if members > run.training.max_group_size:
            raise ProtocolError(
                f"a scored chunk of {members} members; the run's groups hold at most {run.training.max_group_size}"
            )
        return False

    def check_stands_out(self, run: RunConfig, codec: Codec, vector_numel: int, accuser: str) -> None:
        """That the accused's input stands out among the ``scored`` chunk's (``flagged_senders``, with the
        lenient thresholds): the chunk's reducer signed exactly these inputs, each sender signed its own,
        and the accused's ``item`` is one of them. ProtocolError otherwise. It decodes every input of the
        chunk (one group's at most: ``check_draw``), so the coordinator runs it at its judging turn."""
        chunk = self.scored
        if chunk is None:
            raise ProtocolError(f"{KIND} evidence holds no scored chunk")
        decoded = chunk.checked_inputs(codec, vector_numel)
        if self.item not in chunk.inputs:
            raise ProtocolError(f"the input of {self.accused} is not one the chunk's reducer aggregated")
        validator = self.members.index(accuser)
        claims, odd = flagged_senders(run, chunk.inputs, decoded, validator=validator, lenient=True)
        if self.item.sender_index not in claims + odd:
            raise ProtocolError(
                f"the input of {self.accused} does not stand out among the chunk's (swarm.averaging.scores)"
            )

    def slice(self, codec: Codec, vector_numel: int) -> tuple[int, int]:
        """Where the chunk lies in the run's vector; ProtocolError if the run's layout has no such chunk."""
        values = layout_chunk_values(len(self.members), codec.bytes_per_value)
        lo, hi = chunk_slice(vector_numel, len(self.members), self.part, self.chunk, values, self.reducers)
        if hi <= lo:
            raise ProtocolError(f"the run's layout has no chunk {self.chunk} of part {self.part}")
        return lo, hi

    def judge(
        self,
        run: RunConfig,
        tensors: dict[str, torch.Tensor],
        codec: Codec,
        *,
        vector_numel: int,
        device: str,
        deadline: float | None = None,
        margin: float = 0.0,
    ) -> str | None:
        """What the accused did wrong, recomputed from ``tensors`` (the state the evidence's ``facts``
        name, which the caller verified by its hash), or None if its input is what it computed, within
        the run's tolerance widened by ``margin`` of it (a validator's ``ACCUSE_MARGIN``). A SwarmError
        when the evidence does not hold, or the replay cannot be done (by ``deadline``)."""
        step, _ = self.facts()
        lo, hi = self.slice(codec, vector_numel)
        accused = self.accused
        try:
            micro_batches = whole_micro_batches(run, self.item.weight)
        except ProtocolError as e:  # its own signed claim: no replay needed
            return str(e)
        vector = recompute(run, tensors, accused, step, micro_batches, device=device, deadline=deadline)
        what = "window's pseudo-gradient" if run.training.sync == "diloco" else "gradient"
        tolerance = sender_tolerance(run.training) * (1.0 + margin)
        verdict = compare(self.item.data, vector[lo:hi], codec, tolerance, sender=accused, what=what)
        if verdict is None:
            return None
        return f"{verdict} ({self.item.weight:g} samples at step {step}, part {self.part} chunk {self.chunk})"


@dataclass
class _Copy:
    step: int
    state_hash: str
    tensors: dict[str, torch.Tensor]
    entries: dict[int, bytes]  # member index -> its signed group entry
    kept_until: float = 0.0


class SenderChecks:
    """One validator's sender checks (see the module docstring). ``state`` reads this peer's step, state
    hash and a copy of its state tensors; ``accuse`` files evidence (None: only logged); ``suspect``
    (peer, reason) avoids a sender caught lying in matchmaking."""

    def __init__(self, run: RunConfig, *, device: str, state: StateNow, accuse=None, suspect=None):
        self.run, self.device, self.state, self.accuse, self.suspect = run, device, state, accuse, suspect
        self.probability = run.training.sender_check_probability
        self.pending: OrderedDict[bytes, _Copy] = OrderedDict()  # group ID -> the state at its round
        self.kept: OrderedDict[str, _Copy] = OrderedDict()  # state hash -> a state a lie was found on
        self.checked = self.caught = 0
        self.outliers = 0  # senders replayed because their input stood out (``_outlier``), not drawn
        # One replay at a time, and one more waiting its turn: a check that comes due beyond that is
        # skipped (a liar that reads last round's draw cannot count on its validator being busy).
        self._replay_turn = asyncio.Lock()
        self.replays_due = 0
        self.skipped = 0
        # The accusation being filed, in a task of its own: one at a time, as the coordinator takes them.
        self._filing: asyncio.Task | None = None
        self._closed = False

    @property
    def enabled(self) -> bool:
        return sender_checks_on(self.run)

    async def keep(self, runner, signed_entries: Sequence[bytes]) -> None:
        """Copy the state of a complete round (before its update), off the event loop, if this member may
        check one of its senders; ``signed_entries`` are the members' signed group entries, in member
        order. With the round's reveals already in, a member the draw gives no part copies nothing;
        without them it copies (waiting for them would let a member that withholds its reveal hold every
        round), and ``check`` drops the copy once its checks are done."""
        if not self.enabled or len(signed_entries) != len(runner.members):
            return
        if runner.shared_seed is not None and not draw(runner, self.run.training.verify_probability):
            return  # this member checks no part of the round
        step, state_hash, tensors = await asyncio.to_thread(self.state)
        self.pending[runner.group_id] = _Copy(step, state_hash, tensors, dict(enumerate(signed_entries)))
        while len(self.pending) > MAX_PENDING:
            self.pending.popitem(last=False)

    async def check(self, runner, outcomes: Sequence) -> None:
        """Replay the sender the round's draw names for each chunk this member validated; accuse the ones
        that lied. Without every member's reveal (one withheld it) the draw is this member's own: a lie
        found so is not provable to the coordinator, and its sender is only avoided (``suspect``)."""
        copy = self.pending.pop(runner.group_id, None)
        if copy is None:
            return
        seed = runner.shared_seed
        members = len(runner.members)
        reveals = tuple(runner.reveals[i] for i in range(members)) if seed is not None else ()
        own_draw = os.urandom(32) if seed is None else seed
        outlier_replayed, scored = False, 0
        for outcome in outcomes:
            evidence = outcome.evidence
            if not isinstance(evidence, BadAggregateEvidence):
                continue
            candidates = [i for i in range(members) if i != runner.index]
            sender = drawn_sender(own_draw, evidence.part, evidence.chunk, candidates, self.probability)
            item = next((i for i in evidence.inputs if i.sender_index == sender), None)
            if item is not None:  # else nobody drawn, or the drawn member sent nothing to this chunk
                await self._check_one(runner, self._lie(evidence, item, copy, reveals), copy)
            # At most one sender a round replayed for standing out, beside the drawn ones (a replay costs
            # a step, or a window), found in at most ``MAX_SCORED_CHUNKS`` chunks (scoring one decodes
            # every input of it: a member that withholds its reveal makes each member check many parts).
            if outlier_replayed or scored >= MAX_SCORED_CHUNKS or type(evidence) is not BadAggregateEvidence:
                continue
            scored += 1
            odd = await self._outlier(runner, evidence, seed=own_draw, drawn=sender)
            if odd is not None:
                outlier_replayed = True
                self.outliers += 1
                lie = self._lie(evidence, odd, copy, reveals, scored=evidence)
                await self._check_one(runner, lie, copy)

    def _lie(
        self, evidence: BadAggregateEvidence, item: SignedInput, copy: _Copy, reveals: tuple[bytes, ...],
        scored: BadAggregateEvidence | None = None,
    ) -> WrongContributionEvidence:  # fmt: skip
        return WrongContributionEvidence(
            prefix=evidence.prefix, group_id=evidence.group_id, members=evidence.members,
            commitments=evidence.commitments, part=evidence.part, chunk=evidence.chunk,
            reducers=evidence.reducers, item=item, entry=copy.entries[item.sender_index], reveals=reveals,
            scored=scored,
        )  # fmt: skip

    async def _outlier(
        self, runner, evidence: BadAggregateEvidence, *, seed: bytes, drawn: int | None
    ) -> SignedInput | None:
        """The input of a sender of the chunk that stands out (``flagged_senders``), other than the drawn
        one and this member, picked by the round's draw (``outlier_to_replay``); None if none does."""

        def flags() -> tuple[list[int], list[int]]:  # decoding and scoring: off the event loop
            # The run's layout, as the coordinator reads it (``check_stands_out``).
            decoded = evidence.checked_inputs(runner.codec, runner.numel)
            return flagged_senders(self.run, evidence.inputs, decoded, validator=runner.index)

        try:
            claims, odd = await asyncio.to_thread(flags)
        except SwarmError:  # an input that does not decode: the reducer's check is the one that applies
            return None
        odd = outlier_to_replay(claims, odd, seed=seed, part=evidence.part, chunk=evidence.chunk, drawn=drawn)
        if odd is None:
            return None
        logger.info(
            f"{runner.members[odd]}'s input to part {evidence.part} chunk {evidence.chunk} of round "
            f"{runner.group_id.hex()[:8]} stands out among the chunk's; replaying it"
        )
        return next(i for i in evidence.inputs if i.sender_index == odd)

    async def _check_one(self, runner, lie: WrongContributionEvidence, copy: _Copy) -> None:
        accused = lie.accused
        try:
            step, state_hash = lie.facts()
            if (step, state_hash) != (copy.step, copy.state_hash):  # excluded from rounds (step_misfit)
                logger.info(
                    f"{accused} joined round {runner.group_id.hex()[:8]} at another state; not checked"
                )
                return
            if self.replays_due >= MAX_REPLAYS_DUE:  # replays slower than rounds: not piled up
                self.skipped += 1
                logger.info(f"skipped the check of {accused}: replays of earlier rounds are still due")
                return
            self.replays_due += 1
            try:
                async with self._replay_turn:
                    self.checked += 1
                    # A replay is as long as the sender's signed claim (at most a whole step or window);
                    # one past the coordinator's own budget could not be judged, so it stops there.
                    verdict = await asyncio.to_thread(
                        lie.judge, self.run, copy.tensors, runner.codec, vector_numel=runner.numel,
                        device=self.device, deadline=time.monotonic() + JUDGING_BUDGET_S, margin=ACCUSE_MARGIN,
                    )  # fmt: skip
            finally:
                self.replays_due -= 1
        except Exception as e:  # a replay this peer cannot run: nobody is accused
            logger.warning(f"could not check the contribution of {accused}: {e!r}"[:500])
            return
        if verdict is None:
            logger.debug(f"recomputed the contribution of {accused} to part {lie.part} chunk {lie.chunk}")
            return
        self.caught += 1
        logger.warning(f"{accused} {verdict} in round {runner.group_id.hex()[:8]}")
        if self.suspect is not None:
            self.suspect(accused, "sent a contribution other than its public batch seeds give")
        if not lie.reveals:
            return  # found by this member's own draw: the coordinator could not tell it was drawn
        if self.accuse is None:
            copy.kept_until = time.monotonic() + KEEP_S
            self._hold(copy)
            return
        if self._closed:  # the peer left: a replay that ended since files nothing and keeps nothing
            return
        if self._filing is not None and not self._filing.done():
            # The coordinator takes one accusation of a peer at a time, and each waits with its state:
            # one lie a round, filed as it came, once held a state copy a round for as long as they waited.
            logger.info(
                f"{accused} is avoided, not accused: this validator's last accusation is still judged"
            )
            return
        # Served while the accusation is in flight, however long the coordinator's recomputes queue (it
        # downloads the state when this one's turn comes), and ``KEEP_S`` after; at most ``MAX_KEPT``.
        copy.kept_until = math.inf
        self._hold(copy)
        self._filing = asyncio.create_task(self._file(accused, lie, verdict, copy))

    async def _file(self, accused: str, lie: WrongContributionEvidence, verdict: str, copy: _Copy) -> None:
        try:
            await self.accuse(accused, lie, verdict)
        except Exception as e:
            logger.warning(f"could not file the accusation against {accused}: {e!r}")
        finally:
            copy.kept_until = time.monotonic() + KEEP_S

    async def filed(self) -> None:
        """Wait until the accusation being filed, if any, is answered or given up."""
        if self._filing is not None:
            await asyncio.gather(self._filing, return_exceptions=True)

    def close(self) -> None:
        """Stop filing, now and for checks that end later (the peer leaves the run)."""
        self._closed = True
        if self._filing is not None:
            self._filing.cancel()

    def _hold(self, copy: _Copy) -> None:
        now = time.monotonic()
        for state_hash in [h for h, c in self.kept.items() if c.kept_until < now]:
            del self.kept[state_hash]
        self.kept[copy.state_hash] = copy
        self.kept.move_to_end(copy.state_hash)
        while len(self.kept) > MAX_KEPT:
            self.kept.popitem(last=False)

    def find(self, state_hash: str) -> EncodedState | None:
        """A state a lie was found on (for the coordinator to judge it), encoded; None if none is kept."""
        copy = self.kept.get(state_hash)
        if copy is None or copy.kept_until < time.monotonic():
            return None
        data = encode_state(copy.step, copy.tensors, {"run_id": self.run.run_id})
        return EncodedState(copy.step, copy.state_hash, data)


__all__ = [
    "KIND",
    "SenderChecks",
    "WrongContributionEvidence",
    "chunk_slice",
    "compare",
    "drawn_sender",
    "recompute",
    "whole_micro_batches",
]
