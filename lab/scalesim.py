"""A discrete-event model of a data-parallel run at 8 to 1,000+ peers: the real round decisions, modeled links.

No process, socket or tensor is involved: each peer is a few fields, time is a heap of events, and a link
is an uplink rate and a latency. Wherever the code of a real peer decides something, this calls that code:

- a round's layout and bytes: ``evidence.split_bounds``, ``chunk_bounds``, ``layout_chunk_values`` and the
  codec's ``max_bytes`` (the run's codec in tier 1, ``tiers.TIER_COMPRESSION`` in tier 2 and the hand-off);
- how long a round may take: ``deadlines.round_deadlines`` at ``deadlines.round_mbit`` of the members'
  ``Throughput`` (each peer measures its own from its rounds, as a real one does);
- how long a search waits: ``Averager.matchmaking_window_s`` with ``matchmaking.FailedSearches``; a
  second-tier search, ``tiers.second_window_s``, closed once its groups hold the step's peers (``tiers.covers``);
- who represents a group and who relays its hand-off to whom: ``tiers.relay_order`` and ``relay_parent``
  (at the run's ``relay_fanout``); whether a group is its step's only one:
  ``tiers.only_group``; the rest of the second tier's rules as ``tiered.SecondTier`` applies them (a
  strict majority of attestations;
  ``ALONE_AFTER_TRIES``; members wait ``MEMBER_WAIT_TIMEOUTS`` averaging timeouts for the outcome, ``2 * sender_timeout_s``
  between chunks), and ``ADOPT_ASKS`` for a peer that fell a step behind when the code has it; a group that
  ends its first tier after the step's round adopts it (``SecondTier._combined_without``) when that round
  holds at least half of the peers at the step or later (``tiers.holds_the_step``, by its groups'
  members), asking
  peers ahead in ``tiered.adopt_order``;
- whether and where a peer moves: ``catchup.catch_up_move`` with the positions the model holds, its time
  stuck and its ``Groupmates``.

Not modeled: ``SecondTier.absent`` (peers a leader's own window waited for in vain are not waited for
again for a while): every modeled peer that shows a step is waited for.

What is only modeled: matchmaking is "the first peer ready at a step opens a window; peers that become ready
in it join in arrival order until the group holds ``max_group_size`` or every peer at the step (the
leader's ``expected_size``)"; a peer is ready ``compute_s`` (jittered) after it applied its last round; a
round lasts as long as its busiest member needs to send its contributions, then its aggregates, at its
uplink, plus latencies; a download lasts the state's bytes at the holder's uplink. Each peer sees every
other's position at once (no record lag), nobody has credit (catch-up counts keys), every member can be
dialed, and links are never shared between transfers of different rounds (nor the representative's
answers to members whose relayer failed). An attacker is modeled only as a representative that withholds
its group's hand-off (its members wait out their deadline and get nothing) or a relayer that withholds it
from the members below it (they ask the representative after the wait); its inputs are honest, and it never
says ``alone`` falsely.

Example::

    result = ScaleSim(ScaleConfig(peers=128, steps=6)).run()
    print(result["median_step_s"], result["same_update_fraction"])
"""

from __future__ import annotations

import hashlib
import heapq
import math
import random
import statistics
from collections import Counter
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import pairwise
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from swarm.averaging.averager import Averager
from swarm.averaging.compression import get_codec
from swarm.averaging.deadlines import Throughput, round_deadlines, round_mbit
from swarm.averaging.evidence import chunk_bounds, layout_chunk_values, split_bounds
from swarm.averaging.matchmaking import FailedSearches
from swarm.averaging.tiers import (
    MEMBER_WAIT_TIMEOUTS,
    TIER_COMPRESSION,
    covers,
    only_group,
    relay_order,
    relay_parent,
    second_window_s,
)
from swarm.config import TrainingConfig
from swarm.training import tiered
from swarm.training.catchup import Groupmates, Position, catch_up_move

#: Parameters of the demo model (``build_model("gpt", {})``); tests/test_scalesim.py checks it.
DEMO_NUMEL = 4_870_144
#: Bytes of training state per parameter a download moves: fp32 weights and Adam's two moments.
STATE_BYTES_PER_VALUE = 12
INIT = "init"
_RUN = TrainingConfig()


class ScaleConfig(BaseModel):
    """One simulated run. ``benchmarks/scale_sim.py`` derives its flags from these fields."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    peers: int = Field(64, ge=2, le=4096, description="peers in the run")
    steps: int = Field(10, ge=1, le=1000, description="global steps to simulate")
    max_group_size: int = Field(_RUN.max_group_size, ge=2, le=1024, description="peers in one group at most")
    two_tier: bool = Field(True, description="the second tier (false: each group applies its own average)")
    numel: int = Field(DEMO_NUMEL, ge=1, le=10**11, description="values in the averaged vector")
    compression: Literal["fp16", "none", "int8"] = Field(_RUN.compression, description="tier-1 codec")
    compute_s: float = Field(
        30.0, gt=0, le=86400, description="seconds all peers take to compute a step's target batch together"
    )
    compute_jitter: float = Field(0.2, ge=0, lt=1, description="each peer's speed varies by +- this share")
    micro_batch_s: float = Field(1.0, gt=0, le=3600, description="seconds a peer takes for one micro-batch")
    min_mbit: float = Field(10.0, gt=0, le=1e5, description="slowest uplink, Mbit/s")
    max_mbit: float = Field(100.0, gt=0, le=1e5, description="fastest uplink, Mbit/s")
    min_latency_s: float = Field(0.02, ge=0, le=10, description="shortest one-way latency")
    max_latency_s: float = Field(0.2, ge=0, le=10, description="longest one-way latency")
    join_over_s: float = Field(0.0, ge=0, le=86400, description="peer i joins at i / (N - 1) of this")
    churn: float = Field(0.0, ge=0, le=1, description="chance per peer and step that it leaves mid-round")
    rejoin_after_s: float = Field(
        120.0, ge=0, le=86400, description="a departed peer rejoins about this later"
    )
    attackers: float = Field(0.0, ge=0, lt=0.5, description="share of peers that withhold as representative")
    adopt: bool = Field(True, description="a peer a step behind adopts the combined result (if the code can)")
    second_window: Literal["code", "run"] = Field(
        "code",
        description="the second tier's window: 'code' as the code has it (tiers.second_window_s, closed "
        "once its groups hold the step's peers, tiers.covers); 'run', the run's matchmaking window "
        "alone, as the code had it before 2026-11-30",
    )
    late_adopt: bool = Field(
        True,
        description="a group that ends its first tier after the step's others combined adopts their round "
        "(SecondTier._combined_without, as the code has it since 2026-11-30); false: the code before, where it "
        "searched a second-tier round of its own and a peer adopted any checked round of the first peers ahead",
    )
    seed: int = Field(0, ge=0, lt=2**63, description="seed of links, attackers, compute times and churn")
    max_sim_s: float = Field(0.0, ge=0, le=10**8, description="simulated-time bound (0: steps * 3600 s)")
    max_events: int = Field(0, ge=0, le=10**9, description="event bound (0: 400 * peers * steps)")


@dataclass(frozen=True)
class Layout:
    """What each member of a butterfly round of ``members`` sends, in bytes, and the round's deadline inputs."""

    contributions: tuple[int, ...]  # member i's share of every other part
    aggregates: tuple[int, ...]  # member i's aggregate part, to each other member
    part_values: tuple[int, ...]
    chunk_bytes: int  # one full chunk on the wire
    chunk_values: int
    vector_bytes: int  # the whole vector, encoded in this round's layout


@lru_cache(maxsize=4096)
def layout(numel: int, members: int, compression: str) -> Layout:
    """The bytes of a round of ``members`` over ``numel`` values in ``compression``, as ``allreduce`` lays it out."""
    codec = get_codec(compression)
    bounds = split_bounds(numel, members)
    values = layout_chunk_values(members, codec.bytes_per_value)
    parts = [
        sum(codec.max_bytes(hi - lo) for lo, hi in pairwise(chunk_bounds(end - start, values)))
        for start, end in pairwise(bounds)
    ]
    total = sum(parts)
    return Layout(
        contributions=tuple(total - p for p in parts),
        aggregates=tuple(p * (members - 1) for p in parts),
        part_values=tuple(end - start for start, end in pairwise(bounds)),
        chunk_bytes=codec.max_bytes(values),
        chunk_values=values,
        vector_bytes=total,
    )


@dataclass
class _Times:
    """The stand-in ``Averager.matchmaking_window_s`` reads."""

    matchmaking_time_s: float
    averaging_timeout_s: float


@dataclass(eq=False)
class Peer:
    index: int
    name: str
    up_mbit: float
    latency_s: float
    attacker: bool
    rng: random.Random
    link: Throughput = field(default_factory=Throughput)
    alive: bool = False
    pos: Position | None = None
    epoch: int = 0  # bumped on leave and join: events of an earlier life are dropped
    fresh: bool = True  # applied no round since it (re)started
    done: bool = False
    searches: FailedSearches = field(default_factory=FailedSearches)
    tier_searches: FailedSearches = field(default_factory=FailedSearches)
    groupmates: Groupmates = field(default_factory=Groupmates)
    tried_step: int = -1
    tried_at: float = 0.0
    churned_step: int = -1
    speed: float = 1.0  # samples per second, relative
    kept: dict[int, tuple[str, str]] = field(default_factory=dict)  # step -> (state before, state after)

    def send_s(self, nbytes: float) -> float:
        return nbytes * 8 / (self.up_mbit * 1e6)


@dataclass(eq=False)
class _Window:
    key: tuple
    gid: str
    cap: int
    closes: Callable[[list], bool] | None = None  # its leader's rule (``Averager.find_group``'s closes_when)
    members: list = field(default_factory=list)  # peers (tier 1) or groups (tier 2)
    closed: bool = False


@dataclass(eq=False)
class _Group:
    gid: str
    step: int
    members: list[Peer]
    epochs: list[int]
    rep: Peer | None = None
    asked_at: float = 0.0
    order: list[int] = field(default_factory=list)  # tiers.relay_order: the hand-off's tree
    most: int = 0  # the second tier's expected size
    give_up_at: float = 0.0  # when the members stop waiting for the outcome


def _advance(state: str, update: str) -> str:
    return hashlib.sha256(f"{state}|{update}".encode()).hexdigest()[:16]


class ScaleSim:
    """One run of ``config``; ``attackers`` (peer indices) replaces the seeded draw of ``config.attackers``.
    ``run()`` returns the figures (see ``summary``)."""

    def __init__(self, config: ScaleConfig, attackers: Collection[int] | None = None):
        self.config = c = config
        self.training = TrainingConfig(max_group_size=c.max_group_size, max_steps=c.steps)
        self._times = _Times(self.training.matchmaking_time_s, self.training.averaging_timeout_s)
        # SecondTier.wait_s (3 timeouts before the second tier's window waited for later groups)
        self.wait_s = (
            3 if c.second_window == "run" else MEMBER_WAIT_TIMEOUTS
        ) * self.training.averaging_timeout_s
        self.chunk_timeout_s = 2 * self.training.sender_timeout_s
        self.adopt_asks = getattr(tiered, "ADOPT_ASKS", 0) if c.adopt and c.two_tier else 0
        rng = random.Random(c.seed)
        if attackers is None:
            attackers = set(rng.sample(range(c.peers), round(c.attackers * c.peers)))
        self.peers = [
            Peer(
                i,
                f"peer-{i:04d}",
                rng.uniform(c.min_mbit, max(c.min_mbit, c.max_mbit)),
                rng.uniform(c.min_latency_s, max(c.min_latency_s, c.max_latency_s)),
                i in attackers,
                random.Random(f"{c.seed}/{i}"),
            )  # fmt: skip
            for i in range(c.peers)
        ]
        for peer in self.peers:
            peer.speed = peer.rng.uniform(1 - c.compute_jitter, 1 + c.compute_jitter)
        # Every peer's round at a step is due once the peers at it hold the target batch together
        # (EveryStep.ready): per step, the rates and start times of the peers that entered it.
        self.target = c.peers * c.compute_s
        self._rates: dict[int, list[float]] = {}  # step -> [sum of rates, sum of rate * start, version]
        self._waiting: dict[int, list[tuple[Peer, int]]] = {}
        self._due: dict[int, float] = {}
        self._view = 0  # bumped at every move: catch-up decisions are cached per view
        self._decided: dict[tuple, tuple | None] = {}
        self.now = 0.0
        self._heap: list = []
        self._seq = 0
        self._ids = 0
        self._windows: dict[tuple, _Window] = {}
        self._positions: Counter = Counter()  # positions of live peers
        self._steps: Counter = Counter()  # steps of live peers
        self._by_step: dict[int, set[int]] = {}  # the live peers at each step
        self.events = 0
        self.max_events = c.max_events or 400 * c.peers * c.steps
        self.max_sim_s = c.max_sim_s or c.steps * 3600.0
        # Figures, by step.
        self.applied: dict[int, list[tuple[int, str, str, float]]] = {}  # (peer, state after, how, when)
        self.represented: dict[int, list[tuple[int, list[int]]]] = {}  # (representative, members)
        self.groups: dict[int, list[int]] = {}  # sizes of the tier-1 rounds that completed
        self.tier_groups: dict[int, list[int]] = {}
        # (step, combined state) -> the peers of the second-tier round's groups (``TierCheck.groups``)
        self.tier_cover: dict[tuple[int, str], set[int]] = {}
        self.tries: Counter = Counter()
        self.failed: Counter = Counter()
        self.withheld: dict[int, list[list[int]]] = {}  # members an attacker left without a result
        self.sent: dict[int, Counter] = {}  # bytes each peer sent at the step
        self.downloads: list[dict] = []
        self.reached: dict[int, dict[int, float]] = {}  # step -> peer -> first time at or past it

    # --- events ----------------------------------------------------------------------------------------

    def _at(self, delay: float, action: Callable, *args) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (self.now + max(0.0, delay), self._seq, action, args))

    def _id(self, kind: str) -> str:
        self._ids += 1
        return f"{kind}{self._ids}"

    def run(self) -> dict:
        c = self.config
        for peer in self.peers:
            self._at(c.join_over_s * peer.index / max(1, c.peers - 1), self._join, peer)
        finished = False
        while self._heap and self.events < self.max_events:
            when, _, action, args = heapq.heappop(self._heap)
            if when > self.max_sim_s:
                break
            self.now = when
            self.events += 1
            action(*args)
            if self.now >= c.join_over_s and all(p.done for p in self.peers if p.alive):
                finished = True
                break
        return self.summary(finished)

    def _live(self, peer: Peer, epoch: int) -> bool:
        return peer.alive and peer.epoch == epoch

    def _move(self, peer: Peer, pos: Position | None) -> None:
        self._view += 1
        if peer.pos is not None and peer.alive:
            self._positions[peer.pos] -= 1
            if not self._positions[peer.pos]:
                del self._positions[peer.pos]
            self._steps[peer.pos.step] -= 1
            self._by_step[peer.pos.step].discard(peer.index)
        peer.pos = pos
        if pos is not None and peer.alive:
            self._positions[pos] += 1
            self._steps[pos.step] += 1
            self._by_step.setdefault(pos.step, set()).add(peer.index)
            for step in range(pos.step + 1):
                if self.reached.setdefault(step, {}).setdefault(peer.index, self.now) > self.now:
                    break  # pragma: no cover - times only grow
            peer.done = pos.step >= self.config.steps

    def _join(self, peer: Peer) -> None:
        peer.alive, peer.epoch, peer.fresh, peer.done = True, peer.epoch + 1, True, False
        peer.pos = None
        peer.searches, peer.tier_searches, peer.groupmates = FailedSearches(), FailedSearches(), Groupmates()
        peer.kept.clear()
        self._move(peer, Position(0, INIT))
        if not self._catch_up(peer):
            self._compute(peer)

    def _leave(self, peer: Peer, epoch: int) -> None:
        if not self._live(peer, epoch):
            return
        self._move(peer, None)
        peer.alive, peer.epoch = False, peer.epoch + 1
        self._at(self.config.rejoin_after_s * peer.rng.uniform(0.5, 1.5), self._join, peer)

    def _compute(self, peer: Peer) -> None:
        """``peer`` starts accumulating at its step; its round is due when the step's peers hold the target
        batch together (by a fresh view: up to a progress interval later) and it holds a micro-batch."""
        step, first = peer.pos.step, self.config.micro_batch_s / peer.speed
        if step in self._due:
            self._at(first + self._lag(peer), self._try, peer, peer.epoch)
            return
        rates = self._rates.setdefault(step, [0.0, 0.0, 0])
        rates[0] += peer.speed
        rates[1] += peer.speed * self.now
        rates[2] += 1
        self._waiting.setdefault(step, []).append((peer, peer.epoch))
        self._at((self.target + rates[1]) / rates[0] - self.now, self._step_due, step, rates[2])

    def _lag(self, peer: Peer) -> float:
        return peer.rng.uniform(0, self.training.progress_interval_s)

    def _step_due(self, step: int, version: int) -> None:
        if step in self._due or self._rates[step][2] != version:
            return
        self._due[step] = self.now
        for peer, epoch in self._waiting.pop(step, []):
            self._at(self._lag(peer), self._try, peer, epoch)

    # --- a peer's round: TrainingPeer._round ------------------------------------------------------------

    def _try(self, peer: Peer, epoch: int) -> None:
        if not self._live(peer, epoch) or peer.done or self._catch_up(peer):
            return
        step = peer.pos.step
        if peer.tried_step != step:
            peer.tried_step, peer.tried_at = step, self.now
        self.tries[step] += 1
        if sum(self._steps.values()) == 1:  # nobody else in the run: a solo round
            self._apply(peer, epoch, step, _advance(peer.pos.state_hash, self._id("solo")), "solo", [])
            return
        window_s = Averager.matchmaking_window_s(self._times, peer.searches.failed(step))
        self._search(("tier1", step), peer, expected=self._steps[step], window_s=window_s)

    def _search(
        self,
        key: tuple,
        member,
        *,
        expected: int,
        window_s: float,
        closes: Callable[[list], bool] | None = None,
    ) -> None:
        """Join the open window at ``key``, or open one as its leader (``member``: a peer or a group) for
        ``window_s``; it closes early at ``expected`` members, or once its leader's ``closes`` holds for them."""
        lead = member if isinstance(member, Peer) else member.rep
        window = self._windows.get(key)
        if window is None or window.closed:
            cap = max(2, min(self.config.max_group_size, expected))
            window = self._windows[key] = _Window(key, self._id("g"), cap, closes)
            self._at(window_s + 2 * lead.latency_s, self._close, window)
        window.members.append(member)
        if len(window.members) >= window.cap or (window.closes is not None and window.closes(window.members)):
            window.closed = True
            del self._windows[key]
            self._at(2 * lead.latency_s, self._close, window, True)

    def _close(self, window: _Window, full: bool = False) -> None:
        if window.closed and not full:
            return
        if not window.closed:
            window.closed = True
            del self._windows[window.key]
        if window.key[0] == "tier1":
            self._formed(window)
        else:
            self._tier_formed(window)

    def _formed(self, window: _Window) -> None:
        step = window.key[1]
        members = [p for p in window.members if p.alive]
        for peer in members:
            peer.searches.record(step, formed=len(members) >= 2)
        if len(members) < 2:
            for peer in members:
                self._nothing(peer, peer.epoch, step, "no_group")
            return
        group = _Group(window.gid, step, members, [p.epoch for p in members])
        size = len(members)
        lay = layout(self.config.numel, size, self.config.compression)
        contribute = max(p.send_s(lay.contributions[i]) for i, p in enumerate(members))
        reduce = max(p.send_s(lay.aggregates[i]) for i, p in enumerate(members))
        latency = max(p.latency_s for p in members)
        took = contribute + reduce + 2 * latency
        deadlines = self._deadlines(lay, [p.link.mbit for p in members], self.config.compression)
        leaving = []
        for i, p in enumerate(members):
            self._sent(p, step, lay.contributions[i] + lay.aggregates[i])
            p.link.observe(lay.contributions[i], p.send_s(lay.contributions[i]) + latency)
            if p.churned_step != step and p.rng.random() < self.config.churn:
                p.churned_step = step
                leaving.append(p)
                self._at(p.rng.uniform(0, took), self._leave, p, p.epoch)
        if leaving:  # the survivors notice the silence, and a substitute re-reduces the part
            took += deadlines.silence_s
        if took > deadlines.round_s:
            for p, epoch in zip(members, group.epochs, strict=True):
                self._at(deadlines.round_s, self._nothing, p, epoch, step, "round_deadline")
            return
        self._at(took, self._round_done, group)

    def _deadlines(self, lay: Layout, declared: list[float | None], compression: str):
        codec = get_codec(compression)
        return round_deadlines(
            lay.part_values, chunk_bytes=lay.chunk_bytes, bytes_per_value=codec.max_bytes(lay.chunk_values) / lay.chunk_values,
            mbit=round_mbit(declared), silence_floor_s=self.training.sender_timeout_s,
            round_floor_s=self.training.averaging_timeout_s,
        )  # fmt: skip

    def _round_done(self, group: _Group) -> None:
        step = group.step
        alive = [(p, e) for p, e in zip(group.members, group.epochs, strict=True) if self._live(p, e)]
        self.groups.setdefault(step, []).append(len(group.members))
        names = [p.name for p in group.members]
        if not self.config.two_tier:
            for p, e in alive:
                self._apply(p, e, step, _advance(p.pos.state_hash, group.gid), "own", names)
            return
        if not alive:
            return
        commitments = [p.rng.randbytes(32) for p in group.members]
        group.order = relay_order(commitments, names, None)
        rep = group.rep = group.members[group.order[0]]
        self.represented.setdefault(step, []).append((rep.index, [p.index for p in group.members]))
        group.asked_at = self.now + max(p.latency_s for p, _ in alive)
        followers = [(p, e) for p, e in alive if p is not rep]
        if rep not in [p for p, _ in alive]:  # it left: asking it fails at once
            for p, e in followers:
                self._at(self.training.sender_timeout_s, self._nothing, p, e, step, "rep_gone")
            return
        coming = self._steps[step] + self._steps[step - 1]  # SecondTier's peers_at_step, by rep's view
        run_peers = max(coming, sum(self._steps.values()))  # TrainingPeer: the run's members in view
        if only_group(
            len(group.members), peers_at_step=coming, run_peers=run_peers,
            min_group_size=self.training.min_group_size,
        ):  # fmt: skip
            self._hand_alone(group, alive)
            return
        attested = sum(1 for p, _ in alive if p.pos == rep.pos)
        if 2 * attested <= len(group.members):
            self._at(self.training.averaging_timeout_s, self._tier_failed, group, alive, False)
            return
        group.most = 1 + (coming - len(group.members)) // 2
        group.give_up_at = self.now + self.wait_s  # the members' wait, from when their first tier ended
        if not self._combined_without(group, alive):
            self._search_tier2(group)

    def _asked(self, peer: Peer, step: int) -> list[Peer]:
        """The peers a step ahead that ``peer`` asks for the step's combined result (``tiered.adopt_order``)."""
        ahead = self._by_step.get(step + 1, ())
        if not self.config.late_adopt:  # before: the first in the view's order (by name: by index here)
            return [self.peers[i] for i in heapq.nsmallest(self.adopt_asks, ahead)]
        names = {self.peers[i].name: self.peers[i] for i in ahead}
        return [names[n] for n in tiered.adopt_order(peer.name, names)[: self.adopt_asks]]

    def _holds_the_step(self, step: int, combined: str, outside: Collection[int] = ()) -> bool:
        """``tiers.holds_the_step``: the round that moved peers to ``combined`` held (by its groups' members, who
        all sign their certificates here; none of ``outside``) at least half of the peers at ``step`` or
        later. A result adopted from a peer that adopted it is the same round's. (Before: any round was
        adopted.)"""
        if not self.config.late_adopt:
            return True
        showing = set().union(*(peers for at, peers in self._by_step.items() if at >= step))
        held = self.tier_cover.get((step, combined), set()) - set(outside)
        return 2 * len(held & showing) >= len(showing)

    def _combined_without(self, group: _Group, alive: list[tuple[Peer, int]]) -> bool:
        """``SecondTier._combined_without``: one of the first peers a step ahead it asks (at once) holds a round
        of this step and state that holds at least half of the peers at the step or later, the group's own counted as
        in none of its groups (``tiers.holds_the_step``, here by the round's members); the representative
        reads its header, then its members adopt it (``_nothing``) instead of searching."""
        step, rep = group.step, group.rep
        ahead = self._by_step.get(step + 1, ())
        if not (self.config.late_adopt and self.adopt_asks and ahead):
            return False
        own = [p.index for p in group.members]
        for holder in self._asked(rep, step):
            kept = holder.kept.get(step)
            if kept is None or kept[0] != rep.pos.state_hash or not self._holds_the_step(step, kept[1], own):
                continue
            took = 2 * (rep.latency_s + holder.latency_s)  # the header only
            for p, e in alive:
                self._at(took + rep.latency_s, self._nothing, p, e, step, "combined_without")
            return True
        return False

    def _search_tier2(self, group: _Group) -> None:
        rep, step = group.rep, group.step
        window_s = Averager.matchmaking_window_s(self._times, rep.tier_searches.failed(step) + 1)
        closes = None
        if self.config.second_window == "code":  # SecondTier._represent
            window_s = second_window_s(
                run_window_s=window_s, waited_s=self.now - (group.give_up_at - self.wait_s),
                averaging_timeout_s=self.training.averaging_timeout_s,
            )  # fmt: skip
            own = {p.name for p in group.members}

            def closes(groups: list[_Group]) -> bool:  # read at each join, as the code reads its records
                here = {self.peers[i].name for i in self._by_step.get(step, ())} - own
                lagging = {self.peers[i].name for i in self._by_step.get(step - 1, ())}
                return covers(
                    here, {p.name for g in groups for p in g.members}, fewest=self.training.min_group_size,
                    lagging=lagging,
                )  # fmt: skip

        self._search(
            ("tier2", step, rep.pos.state_hash), group, expected=group.most, window_s=window_s, closes=closes
        )

    def _hand_alone(self, group: _Group, alive: list[tuple[Peer, int]]) -> None:
        """The group applies its own result (``alone``), unless its representative withholds that too."""
        rep, step, names = group.rep, group.step, [p.name for p in group.members]
        for p, e in alive:
            if rep.attacker and p is not rep:
                self._at(self.wait_s, self._nothing, p, e, step, "withheld")
            else:
                self._at(
                    rep.latency_s,
                    self._apply,
                    p,
                    e,
                    step,
                    _advance(p.pos.state_hash, group.gid),
                    "alone",
                    names,
                )
        if rep.attacker:
            self.withheld.setdefault(step, []).append([p.index for p, _ in alive if p is not rep])

    def _tier_failed(self, group: _Group, alive: list[tuple[Peer, int]], certified: bool = True) -> None:
        """No second-tier round: the group's own after ``ALONE_AFTER_TRIES`` searches; another search with the
        same result while the members' wait leaves room for a search and a round, short of the last try
        (``SecondTier._represent``); else nothing."""
        rep, step = group.rep, group.step
        rep.tier_searches.record(step, formed=False)
        failed = rep.tier_searches.failed(step)
        if failed >= tiered.ALONE_AFTER_TRIES:
            self._hand_alone(group, alive)
            return
        room = self.now + 2 * self.training.averaging_timeout_s <= group.give_up_at
        moved_on = self._steps[step + 1] > 0  # TrainingPeer._moved_on: adopt what they applied instead
        if certified and rep.alive and failed < tiered.ALONE_AFTER_TRIES - 1 and room and not moved_on:
            self._search_tier2(group)
            return
        for p, e in alive:
            self._at(p.latency_s, self._nothing, p, e, step, "no_tier")

    def _tier_formed(self, window: _Window) -> None:
        step = window.key[1]
        groups = [g for g in window.members if g.rep.alive]
        lives = {
            id(g): [(p, e) for p, e in zip(g.members, g.epochs, strict=True) if self._live(p, e)]
            for g in groups
        }
        if len(groups) < 2:
            for g in groups:
                self._tier_failed(g, lives[id(g)])
            return
        reps = [g.rep for g in groups]
        lay = layout(self.config.numel, len(reps), TIER_COMPRESSION)
        latency = max(r.latency_s for r in reps)
        took = (
            max(r.send_s(lay.contributions[i]) for i, r in enumerate(reps))
            + max(r.send_s(lay.aggregates[i]) for i, r in enumerate(reps))
            + 2 * latency
        )
        deadlines = self._deadlines(lay, [r.link.mbit for r in reps], TIER_COMPRESSION)
        for i, r in enumerate(reps):
            self._sent(r, step, lay.contributions[i] + lay.aggregates[i])
        if took > deadlines.round_s:
            for g in groups:
                self._at(deadlines.round_s, self._tier_failed, g, lives[id(g)])
            return
        self.tier_groups.setdefault(step, []).append(len(reps))
        self.tier_cover[(step, _advance(groups[0].rep.pos.state_hash, window.gid))] = {
            p.index for g in groups for p in g.members
        }
        self._at(took, self._tier_done, window.gid, groups, lives, lay)

    def _tier_done(self, gid: str, groups: list[_Group], lives: dict, lay: Layout) -> None:
        """Each representative applies the combined result and hands it to its members (``_follow``)."""
        for g in groups:
            rep, step = g.rep, g.step
            rep.tier_searches.record(step, formed=True)
            names = [p.name for p in g.members]
            before = rep.pos.state_hash
            combined = _advance(before, gid)
            receivers = [(p, e) for p, e in lives[id(g)] if p is not rep]
            if rep.alive and rep.pos.step == step:  # and keeps it for peers that fall behind (board.keep)
                self._apply(rep, rep.epoch, step, combined, "combined", names, keep=(step, before))
            if rep.attacker:
                self.withheld.setdefault(step, []).append([p.index for p, _ in receivers])
                for p, e in receivers:
                    self._at(
                        max(0.0, g.asked_at + self.wait_s - self.now), self._nothing, p, e, step, "withheld"
                    )
                continue
            self._hand_down(g, receivers, combined, before, names, lay)

    def _hand_down(
        self, g: _Group, receivers: list[tuple[Peer, int]], combined: str, before: str, names: list[str],
        lay: Layout,
    ) -> None:  # fmt: skip
        """The hand-off down the group's relay tree (``tiers.relay_parent``, ``tierserve.fetch_down_the_tree``):
        each member that holds the checked result sends it to its children at once, sharing its uplink; a
        child whose parent cannot pass it on (another state, gone, an attacker that withholds) asks the
        representative, which answers from what it kept (after half of ``wait_s`` for a parent that stays
        silent); a member gives up ``wait_s`` after it asked, as with the direct hand-off."""
        rep, step = g.rep, g.step
        by_index = {g.members.index(p): (p, e) for p, e in receivers}
        in_line = {k for k, (p, _) in by_index.items() if p.pos == Position(step, before)}
        held = {g.order[0]: self.now}  # member index -> when it holds the checked result
        children: dict[int, list[int]] = {}
        for i in g.order[1:]:
            children.setdefault(relay_parent(g.order, i, None, self.training.relay_fanout), []).append(i)
        for i in g.order:  # a parent comes before its children in the order
            kids = [k for k in children.get(i, []) if k in in_line]
            if not kids:
                continue
            parent, root = g.members[i], i == g.order[0]
            header_at = held.get(i, math.inf) + parent.latency_s
            budget = self.wait_s if root else self.wait_s / 2  # fetch_down_the_tree: a relayer gets half
            if i in held and (root or not parent.attacker) and header_at - g.asked_at <= budget:
                self._sent(parent, step, len(kids) * lay.vector_bytes)
                if parent.send_s(len(kids) * lay.chunk_bytes) <= self.chunk_timeout_s:
                    at = header_at + parent.send_s(len(kids) * lay.vector_bytes)
                    held.update(dict.fromkeys(kids, at))
                    continue
            if root:
                continue  # the representative itself was too late or too slow: nothing to fall back on
            # fetch_down_the_tree: ask the representative, which answers from what it kept: at once when the
            # parent failed visibly (gone, or it had nothing), after half the wait when it stayed silent
            silent = i in held or parent.attacker
            asked = max(self.now, g.asked_at + self.wait_s / 2) if silent else self.now
            for k in kids:
                self._sent(rep, step, lay.vector_bytes)
                held[k] = asked + rep.latency_s + rep.send_s(lay.vector_bytes)
        for k, (p, e) in by_index.items():
            at = held.get(k)
            if k not in in_line:
                self._at(rep.latency_s, self._nothing, p, e, step, "other_state")
            elif at is None:
                self._at(rep.latency_s + self.chunk_timeout_s, self._nothing, p, e, step, "hand_off_slow")
            elif at - g.asked_at > self.wait_s:
                self._at(g.asked_at + self.wait_s - self.now, self._nothing, p, e, step, "hand_off_late")
            else:
                self._at(at - self.now, self._apply, p, e, step, combined, "combined", names, (step, before))

    # --- outcomes ----------------------------------------------------------------------------------------

    def _apply(
        self, peer: Peer, epoch: int, step: int, state: str, how: str, names: list[str],
        keep: tuple[int, str] | None = None,
    ) -> None:  # fmt: skip
        if not self._live(peer, epoch) or peer.pos.step != step:
            return
        if keep is not None:  # a member keeps the checked hand-off for peers that fall behind (board.keep)
            peer.kept[step] = (keep[1], state)
        self.applied.setdefault(step, []).append((peer.index, state, how, self.now))
        peer.fresh = False
        if names:
            peer.groupmates.record([n for n in names if n != peer.name], step + 1)
        self._move(peer, Position(step + 1, state))
        if not peer.done:
            self._compute(peer)

    def _nothing(self, peer: Peer, epoch: int, step: int, why: str) -> None:
        """The round gave this peer nothing to apply: adopt the combined result the peers ahead applied (when
        the code has it), else look at catch-up and try again with the gradient it holds."""
        if not self._live(peer, epoch) or peer.pos.step != step:
            return
        self.failed[(step, why)] += 1
        if self.adopt_asks:
            for asked, holder in enumerate(self._asked(peer, step)):
                kept = holder.kept.get(step)
                if (
                    kept is not None
                    and kept[0] == peer.pos.state_hash
                    and self._holds_the_step(step, kept[1])
                ):
                    nbytes = get_codec(TIER_COMPRESSION).max_bytes(self.config.numel)
                    took = (asked + 2) * holder.latency_s + holder.send_s(nbytes)
                    self._at(took, self._adopted, peer, epoch, step, kept[1], holder)
                    return
        self._at(peer.latency_s, self._try, peer, epoch)

    def _adopted(self, peer: Peer, epoch: int, step: int, state: str, holder: Peer) -> None:
        if self._live(peer, epoch) and peer.pos.step == step:
            peer.kept[step] = (peer.pos.state_hash, state)
            self._apply(peer, epoch, step, state, "adopted", [])

    def _catch_up(self, peer: Peer) -> bool:
        """Whether ``catch_up_move`` moves ``peer`` now; if so its download starts."""
        mine = peer.pos
        # catch_up_target counts only positions at or ahead of the caller's step: with none but its own
        # there, it returns None, so the O(N) view is built only when it can decide something.
        if not any(p != mine and p.step >= mine.step for p in self._positions):
            return False
        stuck_s = self.now - peer.tried_at if peer.tried_step == mine.step else 0.0
        trusted = peer.groupmates.recent(mine.step)
        # The decision depends on the view (unchanged since the last move), the caller's position, whether it
        # is stalled or long stalled, and then its groupmates: peers of one step checking at one moment ask
        # the same question, and at 1,000 peers each call reads the whole view.
        stalled = stuck_s > self.training.round_s
        # Two callers at one position see the same others but for themselves, who hold no target.
        long_stalled = stuck_s > 2 * self.training.round_s
        key = (self._view, mine, stalled, long_stalled, frozenset(trusted) if stalled else None)
        if key not in self._decided:
            others = {p.name: p.pos for p in self.peers if p.alive and p is not peer}
            mover = catch_up_move(mine, others, self.training, stuck_s=stuck_s, trusted=trusted or None)
            if len(self._decided) > 4096:
                self._decided.clear()
            self._decided[key] = mover
        move = self._decided[key]
        if move is None:
            return False
        step, state, holders = move
        by_name = {p.name: p for p in self.peers}
        live = [by_name[h] for h in holders if by_name[h].alive]
        if not live:
            return False
        holder = live[peer.index % len(live)]
        took = 2 * (peer.latency_s + holder.latency_s) + holder.send_s(
            self.config.numel * STATE_BYTES_PER_VALUE
        )
        self._move(peer, Position(-1, "downloading"))  # holds no position it could vote for meanwhile
        self._at(took, self._downloaded, peer, peer.epoch, Position(step, state))
        return True

    def _downloaded(self, peer: Peer, epoch: int, target: Position) -> None:
        if not self._live(peer, epoch):
            return
        self.downloads.append({"peer": peer.index, "step": target.step, "joiner": peer.fresh, "t": self.now})
        self._move(peer, target)
        if not peer.done:
            self._compute(peer)

    def _sent(self, peer: Peer, step: int, nbytes: int) -> None:
        self.sent.setdefault(step, Counter())[peer.index] += nbytes

    # --- figures -----------------------------------------------------------------------------------------

    def summary(self, finished: bool) -> dict:
        """The run's figures: per step and overall (``median_step_s``, ``mean_bytes``, ``max_bytes``,
        ``steady_downloads``, ``same_update_fraction``...)."""
        c = self.config
        rows = []
        for step in range(c.steps):
            applied = self.applied.get(step, [])
            sent = self.sent.get(step, Counter())
            rows.append({
                "step": step,
                "groups": len(self.groups.get(step, [])),
                "largest_group": max(self.groups.get(step, [0])),
                "tier2_rounds": len(self.tier_groups.get(step, [])),
                "peers_applied": len(applied),
                "distinct_results": len({a[1] for a in applied}),
                "same_update": len({a[1] for a in applied}) == 1,
                "adopted": sum(1 for a in applied if a[2] == "adopted"),
                "round_tries": self.tries[step],
                "failed": {why: n for (s, why), n in sorted(self.failed.items()) if s == step},
                "withheld": sum(len(g) for g in self.withheld.get(step, [])),
                "state_downloads": sum(1 for d in self.downloads if d["step"] == step + 1),
                "joiner_downloads": sum(1 for d in self.downloads if d["step"] == step + 1 and d["joiner"]),
                "bytes_sent_mean": statistics.fmean(sent.values()) if sent else 0.0,
                "bytes_sent_max": max(sent.values(), default=0),
            })  # fmt: skip
        times = []
        for step in range(1, c.steps + 1):
            reached = sorted(self.reached.get(step, {}).values())
            if len(reached) * 2 > c.peers:  # the time most peers were at or past it
                times.append(reached[c.peers // 2])
        paces = [b - a for a, b in pairwise(times)]
        sent_all = [n for counter in self.sent.values() for n in counter.values()]
        counted = [r for r in rows if r["peers_applied"]]
        return {
            "config": c.model_dump(),
            "finished": finished,
            "sim_s": self.now,
            "events": self.events,
            "median_step_s": statistics.median(paces) if paces else math.nan,
            "mean_bytes": statistics.fmean(sent_all) if sent_all else 0.0,
            "max_bytes": max(sent_all, default=0),
            "downloads": len(self.downloads),
            "joiner_downloads": sum(1 for d in self.downloads if d["joiner"]),
            "steady_downloads": sum(1 for d in self.downloads if d["step"] > 2 and not d["joiner"]),
            "adopted": sum(r["adopted"] for r in rows),
            "same_update_fraction": sum(r["same_update"] for r in counted) / len(counted) if counted else 0.0,
            "attackers": sum(p.attacker for p in self.peers),
            "per_step": rows,
        }


__all__ = ["DEMO_NUMEL", "STATE_BYTES_PER_VALUE", "Layout", "ScaleConfig", "ScaleSim", "layout"]
