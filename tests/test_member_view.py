"""A peer's view of the run's certified members (``PeerPolicy.certified``): a certificate it verified, in a
read of the member records or in a groupmate's signed group entry, holds until it expires, whatever later
reads miss (a partial DHT answer under load, a refresh that timed out). In a rehearsal of 10 peers, a
representative whose view lacked its 6 honest groupmates refused their requests for the step's second-tier
result as "not a certified member of run", so they applied nothing while it moved a step ahead, and the 7
honest peers, which the run's floor needed together, never formed a group again."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

import swarm.averaging.policy as policy_module
from protocols.keys import SigningKey
from swarm.averaging.policy import PeerPolicy

pytestmark = pytest.mark.timeout(60)

RUN = "member-view"


def test_a_member_missing_from_one_read_stays_certified_until_its_certificate_expires(monkeypatch):
    coordinator = SigningKey.generate()
    peers = [SigningKey.generate().peer_id for _ in range(3)]
    clock = {"now": 1_000_000.0}
    expires = clock["now"] + 600
    announced = {p: SimpleNamespace(expires_at=expires) for p in peers}

    async def fetch_members(_dht, _run_id, _key):
        return dict(announced)

    monkeypatch.setattr(policy_module, "fetch_members", fetch_members)
    monkeypatch.setattr(policy_module.time, "time", lambda: clock["now"])
    policy = PeerPolicy(object(), RUN, coordinator_key=coordinator.public_key, refresh_s=0.0)
    stranger = SigningKey.generate().peer_id

    async def scenario():
        await policy.refresh_members()
        assert all(policy.certified(p) for p in peers)
        del announced[peers[1]]  # one read misses its record
        await policy.refresh_members()
        missed = await policy.admission(peers[1], timeout_s=1.0)
        refused_stranger = await policy.admission(stranger, timeout_s=1.0)
        clock["now"] = expires + 1  # its certificate has ended
        await policy.refresh_members()
        return missed, refused_stranger, await policy.admission(peers[1], timeout_s=1.0)

    missed, refused_stranger, expired = asyncio.run(scenario())
    assert missed is None, "a certified groupmate missing from one read is still admitted"
    assert refused_stranger is not None and "not a certified member" in refused_stranger
    assert expired is not None and "not a certified member" in expired
    assert policy.member_count() == 2  # the count follows the last read alone


def test_a_banned_member_is_refused_whatever_its_certificate(monkeypatch):
    coordinator = SigningKey.generate()
    peer = SigningKey.generate().peer_id

    async def fetch_members(_dht, _run_id, _key):
        return {peer: SimpleNamespace(expires_at=time.time() + 600)}

    monkeypatch.setattr(policy_module, "fetch_members", fetch_members)
    policy = PeerPolicy(object(), RUN, coordinator_key=coordinator.public_key, refresh_s=0.0)
    asyncio.run(policy.refresh_members())
    policy.set_bans([peer], issued_at=time.time())
    assert asyncio.run(policy.admission(peer, timeout_s=1.0)) == "banned by the coordinator"


def test_a_groupmate_whose_entry_carried_a_valid_certificate_is_certified_without_a_read(monkeypatch):
    """A peer whose reads of the member records never showed a groupmate (they timed out under load, or
    came back partial) still verified the groupmate's coordinator certificate in its signed group entry:
    the groupmate's requests after the round (the second tier's result, the inputs behind a part) are a
    member's. A forged certificate certifies nobody."""
    from protocols.certificates import issue_certificate

    coordinator = SigningKey.generate()
    mate = SigningKey.generate()

    async def fetch_members(_dht, _run_id, _key):
        return {}  # every read misses it

    monkeypatch.setattr(policy_module, "fetch_members", fetch_members)
    policy = PeerPolicy(object(), RUN, coordinator_key=coordinator.public_key, refresh_s=0.0)

    def certificate(issuer: SigningKey) -> bytes:
        return issue_certificate(
            issuer, public_key=mate.public_key, run_id=RUN, role="data", name="m", serial=1, ttl_s=600
        ).encoded

    assert policy.certificate_refusal(mate.peer_id, certificate(SigningKey.generate())) is not None  # forged
    assert asyncio.run(policy.admission(mate.peer_id, timeout_s=1.0)) is not None
    assert policy.certificate_refusal(mate.peer_id, certificate(coordinator)) is None  # in its group entry
    assert asyncio.run(policy.admission(mate.peer_id, timeout_s=1.0)) is None
