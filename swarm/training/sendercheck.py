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
   ``KEEP_S`` after (the coordinator downloads it at its recompute's turn; ``swarm.training.filings``).
   The coordinator checks the draw named this accuser, chunk and sender, downloads that state from the
   accuser, checks that it hashes to what the accused signed, recomputes the chunk itself and bans
   whoever the evidence proves wrong (``coordinator.contributions``). Without every member's reveal the
   validator draws from its own randomness and only avoids a liar it finds (``suspect``): the coordinator
   could not tell it was drawn.
4. Beside the drawn sender, the validator scores every input of a chunk it checked
   (``swarm.averaging.scores``) and replays one sender that stands out, at most once a round; that
   evidence carries the chunk's scores and needs no draw, so it is filed with or without the reveals.
   Every reducer scores its own part's drawn chunk too, drawn to validate or not (``_own_part``): a
   sender that stands out there is replayed by the two reducers the round's draw names for it
   (``replays_own_part``; without every reveal, by any reducer it stands out at). A sender whose replay
   for standing out found it honest is replayed for that again, for ``CLEARED_ROUNDS`` rounds, only in
   the share of rounds the draw picks (``still_replayed``): colluders that make an honest sender stand
   out cannot cost its reducers a replay every round, and a liar cleared once cannot count on it.
5. A stale input (an older step's or window's) does not stand out: it points where every sender's does.
   So a reducer also scores the fit of a sender's input to one of the sender's own micro-batches
   (``_poor_fit``, ``swarm.averaging.scores.fits_poorly``): that micro-batch's gradient at the round's state
   is a public fact an honest input holds, and an input that fits it worse than the other inputs do is
   replayed. Which reducer scores a sender, and against which micro-batch, a hash of the chunk's other
   signed inputs says (``fit_draw``), unknown to the sender when it signs; about one fit a sender a round.
   One micro-batch's gradient a fit, a member spending ``FIT_SHARE`` of its own micro-batches on them and
   on the replays of honest senders they point to (``FitBudget``; in some rounds only where it computes
   few: which, by its own randomness). The coordinator scores the same fit on the state it downloads
   before it recomputes, so only a poor fit (or a drawn or standing-out sender) can be put to it.

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
whose draw would replay it; only a lie that stands out is filed then (docs/robustness.md).

Example::

    checks = SenderChecks(run, device="cpu", state=lambda: (peer.step, peer.state_hash, tensors))
    averager.sender_checks = checks          # keep() at each complete round, check() after validation
    servicer = StateServicer(run_id, provider, admit=admit, find=checks.find)
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import struct
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch

from protocols.errors import SwarmError
from protocols.messages import JUDGING_BUDGET_S
from swarm.averaging.evidence import (
    BadAggregateEvidence,
    SignedInput,
    drawn_chunk,
)
from swarm.averaging.verification import draw, own_part_evidence, round_of
from swarm.config import RunConfig, sender_checks_on
from swarm.training.contribution import (
    KIND,
    WrongContributionEvidence,
    chunk_slice,
    compare,
    recompute,
    state_model,
)
from swarm.training.filings import Accusations, StateCopy
from swarm.training.fitbudget import FitBudget
from swarm.training.picks import (
    OWN_PART_REPLAYERS,
    drawn_sender,
    fit_draw,
    fit_micro_batches,
    flagged_senders,
    outlier_to_replay,
    own_part_replay_share,
    own_part_replayers,
    whole_micro_batches,
)
from swarm.training.sync import EncodedState

logger = logging.getLogger(__name__)

#: Rounds whose state awaits its check (a new round's copy pushes out the oldest).
MAX_PENDING = 2
#: Checked chunks a validator scores in a round, looking for a sender that stands out (``_outlier``).
MAX_SCORED_CHUNKS = 4
#: How far beyond the tolerance a validator's own replay must find a contribution before it files (as a share
#: of the tolerance): the coordinator convicts beyond the tolerance itself, so a lie placed at the edge, on
#: the side where the validator's replay rounds differently from the coordinator's, is not filed.
ACCUSE_MARGIN = 0.1
#: Replays running or waiting their turn at once (each holds its round's state copy).
MAX_REPLAYS_DUE = 2
#: The share of its own micro-batches a member spends on fits (``_poor_fit``), counted in micro-batches: one
#: a fit scored (its gradient; 0.56-0.81 of a whole micro-batch's on the demo model) and the whole replay of
#: each sender a poor fit pointed to that convicted nobody, each sender's out of its own account
#: (``FitBudget``). In diloco a window of H inner steps affords a fit a round for H >= 14; in every_step a
#: peer that computes few micro-batches a step scores its named senders in some rounds only, by its own
#: randomness, so nobody can tell which. An honest input's fit falls below the others' more often the
#: more micro-batches it holds (its own batch is a smaller share of it), and each such replay costs a
#: whole step: the budget holds the cost whatever that rate, and spends less on fits where it is high.
FIT_SHARE = 0.075
#: Rounds for which a sender whose replay for standing out found it honest is only sometimes replayed for
#: standing out again by that member: colluders that move a chunk's median can make an honest sender stand
#: out, and would otherwise cost its reducers a replay (a step, or a window) in every round.
CLEARED_ROUNDS = 8
#: The share of rounds in which such a cleared sender that stands out is replayed all the same, by the
#: round's draw (``still_replayed``): a liar cleared by one honest round cannot lie unreplayed for the rest.
CLEARED_REPLAY_SHARE = 0.25

# (step, state hash, state tensors) of this peer now, read before the round's update is applied.
StateNow = Callable[[], tuple[int, str, dict[str, torch.Tensor]]]


def _would_hold(lie: WrongContributionEvidence, run: RunConfig, runner, copy: StateCopy, device: str) -> None:
    """The coordinator's checks of ``lie`` before it recomputes (``coordinator.contributions``), as this
    member (the accuser) would pass them, on the state ``copy``; a SwarmError if it would not."""
    me = runner.members[runner.index]
    if lie.check_draw(run, runner.codec, runner.numel, me):
        return
    try:
        lie.check_stands_out(run, runner.codec, runner.numel, me)
    except SwarmError:
        lie.check_fit_scorer(run, runner.codec, runner.numel, me)
        lie.check_fits_poorly(run, copy.tensors, runner.codec, runner.numel, device=device)


class SenderChecks:
    """One validator's sender checks (see the module docstring). ``state`` reads this peer's step, state
    hash and a copy of its state tensors; ``accuse`` files evidence (None: only logged); ``suspect``
    (peer, reason) avoids a sender caught lying in matchmaking."""

    def __init__(self, run: RunConfig, *, device: str, state: StateNow, accuse=None, suspect=None):
        self.run, self.device, self.state, self.suspect = run, device, state, suspect
        self.probability = run.training.sender_check_probability
        self.pending: OrderedDict[bytes, StateCopy] = OrderedDict()  # group ID -> the state at its round
        self.checked = self.caught = 0
        self.outliers = 0  # senders replayed because their input stood out (``_outlier``), not drawn
        self.fits = 0  # senders whose fit to a micro-batch of theirs this member scored (``_poor_fit``)
        self.fit_s = 0.0  # the time those scores took (a micro-batch's gradient each)
        # What fits, and the replays of honest senders they point to, may still cost (one account a sender).
        self.fit_budget = FitBudget(FIT_SHARE)
        self._fit_replays: set[str] = set()  # senders a poor fit pointed to whose replay is due
        self.replay_s = 0.0  # the time replays took (a sender's step, or its window, each)
        # Senders that stood out and whose replay found them honest -> the last round (of ``rounds``, the
        # complete rounds seen) in which they are not replayed for standing out again.
        self.rounds = 0
        self.cleared: dict[str, int] = {}
        # One replay at a time, and one more waiting its turn: a check that comes due beyond that is
        # skipped (a liar that reads last round's draw cannot count on its validator being busy).
        self._replay_turn = asyncio.Lock()
        self.replays_due = 0
        self.skipped = 0
        # Accusations to file, one at a time, each with the state its lie was found on (bounded there).
        self.accusations = Accusations(run, accuse)

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
        self.rounds += 1
        self.cleared = {peer: until for peer, until in self.cleared.items() if until >= self.rounds}
        seed = runner.shared_seed
        # A member the draw gives no part to check still replays a sender that stands out among the inputs
        # of its own part's drawn chunk, which it holds as their reducer (``_own_part``).
        checks_none = seed is not None and not draw(runner, self.run.training.verify_probability)
        if (
            checks_none
            and self._refused(runner, seed) is None
            and await self._own_part(runner, seed) is None
            and not self._fit_candidates(runner, self._own_chunk(runner, seed))
        ):
            return
        step, state_hash, tensors = await asyncio.to_thread(self.state)
        self.pending[runner.group_id] = StateCopy(step, state_hash, tensors, dict(enumerate(signed_entries)))
        while len(self.pending) > MAX_PENDING:
            self.pending.popitem(last=False)

    async def check(self, runner, outcomes: Sequence) -> None:
        """Replay the sender the round's draw names for each chunk this member validated, and one sender a
        round whose input stands out (``_outlier``); accuse the ones that lied. Without every member's
        reveal (one withheld it) the draw is this member's own: a drawn sender's lie found so is not
        provable to the coordinator and its sender is only avoided (``suspect``); one that stands out is
        filed all the same, since its scores need no draw."""
        copy = self.pending.pop(runner.group_id, None)
        if copy is None:
            return
        seed = runner.shared_seed
        members = len(runner.members)
        reveals = tuple(runner.reveals[i] for i in range(members)) if seed is not None else ()
        own_draw = os.urandom(32) if seed is None else seed
        outlier_replayed, scored = False, 0
        claim: tuple[BadAggregateEvidence, SignedInput] | None = None  # a false weight claim, filed last
        refused = self._refused(runner, own_draw, shared=seed is not None)
        if refused is not None:  # a signed input to this member's own part that did not decode: a replay
            chunk, item = refused  # of its own (a decoy that sends one must not spare a liar the others)
            lie = WrongContributionEvidence(
                **round_of(runner, runner.index, chunk), item=item, entry=copy.entries[item.sender_index],
                reveals=reveals,
            )  # fmt: skip
            await self._check_one(runner, lie, copy)
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
            found_claim, odd = await self._outlier(runner, evidence, seed=own_draw, drawn=sender)
            if claim is None and found_claim is not None:
                claim = (evidence, found_claim)
            if odd is not None:
                outlier_replayed = True
                self.outliers += 1
                await self._check_one(runner, self._lie(evidence, odd, copy, reveals, scored=evidence), copy)
        if not outlier_replayed:  # then one among the inputs this member aggregated as a reducer
            found = await self._own_part(runner, own_draw, shared=seed is not None)
            own, own_claim, odd = found if found is not None else (None, None, None)
            if claim is None and own_claim is not None:
                claim = (own, own_claim)
            if odd is not None:
                self.outliers += 1
                await self._check_one(runner, self._lie(own, odd, copy, reveals, scored=own), copy)
            else:  # or one whose input does not fit one of its own micro-batches
                picked = await self._poor_fit(runner, own_draw, copy, reveals)
                if picked is not None:
                    self.outliers += 1
                    await self._replay_poor_fit(
                        runner, self._lie(*picked, copy, reveals, scored=picked[0]), copy
                    )
        # A false weight claim needs no replay, so it takes no replay's place: one a round, filed after the
        # replays, so that decoys' claims cannot fill the filing queue ahead of a liar a replay caught.
        if claim is not None:
            await self._check_one(runner, self._lie(claim[0], claim[1], copy, reveals, scored=claim[0]), copy)

    def _refused(self, runner, seed: bytes, *, shared: bool = True) -> tuple[int, SignedInput] | None:
        """(chunk, input) of a sender whose validly signed input to this member's own part did not decode
        (``PartReducer.undecodable``), for this member to replay: as a reducer the round's draw ``seed``
        names for that sender (``replays_own_part``), or without every reveal (``shared`` False) by this
        member's own randomness as often as the draw would name it, so that about ``OWN_PART_REPLAYERS``
        reducers replay it either way (a decoy that withholds its reveal once made every reducer replay
        the whole batch it claims); None if none."""
        if not runner.reduces(runner.index):
            return None
        for sender, found in sorted(runner.reducer.undecodable.items()):
            if shared:
                if runner.index in replays_own_part(seed, runner, sender):
                    return found
                continue
            share = own_part_replay_share(len(runner.members), runner.reduces, sender)
            if int.from_bytes(os.urandom(8), "big") < share * 2**64:
                return found
        return None

    async def _own_part(
        self, runner, seed: bytes, *, shared: bool = True
    ) -> tuple[BadAggregateEvidence, SignedInput | None, SignedInput | None] | None:
        """A sender to replay among the inputs of the drawn chunk of this member's own part, with the chunk
        as evidence; None if none stands out, or the round's draw ``seed`` names other reducers to replay it
        (``replays_own_part``): each reducer holds its own part's inputs, and a couple of replays of a liar a
        round are enough. Without the round's draw (``shared`` False: ``seed`` is this member's own
        randomness, since a member withheld its reveal) any sender that stands out may be replayed: a liar
        that withholds its reveal from the reducers the draw names must not escape them all."""
        if not self.run.training.replay_outliers:
            return None
        evidence = self._own_chunk(runner, seed)
        if evidence is None:
            return None
        claim, odd = await self._outlier(
            runner, evidence, seed=seed, drawn=None,
            eligible=lambda sender: not shared or runner.index in replays_own_part(seed, runner, sender),
        )  # fmt: skip
        return None if claim is None and odd is None else (evidence, claim, odd)

    def _own_chunk(self, runner, seed: bytes) -> BadAggregateEvidence | None:
        """The drawn chunk of this member's own part (by ``seed``), with every input it aggregated and its
        own signed aggregate; None if it reduces no part or holds no such chunk."""
        if not runner.reduces(runner.index):
            return None
        part = runner.index
        chunk = drawn_chunk(seed, part, runner.chunk_count(part))
        return own_part_evidence(runner, chunk) if chunk is not None else None

    def _fit_candidates(self, runner, evidence: BadAggregateEvidence | None) -> list[SignedInput]:
        """The inputs of ``evidence`` (this member's own chunk) whose fit the chunk's draw has this member
        score (``fit_draw``), other than its own and those whose weight is no sample count the loop signs
        (a lie judged without a replay, ``_outlier``'s)."""
        if evidence is None or not self.run.training.replay_outliers:
            return []
        found = []
        for item in evidence.inputs:
            if item.sender_index == runner.index:
                continue
            try:
                micro_batches = fit_micro_batches(self.run, item.weight)
            except SwarmError:
                continue
            if fit_draw(evidence, item.sender_index, micro_batches)[0]:
                found.append(item)
        return found

    async def _poor_fit(
        self, runner, seed: bytes, copy: StateCopy, reveals: tuple[bytes, ...]
    ) -> tuple[BadAggregateEvidence, SignedInput] | None:
        """A sender to replay whose input to the drawn chunk of this member's own part fits the gradient of
        its micro-batch that the chunk's draw picks (recomputed on ``copy``) worse than the other inputs do
        (``swarm.averaging.scores.fits_poorly``): among ``_fit_candidates``, except a sender cleared of late
        in rounds whose draw spares it (``still_replayed``); with the chunk as evidence; None if none.
        Each sender scored costs a micro-batch's gradient, on a worker thread, and a member spends
        ``FIT_SHARE`` of its own micro-batches on them and on the honest replays they point to
        (``FitBudget``), which senders it scores drawn by its own randomness."""
        evidence = self._own_chunk(runner, seed)
        named = self._fit_candidates(runner, evidence)
        if not named:
            return None
        # Every sender named earns its share, a cleared one too (its debt and its clearance run together).
        own = next((x.weight for x in evidence.inputs if x.sender_index == runner.index), 0.0)
        budget = self.fit_budget
        budget.earn(own / self.run.training.micro_batch_size, [runner.members[x.sender_index] for x in named])
        candidates = [
            item for item in named
            if runner.members[item.sender_index] not in self.cleared or still_replayed(seed, item.sender_index)
        ]  # fmt: skip
        items = [
            x for x in candidates
            if runner.members[x.sender_index] not in self._fit_replays
            and int.from_bytes(os.urandom(8), "big") < budget.afford(runner.members[x.sender_index]) * 2**64
        ]  # fmt: skip
        if not items:
            return None
        for item in items:  # paid when picked: two rounds checked at once see each other's fits
            budget.spend(runner.members[item.sender_index], 1.0)
        # Scored in an order of this member's own randomness: a sender that fits poorly first in member
        # order must not spare a liar scored after it (one replay a round).
        items.sort(key=lambda _: os.urandom(8))

        def score() -> SignedInput | None:  # decoding and gradients: off the event loop
            try:
                decoded = evidence.checked_inputs(runner.codec, runner.numel)
            except SwarmError:  # an input that does not decode: the reducer's check is the one that applies
                return None
            for item in items:
                lie = self._lie(evidence, item, copy, reveals, scored=evidence)
                started = time.monotonic()
                try:
                    self.fits += 1
                    if copy.model is None:
                        copy.model, _ = state_model(self.run, copy.tensors, self.device)
                    if lie.fit_is_poor(
                        self.run, copy.tensors, decoded, runner.codec, runner.numel, device=self.device,
                        model=copy.model,
                    ):  # fmt: skip
                        return item
                except SwarmError as e:
                    logger.info(f"could not score the fit of {lie.accused}: {e}"[:300])
                finally:
                    self.fit_s += time.monotonic() - started
            return None

        odd = await asyncio.to_thread(score)
        if odd is not None:
            logger.info(
                f"{runner.members[odd.sender_index]}'s input to part {evidence.part} chunk {evidence.chunk} fits "
                "its own micro-batch worse than the others' do"
            )
        return None if odd is None else (evidence, odd)

    async def _replay_poor_fit(self, runner, lie: WrongContributionEvidence, copy: StateCopy) -> None:
        """Replay a sender a poor fit pointed to; not scored again by this member while that replay is due,
        and a replay that convicts nobody comes out of its fit account (``FitBudget``)."""
        self._fit_replays.add(lie.accused)
        try:
            if await self._check_one(runner, lie, copy):
                self.fit_budget.spend(lie.accused, whole_micro_batches(self.run, lie.item.weight))
        finally:
            self._fit_replays.discard(lie.accused)

    def _lie(
        self, evidence: BadAggregateEvidence, item: SignedInput, copy: StateCopy, reveals: tuple[bytes, ...],
        scored: BadAggregateEvidence | None = None,
    ) -> WrongContributionEvidence:  # fmt: skip
        return WrongContributionEvidence(
            prefix=evidence.prefix, group_id=evidence.group_id, members=evidence.members,
            commitments=evidence.commitments, part=evidence.part, chunk=evidence.chunk,
            reducers=evidence.reducers, item=item, entry=copy.entries[item.sender_index], reveals=reveals,
            scored=scored,
        )  # fmt: skip

    async def _outlier(
        self, runner, evidence: BadAggregateEvidence, *, seed: bytes, drawn: int | None,
        eligible: Callable[[int], bool] = lambda sender: True,
    ) -> tuple[SignedInput | None, SignedInput | None]:  # fmt: skip
        """From one scoring of the chunk (``flagged_senders``), among the senders ``eligible`` other than the
        drawn one and this member: the input of the first whose signed weight is a false claim (judged
        without a replay), and the input of one whose values stand out, picked by the round's draw
        (``outlier_to_replay``), a sender ``cleared`` of late only in the rounds whose draw still replays it
        (``still_replayed``); None for either where there is none. A claim takes no stand-out replay: a
        decoy's claim must not spare a liar that stands out beside it."""

        def flags() -> tuple[list[int], list[int]]:  # decoding and scoring: off the event loop
            # The run's layout, as the coordinator reads it (``check_stands_out``).
            decoded = evidence.checked_inputs(runner.codec, runner.numel)
            return flagged_senders(self.run, evidence.inputs, decoded, validator=runner.index)

        try:
            found_claims, odd = await asyncio.to_thread(flags)
        except SwarmError:  # an input that does not decode: the reducer's check is the one that applies
            return None, None

        def fresh(sender: int) -> bool:
            return runner.members[sender] not in self.cleared or still_replayed(seed, sender)

        def item(sender: int | None) -> SignedInput | None:
            return None if sender is None else next(i for i in evidence.inputs if i.sender_index == sender)

        claims = [i for i in found_claims if eligible(i) and i != drawn]
        odd = [i for i in odd if eligible(i) and fresh(i)]
        pick = outlier_to_replay([], odd, seed=seed, part=evidence.part, chunk=evidence.chunk, drawn=drawn)
        return item(claims[0] if claims else None), item(pick)

    async def _check_one(self, runner, lie: WrongContributionEvidence, copy: StateCopy) -> bool:
        """Replay ``lie``'s sender and file what it proves; whether a replay ran and convicted nobody (it found
        the sender honest, or could not finish: past its time, or not finite)."""
        accused = lie.accused
        ran = False
        try:
            step, state_hash = lie.facts()
            if (step, state_hash) != (copy.step, copy.state_hash):  # excluded from rounds (step_misfit)
                logger.info(
                    f"{accused} joined round {runner.group_id.hex()[:8]} at another state; not checked"
                )
                return False
            if self.replays_due >= MAX_REPLAYS_DUE:  # replays slower than rounds: not piled up
                self.skipped += 1
                logger.info(f"skipped the check of {accused}: replays of earlier rounds are still due")
                return False
            self.replays_due += 1
            if lie.scored is not None:
                logger.info(
                    f"{accused}'s input to part {lie.part} chunk {lie.chunk} of round {runner.group_id.hex()[:8]} "
                    "stands out among the chunk's; replaying it"
                )
            try:
                async with self._replay_turn:
                    self.checked += 1
                    # A replay is as long as the sender's signed claim (at most a whole step or window);
                    # one past the coordinator's own budget could not be judged, so it stops there.
                    started = time.monotonic()
                    ran = True
                    try:
                        verdict = await asyncio.to_thread(
                            lie.judge, self.run, copy.tensors, runner.codec, vector_numel=runner.numel,
                            device=self.device, deadline=started + JUDGING_BUDGET_S, margin=ACCUSE_MARGIN,
                        )  # fmt: skip
                    finally:
                        self.replay_s += time.monotonic() - started
            finally:
                self.replays_due -= 1
        except Exception as e:  # a replay this peer cannot run: nobody is accused
            logger.warning(f"could not check the contribution of {accused}: {e!r}"[:500])
            return ran
        if verdict is None:
            logger.debug(f"recomputed the contribution of {accused} to part {lie.part} chunk {lie.chunk}")
            if lie.scored is not None:  # it stood out, honestly: not replayed for that again for a while
                self.cleared[accused] = self.rounds + CLEARED_ROUNDS
            return True
        self.caught += 1
        logger.warning(f"{accused} {verdict} in round {runner.group_id.hex()[:8]}")
        if self.suspect is not None:
            self.suspect(accused, "sent a contribution other than its public batch seeds give")
        if not lie.reveals and lie.scored is None and not lie.undecodable(runner.codec, runner.numel):
            # Found by this member's own draw (a member withheld its nonce): the coordinator could not
            # tell it was drawn. A sender that stands out, or whose input does not decode, is filed all
            # the same: that needs no draw.
            return False
        try:  # what the coordinator checks first: evidence that does not hold would ban this member
            await asyncio.to_thread(_would_hold, lie, self.run, runner, copy, self.device)
        except SwarmError as e:
            logger.warning(f"not filing against {accused}: the evidence would not hold ({e})"[:500])
            return False
        if not self.accusations.file(accused, lie, verdict, copy):
            # The coordinator takes one accusation of a validator at a time, each waiting with its state; a
            # lie beyond what the queue holds is avoided (a decoy's accusation must not spare the liar).
            logger.info(f"{accused} is avoided, not accused: this validator's accusations are still judged")
        return False

    async def filed(self) -> None:
        """Wait until the accusations being filed, if any, are answered or given up."""
        await self.accusations.filed()

    def close(self) -> None:
        """Stop filing, now and for checks that end later (the peer leaves the run)."""
        self.accusations.close()

    def find(self, state_hash: str) -> EncodedState | None:
        """A state a lie was found on (for the coordinator to judge it), encoded; None if none is kept."""
        return self.accusations.find(state_hash)


def replays_own_part(seed: bytes, runner, sender: int) -> tuple[int, ...]:
    """The reducers that replay ``sender`` when it stands out among a round's inputs to the reducers' own
    parts, by the round's draw ``seed`` (``picks.own_part_replayers``, of ``runner``'s round)."""
    return own_part_replayers(seed, len(runner.members), runner.reduces, sender)


def still_replayed(seed: bytes, sender: int) -> bool:
    """Whether the round's draw ``seed`` replays ``sender`` for standing out although a replay cleared it
    of late (``CLEARED_REPLAY_SHARE`` of rounds; the draw is fixed only after every input is signed)."""
    pick = hashlib.sha256(b"cleared-replay|" + seed + struct.pack(">I", sender)).digest()
    return int.from_bytes(pick[:8], "big") < CLEARED_REPLAY_SHARE * 2**64


__all__ = [
    "KIND",
    "OWN_PART_REPLAYERS",
    "SenderChecks",
    "WrongContributionEvidence",
    "chunk_slice",
    "compare",
    "drawn_sender",
    "replays_own_part",
    "still_replayed",
    "recompute",
    "whole_micro_batches",
]
