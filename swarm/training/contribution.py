"""What a sender's contribution is, recomputed from public facts, and the evidence that it lied.

``recompute`` replays a sender's contribution to a round from its public batch seeds and the state it
signed it computed at; ``compare`` measures a signed input against it within the run's tolerance;
``micro_gradient`` is the gradient of one of its micro-batches, which its fit is scored against;
``WrongContributionEvidence`` is what a validator files and the coordinator judges
(``coordinator.contributions``), with the checks that say the accuser could put that sender (drawn, standing
out or fitting poorly: ``swarm.training.picks``). The validator's side, which keeps states and replays, is
``swarm.training.sendercheck``.

Example::

    vector = recompute(run, tensors, peer_id, step, micro_batches, device="cpu")
    verdict = compare(signed_data, vector[lo:hi], codec, sender_tolerance(run.training), sender=peer_id)
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from protocols.codec import pack
from protocols.envelope import open_envelope
from protocols.errors import ProtocolError
from swarm.averaging.compression import Codec
from swarm.averaging.evidence import (
    NONCE_BYTES,
    BadAggregateEvidence,
    RoundEvidence,
    SignedInput,
    bytes_field,
    chunk_bounds,
    draw_seed,
    drawn_chunk,
    layout_chunk_values,
    round_fields,
    signed_input,
    split_bounds,
)
from swarm.averaging.groups import GROUP_ENTRY, GroupEntryBody
from swarm.averaging.scores import fits_poorly
from swarm.averaging.verification import Assignment, assignments
from swarm.config import RunConfig, replayable_windows, sender_tolerance
from swarm.training.diloco import DilocoReplica, flat_params
from swarm.training.picks import (
    drawn_sender,
    fit_draw,
    fit_micro_batches,
    flagged_senders,
    whole_micro_batches,
)
from swarm.training.replay import honest_gradients, public_dataset, replay_window
from swarm.training.sync import is_state_hash

KIND = "wrong_contribution"
#: The fields of a scored chunk in ``wrong_contribution`` evidence (``BadAggregateEvidence``'s, less the
#: round fields it shares with the evidence) and the round fields it takes from the evidence.
SCORED_KEYS = ("signer", "numel", "inputs", "output", "output_signature", "entries", "signed_at_ms")
ROUND_KEYS = ("prefix", "group_id", "members", "commitments", "part", "chunk", "reducers")
MAX_ENTRY_BYTES = 16 << 10


def chunk_slice(
    vector_numel: int, members: int, part: int, chunk: int, chunk_values: int, reducers: Sequence[bool] = ()
) -> tuple[int, int]:
    """Where ``chunk`` of ``part`` lies in the averaged vector, by the run's layout; (0, 0) if nowhere."""
    bounds = split_bounds(vector_numel, members, reducers)
    chunks = chunk_bounds(bounds[part + 1] - bounds[part], chunk_values)
    if not 0 <= chunk < len(chunks) - 1:
        return 0, 0
    return bounds[part] + chunks[chunk], bounds[part] + chunks[chunk + 1]


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


def state_model(run: RunConfig, tensors: dict[str, torch.Tensor], device: str) -> tuple[torch.nn.Module, int]:
    """The run's model on ``device`` holding the state ``tensors`` (diloco: the synced model and outer
    optimizer's; else the model and optimizer's), and its sequence length."""
    from swarm.models import build_model, model_config
    from swarm.training.state import build_optimizer, build_outer_optimizer, load_state_tensors

    model = build_model(run.model.name, run.model.config, seed=run.training.seed).to(device)
    seq_len = int(model_config(run.model.name, run.model.config).seq_len)
    if run.training.sync == "diloco":
        if not replayable_windows(run.training):
            raise ProtocolError("this run's diloco windows cannot be replayed from public facts")
        load_state_tensors(model, build_outer_optimizer(model, run.outer_optimizer), tensors)
    else:
        load_state_tensors(model, build_optimizer(model, run.optimizer), tensors)
    return model, seq_len


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
    from swarm.training.state import build_optimizer

    training = run.training
    model, seq_len = state_model(run, tensors, device)
    dataset = public_dataset(run.dataset.name, run.dataset.config)
    if training.sync == "diloco":
        replica = DilocoReplica(model, build_optimizer(model, run.optimizer), run)
        window = replay_window(
            replica, flat_params(replica.synced_params), dataset, run_id=run.run_id, peer_id=peer_id,
            step=step, micro_batches=micro_batches, seq_len=seq_len, precision=training.precision,
            device=device, deadline=deadline,
        )  # fmt: skip
        return window.detach().to("cpu", torch.float32)
    return micro_gradient(
        run, tensors, peer_id, step, 0, micro_batches=micro_batches, device=device, deadline=deadline,
        model=model,
    )  # fmt: skip


def micro_gradient(
    run: RunConfig,
    tensors: dict[str, torch.Tensor],
    peer_id: str,
    step: int,
    micro: int,
    *,
    micro_batches: int = 1,
    device: str,
    deadline: float | None = None,
    model: torch.nn.Module | None = None,
    span: tuple[int, int] | None = None,
) -> torch.Tensor:
    """The flat mean gradient of ``peer_id``'s ``micro_batches`` micro-batches from number ``micro`` on, at
    ``step``, from the state ``tensors`` (``model``: that state already loaded by ``state_model``, whose
    gradients this overwrites): every step, what it sends for its first that many; in diloco, from the
    synced model, the gradient of inner step ``micro``'s batch at the window's start (what its fit,
    ``swarm.averaging.scores.fits_poorly``, is scored against). ``span`` (lo, hi): only those values, for
    less than the whole costs (``honest_gradients``). A SwarmError as ``recompute``."""
    from swarm.models import model_config

    training = run.training
    if model is None:
        model, _ = state_model(run, tensors, device)
    seq_len = int(model_config(run.model.name, run.model.config).seq_len)
    dataset = public_dataset(run.dataset.name, run.dataset.config)
    rows = honest_gradients(
        model, dataset, run_id=run.run_id, step=step, micro_batch=training.micro_batch_size, seq_len=seq_len,
        peers={peer_id: micro_batches * training.micro_batch_size}, precision=training.precision,
        device=device, deadline=deadline, in_place=True, first_micro=micro, span=span,
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
        chunk, that the run replays senders that stand out and the chunk is one a group of the run can
        hold (False: the caller then runs ``check_stands_out``, which alone decides); or, for an input
        that does not decode with the run's codec (``undecodable``: no loop sends one), True with no draw.
        ProtocolError otherwise. So an accuser replays only the sender and chunk the round drew, or a
        sender whose input stands out or does not decode: these need no draw, so a liar that withholds its
        nonce in the rounds whose draw would replay it is still filed against."""
        members = len(self.members)
        if len(self.commitments) != members:
            raise ProtocolError(f"{KIND} evidence needs every member's commitment")
        if accuser not in self.members:
            raise ProtocolError("the accuser is not a member of the round")
        if self.reveals and len(self.reveals) != members:
            raise ProtocolError(f"{KIND} evidence holds {len(self.reveals)} reveals for {members} members")
        if any(hashlib.sha256(r).digest() != c for r, c in zip(self.reveals, self.commitments, strict=False)):
            raise ProtocolError("evidence holds a reveal that does not match its member's commitment")
        if self.scored is None and self.undecodable(codec, vector_numel):
            return True
        if self.scored is not None:
            if not run.training.replay_outliers:
                raise ProtocolError("this run replays only the senders its rounds draw")
            most = max(2, run.training.max_group_size)  # as members check it (``groups.check_group``)
            if members > most:
                raise ProtocolError(
                    f"a scored chunk of {members} members; the run's groups hold at most {most}"
                )
            return False
        if not self.reveals:
            raise ProtocolError(f"{KIND} evidence needs every member's reveal, or the chunk's scores")
        chunks = self._chunk_counts(codec, vector_numel)
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
        if sender != self.item.sender_index:
            raise ProtocolError(f"the round did not draw {self.accused} as the sender to replay")
        return True

    def check_stands_out(self, run: RunConfig, codec: Codec, vector_numel: int, accuser: str) -> None:
        """That the accused's input stands out among the ``scored`` chunk's (``flagged_senders``, with the
        lenient thresholds): the chunk's reducer signed exactly these inputs, each sender signed its own,
        and the accused's ``item`` is one of them. ProtocolError otherwise. It decodes every input of the
        chunk (one group's at most: ``check_draw``), so the coordinator runs it at its judging turn."""
        decoded = self.check_scored(codec, vector_numel)
        validator = self.members.index(accuser)
        claims, odd = flagged_senders(run, self.scored.inputs, decoded, validator=validator, lenient=True)
        if self.item.sender_index not in claims + odd:
            raise ProtocolError(
                f"the input of {self.accused} does not stand out among the chunk's (swarm.averaging.scores)"
            )

    def check_fit_scorer(self, run: RunConfig, codec: Codec, vector_numel: int, accuser: str) -> None:
        """That ``accuser`` may put the accused's fit (``check_fits_poorly``) to the coordinator: the scored
        chunk holds, with the accused's input in it (``check_scored``), the accuser reduced the chunk's part
        and signed its aggregate itself, and the chunk's draw has it score the accused (``fit_draw``).
        ProtocolError otherwise: a fit costs a gradient and its state a download, so nobody else may ask."""
        self.check_scored(codec, vector_numel)
        index = self.members.index(accuser)
        if self.part != index or self.scored.signer is not None:
            raise ProtocolError("only the reducer of a part scores the fit of that part's inputs")
        if self.reveals:  # then the round's drawn chunk of the part, the one its reducer scores
            chunks = self._chunk_counts(codec, vector_numel)[self.part]
            if drawn_chunk(draw_seed(self.digest, self.reveals), self.part, chunks) != self.chunk:
                raise ProtocolError(f"chunk {self.chunk} is not the round's drawn chunk of part {self.part}")
        if not fit_draw(self.scored, self.item.sender_index, fit_micro_batches(run, self.item.weight))[0]:
            raise ProtocolError(f"the chunk's draw did not have {accuser} score the fit of {self.accused}")

    def _chunk_counts(self, codec: Codec, vector_numel: int) -> list[int]:
        """How many chunks each part of the round's layout holds."""
        members = len(self.members)
        values = layout_chunk_values(members, codec.bytes_per_value)
        bounds = split_bounds(vector_numel, members, self.reducers)
        return [len(chunk_bounds(bounds[p + 1] - bounds[p], values)) - 1 for p in range(members)]

    def check_scored(self, codec: Codec, vector_numel: int) -> list[torch.Tensor]:
        """The decoded inputs of the ``scored`` chunk, once it holds (``BadAggregateEvidence.checked_inputs``)
        and the accused's input is one of them; ProtocolError otherwise."""
        chunk = self.scored
        if chunk is None:
            raise ProtocolError(f"{KIND} evidence holds no scored chunk")
        decoded = chunk.checked_inputs(codec, vector_numel)
        if self.item not in chunk.inputs:
            raise ProtocolError(f"the input of {self.accused} is not one the chunk's reducer aggregated")
        return decoded

    def check_fits_poorly(
        self, run: RunConfig, tensors: dict[str, torch.Tensor], codec: Codec, vector_numel: int,
        *, device: str, deadline: float | None = None,
    ) -> None:  # fmt: skip
        """That the accused's input fits its drawn micro-batch's gradient at the evidence's state
        (``tensors``, verified by its hash) no better than the median of the ``scored`` chunk's other inputs
        do, with the lenient threshold (``fit_is_poor``); the chunk checked as ``check_stands_out`` checks
        it. ProtocolError otherwise. It costs one micro-batch's gradient, so the coordinator runs it at its
        judging turn, once the state is downloaded."""
        decoded = self.check_scored(codec, vector_numel)
        if not self.fit_is_poor(
            run, tensors, decoded, codec, vector_numel, device=device, deadline=deadline, lenient=True
        ):
            raise ProtocolError(
                f"the input of {self.accused} neither stands out among the chunk's nor fits its own drawn "
                "micro-batch worse than the others do (swarm.averaging.scores)"
            )

    def fit_is_poor(
        self, run: RunConfig, tensors: dict[str, torch.Tensor], decoded: Sequence[torch.Tensor], codec: Codec,
        vector_numel: int, *, device: str, deadline: float | None = None, lenient: bool = False,
        model: torch.nn.Module | None = None,
    ) -> bool:  # fmt: skip
        """Whether the accused's input, among the ``scored`` chunk's (``decoded``, in its inputs' order),
        fits the gradient of its own micro-batch the chunk's draw picks (``fit_draw``) at the state
        ``tensors`` (``model``: loaded from them) worse than the other inputs do
        (``swarm.averaging.scores.fits_poorly``); False in a run that replays no outliers."""
        if self.scored is None or not run.training.replay_outliers:
            return False
        step, _ = self.facts()
        lo, hi = self.slice(codec, vector_numel)
        micro = fit_draw(self.scored, self.item.sender_index, fit_micro_batches(run, self.item.weight))[1]
        gradient = micro_gradient(
            run, tensors, self.accused, step, micro, device=device, deadline=deadline, model=model,
            span=(lo, hi),
        )  # fmt: skip
        return fits_poorly(decoded, self.scored.inputs.index(self.item), gradient, lenient=lenient)

    def undecodable(self, codec: Codec, vector_numel: int) -> bool:
        """Whether the accused's input does not decode with the run's codec at its chunk's size (non-finite
        values, a malformed encoding): an input the built-in loop never sends, whose replay still decides
        (``judge``: a replay that is not finite convicts nobody)."""
        lo, hi = self.slice(codec, vector_numel)
        try:
            codec.decode_contribution(self.item.data, hi - lo, sender=self.accused)
        except ProtocolError:
            return True
        return False

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
        if not bool(torch.isfinite(vector[lo:hi]).all()):
            # The honest peer would have stopped instead of sending it (``TrainingPeer._own_contribution``);
            # non-finite values may come out unlike on another device, so nothing here convicts anyone.
            raise ProtocolError(f"the replay of {accused}'s contribution to chunk {self.chunk} is not finite")
        what = "window's pseudo-gradient" if run.training.sync == "diloco" else "gradient"
        tolerance = sender_tolerance(run.training) * (1.0 + margin)
        verdict = compare(self.item.data, vector[lo:hi], codec, tolerance, sender=accused, what=what)
        if verdict is None:
            return None
        return f"{verdict} ({self.item.weight:g} samples at step {step}, part {self.part} chunk {self.chunk})"
