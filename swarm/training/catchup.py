"""The one catch-up rule: when a holder of training state must move to another state, and from whom.

Used by the data-parallel trainer, by every pipeline stage replica (among the replicas of its stage)
and by the coordinator's checkpoint keeper, so all three follow exactly the same rule:

1. Only positions (step, state hash) from signed records of distinct certified, unbanned peers seen in
   the last record window count (``swarm.records.RecordTrust`` builds those views; a made-up subkey, an
   unsigned record or a banned signer never reaches this module).
2. A position ahead of the caller is followed only when a strict majority of every other peer in view
   holds it, counting the caller too when it sees at least two other peers and nobody but the
   candidate's holders is ahead of it (its state is then as current as any). Right after a commit the
   caller's honest groupmates still show the step they are finishing, and honest peers far behind
   (downloading, just joined) hold no candidate: were either left out, one admitted peer announcing a
   step ahead would be a majority of one. A position at the caller's own step is decided among the
   peers at, ahead of or one step behind it (rule 4), so peers far behind cannot keep two apart sides
   apart. A handful of Sybil keys therefore move nobody: with fewer certified attackers than honest
   peers they never outnumber the honest peers in view, and admission bounds how many keys one
   attacker gets. A coordinator's signed checkpoint record is the other trusted source; callers use it
   when most peers in view have not trained past step 0.
   Once ``CREDIT_QUORUM`` (3) peers in view have credit, votes are not counted but weighed
   (``by_credit``): by the samples the coordinator credited each for rounds other members witnessed, as
   it signs them into its heartbeat answers (``swarm.standing``), each capped at the third most any peer
   in view holds, so that one peer with a long history neither decides nor vetoes alone. Keys that did
   no witnessed work weigh nothing, so under ``open`` admission Sybils that outnumber the honest peers in
   view neither move a fresh peer, one that is not stalled, or the coordinator's checkpoint keeper, nor
   keep them from the honest peers' state, and only credited holders serve the download. At the
   caller's own step its own credit weighs for its side (rule 4). Before credit exists (a run's first
   steps), and for a stalled caller's groupmates (below), counting decides.
   A caller whose rounds have failed at its step for longer than a whole round can take (``stalled``,
   counted from its first round attempt at the step, never from the step's start: computing a large
   batch is not being stuck) lets only the peers ahead of it vote: the peers at its own step may be as
   stuck as it is (a groupmate that keeps vanishing), and one completed round must not leave them apart
   for good. Of those, only the members of the last round it completed and applied (``Groupmates``)
   vote, and all of them at or ahead of its step: a position ahead needs a strict majority of them;
   after twice as long, only those ahead vote (the ones at its step may be stuck with it, below the
   run's minimum group size), and only while the peers in view at its step are no more than those
   ahead of it (else rounds at its step can form, and a groupmate ahead alone must not decide) and most
   peers in view ahead of it hold the same position. The state is then downloaded from those
   groupmates only. A stalled caller with no such groupmate in view is not treated as
   stalled. Before, one record one step ahead, of any certified key, was a majority of one for a peer
   whose rounds an attacker kept failing.
3. Never backwards (but rule 6's one step to where the caller was), never past ``max_step`` (the run's
   ``max_steps``, or ``MAX_STEP``): a record of step 2**63-1 cannot freeze a run or its checkpoints.
4. At the caller's own step the majority position must also beat the caller's own side (itself plus
   the peers that agree with it); equal sides go to the smaller hash, so two apart peers never swap.
5. The state is downloaded only from the peers that hold the chosen position (certified holders), and
   each download is verified against the hash (``swarm.training.sync``). A holder that trained past
   that step before the download began offers its newer state; it is taken only when a strict majority
   of the peers in view were seen at that step with that hash (``PositionHistory``), otherwise the
   caller looks again.
6. One step back, and only to where it was (``step_back_target``): a data-parallel peer that applied a
   round its groupmates did not (their part of it failed) is alone at the next step, and when the peers
   behind are too few for the run's minimum group size without it, nobody can ever form a round again.
   Rules 2 and 4 cannot end that: one peer ahead is no majority. So a caller whose rounds have failed
   three times as long as a round takes (longer than the peers behind wait before rule 2 lets them
   follow it, where it can) moves back to the position it held before its last applied round, when that
   round brought it to its current step, and a strict majority of every other peer in view (of their
   credit and credited heads once credit decides) holds exactly that position. Records at or past its
   step do not stop it: one key placed there, credited or not, would otherwise keep the run stuck, and
   peers that applied the round with it and are as stuck go back too. It can only return to a state it
   held and verified itself, one step back, and only where most of the run is: the worst a majority of
   liars makes of this is one step of one peer's work redone, which that majority could cost anyway.
   Not at ``max_steps``: no round is tried there, so the stall clock does not run, and a peer waiting
   there for slower peers (still computing, or stuck) looks the same from its records.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Collection, Mapping
from dataclasses import dataclass

MAX_STEP = 2**62
# A peer's vote by credit is capped at the credit of the peer that holds this much of it (the third most).
CREDIT_CAP_RANK = 3
# Peers in view with credit that make credit, not the count of keys, decide a move: with fewer, one peer
# credited early would decide alone.
CREDIT_QUORUM = 3
# When credit decides, a download holder holds at least this share of the vote cap (the third most credit
# in view): keys with a sliver of farmed credit that copy the position are no holders, each of which the
# downloader would try in turn.
HOLDER_SHARE = 0.1
# Round times a caller's rounds have failed before rule 6 moves it back: more than the two after which the
# peers behind it may follow it forward (rule 2), so that both sides do not move at once.
STEP_BACK_ROUNDS = 3


@dataclass(frozen=True)
class Position:
    """Where a peer is: its step and the hash of the state it holds at the start of that step."""

    step: int
    state_hash: str


@dataclass(frozen=True)
class Target:
    """Where to move: the position, the peers that hold it, and how many of the others vouch for it."""

    step: int
    state_hash: str
    holders: list[str]
    support: int


def quorum(others: int) -> int:
    """Agreeing peers needed among ``others`` certified peers: a strict majority."""
    return others // 2 + 1


def credit_weights(peers: Collection[str], credit: Mapping[str, float]) -> dict[str, float]:
    """Each of ``peers``' vote by credit: its credited samples (0 without credit), capped at the third
    most any of them holds, so that one peer with a long history neither decides nor vetoes alone.
    The cap is set by the three peers with the most credit: with three honest peers among them, many
    keys with a little credit cannot lower it; with fewer, keys holding as much as the third do."""
    held = sorted((c for c in (credit.get(peer, 0.0) for peer in peers) if c > 0), reverse=True)
    cap = held[min(CREDIT_CAP_RANK, len(held)) - 1] if held else 0.0
    return {peer: min(credit.get(peer, 0.0), cap) for peer in peers}


def own_vote(mine: Position, others: Mapping[str, Position], best: Position) -> bool:
    """Whether the caller's own state is a vote against ``best``, a state ahead of it: when it holds
    trained state (a peer restarted at step 0 holds none to defend), nobody but ``best``'s holders is
    ahead of it, and it sees at least two others (counting and credit alike; a caller behind an honest
    majority that moved on, beside keys elsewhere ahead, must still follow it). Under credit ``others``
    are the credited heads only, so a key without credit placed ahead cannot switch the vote off."""
    return (
        mine.step > 0
        and len(others) >= 2
        and all(p.step <= mine.step for p in others.values() if Position(p.step, p.state_hash) != best)
    )


def heads(peers: Collection[str], weights: Mapping[str, float]) -> list[str]:
    """The credited heads among ``peers``: those whose vote weighs at least ``HOLDER_SHARE`` of the vote
    cap (a key with a sliver of farmed credit is no head)."""
    floor = HOLDER_SHARE * max(weights.values(), default=0.0)
    return [peer for peer in peers if weights.get(peer, 0.0) >= floor > 0]


def carried(holders: Collection[str], electorate: Collection[str], weights: Mapping[str, float]) -> bool:
    """Whether ``holders`` (of ``electorate``) hold a strict majority of its credit and of its credited
    heads: credit per key differs by up to twice a step's average share (keys that sign made-up rounds
    take all of it), so 3 such keys outweighed 4 honest members a key."""
    held = set(holders) & set(electorate)
    if 2 * sum(weights[peer] for peer in held) <= sum(weights[peer] for peer in electorate):
        return False
    counted = heads(electorate, weights)
    return sum(1 for peer in counted if peer in held) >= quorum(len(counted))


def holding_credit(others: Collection[str], credit: Mapping[str, float]) -> set[str]:
    """The peers of ``others`` (those in view) that may serve a download once credit decides: those with at
    least ``HOLDER_SHARE`` of the vote cap in credit (keys without credit, or with a sliver of it, that copy
    a position would otherwise be most of its holders, each tried first in turn)."""
    floor = HOLDER_SHARE * max(credit_weights(others, credit).values(), default=0.0)
    return {peer for peer in others if credit.get(peer, 0.0) >= max(floor, 1e-9)}


def credited(peers: Collection[str], credit: Mapping[str, float]) -> list[str]:
    """The peers of ``peers`` the coordinator credited with witnessed work."""
    return [peer for peer in peers if credit.get(peer, 0.0) > 0]


def by_credit(
    mine: Position | None,
    others: Mapping[str, Position],
    voters: Mapping[str, Position],
    *,
    lowest: int,
    limit: int,
    stalled: bool,
    credit: Mapping[str, float],
    me: str | None = None,
) -> tuple[Position, int] | None:
    """The position the voters' credit decides, with how many voters hold it; None when no position has
    a strict majority of the credit (for a state ahead, of the credit and of the credited heads:
    ``carried``). Each vote weighs ``credit_weights`` (over every peer in view and
    the caller, ``me``). A state ahead of a caller that is not stalled needs a majority of the credit
    of every peer in view and of the caller's own, as counting asks of it (honest peers further behind
    must not leave the decision to the peers ahead; without the caller's own, 3 Sybil keys with as much
    credit each as 4 honest members moved every one of them). At the caller's own step its own side (itself and the voters that
    agree with it) must be outweighed, equal sides going to the smaller hash as when counting: two
    apart sides of equal credit never swap states."""
    weights = credit_weights([*others, *([me] if me is not None else [])], credit)
    backing: dict[Position, float] = {}
    for peer, p in voters.items():
        if lowest <= p.step <= limit and weights[peer] > 0:
            backing[p] = backing.get(p, 0.0) + weights[peer]
    if not backing:
        return None
    best = min(backing, key=lambda p: (-backing[p], -p.step, p.state_hash))
    if best == mine:
        return None
    if not stalled and (mine is None or best.step > mine.step):
        # A state ahead: a strict majority of the credit and of the credited heads of every peer in view,
        # and of the caller's own when counting would count it (``own_vote``, over the heads in view).
        electorate = list(others)
        counted = {peer: others[peer] for peer in heads(others, weights)}
        if mine is not None and me is not None and own_vote(mine, counted, best):
            electorate.append(me)
        if not carried([peer for peer, p in voters.items() if p == best], electorate, weights):
            return None
    elif 2 * backing[best] <= sum(weights[peer] for peer in voters):
        return None
    if mine is not None and best.step == mine.step:
        mine_side = backing.get(mine, 0.0) + (weights[me] if me is not None else 0.0)
        if mine_side > backing[best] or (mine_side == backing[best] and mine.state_hash < best.state_hash):
            return None
    return best, sum(1 for p in voters.values() if p == best)


def catch_up_target(
    mine: Position | None,
    others: Mapping[str, Position],
    *,
    max_step: int | None = None,
    stalled: bool = False,
    trusted: Collection[str] | None = None,
    long_stalled: bool = False,
    credit: Mapping[str, float] | None = None,
    me: str | None = None,
) -> Target | None:
    """The position to move to, or None when the caller is in line (or no majority exists yet).

    ``others`` maps peer IDs (never the caller's own) to their verified positions; ``mine`` is None for a
    caller that holds no state of its own (the checkpoint keeper). ``trusted``: the members of the
    caller's last applied round (``Groupmates``); a stalled caller that has some in view at or ahead of
    its step follows only what a strict majority of those hold, and one that has none in view is not
    treated as stalled. ``long_stalled`` (its rounds have failed twice as long): the anchors at its own step
    may be as stuck as it is (below the run's minimum group size with it), so only the anchors ahead vote.
    None: a stalled caller lets every peer ahead vote. A caller with no peer ahead is not stalled.
    ``credit``: the coordinator's signed standing (``swarm.standing``); once ``CREDIT_QUORUM`` peers in
    view have credit, a move that groupmates do not decide is decided by credit (``by_credit``; ``me``:
    the caller's peer ID, whose own credit weighs for its side), not by counting keys. None: counting
    only."""
    limit = min(MAX_STEP, max_step if max_step is not None else MAX_STEP)
    if stalled and mine is not None and not any(mine.step < p.step <= limit for p in others.values()):
        # Nobody ahead to follow: a peer apart from the others at its own step (a stage replica at the run's
        # last step, where no round comes) moves to the majority's state like one that is not stalled.
        stalled = long_stalled = False
    anchors: dict[str, Position] = {}
    if stalled and mine is not None and trusted is not None:
        anchors = {peer: p for peer, p in others.items() if peer in trusted and p.step >= mine.step}
        if not anchors:
            stalled = False  # no groupmate in view: the rule of a caller that is not stalled
        elif long_stalled:
            anchors = {peer: p for peer, p in anchors.items() if p.step > mine.step}
            level = sum(1 for p in others.values() if p.step == mine.step)
            ahead = sum(1 for p in others.values() if p.step > mine.step)
            if not anchors or level > ahead:
                # Every groupmate in view is where the caller is (nobody to follow), or most peers in view
                # are at its step, so that rounds there can form: a groupmate ahead alone must not decide.
                return None
    if mine is None:
        lowest, voters = -1, dict(others)
    elif anchors:
        # Only peers this one verified work with decide, and all of them do, ahead or not: keys that
        # never shared a round with it, however many, have no say, and one groupmate ahead of the others
        # is no majority.
        lowest = mine.step + 1
        voters = anchors
    elif stalled:
        lowest = mine.step + 1
        voters = {peer: p for peer, p in others.items() if p.step >= lowest}
    else:
        lowest = mine.step
        voters = {peer: p for peer, p in others.items() if p.step >= mine.step - 1}
    weighed = credit is not None and not anchors and len(credited(others, credit)) >= CREDIT_QUORUM
    if weighed:
        decided = by_credit(
            mine, others, voters, lowest=lowest, limit=limit, stalled=stalled, credit=credit, me=me
        )
        if decided is None:
            return None
        best, support = decided
    else:
        counts = Counter(p for p in voters.values() if lowest <= p.step <= limit)
        if not counts:
            return None
        best, support = min(counts.items(), key=lambda item: (-item[1], -item[0].step, item[0].state_hash))
        electorate = len(voters)
        if mine is not None and not stalled and best.step > mine.step:
            # A state ahead needs a majority of every peer in view: honest peers that are further behind
            # (downloading, just joined) must not leave the window to a few keys that agree on a step
            # ahead. The caller's own state is a vote too when nobody but the candidate's holders is
            # ahead of it.
            electorate = len(others) + int(own_vote(mine, others, best))
        if support < quorum(electorate) or best == mine:
            return None
        if anchors and long_stalled:
            # The groupmates ahead decide only what most peers in view ahead of the caller hold too: one
            # attacker groupmate ahead is no majority of the honest peers that moved on.
            ahead_of_me = [p for p in others.values() if mine.step < p.step <= limit]
            held = sum(1 for p in ahead_of_me if Position(p.step, p.state_hash) == best)
            if held < quorum(len(ahead_of_me)):
                return None
        if mine is not None and best.step == mine.step:
            mine_side = 1 + sum(1 for p in voters.values() if p == mine)
            if mine_side > support or (mine_side == support and mine.state_hash < best.state_hash):
                return None
    # Downloads come from the peers that decided: groupmates, or when credit decides, peers with a share of
    # the credit cap (keys without credit, or with a sliver of it, that copy the position would be most of
    # the holders, each tried first in turn).
    servers = holding_credit(others, credit) if weighed else others
    holders = sorted(
        peer
        for peer, p in others.items()
        if Position(p.step, p.state_hash) == best and (not anchors or peer in trusted) and peer in servers
    )
    return Target(best.step, best.state_hash, holders, support)


def step_back_target(
    mine: Position,
    others: Mapping[str, Position],
    before: Position | None,
    *,
    credit: Mapping[str, float] | None = None,
    me: str | None = None,
) -> Target | None:
    """Rule 6: ``before``, the position the caller held before the round that brought it to ``mine``
    (None: no such round, as after a download), when it is one step back and a strict majority of
    ``others`` holds it: of their count, or once ``CREDIT_QUORUM`` of them have credit, of their credit
    and credited heads (``carried``; the caller's own credit counts in the cap, not as a vote). The
    caller must have been stalled three round times; ``catch_up_move`` checks that."""
    if before is None or before.step != mine.step - 1 or not others:
        return None
    holders = sorted(peer for peer, p in others.items() if Position(p.step, p.state_hash) == before)
    if credit is not None and len(credited(others, credit)) >= CREDIT_QUORUM:
        weights = credit_weights([*others, *([me] if me is not None else [])], credit)
        if not carried(holders, list(others), weights):
            return None
        servers = holding_credit(others, credit)
        holders = [peer for peer in holders if peer in servers]
    elif len(holders) < quorum(len(others)):
        return None
    return Target(before.step, before.state_hash, holders, len(holders)) if holders else None


def catch_up_move(
    mine: Position,
    others: Mapping[str, Position],
    training,
    *,
    stuck_s: float,
    trusted: Collection[str] | None = None,
    long_stall_rule: bool = True,
    credit: Mapping[str, float] | None = None,
    me: str | None = None,
    before: Position | None = None,
) -> tuple[int, str, list[str]] | None:
    """(step, state hash, holders) to move to under the run's ``training`` settings, or None: the caller
    counts as stalled once its rounds at this step have failed (``stuck_s``, since its first attempt)
    for longer than a matchmaking window plus a round timeout (``trusted``: see ``catch_up_target``),
    and as long stalled twice as long, unless ``long_stall_rule`` is off (a stage replica sitting out
    the step it joined at). ``credit``, ``me``: see ``catch_up_target``. ``before``: the position the
    caller held before the round that brought it to ``mine`` (a data-parallel peer's, for rule 6:
    ``step_back_target``, once stalled ``STEP_BACK_ROUNDS`` round times; None: never back). The
    data-parallel trainer and every stage replica call this."""
    stalled = stuck_s > training.round_s
    long_stalled = long_stall_rule and stuck_s > 2 * training.round_s
    target = catch_up_target(
        mine, others, max_step=training.max_steps, stalled=stalled, trusted=trusted,
        long_stalled=long_stalled, credit=credit, me=me,
    )  # fmt: skip
    if target is None and stuck_s > STEP_BACK_ROUNDS * training.round_s:
        target = step_back_target(mine, others, before, credit=credit, me=me)
    return None if target is None else (target.step, target.state_hash, target.holders)


class Groupmates:
    """The members of the last round this peer completed and applied, within ``window`` steps: the anchors
    of a stalled caller's catch-up (``catch_up_target``'s ``trusted``). Each was listed with its own
    signed, fresh entry at the round's step in a group this peer checked, its contribution went into the
    aggregate this peer applied (so it held this peer's state then), and by the run's model of attackers
    the round had an honest majority. Only the last round counts: a union over several rounds would let
    a leader that adds two fresh Sybils to each of the victim's rounds make them most of its anchors."""

    def __init__(self, window: int = 8):
        self.window = window
        self.members: frozenset[str] = frozenset()
        self.step = -1
        self._moved: tuple[Position, Position] | None = None  # (before, after) the last round

    def record(
        self, peers: Collection[str], step: int, moved: tuple[Position, Position] | None = None
    ) -> None:
        """``peers`` were the other kept members of the round that brought this peer to ``step``;
        ``moved``: its position when that round began and the one it ended at."""
        self.members, self.step, self._moved = frozenset(peers), step, moved

    def before(self, mine: Position) -> Position | None:
        """Where this peer was before the round that brought it to ``mine`` (rule 6); None when its last
        applied round did not (it downloaded or adopted a state since)."""
        return self._moved[0] if self._moved is not None and self._moved[1] == mine else None

    def arriving(self, step: int) -> frozenset[str]:
        """The last round's members when that round brought this peer to ``step``: they come to ``step`` too
        (unless the round failed for them), whatever their records show yet."""
        return self.members if self.step == step else frozenset()

    def recent(self, step: int) -> set[str]:
        """The last round's members, if that round brought this peer to ``step - window`` or later."""
        return set(self.members) if self.step >= step - self.window else set()


class PositionHistory:
    """The last positions each peer's verified records showed, for a download that the run outran: a
    holder that trained on while a requester read a slightly older view offers a newer state, and rule 2
    is applied to it with these as support. The state is taken only when a strict majority of the voters
    (the other peers in the caller's current view: the caller is behind them, so its own state has no
    vote) were seen at that step with that hash. A holder alone among many cannot vouch for its own
    state, a peer that left the view vouches for nothing, and each peer's memory is its own
    (``per_peer`` distinct positions), so one key announcing many steps pushes out only its own.
    """

    def __init__(self, per_peer: int = 16):
        self.per_peer = per_peer
        self._seen: dict[str, OrderedDict[Position, None]] = {}

    def observe(
        self,
        others: Mapping[str, Position],
        *,
        max_step: int | None = None,
        keep: Collection[str] | None = None,
    ) -> None:
        """Remember ``others``' positions; forget peers not in ``keep`` (the current view) when given."""
        limit = min(MAX_STEP, max_step if max_step is not None else MAX_STEP)
        for peer, position in others.items():
            if 0 <= position.step <= limit:
                seen = self._seen.setdefault(peer, OrderedDict())
                seen[position] = None
                seen.move_to_end(position)
                while len(seen) > self.per_peer:
                    seen.popitem(last=False)
        if keep is not None:
            for peer in [p for p in self._seen if p not in keep]:
                del self._seen[peer]

    def agreed(
        self,
        step: int,
        state_hash: str,
        voters: Collection[str],
        credit: Mapping[str, float] | None = None,
        me: str | None = None,
    ) -> bool:
        """Whether a strict majority of ``voters`` were seen at ``step`` holding ``state_hash``: of their
        credit once ``CREDIT_QUORUM`` of them have some (``credit``: the coordinator's standing; the
        caller ``me``'s own credit weighs against it, as in ``by_credit``), else of their count, as
        ``catch_up_target`` decides."""
        position, voters = Position(step, state_hash), set(voters)
        seen = {peer for peer in voters if position in self._seen.get(peer, ())}
        if credit is not None and len(credited(voters, credit)) >= CREDIT_QUORUM:
            electorate = [*voters, *([me] if me is not None else [])]
            return carried(seen, electorate, credit_weights(electorate, credit))
        return bool(seen) and len(seen) >= quorum(len(voters))
