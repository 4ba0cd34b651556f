"""What an attacker that has read ``PeerPolicy``'s kept certificates (``certified``, ``certificate_refusal``,
``MAX_CERTIFIED_KEPT``) could do with them, and what it can do now."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

import swarm.averaging.policy as policy_module
from protocols.certificates import issue_certificate
from protocols.keys import PublicKey, SigningKey
from swarm.averaging.policy import MAX_CERTIFIED_KEPT, PeerPolicy
from swarm.records import check_record_certificate

pytestmark = pytest.mark.timeout(60)

RUN = "member-view-redteam"


def _certificate(coordinator: SigningKey, peer: SigningKey, *, ttl_s: float = 600) -> bytes:
    return issue_certificate(
        coordinator, public_key=peer.public_key, run_id=RUN, role="data", name="p", serial=1, ttl_s=ttl_s
    ).encoded


def test_a_members_entry_checked_again_verifies_no_signature_on_its_certificate_again(
    monkeypatch,
):
    """Attack: an admitted peer gets its signed entry checked as often as it can: in every group it joins
    and, up to ``MAX_TIER_MEMBERS`` entries at a time, in every second-tier answer a peer checks
    (``TierCheck``: one identity's entry repeated, since duplicates are refused only after the loop).
    Flaw (``PeerPolicy.certificate_refusal``): after the cached check (``check_record_certificate``, whose
    signature check runs once per certificate) it verifies the same certificate again with
    ``verify_certificate``, uncached, to learn its expiry. Gain: each entry check costs one full Ed25519
    verification more than the same certificate costs in a DHT record: a group check's signature work
    doubles (entry + certificate), a second-tier answer's grows by half (two opens of the entry + certificate).
    Now the cached check returns the certificate it verified, and its expiry is read from that.
    """
    coordinator, member = SigningKey.generate(), SigningKey.generate()
    certificate = _certificate(coordinator, member)
    policy = PeerPolicy(None, RUN, coordinator_key=coordinator.public_key)
    assert policy.certificate_refusal(member.peer_id, certificate) is None  # the first check: cache warm

    verified = {"n": 0}
    verify = PublicKey.verify

    def counting(self, signature: bytes, data: bytes) -> None:
        verified["n"] += 1
        return verify(self, signature, data)

    monkeypatch.setattr(PublicKey, "verify", counting)
    now = time.time()
    for _ in range(10):  # the same certificate in ten DHT records: no signature verified again
        check_record_certificate(
            certificate, coordinator.public_key, RUN, peer_id=member.peer_id, expires_at=now, now=now
        )
    assert verified["n"] == 0
    for _ in range(10):  # the same certificate in ten checked entries: none verified again either
        assert policy.certificate_refusal(member.peer_id, certificate) is None
    assert verified["n"] == 0


def test_admitted_identities_that_fill_the_kept_certificates_do_not_push_out_a_new_groupmate(
    monkeypatch,
):
    """Attack: ``MAX_CERTIFIED_KEPT`` (65,536) identities admitted at once (open admission: one challenge a
    second per IPv4 address or IPv6 /64, so a /48 or 19 addresses mint them within a certificate's hour;
    renewals then come with heartbeats) show their certificates to a peer: member records rotated through
    the DHT's 4,096 per dictionary (kept entries accumulate across reads), or signed entries in groups
    and second-tier answers (``TierCheck`` certifies each entry's sender before checking its step). Flaw
    (``PeerPolicy._certify``): a full map refuses every new peer and evicts none, and the attacker keeps
    its own entries alive by renewing. Gain: every honest peer that joins afterwards gets nothing from the
    kept certificates: a representative whose read misses it refuses its second-tier requests as not a
    certified member again, as before the map existed (the stall it was added against). Now the least
    recently verified certificate makes room: a groupmate checked in this round is kept."""
    coordinator, newcomer = SigningKey.generate(), SigningKey.generate()
    sybils = {f"sybil-{i}": SimpleNamespace(expires_at=time.time() + 3600) for i in range(MAX_CERTIFIED_KEPT)}
    read = {"members": sybils}

    async def fetch_members(_dht, _run_id, _key):
        return dict(read["members"])

    monkeypatch.setattr(policy_module, "fetch_members", fetch_members)
    policy = PeerPolicy(object(), RUN, coordinator_key=coordinator.public_key, refresh_s=0.0)

    async def scenario():
        await policy.refresh_members()  # the Sybils' member records, each with a valid certificate
        # The newcomer's valid certificate, checked in its signed group entry, proves it a member ...
        proved = policy.certificate_refusal(newcomer.peer_id, _certificate(coordinator, newcomer))
        # ... and is kept although the next read misses the newcomer's record.
        read["members"] = {}
        return proved, await policy.admission(newcomer.peer_id, timeout_s=1.0)

    proved, admitted = asyncio.run(scenario())
    assert proved is None and admitted is None
    assert len(policy._certified_until) <= MAX_CERTIFIED_KEPT
