"""Ways in found by reading the trust work as an attacker would, each with the real classes: the attack,
where the flaw was, what it did before, and that it no longer does (each test failed on the old code)."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from hivemind.p2p import PeerID
from test_step_claims_redteam import H_OLD, PREFIX, RUN, SCHEMA, _averager_of

from protocols.envelope import seal
from protocols.keys import SigningKey
from swarm.averaging.groups import GROUP_ENTRY
from swarm.averaging.policy import PeerPolicy
from swarm.training.progress import step_misfit

pytestmark = pytest.mark.timeout(120)


def _entry(key: SigningKey, step: int, *, now: float | None = None, prefix: str = PREFIX) -> bytes:
    """A group entry exactly as ``Averager.find_group`` signs one (weight 8, step in ``extra``)."""
    body = {
        "schema_hash": SCHEMA, "weight": 8.0, "commit": os.urandom(32), "data": None,
        "extra": {"step": step, "state_hash": H_OLD},
    }  # fmt: skip
    return seal(key, GROUP_ENTRY, prefix, body, now=now)


def _info(members: list[str], gathered: dict[str, bytes]) -> SimpleNamespace:
    """What hivemind hands a follower once its leader begins the round: the leader's list and entries."""
    return SimpleNamespace(
        peer_ids=[PeerID.from_base58(p) for p in members],
        gathered=[gathered[p] for p in members],
        group_id=os.urandom(16),
    )


# --- 1. a leader breaks every group it leads and the blame lands on a phantom -----------------------


def test_a_leader_listing_a_phantom_member_is_blamed_for_it_and_the_phantom_is_not():
    """Attack: a certified Sybil leader gathers honest followers, then announces the group with one extra
    member, a freshly generated key that no coordinator ever certified (its "entry" is junk bytes).
    Flaw (swarm/averaging/groups.py:check_group): a listed member that is not admitted was named the
    culprit, so every follower left the group, suspected the phantom, and followed the same leader again:
    20 groups in a row broken for both honest followers, and 20 phantom keys in each one's suspect book.
    Now the leader that listed it is blamed (avoided as a leader), and the phantom never enters the book."""
    leader, b, c = (SigningKey.generate() for _ in range(3))
    certified = [leader.peer_id, b.peer_id, c.peer_id]
    followers = {me.peer_id: (me, _entry(me, 11)) for me in (b, c)}
    averagers = {p: _averager_of(me, leader, certified, e) for p, (me, e) in followers.items()}
    for _ in range(20):
        phantom = SigningKey.generate()  # free: never joined, never certified
        members = [leader.peer_id, b.peer_id, c.peer_id, phantom.peer_id]
        gathered = {leader.peer_id: _entry(leader, 11), phantom.peer_id: b"junk"}
        gathered.update({p: e for p, (_, e) in followers.items()})
        for averager in averagers.values():
            group = asyncio.run(
                averager._checked(
                    _info(members, gathered), lambda e, _signer: step_misfit(e.extra, {"step": 11})
                )
            )
            assert group is None, "a group with a member that is not admitted is still left"
            assert averager.policy.suspects.get(phantom.peer_id) is None, "the phantom takes no blame"
            assert averager.policy.refusal(leader.peer_id, as_leader=True) is not None, "its leader does"
    for averager in averagers.values():
        assert set(averager.policy.suspects._held) == {leader.peer_id}, "the book holds the leader alone"


# --- 2. two Sybils pad a laggard's group so that it suspects the honest peers ahead ------------------


def test_two_sybils_at_a_laggards_step_cannot_make_it_suspect_the_honest_peers_ahead():
    """Attack: a Sybil leader announces to an honest laggard V (step 10) a group of V, two Sybils signing
    step 10, and the fresh step-11 entries of honest B and C it received in an earlier group with them.
    Flaw: the misfits B and C were 2 of 5 (under half of ``VerifiedGroup.suspects``' count, which counts
    the Sybils the leader adds), so V suspected both honest peers ahead for 60 to 960 s and, once caught
    up, expected neither in its next round. Now a step ahead that the run's signed progress records hold
    (``step_misfit``'s ``held``) blames nobody: V is the laggard."""
    v, b, c, s1, s2 = (SigningKey.generate() for _ in range(5))
    members = [s1.peer_id, s2.peer_id, v.peer_id, b.peer_id, c.peer_id]
    gathered = {s1.peer_id: _entry(s1, 10), s2.peer_id: _entry(s2, 10), v.peer_id: _entry(v, 10),
                b.peer_id: _entry(b, 11, now=time.time() - 20), c.peer_id: _entry(c, 11, now=time.time() - 20)}  # fmt: skip
    averager = _averager_of(v, s1, members, gathered[v.peer_id])
    held = {11}  # V's view: B and C published signed progress records at step 11
    group = asyncio.run(
        averager._checked(
            _info(members, gathered), lambda e, _signer: step_misfit(e.extra, {"step": 10}, held)
        )
    )
    assert group is not None and {str(p) for p in group.peer_ids} == {s1.peer_id, s2.peer_id, v.peer_id}
    assert averager.policy.refusal(b.peer_id) is None and averager.policy.refusal(c.peer_id) is None
    # V caught up to step 11 by download; its trainer's expected group (Trainer._round's ``at_step``):
    at_step = [p for p in (b.peer_id, c.peer_id, s1.peer_id) if averager.policy.refusal(p) is None]
    assert at_step == [b.peer_id, c.peer_id, s1.peer_id], "both honest peers ahead are expected again"
    # A claim ahead that no progress record holds is still a lie, and blamed while the liars are few.
    misfit = step_misfit({"step": 12}, {"step": 10}, held)
    assert misfit is not None and misfit.blamed


# --- 4. four admitted identities hold every state upload slot of a holder, forever ------------------


def _served_state():
    """A 48 MiB state (more than the daemons buffer between two peers), its handler's name, and a state
    servicer that serves it to every requester (each a certified, unbanned member of the run here)."""
    import torch

    from swarm.training.state import encode_state, state_hash
    from swarm.training.sync import EncodedState, StateServicer, state_namespace

    tensors = {"w": torch.arange(12 << 20, dtype=torch.float32)}
    state = EncodedState(7, state_hash(7, tensors), encode_state(7, tensors, {"run_id": RUN}))

    async def provide() -> EncodedState:
        return state

    async def admit(requester: str) -> str | None:
        return None

    name = StateServicer._get_handle_name(state_namespace(RUN), "rpc_download_state")
    return tensors, state, name, StateServicer(RUN, provide, admit=admit)


@pytest.mark.timeout(120)
def test_admitted_identities_that_never_read_free_the_state_upload_slots_they_took(monkeypatch):
    """Attack: four certified Sybils each open one ``rpc_download_state`` stream to an honest holder, send
    the request, and never read the reply, to hold every upload slot. Flaw: the holder's handler blocked
    in its write with no deadline (swarm/inbound.py:BoundedServicer._pump timed only the first request),
    so 4 of 4 slots stayed held 35 s after the streams opened, and every honest requester (a joining or
    stalled peer, the coordinator's checkpoint keeper) was refused "already serves 4 state downloads".
    Now each reply must be taken within ``transfer_within_s`` of its size (shortened here): the Sybils'
    streams end, their slots free, and the honest peer downloads the state."""
    import torch
    from hivemind.p2p import P2P

    import swarm.inbound
    from protocols import averaging_pb2 as apb
    from swarm.training.sync import MAX_UPLOADS, download_state, state_namespace

    # 10 s plus a chunk at 1 Mbit/s in a run; 2 s here, so that the test does not wait for it.
    monkeypatch.setattr(swarm.inbound, "FIRST_REQUEST_TIMEOUT_S", 1.0)
    monkeypatch.setattr(swarm.inbound, "FIRST_REQUEST_MIN_BYTES_PER_S", 1 << 20)
    tensors, state, name, servicer = _served_state()

    async def scenario():
        holder = await P2P.create()
        await servicer.add_p2p_handlers(holder, namespace=state_namespace(RUN))
        maddrs = await holder.get_visible_maddrs()
        sybils = [await P2P.create(initial_peers=maddrs) for _ in range(MAX_UPLOADS)]
        honest = await P2P.create(initial_peers=maddrs)
        streams = []
        try:
            for sybil in sybils:  # one stream each: the per-requester limit is 1
                _, reader, writer = await sybil.call_binary_stream_handler(holder.peer_id, name)
                await P2P.send_protobuf(apb.StateRequest(run_id=RUN, min_step=7), writer)
                await P2P.send_protobuf(P2P.END_OF_STREAM, writer)
                streams.append((reader, writer))  # ... and never read from ``reader``
            await asyncio.sleep(1.0)
            taken = sum(servicer.uploads.values())
            started = time.monotonic()
            while servicer.uploads and time.monotonic() - started < 60:
                await asyncio.sleep(0.2)
            freed_s = time.monotonic() - started
            decoded = await download_state(honest, holder.peer_id, namespace=state_namespace(RUN), run_id=RUN,
                                           min_step=7, expected_hash=state.state_hash, max_bytes=len(state.data) * 2,
                                           timeout_s=30)  # fmt: skip
            return taken, freed_s, decoded
        finally:
            for _, writer in streams:
                writer.close()
            for p in (*sybils, honest, holder):
                await p.shutdown()

    taken, freed_s, decoded = asyncio.run(scenario())
    assert taken == MAX_UPLOADS, "the Sybils did take every slot"
    assert freed_s < 30, f"their slots stayed held {freed_s:.0f}s"
    assert decoded.step == 7 and torch.equal(decoded.tensors["w"], tensors["w"])


def test_phantom_members_cannot_flush_a_real_withholder_out_of_a_followers_suspect_book():
    """Attack: as in the phantom test above, a Sybil leader breaks groups by listing a fresh uncertified
    key each time, to push a real offender W (avoided on its third strike: 240 s) out of the follower's
    suspect book, which forgets its oldest entry at ``MAX_SUSPECTS``. Flaw: each broken group put one
    phantom in the book (swarm/averaging/groups.py:check_group named it), so after 4,096 of them W was
    followed again and its next offence counted as a first one. Now each break blames the one leader.
    (A reducer's missed rounds are kept in a book of their own, ``missed``, which phantoms never reach.)"""
    from swarm.averaging.policy import MAX_SUSPECTS

    leader, b, w = (SigningKey.generate() for _ in range(3))
    my_entry = _entry(b, 11)
    averager = _averager_of(b, leader, [leader.peer_id, b.peer_id, w.peer_id], my_entry)
    policy = averager.policy
    for _ in range(3):  # W offended three times in a row: 60 s, 120 s, then 240 s
        held = policy.suspects.get(w.peer_id)
        if held is not None:  # let its avoid period end, within the repeat window
            policy.suspects._held[w.peer_id] = held.__class__(
                time.monotonic() - 1, held.reason, False, held.strikes
            )
        policy.suspect(w.peer_id, "sent a contribution other than its public batch seeds give")
    assert policy.suspects.get(w.peer_id).strikes == 3 and policy.refusal(w.peer_id) is not None
    fits = lambda e, _signer: step_misfit(e.extra, {"step": 11})  # noqa: E731
    leader_entry = _entry(leader, 11)

    async def flood():
        for _ in range(MAX_SUSPECTS):
            phantom = SigningKey.generate()  # never certified; its "entry" is junk
            members = [leader.peer_id, b.peer_id, phantom.peer_id]
            info = _info(
                members, {leader.peer_id: leader_entry, b.peer_id: my_entry, phantom.peer_id: b"junk"}
            )
            assert await averager._checked(info, fits) is None

    asyncio.run(flood())
    assert policy.refusal(w.peer_id) is not None, "the withholder is still avoided"
    assert policy.suspects.get(w.peer_id).strikes == 3, "and its strikes are kept"
    assert policy.refusal(leader.peer_id, as_leader=True) is not None
    assert len(policy.suspects) == 2, "the book holds the withholder and the leader"


# --- Sybil-on-Sybil convictions and the published ban list ------------------------------------------


@pytest.mark.timeout(300)
def test_convictions_fabricated_among_sybils_cannot_push_a_real_cheaters_conviction_off_the_ban_list(
    tmp_path: Path,
):
    """Attack: Sybils make up rounds among themselves (no honest peer, no network round) in which one
    Sybil reducer shifts its aggregate and another files the true evidence: each is a real conviction.
    Flaw (coordinator/banlist.py:enforced_bans_sync): the list ranked convictions newest first, so
    ``MAX_BANNED`` (25,600) of them within a real cheater's certificate lifetime pushed its conviction off
    the signed list every peer enforces (25,600 joins: 8 addresses at the default challenge rate for an
    hour). Now a conviction ranks by how many earlier ones its accuser's address brought: the flock's
    convictions from 8 addresses rank behind a conviction from any other address."""
    from test_sybil_coordinator import admitted, serving, true_accusation

    from coordinator.limits import ServiceLimits
    from swarm.bans import MAX_BANNED

    flock = [f"10.0.{i}.0/24" for i in range(8)]  # the Sybils' addresses, as ``caller_key`` names them

    async def scenario():
        async with serving(tmp_path, ServiceLimits()) as (address, store, service):
            accuser, cheater, third, s_accuser, s_third, *s_reducers = await admitted(address, 8)
            for s in s_reducers:  # made-up rounds of three Sybils, convicted through the service first
                answer = await true_accusation(address, service, s_accuser, s, s_third)
                assert answer.banned_peer == s.peer_id and "differs" in answer.verdict
            # The rest of the flock, as the service records a conviction from each of its addresses.
            await store._run(lambda db: db.execute("PRAGMA synchronous=OFF"))
            for i in range(MAX_BANNED):
                await store.ban(SigningKey.generate().peer_id, "part 1 chunk 0: differs from the rule's result",
                                b"evidence", max_stored_evidence_bytes=0, accuser_address=flock[i % 8])  # fmt: skip
            # The real cheat comes last, filed from the honest accuser's own address (a loopback one here).
            answer = await true_accusation(address, service, accuser, cheater, third)
            assert answer.banned_peer == cheater.peer_id
            listed = await store.enforced_bans(time.time(), grace_s=600)
            return listed, await store.get_peer(cheater.peer_id)

    listed, cheater_row = asyncio.run(scenario())
    assert len(listed) > MAX_BANNED
    assert cheater_row.peer_id in listed[:MAX_BANNED], "what coordinator/node.py:_publish_bans signs"
    assert cheater_row.cert_expires_at > time.time() + 300, "while its certificate is valid"


# --- a second read, of the fixes above ------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_an_accomplice_reaccusing_a_convicted_cheater_from_a_crowded_address_cannot_move_its_ban(
    tmp_path: Path,
):
    """Attack: after an honest member H convicts cheater C, C's accomplice S (a member of the same round,
    holding the same signed evidence) files the same true accusation again from an address X whose Sybils
    already convicted each other MAX_BANNED times. Flaw (coordinator/banlist.py:ban_sync): the re-judged ban
    replaced C's row, so C ranked as X's newest conviction and fell off the signed list while its
    certificate was valid. Now a ban keeps its first conviction's time and address."""
    from helpers import relay_from
    from test_byzantine import RUN as BYZ_RUN
    from test_byzantine import signed_round
    from test_sybil_coordinator import admitted, serving, true_accusation

    from coordinator.limits import ServiceLimits
    from swarm.bans import MAX_BANNED
    from swarm.coordinator_client import CoordinatorClient

    crowded = "127.0.0.2"  # the accomplices' address, as ``caller_key`` names it

    async def scenario():
        async with serving(tmp_path, ServiceLimits()) as (address, store, service):
            honest, cheater, accomplice = await admitted(address, 3)
            await store._run(lambda db: db.execute("PRAGMA synchronous=OFF"))
            for _ in range(MAX_BANNED):  # the flock's made-up rounds, convicted from the crowded address
                await store.ban(SigningKey.generate().peer_id, "part 1 chunk 0: differs from the rule's result",
                                b"evidence", max_stored_evidence_bytes=0, accuser_address=crowded)  # fmt: skip
            answer = await true_accusation(address, service, honest, cheater, accomplice)
            assert answer.banned_peer == cheater.peer_id
            host, port = address.rsplit(":", 1)
            relay = await relay_from(crowded, (host, int(port)))
            try:
                vector = service._layouts[BYZ_RUN.replace(".", "_")]
                evidence = signed_round(
                    [honest, cheater, accomplice], shift=0.5, part=1, vector=vector
                ).to_bytes()
                async with CoordinatorClient(
                    f"127.0.0.1:{relay.sockets[0].getsockname()[1]}", timeout_s=30
                ) as c:
                    await c.accuse(
                        accomplice, BYZ_RUN, accused=cheater.peer_id, reason="shifted", evidence=evidence
                    )
            finally:
                relay.close()
            return await store.enforced_bans(time.time(), grace_s=600), await store.get_peer(cheater.peer_id)

    after, cheater_row = asyncio.run(scenario())
    assert cheater_row.peer_id in after[:MAX_BANNED], "H's conviction keeps its place on the signed list"


def test_a_member_gone_from_a_followers_view_neither_breaks_an_honest_leaders_group_nor_blames_it(
    monkeypatch,
):
    """Attack: Sybil M announces its member record, stops announcing (the record drops out of the DHT),
    pokes honest follower F into re-reading the members, and joins honest leader L's group, whose cache
    still admits it. Flaw: check_group judged membership from F's view of the DHT, so F left and blamed
    L: repeated, F avoided L as a leader for 960 s while following Sybil leaders. Now each entry carries its
    member's coordinator certificate, checked offline: F keeps M in the round and blames nobody; a listed
    key with no valid certificate (a phantom) is excluded by every member alike and the round goes on."""
    import swarm.averaging.policy as policy_module
    from protocols.certificates import issue_certificate

    coordinator = SigningKey.generate()
    leader, follower, m = (SigningKey.generate() for _ in range(3))
    announced = {p.peer_id for p in (leader, follower, m)}

    async def fetch_members(_dht, _run_id, _key):
        return {p: SimpleNamespace(expires_at=time.time() + 600) for p in announced}

    monkeypatch.setattr(policy_module, "fetch_members", fetch_members)

    def certified_entry(key: SigningKey) -> bytes:
        certificate = issue_certificate(
            coordinator, public_key=key.public_key, run_id=RUN, role="data", name="m", serial=1, ttl_s=600
        ).encoded
        body = {"schema_hash": SCHEMA, "weight": 8.0, "commit": os.urandom(32), "data": None,
                "extra": {"step": 11, "state_hash": H_OLD}, "certificate": certificate}  # fmt: skip
        return seal(key, GROUP_ENTRY, PREFIX, body)

    my_entry = certified_entry(follower)
    averager = _averager_of(follower, leader, [], my_entry)
    averager.policy = PeerPolicy(object(), RUN, coordinator_key=coordinator.public_key, refresh_s=0.0)

    async def scenario():
        await averager.policy.refresh_members()
        announced.discard(m.peer_id)  # M stops announcing
        assert await averager.policy.admission(SigningKey.generate().peer_id) is not None  # the poke
        members = [leader.peer_id, follower.peer_id, m.peer_id]
        gathered = {
            leader.peer_id: certified_entry(leader),
            follower.peer_id: my_entry,
            m.peer_id: certified_entry(m),
        }
        kept = await averager._checked(
            _info(members, gathered), lambda e, _signer: step_misfit(e.extra, {"step": 11})
        )
        phantom = SigningKey.generate()
        members.append(phantom.peer_id)
        gathered[phantom.peer_id] = _entry(phantom, 11)  # signed by its key, but no certificate
        without = await averager._checked(
            _info(members, gathered), lambda e, _signer: step_misfit(e.extra, {"step": 11})
        )
        return kept, without, phantom

    kept, without, phantom = asyncio.run(scenario())
    assert kept is not None and len(kept.peer_ids) == 3, "M's entry proves its membership"
    assert without is not None and phantom.peer_id not in {str(p) for p in without.peer_ids}
    assert len(averager.policy.suspects) == 0, "nobody is blamed: no listed member lacked what it needed"


def test_a_member_banned_moments_ago_breaks_the_group_blaming_nobody_and_an_old_ban_blames_the_leader():
    """A leader reads the coordinator's ban list at its own pace: a member banned moments ago in the
    follower's view is no proof against the leader (the second review's race, through a Sybil that gets
    itself banned). The follower leaves the group and blames nobody; once it has held the ban for
    BAN_GRACE_S, a leader that still lists the banned peer is at fault."""
    from swarm.averaging import policy as policy_module

    leader, b, banned = (SigningKey.generate() for _ in range(3))
    members = [leader.peer_id, b.peer_id, banned.peer_id]
    my_entry = _entry(b, 11)
    averager = _averager_of(b, leader, members, my_entry)
    gathered = {leader.peer_id: _entry(leader, 11), b.peer_id: my_entry, banned.peer_id: _entry(banned, 11)}
    averager.policy.set_bans({banned.peer_id}, issued_at=1.0)
    fits = lambda e, _signer: step_misfit(e.extra, {"step": 11})  # noqa: E731
    assert asyncio.run(averager._checked(_info(members, gathered), fits)) is None
    assert len(averager.policy.suspects) == 0, "a fresh ban blames nobody"
    averager.policy._banned_since[banned.peer_id] -= policy_module.BAN_GRACE_S + 1
    assert asyncio.run(averager._checked(_info(members, gathered), fits)) is None
    assert averager.policy.refusal(leader.peer_id, as_leader=True) is not None, "an old one blames the leader"


class _SharedUplink:
    """A TCP relay in front of a holder whose holder-to-caller bytes all share one ``rate`` (bytes/s): the
    holder's uplink, as every stream it serves sees it."""

    def __init__(self, target: tuple[str, int], rate: float):
        self.target, self.rate, self._free_at = target, rate, 0.0
        self.server: asyncio.Server | None = None

    async def _pace(self, n: int) -> None:
        loop = asyncio.get_running_loop()
        start = max(loop.time(), self._free_at)
        self._free_at = start + n / self.rate
        await asyncio.sleep(self._free_at - loop.time())

    async def _pipe(self, reader, writer, paced: bool) -> None:
        import contextlib

        with contextlib.suppress(OSError, ConnectionError):
            while data := await reader.read(16 << 10):
                if paced:
                    await self._pace(len(data))
                writer.write(data)
                await writer.drain()
        writer.close()

    async def _handle(self, reader, writer) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self.target)
        await asyncio.gather(self._pipe(reader, up_writer, False), self._pipe(up_reader, writer, True))

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]


@pytest.mark.timeout(120)
def test_an_honest_joiner_downloads_from_a_holder_whose_slow_uplink_three_others_share(monkeypatch):
    """Attack: three certified Sybils download the state at full speed, one stream each, from an honest
    holder on the 1 Mbit/s uplink the deadlines count on, so an honest joiner gets a quarter of it. Flaw:
    each reply's deadline allowed one message on a whole 1 Mbit/s link (swarm/inbound.py:_pump), so the
    joiner's stream was cut after 1 MiB. Now the state servicer's replies allow for the MAX_UPLOADS
    streams that share the uplink (``reply_sharers``). Scaled 67x: uplink and minimum rate 8 MiB/s."""
    import torch
    from hivemind.p2p import P2P

    import swarm.inbound
    from protocols import averaging_pb2 as apb
    from swarm.training.sync import download_state, state_namespace

    rate = float(8 << 20)  # the holder's uplink, which is also the minimum the deadlines assume
    monkeypatch.setattr(swarm.inbound, "FIRST_REQUEST_MIN_BYTES_PER_S", rate)
    monkeypatch.setattr(swarm.inbound, "FIRST_REQUEST_TIMEOUT_S", 10.0 * 125_000 / rate)
    tensors, state, name, servicer = _served_state()

    async def drain(p2p, holder) -> None:
        """A Sybil's download, read as fast as the uplink gives it; again when it ends."""
        while True:
            try:
                _, reader, writer = await p2p.call_binary_stream_handler(holder.peer_id, name)
                await P2P.send_protobuf(apb.StateRequest(run_id=RUN, min_step=7), writer)
                await P2P.send_protobuf(P2P.END_OF_STREAM, writer)
                while await P2P.receive_protobuf(apb.StateChunk, reader) is not None:
                    pass
            except Exception:
                await asyncio.sleep(0.05)

    async def scenario():
        holder = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        await servicer.add_p2p_handlers(holder, namespace=state_namespace(RUN))
        maddr = str((await holder.get_visible_maddrs())[0])
        uplink = _SharedUplink(("127.0.0.1", int(maddr.split("/tcp/")[1].split("/")[0])), rate)
        via = f"/ip4/127.0.0.1/tcp/{await uplink.start()}/p2p/{holder.peer_id}"
        joiner = await P2P.create(initial_peers=[via])
        sybils = [await P2P.create(initial_peers=[via]) for _ in range(3)]
        tasks = [asyncio.create_task(drain(s, holder)) for s in sybils]
        try:
            await asyncio.sleep(1.0)
            return await download_state(joiner, holder.peer_id, namespace=state_namespace(RUN), run_id=RUN,
                                        min_step=7, expected_hash=state.state_hash, max_bytes=len(state.data) * 2,
                                        timeout_s=60)  # fmt: skip
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            uplink.server.close()
            for p in (*sybils, joiner, holder):
                await p.shutdown()

    decoded = asyncio.run(scenario())
    assert decoded.step == 7 and torch.equal(decoded.tensors["w"], tensors["w"]), "the joiner gets the state"
