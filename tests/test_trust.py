"""The trust boundary of the DHT: signed records, validators, the catch-up rule and state downloads.

The attacker in the multi-process tests is what the issue describes: a stock ``hivemind.DHT`` with a
fresh key and no certificate, bootstrapped from the honest peers' addresses, mounting the rehearsable
protocol attacks of ``swarm.byzantine.protocol_attacks``.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from pathlib import Path

import pytest
import torch
from helpers import stock_dht
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils import MSGPackSerializer, ValueWithExpiration, get_dht_time

from lab.localswarm import tiny_run
from protocols.certificates import issue_certificate
from protocols.keys import SigningKey
from swarm.bans import ban_list_pages, fetch_ban_list, publish_ban_list
from swarm.byzantine.protocol_attacks import POISON_HASH, ProtocolTarget, make_protocol_attack
from swarm.dht import start_dht
from swarm.identity import create_identity
from swarm.keyspace import RunValidator
from swarm.membership import fetch_members, publish_certificate
from swarm.ratelimit import RateLimiter
from swarm.records import RecordSigner, RecordTrust, TrustValidator, record_key, seal_peer_record
from swarm.training.catchup import Position, PositionHistory, catch_up_target
from swarm.training.progress import PeerProgress, fetch_progress
from swarm.training.state import encode_state, state_hash
from swarm.training.sync import (
    EncodedState,
    StateMovedOn,
    StateServicer,
    download_state,
    fetch_checkpoint_record,
    publish_checkpoint_record,
    state_namespace,
)
from swarm.training.trainer import Trainer

RUN = "trust-run"
# What the honest trainers' process may grow by while every attack (``hostile``: 300 KiB DHT values,
# frames claiming a terabyte, at each handler) is mounted again and again: their own training included.
HOSTILE_RSS_BOUND = 256 << 20
H1, H2, H3 = "1" * 64, "2" * 64, "3" * 64


# --- the catch-up rule ------------------------------------------------------------------------------


def test_catch_up_follows_a_strict_majority_of_certified_peers_only():
    honest = {"a": Position(5, H1), "b": Position(5, H1)}
    sybils = {f"s{i}": Position(6, H2) for i in range(2)}
    assert catch_up_target(Position(5, H1), {**honest, **sybils}) is None, "2 of 4 is no majority"
    assert catch_up_target(Position(0, H3), honest).holders == ["a", "b"], "a late joiner follows the run"
    # A round completed for "a" only; "b" is one step behind and a joiner at step 0 watches. One peer
    # ahead is all an attacker needs to be, so "b" follows it only once stalled; the joiner has no vote.
    seen_by_b = {"a": Position(7, H1), "joiner": Position(0, H3)}
    assert catch_up_target(Position(6, H2), seen_by_b) is None, "a lone peer ahead is no majority"
    assert catch_up_target(Position(6, H2), seen_by_b, stalled=True).holders == ["a"]
    assert catch_up_target(Position(6, H2), {"a": Position(7, H1)}).holders == ["a"], (
        "of two peers, one leads"
    )
    seen_by_joiner = {"a": Position(7, H1), "b": Position(6, H2)}
    assert catch_up_target(Position(0, H3), seen_by_joiner) is None, "the joiner waits for agreement"
    # "b" and "c" hold the same state, and their rounds keep failing: once stalled, only peers ahead vote.
    seen_by_c = {"a": Position(7, H1), "b": Position(6, H2)}
    assert catch_up_target(Position(6, H2), seen_by_c) is None
    assert catch_up_target(Position(6, H2), seen_by_c, stalled=True).holders == ["a"]
    three = {**sybils, "s2": Position(6, H2)}
    assert catch_up_target(Position(5, H1), {**honest, **three}) is None, (
        "3 of 6 with the caller is no majority"
    )
    moved = catch_up_target(Position(5, H1), {**honest, **three, "s3": Position(6, H2)})
    assert moved is not None and moved.state_hash == H2, "only a majority of certified keys moves a peer"


def test_sybils_without_credit_neither_steer_nor_hold_back_a_fresh_peer_a_peer_in_line_or_the_keeper():
    """Issue 25 (catch-up that Sybils cannot steer). Under open admission one address gets many
    certified keys: 5 Sybils announce a made-up step 6 beside 3 honest peers at step 5. Counting keys, a
    fresh peer, the checkpoint keeper and an honest peer in line all followed the Sybils (and downloaded
    their state); weighed by the coordinator's signed credit, keys that did no witnessed work have no say."""
    honest = {"h1": Position(5, H1), "h2": Position(5, H1), "h3": Position(5, H1)}
    sybils = {f"s{i}": Position(6, H2) for i in range(5)}
    view = {**honest, **sybils}
    credit = {"h1": 1200.0, "h2": 900.0, "h3": 1000.0}
    fresh, keeper, in_line = Position(0, H3), None, Position(5, H1)
    for mine in (fresh, keeper):  # counting keys: the Sybils' state
        assert catch_up_target(mine, view).state_hash == H2
    assert catch_up_target(in_line, view).state_hash == H2  # a fourth honest peer, at step 5 with them
    for mine in (fresh, keeper):
        target = catch_up_target(mine, view, credit=credit)
        assert (target.step, target.state_hash, target.holders) == (5, H1, ["h1", "h2", "h3"])
    assert catch_up_target(in_line, view, credit=credit) is None
    # Sybils that farmed a little credit by witnessing each other's made-up rounds weigh that little.
    farmed = {**credit, **{s: 60.0 for s in sybils}}
    assert catch_up_target(fresh, view, credit=farmed).state_hash == H1
    # One peer with a long history weighs no more than the third most credited: it neither decides ...
    whale = {**credit, "s0": 10**9}
    assert catch_up_target(fresh, view, credit=whale).state_hash == H1
    # ... nor vetoes: alone at another state, it cannot keep a fresh peer from the honest peers' state.
    split = {**honest, "w": Position(5, H2)}
    assert catch_up_target(fresh, split, credit={**credit, "w": 10**9}).state_hash == H1
    # Before three peers in view have credit (a run's first steps), counting keys decides as before.
    assert catch_up_target(fresh, view, credit={"h1": 5.0, "h2": 5.0}).state_hash == H2
    # A newer state a holder offers during a download is vouched for by credit the same way.
    history = PositionHistory()
    history.observe({**{k: Position(7, H3) for k in sybils}, **honest})
    voters = list(view)
    assert history.agreed(7, H3, voters) and not history.agreed(7, H3, voters, credit=credit)


def test_a_stalled_stage_replica_apart_at_the_last_step_moves_to_its_stage_mates_state():
    """A stage replica counts as stalled once its step has lasted a round's time, and a stalled one let
    only peers ahead vote. At the run's last step no round comes and nobody is ahead, so a replica that
    came out of the last round apart from its stage-mates stayed apart for good (a CI run of the pipeline
    attack sim ended with "the honest replicas of every stage DISAGREE"). With nobody ahead, the majority
    at its own step decides, as for a replica that is not stalled; a lone other state is no majority."""
    mates = {"a": Position(3, H2), "b": Position(3, H2)}
    assert catch_up_target(Position(3, H3), mates, max_step=3, stalled=True).holders == ["a", "b"]
    assert catch_up_target(Position(3, H1), {"x": Position(3, H2)}, max_step=3, stalled=True) is None
    # Peers ahead still decide alone for a stalled replica, as before.
    assert catch_up_target(Position(2, H1), {"a": Position(3, H2)}, stalled=True).holders == ["a"]


def test_one_admitted_peer_ahead_cannot_steer_a_peer_that_just_committed():
    """Right after "c" commits step 6 its honest groupmates still show step 5 (their records lag by up to
    a progress interval); an admitted attacker announces step 7 with a poisoned hash, then step 8. Before,
    only peers at or ahead of the caller voted, so the attacker was a majority of one and "c" downloaded
    its state."""
    finishing = {"a": Position(5, H1), "b": Position(5, H1)}
    for ahead in (7, 8):
        assert catch_up_target(Position(6, H2), {**finishing, "evil": Position(ahead, H3)}) is None
    # Once the groupmates show step 6 with the caller's state, the attacker is still one voter of four.
    done = {"a": Position(6, H2), "b": Position(6, H2), "evil": Position(7, H3)}
    assert catch_up_target(Position(6, H2), done) is None
    # A peer that fell behind follows the honest majority as before, the attacker's vote notwithstanding.
    assert catch_up_target(Position(3, H1), done).holders == ["a", "b"]
    # Honest peers far behind (downloading, just joined) still count: three keys that agree on a step
    # ahead are no majority of the seven other peers in view, though they are three of the four near it.
    crowd = {"a": Position(6, H2), **{f"new{i}": Position(0, H1) for i in range(3)},
             **{f"evil{i}": Position(7, H3) for i in range(3)}}  # fmt: skip
    assert catch_up_target(Position(6, H2), crowd) is None


def test_a_stalled_peer_follows_only_a_majority_of_the_peers_it_verified_work_with():
    """Issue 25, catch-up that Sybils cannot steer. Before, once a peer's rounds had failed for a matchmaking
    window plus a round timeout, only the peers ahead voted, so one certified key one step ahead (or a few
    Sybils that never trained) was a majority and the stalled peer downloaded their state. Now a stalled
    peer asks only the peers it completed and applied rounds with lately, all of them, ahead or not."""
    groupmates = {"a": Position(6, H2), "b": Position(6, H2)}
    strangers = {f"sybil{i}": Position(7, H3) for i in range(5)}
    trusted = {"a", "b"}
    assert (
        catch_up_target(Position(6, H2), {**groupmates, **strangers}, stalled=True, trusted=trusted) is None
    )
    assert catch_up_target(Position(6, H2), {**groupmates, **strangers}, stalled=True).state_hash == H3, (
        "the rule without anchors: the strangers ahead decide (as stage replicas still do)"
    )
    # A groupmate that turned attacker is one vote among the groupmates in view.
    turned = {**groupmates, "c": Position(7, H3)}
    assert catch_up_target(Position(6, H2), turned, stalled=True, trusted={"a", "b", "c"}) is None
    # Most groupmates moved on (the caller's part of a round failed): it follows them.
    moved = {"a": Position(7, H1), "b": Position(7, H1), "c": Position(6, H2), **strangers}
    target = catch_up_target(Position(6, H2), moved, stalled=True, trusted={"a", "b", "c"})
    assert target is not None and (target.step, target.state_hash, target.holders) == (7, H1, ["a", "b"])
    # No groupmate in view (a peer that never completed a round): not stalled, a majority of all decides.
    two = {"sybil0": Position(7, H3), "sybil1": Position(7, H3)}
    assert catch_up_target(Position(6, H2), {**groupmates, **two}, stalled=True).holders == [
        "sybil0",
        "sybil1",
    ]
    assert catch_up_target(Position(6, H2), {**groupmates, **two}, stalled=True, trusted=set()) is None


def test_a_trainer_records_its_groupmates_and_a_stalled_one_ignores_keys_it_never_averaged_with():
    """The same through the real Trainer: the members of its last applied round, forgotten after a window
    of steps, anchor ``_ahead_or_apart`` once its rounds have failed for longer than ``round_s``; after
    twice as long only those ahead of it vote (those at its step may be stuck with it)."""
    key = SigningKey.generate()
    trainer = Trainer(tiny_run(RUN), None, peer_id=key.peer_id, signing_key=key)
    trainer.peer.synced.step, trainer.peer.synced.state_hash = 6, H2
    trainer.peer.groupmates.record(["a", "b"], 6)
    now = time.time()
    view = {"a": (6, H2), "b": (6, H2), **{f"sybil{i}": (7, H3) for i in range(5)}}
    trainer.peer.view = {k: PeerProgress(k, s, 8, 1.0, h, now) for k, (s, h) in view.items()}
    round_s = trainer.peer.config.training.round_s
    for stalled_for in (1.5 * round_s, 3 * round_s):  # stalled, then twice as long
        trainer.peer.catchup.stalled_since = time.monotonic() - stalled_for
        assert trainer.peer.catchup.ahead_or_apart() is None, "stalled, yet the Sybils ahead have no say"
    trainer.peer.view["a"] = PeerProgress("a", 7, 8, 1.0, H1, now)
    assert trainer.peer.catchup.ahead_or_apart() is None, (
        "twice as long, but most peers ahead hold another state"
    )
    for i in range(5):
        del trainer.peer.view[f"sybil{i}"]
    assert trainer.peer.catchup.ahead_or_apart() == (7, H1, ["a"]), (
        "twice as long: the groupmates ahead decide"
    )
    trainer.peer.catchup.stalled_since = time.monotonic() - 1.5 * round_s
    assert trainer.peer.catchup.ahead_or_apart() is None, "before that, one of two groupmates is no majority"
    trainer.peer.view["b"] = PeerProgress("b", 7, 8, 1.0, H1, now)
    assert trainer.peer.catchup.ahead_or_apart() == (7, H1, ["a", "b"])
    trainer.peer.synced.step = (
        6 + trainer.peer.groupmates.window + 1
    )  # long past the last round with "a" and "b"
    assert trainer.peer.groupmates.recent(trainer.step) == set()


def test_catch_up_never_follows_an_absurd_step_and_apart_peers_never_swap():
    assert catch_up_target(Position(3, H1), {"x": Position(2**63 - 1, H2)}) is None
    assert catch_up_target(Position(3, H1), {"x": Position(11, H2)}, max_step=10) is None
    assert catch_up_target(Position(3, H1), {"x": Position(2, H2)}) is None, "never backwards"
    # Two peers apart at one step: exactly one of them moves, to the smaller hash.
    assert catch_up_target(Position(4, H2), {"a": Position(4, H1)}).state_hash == H1
    assert catch_up_target(Position(4, H1), {"b": Position(4, H2)}) is None
    assert (
        catch_up_target(None, {"a": Position(4, H1), "b": Position(4, H1), "c": Position(2**62 + 1, H2)}).step
        == 4
    )


# --- the validator and the readers -------------------------------------------------------------------


def _record(kind: str, subkey: object, value: object, expires_in_s: float) -> DHTRecord:
    key = DHTID.generate(source=record_key(RUN, kind)).to_bytes()
    subkey_bytes = MSGPackSerializer.dumps(subkey)
    return DHTRecord(key, subkey_bytes, MSGPackSerializer.dumps(value), get_dht_time() + expires_in_s)


def _progress(key: SigningKey, certificate: bytes, step: int = 1) -> bytes:
    body = {"step": step, "samples": 4, "samples_per_s": 1.0, "state_hash": H1}
    return seal_peer_record(key, "progress", RUN, body, certificate)


def test_validator_accepts_certified_records_and_refuses_junk_forgeries_and_far_future_values():
    coordinator, peer, stranger = SigningKey.generate(), SigningKey.generate(), SigningKey.generate()
    certificate = issue_certificate(
        coordinator, public_key=peer.public_key, run_id=RUN, role="data", name="p", serial=1, ttl_s=600
    ).encoded
    expired = issue_certificate(coordinator, public_key=stranger.public_key, run_id=RUN, role="data", name="s",
                                serial=1, ttl_s=10, now=time.time() - 100).encoded  # fmt: skip
    validator = TrustValidator(RUN, coordinator.public_key)
    assert validator.validate(_record("progress", peer.peer_id, _progress(peer, certificate), 10))
    stage = {"role": "stage", "stage": 1, "step": 3, "samples_per_s": 2.0, "load": 0.5, "state_hash": H1,
             "param_hash": H2}  # fmt: skip
    signed_stage = seal_peer_record(peer, "pipeline", RUN, stage, certificate)
    assert validator.validate(_record("pipeline", peer.peer_id, signed_stage, 10))
    refused = {
        "unsigned dict": _record("progress", peer.peer_id, {"step": 9, "state_hash": H2}, 10),
        "no certificate": _record("progress", stranger.peer_id, _progress(stranger, b""), 10),
        "expired certificate": _record("progress", stranger.peer_id, _progress(stranger, expired), 10),
        "someone else's certificate": _record(
            "progress", stranger.peer_id, _progress(stranger, certificate), 10
        ),
        "under another subkey": _record("progress", stranger.peer_id, _progress(peer, certificate), 10),
        "malformed subkey": _record("progress", "!!!!", _progress(peer, certificate), 10),
        "far future": _record("progress", peer.peer_id, _progress(peer, certificate), 1e9),
        "single junk value": _record("progress", None, b"junk", 10),
        "junk ban list": _record("bans", None, b"junk", 10),
        "junk members": _record("members", peer.peer_id, b"junk", 10),
        "unsigned stage record": _record("pipeline", peer.peer_id, stage, 10),
        "stage record as progress": _record("progress", peer.peer_id, signed_stage, 10),
    }
    for what, record in refused.items():
        assert not validator.validate(record), what
    other_key = DHTRecord(b"x" * 20, b"", b"anything", get_dht_time() + 1e9)
    assert validator.validate(other_key), "keys of other subsystems are theirs to check"


def test_an_old_signed_record_cannot_be_stored_to_outlive_its_signers_newer_ones():
    # hivemind keeps whichever value expires last. Before the signed expiry, anyone could store a peer's
    # old progress record (or the coordinator's old ban page) again to expire up to the kind's limit, and
    # every node then refused the signer's newer records, which expire sooner: a frozen view for minutes.
    coordinator, peer = SigningKey.generate(), SigningKey.generate()
    certificate = issue_certificate(
        coordinator, public_key=peer.public_key, run_id=RUN, role="data", name="p", serial=1, ttl_s=600
    ).encoded
    validator = TrustValidator(RUN, coordinator.public_key)
    old = seal_peer_record(peer, "progress", RUN, {"step": 1, "samples": 4, "samples_per_s": 1.0,
                           "state_hash": H1}, certificate, expires_at=get_dht_time() + 5)  # fmt: skip
    assert validator.validate(_record("progress", peer.peer_id, old, 5)), "as its signer stored it"
    assert not validator.validate(_record("progress", peer.peer_id, old, 500)), "replayed to live longer"
    signer = RecordSigner(peer, certificate)
    newer, expires_at = signer.seal("progress", RUN, {"step": 2, "samples": 4, "samples_per_s": 1.0,
                                    "state_hash": H2}, ttl_s=5)  # fmt: skip
    assert expires_at > get_dht_time() and validator.validate(_record("progress", peer.peer_id, newer, 4.9))

    page = ban_list_pages(coordinator, RUN, ["x"], changed_at=1.0, expires_at=get_dht_time() + 5)[0]
    assert validator.validate(_record("bans", None, page, 5))
    assert not validator.validate(_record("bans", None, page, 500)), "a ban page replayed to live longer"


def test_a_record_may_not_outlive_the_certificate_it_carries():
    # A record valid when stored but outliving its certificate turns invalid in storage, and one invalid
    # entry makes hivemind drop the whole dictionary a node returns: the run's progress would vanish.
    coordinator, peer = SigningKey.generate(), SigningKey.generate()
    certificate = issue_certificate(
        coordinator, public_key=peer.public_key, run_id=RUN, role="data", name="p", serial=1, ttl_s=30
    ).encoded
    validator = TrustValidator(RUN, coordinator.public_key)
    body = {"step": 1, "samples": 4, "samples_per_s": 1.0, "state_hash": H1}
    late = seal_peer_record(peer, "progress", RUN, body, certificate, expires_at=get_dht_time() + 300)
    assert not validator.validate(_record("progress", peer.peer_id, late, 20))
    record, expires_at = RecordSigner(peer, certificate).seal("progress", RUN, body, ttl_s=300)
    assert expires_at <= time.time() + 31, "the signer stops at its certificate's expiry"
    assert validator.validate(_record("progress", peer.peer_id, record, expires_at - get_dht_time()))


def test_readers_ignore_bad_records_with_one_log_line_and_never_raise(caplog):
    coordinator, peer = SigningKey.generate(), SigningKey.generate()
    certificate = issue_certificate(
        coordinator, public_key=peer.public_key, run_id=RUN, role="data", name="p", serial=1, ttl_s=600
    ).encoded
    expires = get_dht_time() + 10
    found = ValueWithExpiration(
        {
            peer.peer_id: ValueWithExpiration(_progress(peer, certificate), expires),
            "!!!!": ValueWithExpiration({"step": 2**63 - 1}, expires),
            7: ValueWithExpiration(b"\xc1", expires),
        },
        expires,
    )
    banned: set[str] = set()
    trust = RecordTrust(RUN, coordinator.public_key, is_banned=banned.__contains__)
    for _ in range(3):
        assert set(trust.open_dictionary("progress", found)) == {peer.peer_id}
    assert caplog.text.count("'!!!!'") == 1, "each bad record is logged once"
    banned.add(peer.peer_id)
    assert trust.open_dictionary("progress", found) == {}, "a banned signer's records are ignored"
    assert trust.open_dictionary("progress", ValueWithExpiration(b"junk", expires)) == {}


# --- real DHT processes and a stock hivemind attacker ----------------------------------------------


class Admitted:
    """An admitted peer: an identity, a DHT under it with the run's validator, and a certificate."""

    def __init__(self, coordinator: SigningKey, run_id: str, home: Path, initial_peers: list[str]):
        path = home / f"{len(list(home.iterdir()))}.key"
        self.key = create_identity(path)
        validator = RunValidator(run_id, coordinator.public_key, stages=1)  # as a volunteer's session does
        self.dht = start_dht(self.key, path, host="127.0.0.1", port=0, initial_peers=initial_peers,
                             validators=[validator])  # fmt: skip
        self.certificate = issue_certificate(
            coordinator,
            public_key=self.key.public_key,
            run_id=run_id,
            role="data",
            name="p",
            serial=1,
            ttl_s=600,
        )
        self.signer = RecordSigner(self.key, self.certificate.encoded)

    @property
    def maddrs(self) -> list[str]:
        return [str(a) for a in self.dht.get_visible_maddrs()]


@pytest.mark.slow
@pytest.mark.timeout(300)
async def within(awaitable, what: str, timeout_s: float):
    """``awaitable``'s result; an AssertionError naming ``what`` if it takes longer than ``timeout_s``."""
    try:
        return await asyncio.wait_for(awaitable, timeout_s)
    except asyncio.TimeoutError:
        raise AssertionError(f"{what} took more than {timeout_s:.0f}s") from None


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_an_unadmitted_attacker_neither_steers_nor_crashes_nor_blinds_honest_trainers():
    torch.set_num_threads(1)
    run = tiny_run(RUN, max_steps=4, min_group_size=2)
    coordinator = SigningKey.generate()
    home = Path(tempfile.mkdtemp(prefix="swarm-trust-"))
    first = Admitted(coordinator, RUN, home, [])
    second = Admitted(coordinator, RUN, home, first.maddrs)
    attacker_dht = stock_dht(first.maddrs)
    peers = [first, second]
    trainers = [
        Trainer(
            run,
            p.dht,
            peer_id=p.key.peer_id,
            coordinator_key=coordinator.public_key,
            record_signer=p.signer,
            signing_key=p.key,
        )
        for p in peers
    ]
    target = ProtocolTarget(attacker_dht, RUN, holders=[p.key.peer_id for p in peers],
                            state_namespace=state_namespace(RUN))  # fmt: skip
    record_attacks = [
        make_protocol_attack(n) for n in ("forged_progress", "sybil_hash", "malformed_subkey", "hostile")
    ]
    far_future = make_protocol_attack("far_future")
    flood = make_protocol_attack("download_flood", {"requests": 4})
    stop = asyncio.Event()

    async def publish_and_blind() -> None:
        # The coordinator's own records and the peers' member records, which far_future tries to replace.
        await publish_checkpoint_record(first.dht, coordinator, RUN, step=0, state_hash=H3, ttl_s=60)
        await publish_ban_list(first.dht, coordinator, RUN, [], changed_at=time.time(), ttl_s=60)
        for p in peers:
            await publish_certificate(p.dht, p.key, p.certificate, ttl_s=60)
        await far_future.mount(target)

    async def scenario() -> None:
        await within(publish_and_blind(), "publishing the records", 60)
        started, rss_before = time.monotonic(), rss_bytes()
        tasks = [asyncio.create_task(t.run(stop)) for t in trainers]
        moves: list[object] = []
        while not all(t.finished for t in trainers):
            assert not any(t.done() and t.exception() for t in tasks), "an honest trainer crashed"
            for attack in record_attacks:
                await within(attack.mount(target), f"mounting {attack.name}", 30)
            await asyncio.sleep(0.3)
            moves += [
                m for m in (t.peer.catchup.ahead_or_apart() for t in trainers) if m and m[1] == POISON_HASH
            ]
            if time.monotonic() > started + 200:
                raise AssertionError(f"honest trainers stalled at steps {[t.step for t in trainers]}")
        assert not moves, "no honest peer ever chose the attacker's state"
        assert trainers[0].state_hash == trainers[1].state_hash, "honest peers stay bit-identical"
        grown = rss_bytes() - rss_before
        print(f"the honest trainers' process grew by {grown / 2**20:.0f} MiB under the attacks")
        assert grown < HOSTILE_RSS_BOUND, f"grew by {grown / 2**20:.0f} MiB"
        await within(publish_and_blind(), "publishing the records again", 60)
        view = await within(fetch_progress(first.dht, trainers[0].peer.trust), "reading progress", 30)
        assert set(view) == {p.key.peer_id for p in peers}, "only certified peers are in the view"
        members = await within(fetch_members(second.dht, RUN, coordinator.public_key), "reading members", 30)
        assert set(members) == set(view)
        checkpoint = await within(
            fetch_checkpoint_record(second.dht, RUN, coordinator.public_key), "reading", 30
        )
        assert checkpoint == (0, H3)
        assert (
            await within(fetch_ban_list(second.dht, RUN, coordinator.public_key), "reading bans", 30)
            is not None
        )
        # The flood gets nothing: the attacker has no signed record, so no holder serves it.
        await within(flood.mount(target), "the download flood", 60)
        assert flood.received_bytes == 0 and flood.refusals == 2 * 4, "every request reached and was refused"
        stop.set()
        await within(asyncio.gather(*tasks, return_exceptions=True), "the trainers stopping", 60)

    try:
        asyncio.run(scenario())
    finally:
        attacker_dht.shutdown()
        for p in peers:
            p.dht.shutdown()


@pytest.mark.timeout(120)
def test_state_downloads_need_admission_go_through_the_limiter_and_are_bounded_per_requester():
    home = Path(tempfile.mkdtemp(prefix="swarm-trust-"))
    coordinator = SigningKey.generate()
    holder = Admitted(coordinator, RUN, home, [])
    member = Admitted(coordinator, RUN, home, holder.maddrs)
    stranger = Admitted(coordinator, RUN, home, holder.maddrs)
    data = bytes(3 << 20)
    state = EncodedState(1, H1, data)
    limiter = RateLimiter(8 << 20)

    async def provide() -> EncodedState:
        return state

    async def admit(requester: str) -> str | None:
        return None if requester == member.key.peer_id else f"{requester} is not a member"

    async def scenario() -> None:
        servicer = StateServicer(RUN, provide, admit=admit, upload_limiter=limiter)
        p2p = await holder.dht.replicate_p2p()
        await servicer.add_p2p_handlers(p2p, namespace=state_namespace(RUN))

        async def fetch(peer: Admitted) -> str:
            try:
                await download_state(await peer.dht.replicate_p2p(), holder.dht.peer_id,
                                     namespace=state_namespace(RUN), run_id=RUN, min_step=1, expected_hash=H1,
                                     max_bytes=8 << 20, timeout_s=30)  # fmt: skip
            except (
                Exception
            ) as e:  # the decode fails (these bytes are no state): only the transfer matters here
                return str(e)
            return "ok"

        refusal = await fetch(stranger)
        assert "is not a member" in refusal and limiter.bytes_sent == 0
        answers = await asyncio.gather(*(fetch(member) for _ in range(4)))
        assert sum("already has 1 state downloads" in a for a in answers) >= 1, answers
        assert limiter.bytes_sent >= len(data), "served bytes go through the upload limiter"
        assert servicer.uploads == {}, "finished streams release their slots"

    try:
        asyncio.run(scenario())
    finally:
        for p in (holder, member, stranger):
            p.dht.shutdown()


@pytest.mark.timeout(120)
def test_a_download_the_run_outran_takes_the_newer_state_only_when_the_records_vouch_for_it():
    """The holder trained from step 5 to 7 between the requester's view and its request: a run that steps
    faster than a download starts must not lock a peer out for good, and a holder alone among others
    that saw another hash at step 7 cannot slip its own state in."""
    home = Path(tempfile.mkdtemp(prefix="swarm-trust-"))
    coordinator = SigningKey.generate()
    holder = Admitted(coordinator, RUN, home, [])
    member = Admitted(coordinator, RUN, home, holder.maddrs)
    tensors = {"w": torch.arange(6, dtype=torch.float32)}
    data = encode_state(7, tensors, {"run_id": RUN})
    newer = EncodedState(7, state_hash(7, tensors), data)
    at_five = state_hash(5, tensors)

    async def provide() -> EncodedState:
        return newer

    async def admit(requester: str) -> str | None:
        return None

    holder_id = holder.key.peer_id

    async def scenario() -> list[object]:
        servicer = StateServicer(RUN, provide, admit=admit)
        await servicer.add_p2p_handlers(await holder.dht.replicate_p2p(), namespace=state_namespace(RUN))
        p2p = await member.dht.replicate_p2p()
        outcomes: list[object] = []
        for seen in (None, {holder_id: newer.state_hash, "x": newer.state_hash},
                     {holder_id: newer.state_hash, "x": H2, "y": H2}):  # fmt: skip
            history = PositionHistory()
            if seen is not None:
                history.observe({peer: Position(7, h) for peer, h in seen.items()})

            voters = list(seen or {})

            async def vouched(step: int, h: str, history=history, voters=voters) -> bool:
                return history.agreed(step, h, voters)

            try:
                decoded = await download_state(p2p, holder.dht.peer_id, namespace=state_namespace(RUN), run_id=RUN,
                                               min_step=5, expected_hash=at_five, max_bytes=1 << 20, timeout_s=30,
                                               accept_newer=None if seen is None else vouched)  # fmt: skip
                outcomes.append((decoded.step, decoded.state_hash))
            except StateMovedOn as e:
                outcomes.append(str(e))
        return outcomes

    try:
        refused, taken, outvoted = asyncio.run(scenario())
    finally:
        for p in (holder, member):
            p.dht.shutdown()
    assert "has moved on to step 7" in refused, "without records to check it against, nothing newer is taken"
    assert taken == (7, newer.state_hash), "the records seen at step 7 vouch for the holder's state"
    assert "do not vouch for" in outvoted, "1 of 3 peers seen at step 7 is no majority"


def test_the_position_history_counts_only_peers_in_view_and_each_key_evicts_only_its_own():
    history = PositionHistory(per_peer=3)
    for step in range(6):
        history.observe({"a": Position(step, H1), "b": Position(step, H1)}, max_step=100)
    history.observe({"a": Position(2**63 - 1, H1)}, max_step=100)
    assert not history.agreed(2, H1, ["a"]), "a peer remembers only its last 3 positions"
    assert history.agreed(5, H1, ["a", "b"]) and not history.agreed(5, H2, ["a", "b"])
    assert not history.agreed(2**63 - 1, H1, ["a"]), "a step past max_steps is never recorded"
    assert not history.agreed(5, H1, ["a", "c", "d"]), "one holder seen among three is no majority"
    # A key that announces many steps pushes out its own memory, not "b"'s.
    for i in range(50):
        history.observe({"evil": Position(100 + i, H3)}, max_step=1000)
    assert history.agreed(5, H1, ["b"])
    # Peers that left the view vouch for nothing, even when they were seen.
    history.observe({}, keep={"b"})
    assert not history.agreed(5, H1, ["a"]), "a left the view"
    assert not history.agreed(5, H1, ["b", "c"]), "one of two is no majority"
