"""Named attacks a Byzantine peer can mount, each a small object that plugs into the library's hooks.

An :class:`Attack` is at once the peer's ``TrainingHooks`` (``swarm.training.hooks``), ``RoundHooks``
(``swarm.averaging.hooks``) and ``PipelineHooks`` (``swarm.pipeline.hooks``): ``peer/`` and ``lab/`` build
one and pass it as ``hooks`` to the ``Trainer``, ``PipelineTrainer`` or ``StageWorker``; the library calls
it where a volunteer can lie and never imports this package. Every hook is honest (returns its input)
unless the attack says otherwise. On top of the library's hooks an attack has its own, simpler ones:

- ``batch(inputs, targets) -> (inputs, targets)``: the data the peer trains on (``label_flip``);
- ``contribution(honest, step, *, peers=None) -> Tensor``: the gradient it sends, given the honest one
  it computed (``sign_flip``, ``random_direction``, ``delayed_gradient``, ``alie``, ``ipm``, ``nan``),
  which ``contribute`` (the training hook) calls;
- ``weight(claimed) -> float``: the weight (sample count) it claims (``huge_weight``);
- ``claim(samples) -> int``: the samples its signed progress record claims at its step (``batch_claim``);
- ``reduce(aggregate) -> Tensor``: what it returns as the reducer of a part (``bad_reducer``, which sets
  ``rewrites_aggregates``), which ``aggregate`` (the round hook) calls;
- ``announce(record) -> record``: the pipeline record it publishes (``swarm.byzantine.pipeline_attacks``);
- ``heard(microbatches)``: what a stage replica knows before it announces: the (trainer, micro-batch ID)
  pairs the trainers in view issue at its step, since IDs are public seeds (``forged_retried`` claims them);
- ``front_run(request, victim_ids) -> [request]``: forwards a pipeline trainer sends to a stage server
  before its own (``front_runner``).

A pipeline attack says which pipeline role mounts it (``pipeline_role``: ``"stage"`` or ``"trainer"``);
``swarm-sim --stages`` gives it to that many peers of that role.

Attacks that model collusion (``alie``, ``ipm``) need an estimate of the honest gradients' mean and
spread. Colluding attackers know their own honest gradients: pass them stacked as ``peers`` (this
attacker's included) when the attackers share them; without ``peers`` the attack estimates from this
attacker's own honest gradients of its last ``window`` steps. ``omniscient_alie`` and ``omniscient_ipm``
are the attackers that read the code: every peer's batches derive from public seeds, so they recompute
each honest peer's exact gradient of the step (``swarm.byzantine.colluders``) and aim at the true mean
and spread (``Attack.omniscient`` asks the trainer for them); in a diloco run, each honest peer's exact
pseudo-gradient, its whole window replayed on a shadow of its inner optimizer (``ShadowWindows``). Everything random is drawn from a
generator seeded with the attack's seed and the step, so a rehearsal replays exactly.

Example::

    attack = make_attack("alie", group_size=8, attackers=2, seed=1)
    sent = attack.contribution(honest_gradient, step)
"""

from __future__ import annotations

import hashlib
import math
import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from protocols.errors import ConfigError
from swarm.averaging.hooks import RoundHooks
from swarm.pipeline.hooks import PipelineHooks
from swarm.registry import Registry
from swarm.training.hooks import TrainingHooks

if TYPE_CHECKING:
    from swarm.averaging.allreduce import ButterflyAllReduce
    from swarm.training.peer import TrainingPeer


@dataclass(frozen=True)
class AttackContext:
    """What an attacker knows of the run: its group's size, how many attackers collude, its seed."""

    group_size: int
    attackers: int
    seed: int = 0

    def __post_init__(self) -> None:
        if self.group_size < 1 or not 0 <= self.attackers <= self.group_size:
            raise ConfigError(
                f"attack context needs 1 <= group_size and 0 <= attackers <= group_size, "
                f"got group_size={self.group_size}, attackers={self.attackers}"
            )


class AttackOptions(BaseModel):
    """The options of an attack that takes none (``equivocator``, ``withholder``); every attack's own
    options extend them, and unknown fields are refused."""

    model_config = ConfigDict(extra="forbid")


class Attack(TrainingHooks, RoundHooks, PipelineHooks):
    """Honest at every hook; each named attack overrides the hooks it lies at."""

    name = "honest"
    #: The pipeline role that mounts this attack (``"stage"`` or ``"trainer"``); None: not a pipeline attack.
    pipeline_role: ClassVar[str | None] = None

    def __init__(self, options: AttackOptions, context: AttackContext) -> None:
        self.options, self.context = options, context
        self._shadows = None  # an omniscient attack's ShadowWindows in a diloco run, made at first use

    def contribution(
        self, honest: torch.Tensor, step: int, *, peers: torch.Tensor | None = None
    ) -> torch.Tensor:
        return honest

    def reduce(self, aggregate: torch.Tensor) -> torch.Tensor:
        """What this peer returns as reducer; ``aggregate`` asks only when ``rewrites_aggregates`` is set."""
        return aggregate

    @property
    def omniscient(self) -> bool:
        """Whether ``contribution`` wants every peer's exact gradient of the step as ``peers``."""
        return bool(getattr(self.options, "omniscient", False))

    @property
    def round_hooks(self) -> RoundHooks:
        return self

    def contribute(self, trainer: TrainingPeer, honest: torch.Tensor) -> torch.Tensor:
        """The training hook: ``contribution`` at the trainer's step, with every peer's exact gradient of
        the step (diloco: pseudo-gradient of the window) as ``peers`` when the attack is ``omniscient``."""
        peers = None
        if self.omniscient:
            from swarm.byzantine.colluders import ShadowWindows, exact_gradients

            if trainer.config.training.sync == "diloco":  # pseudo-gradients: each peer's whole window
                if self._shadows is None:
                    self._shadows = ShadowWindows()
                peers = self._shadows.pseudo_gradients(trainer, honest)
            else:
                peers = exact_gradients(trainer, honest)
        return self.contribution(honest, trainer.step, peers=peers)

    def aggregate(
        self, round: ButterflyAllReduce, part: int, chunk: int, honest: torch.Tensor
    ) -> torch.Tensor:
        """The round hook: ``reduce`` of the honest aggregate."""
        return self.reduce(honest)

    def generator(self, step: int) -> torch.Generator:
        """A CPU generator for ``step``: the same draws for the same seed and step, on every run."""
        return torch.Generator(device="cpu").manual_seed((self.context.seed * 1_000_003 + step) % (1 << 63))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.options!r}, {self.context!r})"


AttackFactory = Callable[[Any, AttackContext], Attack]
ATTACKS: Registry[AttackFactory] = Registry(kind="attack", group="swarm.attacks")


def register_attack(name: str, options_cls: type[BaseModel] = AttackOptions) -> Callable:
    """Register an :class:`Attack` subclass (or any ``factory(options, context)``) under ``name``."""
    return ATTACKS.register(name, options_cls)


def attack_names() -> list[str]:
    return ATTACKS.names()


def attack_options(name: str, options: Mapping[str, Any] | None = None) -> BaseModel:
    """The typed options of attack ``name``; a ConfigError names the bad field and the known attacks."""
    return ATTACKS.validate(name, options)


def make_attack(
    name: str,
    options: Mapping[str, Any] | None = None,
    *,
    group_size: int,
    attackers: int,
    seed: int = 0,
) -> Attack:
    """The attack ``name`` for an attacker in groups of ``group_size`` with ``attackers`` colluders."""
    context = AttackContext(group_size=group_size, attackers=attackers, seed=seed)
    attack = ATTACKS.get(name).factory(ATTACKS.validate(name, options), context)
    attack.name = name
    return attack


# --- helpers -------------------------------------------------------------------------------------------


class _History:
    """This attacker's honest gradients of its last ``window`` steps (one per step, latest kept)."""

    def __init__(self, window: int) -> None:
        self.window = window
        self.by_step: dict[int, torch.Tensor] = {}

    def add(self, step: int, honest: torch.Tensor) -> None:
        self.by_step[step] = honest.detach().clone()
        for old in sorted(self.by_step)[: -self.window]:
            del self.by_step[old]

    def stacked(self) -> torch.Tensor:
        return torch.stack([self.by_step[s] for s in sorted(self.by_step)])


def _estimate(
    history: _History, honest: torch.Tensor, step: int, peers: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Coordinate-wise mean and standard deviation of the honest gradients, as the attackers see them."""
    if peers is not None:
        samples = peers.to(torch.float32).reshape(-1, honest.numel())
    else:
        history.add(step, honest.flatten().to(torch.float32))
        samples = history.stacked()
    mean = samples.mean(dim=0)
    std = samples.std(dim=0, correction=0) if samples.shape[0] > 1 else torch.zeros_like(mean)
    return mean.reshape(honest.shape).to(honest.dtype), std.reshape(honest.shape).to(honest.dtype)


def alie_z(group_size: int, attackers: int) -> float:
    """ALIE's z_max for ``attackers`` of ``group_size``: the deviation the majority does not notice.

    s = floor(n/2 + 1) - f senders must be won over; z is the standard normal quantile at (n - s) / n.
    """
    n, f = group_size, attackers
    s = math.floor(n / 2 + 1) - f
    p = min(max((n - s) / n, 1e-6), 1 - 1e-6)
    return statistics.NormalDist().inv_cdf(p)


# --- the attacks ---------------------------------------------------------------------------------------


class SignFlipOptions(AttackOptions):
    """Options of ``sign_flip``: ``scale``, the multiple of the reversed honest gradient it sends."""

    scale: float = Field(1.0, gt=0, le=1e6, description="send -scale times the honest gradient")


@register_attack("sign_flip", SignFlipOptions)
class SignFlip(Attack):
    """Sends the honest gradient reversed (times ``scale``): ascent instead of descent."""

    def contribution(
        self, honest: torch.Tensor, step: int, *, peers: torch.Tensor | None = None
    ) -> torch.Tensor:
        return honest * -self.options.scale


class RandomDirectionOptions(AttackOptions):
    """Options of ``random_direction``: ``norm_ratio``, the random vector's norm as a multiple of the
    honest gradient's."""

    norm_ratio: float = Field(
        10.0, gt=0, le=1e6, description="norm of the random vector, as a multiple of the honest norm"
    )


@register_attack("random_direction", RandomDirectionOptions)
class RandomDirection(Attack):
    """Sends a uniformly random direction with ``norm_ratio`` times the honest gradient's norm."""

    def contribution(
        self, honest: torch.Tensor, step: int, *, peers: torch.Tensor | None = None
    ) -> torch.Tensor:
        noise = torch.randn(honest.shape, generator=self.generator(step), dtype=torch.float32)
        norm = float(torch.linalg.vector_norm(honest.to(torch.float32))) or 1.0
        scale = self.options.norm_ratio * norm / max(float(torch.linalg.vector_norm(noise)), 1e-30)
        return (noise * scale).to(honest.dtype)


class LabelFlipOptions(AttackOptions):
    """Options of ``label_flip``: ``num_classes``, the number of classes: a target y in [0, num_classes)
    becomes num_classes - 1 - y."""

    num_classes: int = Field(256, ge=2, le=10**7, description="targets are class ids in [0, num_classes)")


@register_attack("label_flip", LabelFlipOptions)
class LabelFlip(Attack):
    """Trains on flipped labels, ``y -> num_classes - 1 - y``, then sends that gradient honestly."""

    def batch(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if targets.dtype.is_floating_point or targets.dtype == torch.bool:
            raise ConfigError(f"label_flip needs integer class targets, got {targets.dtype}")
        last = self.options.num_classes - 1
        # Targets outside [0, num_classes) (padding such as -100) are left as they are.
        valid = (targets >= 0) & (targets <= last)
        return inputs, torch.where(valid, last - targets, targets)


class DelayedGradientOptions(AttackOptions):
    """Options of ``delayed_gradient``: ``delay``, how many steps old the honest gradient it sends is."""

    delay: int = Field(10, ge=1, le=10_000, description="send the honest gradient of this many steps ago")


@register_attack("delayed_gradient", DelayedGradientOptions)
class DelayedGradient(Attack):
    """Sends its honest gradient from ``delay`` steps ago (the oldest it has until then): a stale peer."""

    def __init__(self, options: DelayedGradientOptions, context: AttackContext) -> None:
        super().__init__(options, context)
        self.history = _History(options.delay + 1)

    def contribution(
        self, honest: torch.Tensor, step: int, *, peers: torch.Tensor | None = None
    ) -> torch.Tensor:
        self.history.add(step, honest)
        wanted = step - self.options.delay
        kept = sorted(self.history.by_step)
        return self.history.by_step.get(wanted, self.history.by_step[kept[0]]).clone()


class EstimateOptions(AttackOptions):
    """Options of the colluding attacks (``alie``, ``ipm``): ``window``, how many steps of this attacker's
    own honest gradients estimate the honest mean and spread when no ``peers`` are passed."""

    window: int = Field(
        8, ge=1, le=1000, description="own honest gradients of this many steps estimate the honest spread"
    )


class AlieOptions(EstimateOptions):
    """Options of ``alie``: ``z``, the deviation from the honest mean in standard deviations (default: the
    group's z_max), and ``window``."""

    z: float | None = Field(
        None, ge=-100, le=100, description="deviation in standard deviations; default: z_max of the paper"
    )


@register_attack("alie", AlieOptions)
class Alie(Attack):
    """A little is enough (Baruch et al., 2019): every coordinate at mean + z * std of the honest ones.

    ``z`` defaults to z_max for the group: the largest deviation that still leaves the attackers'
    values inside the majority's spread, so median- and trimming-based rules keep them.
    """

    def __init__(self, options: AlieOptions, context: AttackContext) -> None:
        super().__init__(options, context)
        self.history = _History(options.window)
        self.z = options.z if options.z is not None else alie_z(context.group_size, context.attackers)

    def contribution(
        self, honest: torch.Tensor, step: int, *, peers: torch.Tensor | None = None
    ) -> torch.Tensor:
        mean, std = _estimate(self.history, honest, step, peers)
        return mean + self.z * std


class IpmOptions(EstimateOptions):
    """Options of ``ipm``: ``epsilon``, the multiple of the negated honest mean it sends, and ``window``."""

    epsilon: float = Field(0.1, gt=0, le=1e6, description="send -epsilon times the honest mean")


@register_attack("ipm", IpmOptions)
class InnerProductManipulation(Attack):
    """Inner product manipulation (Xie et al., 2019): sends ``-epsilon`` times the honest mean.

    A small epsilon stays close to the honest values yet turns the aggregate's inner product with the
    true gradient negative once enough attackers join; a large one overwhelms a plain mean.
    """

    def __init__(self, options: IpmOptions, context: AttackContext) -> None:
        super().__init__(options, context)
        self.history = _History(options.window)

    def contribution(
        self, honest: torch.Tensor, step: int, *, peers: torch.Tensor | None = None
    ) -> torch.Tensor:
        mean, _ = _estimate(self.history, honest, step, peers)
        return mean * -self.options.epsilon


class OmniscientOptions(AttackOptions):
    """Option of the omniscient attacks: ``omniscient`` makes the trainer pass every peer's exact gradient
    of the step as ``peers``, recomputed from the public batch seeds."""

    omniscient: bool = Field(True, description="recompute every peer's gradient from the public batch seeds")


class OmniscientAlieOptions(AlieOptions, OmniscientOptions):
    """Options of ``omniscient_alie``: those of ``alie``, with ``omniscient`` on."""

    pass


class OmniscientIpmOptions(IpmOptions, OmniscientOptions):
    """Options of ``omniscient_ipm``: those of ``ipm``, with ``omniscient`` on."""

    pass


@register_attack("omniscient_alie", OmniscientAlieOptions)
class OmniscientAlie(Alie):
    """``alie`` at the honest peers' exact mean and spread, recomputed from their public batch seeds."""


@register_attack("omniscient_ipm", OmniscientIpmOptions)
class OmniscientIpm(InnerProductManipulation):
    """``ipm`` against the honest peers' exact mean, recomputed from their public batch seeds."""


class NanOptions(AttackOptions):
    """Options of ``nan``: ``value``, the non-finite value sent, and ``fraction``, the share of the values
    (drawn at random) it replaces."""

    value: Literal["nan", "inf", "-inf"] = Field("nan", description="the non-finite value sent")
    fraction: float = Field(1.0, gt=0, le=1, description="fraction of the values replaced (random ones)")


@register_attack("nan", NanOptions)
class NonFinite(Attack):
    """Sends NaN (or an infinity) in place of a ``fraction`` of the values: validation must refuse it."""

    def contribution(
        self, honest: torch.Tensor, step: int, *, peers: torch.Tensor | None = None
    ) -> torch.Tensor:
        poisoned = honest.clone()
        value = float(self.options.value)
        if self.options.fraction >= 1:
            return poisoned.fill_(value)
        flat = poisoned.view(-1)
        count = max(1, math.floor(self.options.fraction * flat.numel()))
        flat[torch.randperm(flat.numel(), generator=self.generator(step))[:count]] = value
        return poisoned


class HugeWeightOptions(AttackOptions):
    """Options of ``huge_weight``: ``weight``, the sample count it claims, and ``flip_sign``, whether it
    also sends the reversed gradient."""

    weight: float = Field(1e6, gt=0, le=1e30, description="the weight claimed, whatever the honest one")
    flip_sign: bool = Field(
        True, description="also send the reversed gradient, so that the weight does harm under a mean"
    )


@register_attack("huge_weight", HugeWeightOptions)
class HugeWeight(Attack):
    """Claims an enormous weight (sample count) so a weighted mean follows this sender alone."""

    def contribution(
        self, honest: torch.Tensor, step: int, *, peers: torch.Tensor | None = None
    ) -> torch.Tensor:
        return -honest if self.options.flip_sign else honest

    def weight(self, claimed: float) -> float:
        return self.options.weight


class BatchClaimOptions(AttackOptions):
    """Options of ``batch_claim``: ``samples``, what its progress record claims to hold at every step."""

    samples: int = Field(
        1 << 40, ge=0, lt=1 << 63, description="the samples its record claims, whatever it holds"
    )


@register_attack("batch_claim", BatchClaimOptions)
class BatchClaim(Attack):
    """Trains and sends honestly, but its signed progress record claims ``samples`` at its step, to make the
    every_step peers at that step start their rounds after one micro-batch (``swarm.training.readiness``
    counts such a claim only as far as the claimant's last rounds showed its work). Nothing it signs
    contradicts the claim: nobody can be convicted for it."""

    def claim(self, samples: int) -> int:
        return self.options.samples


class BadReducerOptions(AttackOptions):
    """Options of ``bad_reducer`` and ``refusing_reducer``: ``shift``, the finite offset added to every
    value of the aggregate, as a multiple of its RMS."""

    shift: float = Field(
        1.0, gt=0, le=1e6, description="added to every value, as a multiple of the aggregate's RMS"
    )

    @model_validator(mode="after")
    def _finite(self) -> BadReducerOptions:
        if not math.isfinite(self.shift):
            raise ValueError("shift must be finite")
        return self


@register_attack("bad_reducer", BadReducerOptions)
class BadReducer(Attack):
    """As the reducer of a part, returns the aggregate shifted by ``shift`` times its RMS on every value.

    Its own contributions are honest: only a check of the reducers' outputs catches it.
    """

    rewrites_aggregates = True

    def reduce(self, aggregate: torch.Tensor) -> torch.Tensor:
        rms = float(torch.sqrt(torch.mean(aggregate.to(torch.float64) ** 2))) if aggregate.numel() else 0.0
        return aggregate + self.options.shift * (rms if rms > 0 else 1.0)


# --- attacks on verification, each rehearsing a way around the validators or the judge -----------------
#
# Their round hooks (``swarm.averaging.hooks``) are called by the all-reduce and the validators with the
# live round (a ``ButterflyAllReduce``), since they act on what a round has signed rather than on a gradient.


class DrawAwareReducerOptions(BadReducerOptions):
    """Options of ``draw_aware_reducer``: ``shift`` as for ``bad_reducer``, and ``verify_probability``,
    the run's verify probability, from which it works out the chunks validators will check."""

    verify_probability: float = Field(
        1.0, ge=0, le=1, description="the run's verify probability, which the attacker knows"
    )


@register_attack("draw_aware_reducer", DrawAwareReducerOptions)
class DrawAwareReducer(BadReducer):
    """A ``bad_reducer`` that lies only on chunks no validator will check, as far as it can predict the
    draw at the moment it signs: the draw itself once every nonce is revealed, else its best guess from
    what it holds then (the round's digest and every member's nonce commitment, the SHA-256 of the
    nonce). It lies wherever its prediction says nobody looks."""

    def aggregate(
        self, runner: ButterflyAllReduce, part: int, chunk: int, honest: torch.Tensor
    ) -> torch.Tensor:
        if part != runner.index:  # as a repair's substitute it cannot tell: it lies throughout
            return self.reduce(honest)
        from swarm.averaging.verification import Assignment, assignments

        seed = runner.shared_seed
        if seed is None and all(runner.commitments):  # the draw as if the commitments were its input
            public = b"".join(c for c in runner.commitments if c is not None)
            seed = hashlib.sha256(b"shared|" + runner.digest + public).digest()
        if seed is not None:
            chunks = [len(c) - 1 for c in runner.part_chunks]
            mine = Assignment(runner.index, chunk)
            for member in range(len(runner.peer_ids)):
                drawn = assignments(
                    seed, len(runner.peer_ids), member, self.options.verify_probability, chunks,
                    reducers=runner.reducers,
                )  # fmt: skip
                if mine in drawn:
                    return honest
        return self.reduce(honest)


@register_attack("refusing_reducer", BadReducerOptions)
class RefusingReducer(BadReducer):
    """A ``bad_reducer`` that will not show a validator any input it aggregated (not even its own)."""

    refuses_inputs = True


class FramerOptions(AttackOptions):
    """Options of ``framer``: ``trick``, how it forges the evidence: ``numel`` claims a chunk one value
    longer, ``slot`` substitutes a second contribution signed for the framer's own slot."""

    trick: Literal["numel", "slot"] = Field(
        "slot",
        description="numel: claim a chunk one value longer than it is; slot: substitute a second, "
        "different contribution signed for the framer's own slot",
    )


@register_attack("framer", FramerOptions)
class Framer(Attack):
    """As a validator, turns the true evidence of an honest reducer's chunk into an accusation of it."""

    def frame(self, evidence: Any, runner: Any) -> Any:
        import dataclasses

        if self.options.trick == "numel":
            return dataclasses.replace(evidence, numel=evidence.numel + 1)
        forged = self._second_input(runner, evidence.part, evidence.chunk)
        inputs = tuple(forged if i.sender_index == runner.index else i for i in evidence.inputs)
        return dataclasses.replace(evidence, inputs=inputs)

    @staticmethod
    def _second_input(runner: Any, part: int, chunk: int) -> Any:
        """A contribution to ``(part, chunk)`` that this peer signs but never sent: its values negated."""
        from swarm.averaging.evidence import SignedInput, contribution_message

        honest = runner.own_input(part, chunk)
        lo, hi = runner.chunk_range(part, chunk)
        data = runner.codec.encode_contribution(
            -runner.codec.decode(honest.data, hi - lo, sender="self") - 1.0
        )
        me = runner.members[runner.index]
        message = contribution_message(runner.digest, part, chunk, me, honest.weight, data)
        return SignedInput(runner.index, data, runner.key.sign(message), honest.weight)


@register_attack("equivocator", AttackOptions)
class Equivocator(Attack):
    """Sends its honest contribution to each reducer, but shows validators another one, signed as well,
    so that the reducer seems to have aggregated something its sender never sent."""

    def show(self, runner: Any, part: int, chunk: int, honest: Any) -> Any:
        return Framer._second_input(runner, part, chunk)


@register_attack("withholder", AttackOptions)
class Withholder(Attack):
    """Sends honest, signed contributions, but never returns the aggregate of its own part."""

    withholds_aggregates = True


@register_attack("step_liar", AttackOptions)
class StepLiar(Attack):
    """Trains and sends honestly, but signs the next step into every group entry (issue 25 item 3). Before,
    one such member voided every DiLoCo outer round it joined, and two in a group of four every_step round;
    the stalled honest peers then let the peers ahead decide their catch-up."""

    def entry(self, extra: dict) -> dict:
        step = extra.get("step")
        return {**extra, "step": step + 1} if type(step) is int else extra


@register_attack("denier", AttackOptions)
class Denier(Attack):
    """Joins groups with its own signed entry and sends honest contributions, but answers every part stream
    sent to it that it knows no such round, as an honest member that left the group would (issue 25 item
    4). Before, its part was never repaired and the honest leader took the blame."""

    denies_rounds = True
