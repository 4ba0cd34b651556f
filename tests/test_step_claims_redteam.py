"""Regressions from an attacker's read of the step-claim exclusion, the groupmate-anchored catch-up and
the coordinator's refusal log. Each was first written to pass while its defect was present (asserting
the bad outcome, named in the docstring's "Before"); each now asserts the outcome after the fix."""

from __future__ import annotations

import asyncio
import hashlib
import os
import time
from types import SimpleNamespace

import pytest
from hivemind.p2p import PeerID

from coordinator.limits import RefusalLog
from lab.localswarm import tiny_run
from protocols.envelope import seal
from protocols.errors import ProtocolError
from protocols.keys import SigningKey
from protocols.messages import MAX_ENTRY_BYTES, MAX_ROUND_ENTRIES, MAX_WITNESSED_ROUNDS, HeartbeatBody
from swarm.averaging.averager import Averager
from swarm.averaging.groups import GROUP_ENTRY
from swarm.averaging.policy import PeerPolicy
from swarm.training.catchup import Position, catch_up_target
from swarm.training.peer import TrainingPeer
from swarm.training.progress import PeerProgress, step_misfit
from swarm.training.trainer import Trainer
from swarm.training.witness import WitnessedRounds

pytestmark = pytest.mark.timeout(120)

RUN = "redteam-run"
PREFIX = "redteam-run"
SCHEMA = hashlib.sha256(b"schema").digest()
H_OLD, H_NEW, H_EVIL = "1" * 64, "2" * 64, "e" * 64


def _entry(key: SigningKey, step: int, *, now: float | None = None) -> bytes:
    body = {
        "schema_hash": SCHEMA, "weight": 8.0, "commit": os.urandom(32), "data": None,
        "extra": {"step": step, "state_hash": H_OLD},
    }  # fmt: skip
    return seal(key, GROUP_ENTRY, PREFIX, body, now=now)


def _averager_of(me: SigningKey, leader: SigningKey, members: list[str], my_entry: bytes) -> Averager:
    """The real ``Averager._checked`` without a daemon: only what it reads is set."""
    averager = object.__new__(Averager)
    averager.p2p = SimpleNamespace(peer_id=PeerID.from_base58(me.peer_id))
    averager.matchmaking = SimpleNamespace(leader=PeerID.from_base58(leader.peer_id))
    averager.policy = PeerPolicy(None, RUN, allowed=members)
    averager.prefix, averager.schema_hash, averager.signing_key = PREFIX, SCHEMA, me
    averager._entry = my_entry
    averager.averaging_timeout_s, averager.matchmaking_time_s = 30.0, 2.0
    averager.min_reducers, averager.max_weight, averager.max_group_size = 1, 1e9, 64
    averager.longest_search_s = None
    return averager


def _trainer(step: int, state_hash: str) -> TrainingPeer:
    key = SigningKey.generate()
    peer = Trainer(tiny_run(RUN), None, peer_id=key.peer_id, signing_key=key).peer
    peer.synced.step, peer.synced.state_hash = step, state_hash
    return peer


def _view(positions: dict[str, tuple[int, str]]) -> dict[str, PeerProgress]:
    now = time.time()
    return {k: PeerProgress(k, s, 8, 1.0, h, now) for k, (s, h) in positions.items()}


# --- 1. misfit suspicion can be pinned on an honest peer ---------------------------------------------


def test_a_leader_replaying_an_honest_peers_earlier_entry_gets_it_excluded_but_not_suspected():
    """Before, every misfit was suspected (``VerifiedGroup.suspects``). A group entry is bound to the run
    and dated, but not to a group, a leader or a round: any member of the previous round received X's
    signed entry of step 10 (gathered data goes to every member) and it stays "fresh" for
    averaging_timeout_s + 3 * matchmaking_time_s + 120 s, many every_step rounds. A Sybil leading the next
    round lists X with that entry: each honest follower at step 11 excludes X as a misfit and suspects it,
    an honest peer, on the leader's word (a full suspicion, not leader_only), and the round goes on among
    the rest. X need not even be in that group. Now a claim of a step behind (what a laggard signs, and what
    a replayed entry shows) excludes its signer without blaming it."""
    honest = [SigningKey.generate() for _ in range(3)]  # B, C and the victim X
    leader = SigningKey.generate()
    b, c, x = honest
    replayed = _entry(x, 10, now=time.time() - 30.0)  # X's own entry of the previous round, 30 s old
    members = [leader.peer_id, b.peer_id, c.peer_id, x.peer_id]
    gathered = {leader.peer_id: _entry(leader, 11), b.peer_id: _entry(b, 11), c.peer_id: _entry(c, 11)}
    gathered[x.peer_id] = replayed
    info = SimpleNamespace(
        peer_ids=[PeerID.from_base58(p) for p in members],
        gathered=[gathered[p] for p in members],
        group_id=os.urandom(16),
    )
    for me in (b, c):
        averager = _averager_of(me, leader, members, gathered[me.peer_id])
        fits = lambda e, _signer: step_misfit(e.extra, {"step": 11, "state_hash": H_OLD})  # noqa: E731
        group = asyncio.run(averager._checked(info, fits))
        assert group is not None, "the round goes on without X"
        assert x.peer_id not in {str(p) for p in group.peer_ids}
        assert averager.policy.refusal(x.peer_id) is None, "X is not suspected on the leader's word"


def test_an_honest_peer_one_step_behind_is_not_refused_after_it_caught_up():
    """Before, without any attacker: an honest peer one step behind (its last round was incomplete, it downloaded a
    state the run then outran) that meets its groupmates at the next step is suspected by each of them,
    for SUSPECT_S (60 s, doubling on a repeat up to 960 s). After it caught up by download it is still
    refused as a member, so with swarm-sim's min_group_size (the honest peer count) no round reaches the
    floor until the suspicion ends: the whole run waited. Now it is excluded from that round only."""
    b, c, x = (SigningKey.generate() for _ in range(3))
    members = [b.peer_id, c.peer_id, x.peer_id]
    gathered = {b.peer_id: _entry(b, 11), c.peer_id: _entry(c, 11), x.peer_id: _entry(x, 10)}
    info = SimpleNamespace(
        peer_ids=[PeerID.from_base58(p) for p in members], gathered=[gathered[p] for p in members],
        group_id=os.urandom(16),
    )  # fmt: skip
    averager = _averager_of(b, b, members, gathered[b.peer_id])
    asyncio.run(averager._checked(info, lambda e, _signer: step_misfit(e.extra, {"step": 11})))
    # X has caught up to step 11 by download; B's trainer builds its next round's expected group:
    at_step = [p for p in (c.peer_id, x.peer_id) if averager.policy.refusal(p) is None]
    assert at_step == [c.peer_id, x.peer_id], "the honest peer that caught up is in the next rounds"


def test_one_sybil_at_a_laggards_step_cannot_turn_the_laggard_against_the_honest_peers_ahead():
    """Before, ``suspects`` spared the peers ahead only when the misfits are a strict majority of everyone listed,
    and ``listed`` counts the Sybils the leader adds (at the laggard's step, or with broken entries). An
    honest peer V one step behind, in a group with honest B and C ahead and one Sybil that signs V's
    step: 2 misfits of 4 is no majority, so V suspected both honest peers. Now misfits that are half of the
    group or more are suspected by nobody."""
    v, b, c, sybil = (SigningKey.generate() for _ in range(4))
    members = [sybil.peer_id, v.peer_id, b.peer_id, c.peer_id]
    gathered = {sybil.peer_id: _entry(sybil, 10), v.peer_id: _entry(v, 10), b.peer_id: _entry(b, 11),
                c.peer_id: _entry(c, 11)}  # fmt: skip
    info = SimpleNamespace(
        peer_ids=[PeerID.from_base58(p) for p in members], gathered=[gathered[p] for p in members],
        group_id=os.urandom(16),
    )  # fmt: skip
    averager = _averager_of(v, sybil, members, gathered[v.peer_id])
    group = asyncio.run(averager._checked(info, lambda e, _signer: step_misfit(e.extra, {"step": 10})))
    assert group is not None and {str(p) for p in group.peer_ids} == {v.peer_id, sybil.peer_id}
    assert averager.policy.refusal(b.peer_id) is None and averager.policy.refusal(c.peer_id) is None


# --- 2. Groupmates-anchored catch-up -----------------------------------------------------------------


def test_two_honest_peers_split_from_a_completed_round_catch_up_once_stalled_twice_as_long():
    """Three honest peers, min_group_size 3 (swarm-sim's floor). At step 6 one round completes for H1 only
    (a reducer's aggregate lost on the way to V and W): H1 commits 7, V and W stay at 6. Every later round
    fails for all three (nobody has 3 peers at its step). Before, a stalled peer let the peers ahead vote
    (H1 alone ahead: a majority of one) and V and W followed H1. Now the anchors are ALL groupmates at or
    ahead of the caller, so W (at V's own step) is in the electorate and H1's 1 vote of 2 is no majority:
    neither V nor W ever moved, and H1 never moves back: the run deadlocked with no attacker. Now, stalled
    twice as long, only the groupmates ahead vote while no more peers in view are at the caller's step
    than ahead of it."""
    v, w = _trainer(6, H_OLD), _trainer(6, H_OLD)
    h1 = "h1-peer"
    for me, other in ((v, w), (w, v)):
        me.groupmates.record([h1, other.peer_id], 6)
        me.view = _view({h1: (7, H_NEW), other.peer_id: (6, H_OLD)})
        me.catchup.stalled_since = time.monotonic() - 1.5 * me.config.training.round_s
        assert me.catchup.ahead_or_apart() is None, "stalled: H1 is 1 vote of 2 anchors"
        me.catchup.stalled_since = time.monotonic() - 3 * me.config.training.round_s
        assert me.catchup.ahead_or_apart() == (7, H_NEW, [h1]), "stalled twice as long: H1 ahead decides"
        mine = Position(6, H_OLD)
        others = {k: Position(p.step, p.state_hash) for k, p in me.view.items()}
        old_rule = catch_up_target(mine, others, stalled=True)  # trusted=None: the rule before this change
        assert old_rule is not None and (old_rule.step, old_rule.holders) == (7, [h1])


def test_one_attacker_groupmate_parked_at_the_victims_step_holds_it_only_for_two_windows():
    """Group of three, one attacker (f = 1 < n/2). The round at step 6 completes for H1 but not for V (the
    attacker's aggregate never reached V). The attacker A keeps publishing a record at V's step (cheap, and
    indistinguishable from an honest peer that is stuck too). V's anchors are {H1 at 7, A at 6}: H1 has 1
    vote of 2, so V never follows; the unstalled rule counts V's own side and A too (1 of 3). Before, only
    the peers ahead voted when stalled, and V followed H1. With any group of 2f + 1 and f attackers at the
    victim's step, the f honest groupmates ahead were never a strict majority. Now, stalled twice as long,
    only the groupmates ahead vote."""
    victim = _trainer(6, H_OLD)
    victim.groupmates.record(["h1", "attacker"], 6)
    victim.view = _view({"h1": (7, H_NEW), "attacker": (6, H_OLD)})
    for stuck_for in (0.0, 1.5):
        victim.catchup.stalled_since = time.monotonic() - stuck_for * victim.config.training.round_s
        assert victim.catchup.ahead_or_apart() is None
    victim.catchup.stalled_since = time.monotonic() - 3 * victim.config.training.round_s
    assert victim.catchup.ahead_or_apart() == (7, H_NEW, ["h1"])


def test_rotating_sybils_each_a_minority_of_one_round_never_become_most_of_the_anchors():
    """Before, ``Groupmates`` was a union over 8 steps that counts identities. A Sybil leader forms V's groups from V,
    the same two honest followers and two fresh Sybils each step (2 of 5: a minority of every round). After
    8 steps V's anchors are 2 honest peers and 16 Sybils, while the view holds 40 honest peers, so the
    unstalled rule (a majority of everyone in view) is safe. Once the attacker makes V's rounds fail for
    round_s, the Sybils' position ahead was 16 of 18 anchors and V downloaded the attacker's state. Now the
    anchors are the last round's members only (2 honest, 2 Sybils: no majority), and after twice as long
    the 40 peers at V's step outnumber the Sybils ahead."""
    victim = _trainer(0, H_OLD)
    honest_mates = ["h1", "h2"]
    sybils = [f"sybil{i}" for i in range(16)]
    for step in range(8):
        victim.groupmates.record([*honest_mates, *sybils[2 * step : 2 * step + 2]], step)
    victim.synced.step = 8
    crowd = {f"honest{i}": (8, H_OLD) for i in range(38)}
    view = {**crowd, **{h: (8, H_OLD) for h in honest_mates}, **{s: (9, H_EVIL) for s in sybils}}
    victim.view = _view(view)
    victim.catchup.stalled_since = None  # not stalled: the whole view decides, and the Sybils are a minority
    assert victim.catchup.ahead_or_apart() is None
    for stuck_for in (1.5, 3.0):
        victim.catchup.stalled_since = time.monotonic() - stuck_for * victim.config.training.round_s
        assert victim.catchup.ahead_or_apart() is None


def test_a_stalled_peers_groupmate_target_is_downloaded_from_groupmates_only():
    """The rule keeps five Sybils ahead from deciding a stalled peer's target (tests/test_trust.py), but
    the download still takes holders from every key at the chosen position and vouches for a "newer" state
    with the whole view (``_vouched_for`` / ``PositionHistory.agreed``), not the groupmates. The Sybils
    once publish (8, evil), then copy the groupmates' (7, H_NEW): they are holders of the anchored target,
    and a Sybil holder that served its (8, evil) state was vouched for by 5 of the 7 peers in view. Now the
    state of an anchored target is downloaded from the groupmates that hold it only. (A groupmate holder
    offering a newer state is still vouched for by the whole view: that needs Sybils that are most of it.)"""
    victim = _trainer(6, H_OLD)
    victim.groupmates.record(["a", "b"], 6)
    sybils = [f"sybil{i}" for i in range(5)]
    earlier = {"a": (7, H_NEW), "b": (7, H_NEW), **{s: (8, H_EVIL) for s in sybils}}
    victim.progress_view.positions.observe({k: Position(*p) for k, p in earlier.items()})
    victim.view = _view({"a": (7, H_NEW), "b": (7, H_NEW), **{s: (7, H_NEW) for s in sybils}})
    for k, p in victim.view.items():
        victim.progress_view.positions.observe({k: Position(p.step, p.state_hash)})
    victim.catchup.stalled_since = time.monotonic() - 1.5 * victim.config.training.round_s
    assert victim.catchup.ahead_or_apart() == (7, H_NEW, ["a", "b"]), "only groupmates are holders"


# --- 3. RefusalLog -----------------------------------------------------------------------------------


def test_a_cheap_flood_does_not_silence_another_callers_refusals_of_the_same_kind():
    """Before, the budget was per (RPC, error class), not per caller: 20 junk Accuse calls a minute from one address
    hide every refused Accuse of another caller (say, a forged accusation against an honest peer) from
    the log, and the later summary named neither caller nor reason."""
    lines: list[str] = []
    now = [0.0]
    log = RefusalLog(lines.append, clock=lambda: now[0])
    for i in range(20):
        now[0] = i * 0.1
        log.refused("Accuse", "ipv4:198.51.100.9:1", ProtocolError("malformed"))
    now[0] = 5.0
    log.refused("Accuse", "ipv4:203.0.113.7:1", ProtocolError("evidence against QmHonest does not verify"))
    assert "refused Accuse from ipv4:203.0.113.7:1: evidence against QmHonest does not verify" in lines


def test_the_count_of_left_out_refusals_is_written_when_the_flood_stops():
    """Before, the summary line was written only by the next refusal of the same key after the window: a
    burst that ended left no trace of how many refusals were dropped. Now any later refusal writes it."""
    lines: list[str] = []
    now = [0.0]
    log = RefusalLog(lines.append, clock=lambda: now[0])
    for i in range(5000):
        now[0] = i * 0.01
        log.refused("Challenge", "ipv4:198.51.100.9:1", ProtocolError("too many"))
    now[0] = 3600.0  # an hour later, refusals of other kinds only
    log.refused("Join", "ipv4:203.0.113.7:1", ProtocolError("bad name"))
    assert any("4980 more refusals of Challenge (ProtocolError) from 198.51.100.9" in line for line in lines)


def test_a_member_that_suspects_a_groupmate_stays_in_the_round_and_leaves_it_only_for_a_ban():
    """Before, a member that suspected a groupmate left the group, and answered that groupmate's and the
    others' part streams that it knew no such round, as a denier does: the members that did not share its
    suspicion suspected it in turn. In a swarm-sim run with two deniers of six, suspicion so spread to
    every honest peer and no group reached the run's floor for 900 s. Now only a ban or a missing
    certificate makes a member leave; suspicion steers matchmaking only."""
    b, c, x = (SigningKey.generate() for _ in range(3))
    members = [b.peer_id, c.peer_id, x.peer_id]
    gathered = {k.peer_id: _entry(k, 11) for k in (b, c, x)}
    info = SimpleNamespace(
        peer_ids=[PeerID.from_base58(p) for p in members], gathered=[gathered[p] for p in members],
        group_id=os.urandom(16),
    )  # fmt: skip
    averager = _averager_of(b, b, members, gathered[b.peer_id])
    averager.policy.suspect(x.peer_id, "said it knows no such round")
    group = asyncio.run(averager._checked(info, lambda e, _signer: step_misfit(e.extra, {"step": 11})))
    assert group is not None and [str(p) for p in group.peer_ids] == members
    averager.policy.set_bans([x.peer_id], issued_at=time.time())
    assert asyncio.run(averager._checked(info, lambda e, _signer: step_misfit(e.extra, {"step": 11}))) is None


def test_a_groupmates_oversized_entry_is_left_out_of_the_witnessed_rounds_never_sent_to_be_refused():
    """A heartbeat whose witnessed rounds break the message's bounds is refused whole, and a peer whose
    heartbeats are refused goes offline: a groupmate that signs an entry over ``MAX_ENTRY_BYTES`` (its
    ``extra`` holds up to 32 keys) must not get that done to the honest members that report its round."""
    trainer = _trainer(5, H_OLD)
    me = trainer.peer_id
    others = [SigningKey.generate() for _ in range(60)]
    huge = seal(others[0], GROUP_ENTRY, PREFIX, {"pad": "x" * 4096})
    group = SimpleNamespace(
        peer_ids=[me, *(k.peer_id for k in others)],
        signed_entries=[b"mine" * 10, huge, *(b"e" * 500 for _ in others[1:])],
    )
    trainer.witness.record(group)
    (reported,) = trainer.witnessed()
    assert reported[0] == b"mine" * 10 and huge not in reported
    assert len(reported) == MAX_ROUND_ENTRIES and all(len(e) <= MAX_ENTRY_BYTES for e in reported)
    for _ in range(5):
        trainer.witness.record(group)
    HeartbeatBody.model_validate(
        {"seq": 1, "state": "online", "rounds": trainer.witnessed()}
    )  # within every bound of the message
    assert len(trainer.witnessed()) == MAX_WITNESSED_ROUNDS


def test_an_honest_entry_at_every_bound_is_witnessed_and_a_full_heartbeat_fits_its_envelope():
    """An honest peer's entry carries its certificate (run ID, name) and its data address. With a long
    host name (a 120-character address was enough) it passed the 1,024 bytes a witnessed entry could have, so
    every witness, itself included, left it out: the peer earned no credit, and nothing said why. The
    bound now holds an entry with every field an honest peer fills at its own bound, and a heartbeat full
    of such entries still fits the signed envelope."""
    from protocols.certificates import issue_certificate
    from protocols.messages import HEARTBEAT
    from protocols.version import MAX_ENVELOPE_BYTES
    from swarm.averaging.groups import GroupEntryBody, make_entry

    coordinator, me = SigningKey.generate(), SigningKey.generate()
    run_id = "r" * 64  # RUN_ID_PATTERN's longest
    certificate = issue_certificate(
        coordinator, public_key=me.public_key, run_id=run_id, role="data", name="\U0001f600" * 64,
        serial=2**40, ttl_s=86400.0,
    )  # fmt: skip
    body = GroupEntryBody(
        schema_hash=b"s" * 32, weight=1e12 + 0.5, commit=b"c" * 32, data="h" * 250 + ":65535", dialable=True,
        uplink_mbit=99999.5, extra={"step": 2**62, "state_hash": "f" * 64}, certificate=certificate.encoded,
    )  # fmt: skip
    entry = make_entry(me, run_id, body)
    assert len(entry) <= MAX_ENTRY_BYTES, f"an honest entry of {len(entry)} bytes would be left out"
    witness = WitnessedRounds(me.peer_id)
    others = [SigningKey.generate() for _ in range(MAX_ROUND_ENTRIES)]
    group = SimpleNamespace(peer_ids=[me.peer_id, *(k.peer_id for k in others)], signed_entries=[entry] * 49)
    for _ in range(MAX_WITNESSED_ROUNDS):
        witness.record(group)
    rounds = witness.next()
    assert [len(r) for r in rounds] == [MAX_ROUND_ENTRIES] * MAX_WITNESSED_ROUNDS and rounds[0][0] == entry
    metrics = {f"metric_{i:02d}_" + "m" * 54: 1e300 for i in range(64)}
    heartbeat = {"seq": 1, "state": "online", "step": 2**62, "param_hash": "f" * 64, "metrics": metrics,
                 "suspects": [me.peer_id] * 16, "rounds": rounds}  # fmt: skip
    HeartbeatBody.model_validate(heartbeat)
    assert len(seal(me, HEARTBEAT, run_id, heartbeat)) <= MAX_ENVELOPE_BYTES
