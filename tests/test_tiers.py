"""The second tier's decision logic in-process: who represents a group, what a member checks in its
representative's hand-off (``TierCheck``), and who may ask for it (``TierBoard``). The real round, with real
peers, is ``tests/test_sim.py::test_two_groups_of_a_step_apply_one_update_through_the_second_tier``."""

from __future__ import annotations

import asyncio
import hashlib
import os
import time

import pytest
import torch

from protocols import averaging_pb2 as apb
from protocols.errors import ProtocolError
from protocols.keys import SigningKey
from swarm.averaging.compression import get_codec
from swarm.averaging.evidence import (
    aggregate_message,
    chunk_bounds,
    input_entries,
    layout_chunk_values,
    reducer_mask,
    round_digest,
    split_bounds,
)
from swarm.averaging.groups import GroupEntryBody, make_entry
from swarm.averaging.tiercert import certificate, certificate_misfit, result_digest, sign_attestation
from swarm.averaging.tiers import (
    MEMBER_WAIT_TIMEOUTS,
    ROUND_ROOM_TIMEOUTS,
    TIER_COMPRESSION,
    TierCheck,
    TierOutcome,
    covered_peers,
    covers,
    only_group,
    representative,
    second_window_s,
    tier_prefix,
)
from swarm.averaging.tierserve import TierBoard

PREFIX = tier_prefix("run").replace(".", "_")
SCHEMA = hashlib.sha256(b"schema").digest()
NUMEL = 300
CODEC = get_codec(TIER_COMPRESSION)


MINE = {"step": 3, "state_hash": "ab" * 32}


def certified(key: SigningKey, weight: float, result: torch.Tensor, *, signers: int = 2, mine=MINE) -> dict:
    """The certificate a representative ``key`` carries for a first-tier group of 3 (itself and two others)
    whose result is ``result``: signed by ``signers`` of them (the representative first)."""
    others = [SigningKey.generate() for _ in range(2)]
    group = [key, *others]
    group_id, digest = os.urandom(20), result_digest(result)
    listed = [k.peer_id for k in group]
    signed = {
        i: sign_attestation(
            k, group_id, mine["step"], mine["state_hash"], key.peer_id, weight, digest, listed
        )
        for i, k in enumerate(group[:signers])
    }
    return certificate(group_id, listed, weight, digest, signed)


def second_tier(
    members: int = 3, *, rep: int = 0, group_input: torch.Tensor, weight: float = 64.0, rep_sends=None,
    mine=MINE, included=None,
) -> tuple[apb.TierAnswer, list[apb.PartChunk], list[SigningKey]]:  # fmt: skip
    """A second-tier round's hand-off as a representative sends it: every member signs its entry (certified
    by its group, at ``mine``'s step and state), every reducer signs its chunks over the inputs it took, the
    representative's being ``rep_sends`` (default: its group's result ``group_input``) at ``weight``;
    ``included``: the members whose inputs every chunk lists (default: all)."""
    keys = [SigningKey.generate() for _ in range(members)]
    names = [k.peer_id for k in keys]
    inputs = [torch.randn(NUMEL) for _ in range(members)]
    inputs[rep] = group_input if rep_sends is None else rep_sends
    bodies = [
        GroupEntryBody(
            schema_hash=SCHEMA,
            weight=weight,
            commit=os.urandom(32),
            extra={
                **mine,
                "group": certified(keys[i], weight, group_input if i == rep else inputs[i], mine=mine),
            },
        )  # fmt: skip
        for i in range(members)
    ]
    entries = [make_entry(k, PREFIX, b) for k, b in zip(keys, bodies, strict=True)]
    group_id = os.urandom(20)
    mask = reducer_mask([True] * members)
    digest = round_digest(PREFIX, group_id, names, [b.commit for b in bodies], mask)
    bounds = split_bounds(NUMEL, members, mask)
    values = layout_chunk_values(members, CODEC.bytes_per_value)
    listed = list(range(members)) if included is None else included
    chunks = []
    for part in range(members):
        lo_part, hi_part = bounds[part], bounds[part + 1]
        cuts = chunk_bounds(hi_part - lo_part, values)
        for chunk in range(len(cuts) - 1):
            lo, hi = lo_part + cuts[chunk], lo_part + cuts[chunk + 1]
            sent = {i: CODEC.encode_contribution(inputs[i][lo:hi]) for i in listed}
            entries_in = input_entries([(i, weight, sent[i]) for i in listed])
            data = CODEC.encode(torch.stack([inputs[i][lo:hi] for i in listed]).mean(0))
            at_ms = int(time.time() * 1000)
            signature = keys[part].sign(
                aggregate_message(digest, part, chunk, names[part], entries_in, data, at_ms)
            )
            chunks.append(
                apb.PartChunk(
                    part_index=part,
                    chunk_index=chunk,
                    data=data,
                    signature=signature,
                    included=entries_in,
                    signed_at_ms=at_ms,
                )  # fmt: skip
            )
    header = apb.TierAnswer(
        tier_group_id=group_id, entries=entries, representative=rep, signers=list(range(members))
    )
    return header, chunks, keys


def tier_check(header, group_input, *, representative_id, weight=64.0, mine=MINE, refusal=None) -> TierCheck:
    return TierCheck(
        header, prefix=PREFIX, schema_hash=SCHEMA, numel=NUMEL, mine=mine, representative=representative_id,
        contribution=group_input, weight=weight, max_age_s=60.0, certify=None, refusal=refusal,
    )  # fmt: skip


def check_all(header, chunks, group_input, keys, *, weight=64.0, mine=MINE):
    check = tier_check(
        header, group_input, representative_id=keys[header.representative].peer_id, weight=weight, mine=mine
    )
    expected = list(check.expected())
    assert len(expected) == len(chunks)
    for (part, chunk), message in zip(expected, chunks, strict=True):
        check.take(part, chunk, message)
    return check.output


def test_a_member_decodes_exactly_the_bytes_the_second_tier_signed():
    group_input = torch.randn(NUMEL)
    header, chunks, keys = second_tier(group_input=group_input)
    output = check_all(header, chunks, group_input, keys)
    decoded = torch.cat([CODEC.decode(c.data, len(c.data) // 2, sender="reducer") for c in chunks])  # fp16
    assert torch.equal(output, decoded), "what every representative decoded, bit for bit"


def test_a_representative_that_passed_off_another_input_for_its_group_is_caught():
    group_input = torch.randn(NUMEL)
    header, chunks, keys = second_tier(group_input=group_input, rep_sends=group_input * 10)
    with pytest.raises(ProtocolError, match="never sent"):
        check_all(header, chunks, group_input, keys)


def test_a_representative_that_claimed_another_weight_for_its_group_is_caught():
    group_input = torch.randn(NUMEL)
    header, chunks, keys = second_tier(group_input=group_input, weight=640.0)
    with pytest.raises(ProtocolError, match="never sent"):
        check_all(header, chunks, group_input, keys, weight=64.0)


def test_a_result_altered_on_its_way_is_caught_naming_the_chunk():
    group_input = torch.randn(NUMEL)
    header, chunks, keys = second_tier(group_input=group_input)
    chunks[1].data = CODEC.encode(torch.zeros(len(chunks[1].data) // 2))
    with pytest.raises(ProtocolError, match=r"part \d+ chunk \d+"):
        check_all(header, chunks, group_input, keys)


def test_a_result_that_leaves_the_members_group_out_is_refused():
    group_input = torch.randn(NUMEL)
    header, chunks, keys = second_tier(group_input=group_input, included=[1, 2])
    with pytest.raises(ProtocolError, match="leaves out the input of this peer's group"):
        check_all(header, chunks, group_input, keys)


def test_a_round_of_another_step_or_state_is_refused():
    group_input = torch.randn(NUMEL)
    header, chunks, keys = second_tier(
        group_input=group_input, mine={"step": 2, "state_hash": MINE["state_hash"]}
    )
    with pytest.raises(ProtocolError, match="another step or state"):
        check_all(header, chunks, group_input, keys)


def test_a_hand_off_naming_a_substitute_or_another_representative_is_refused():
    group_input = torch.randn(NUMEL)
    header, chunks, keys = second_tier(group_input=group_input)
    substituted = apb.TierAnswer()
    substituted.CopyFrom(header)
    substituted.signers[1] = 0
    with pytest.raises(ProtocolError, match="other than a part's own reducer"):
        tier_check(substituted, group_input, representative_id=keys[0].peer_id)
    with pytest.raises(ProtocolError, match="names member 0"):
        tier_check(header, group_input, representative_id=keys[1].peer_id)


def test_entries_signed_for_another_prefix_or_listed_twice_are_refused():
    group_input = torch.randn(NUMEL)
    header, _, keys = second_tier(group_input=group_input)
    with pytest.raises(ProtocolError, match="is for run .run_tier2., expected .other_tier2."):
        TierCheck(header, prefix="other_tier2", schema_hash=SCHEMA, numel=NUMEL, mine=MINE,
                  representative=keys[0].peer_id, contribution=group_input, weight=64.0, max_age_s=60.0,
                  certify=None, refusal=None)  # fmt: skip
    twice = apb.TierAnswer()
    twice.CopyFrom(header)
    twice.entries[1] = header.entries[0]
    with pytest.raises(ProtocolError, match="twice"):
        tier_check(twice, group_input, representative_id=keys[0].peer_id)
    with pytest.raises(ProtocolError, match="proves no admission"):
        TierCheck(header, prefix=PREFIX, schema_hash=SCHEMA, numel=NUMEL, mine=MINE,
                  representative=keys[0].peer_id, contribution=group_input, weight=64.0, max_age_s=60.0,
                  certify=lambda peer, cert: "no certificate", refusal=None)  # fmt: skip


def test_a_group_certificate_needs_a_majority_of_admitted_members_and_names_its_representative():
    key, result = SigningKey.generate(), torch.randn(NUMEL)

    def misfit(extra, signer=key.peer_id, refusal=None):
        return certificate_misfit(
            extra, signer=signer, step=MINE["step"], state_hash=MINE["state_hash"], refusal=refusal
        )

    good = {**MINE, "group": certified(key, 64.0, result)}
    assert misfit(good) is None
    assert "not a majority" in misfit({**MINE, "group": certified(key, 64.0, result, signers=1)})
    assert "not in" in misfit(good, signer=SigningKey.generate().peer_id), "a Sybil cannot carry another's"
    other_member = good["group"]["members"][1]
    refused = misfit(good, refusal=lambda peer: "banned" if peer == other_member else None)
    assert "not a majority" in refused, "a banned member's signature does not count"
    assert "does not hold" in misfit({**MINE, "group": {**good["group"], "weight": 640.0}})
    assert "no group certificate" in misfit(dict(MINE))
    small = certificate_misfit(
        good,
        signer=key.peer_id,
        step=MINE["step"],
        state_hash=MINE["state_hash"],
        refusal=None,
        min_members=4,
    )
    assert "not 4 to 1,024" in small, "a group smaller than the run's minimum is no group"
    at_other_step = certificate_misfit(
        good, signer=key.peer_id, step=4, state_hash=MINE["state_hash"], refusal=None
    )
    assert "does not hold" in at_other_step


def test_every_member_names_the_same_dialable_representative():
    names = [SigningKey.generate().peer_id for _ in range(6)]
    commitments = [os.urandom(32) for _ in names]
    chosen = names[representative(commitments, names, None)]
    dialable = [name != chosen for name in names]
    assert names[representative(commitments, names, dialable)] != chosen, "one behind NAT never represents"
    assert names[representative(commitments, names, None)] == chosen, "the same inputs, the same choice"


def test_a_group_skips_the_second_tier_only_when_no_other_group_can_exist():
    # 3 of 4 peers, the fourth alone at the step (a straggler, or an attacker that every group avoids): it
    # can form no group, so the group applies its own result instead of three second-tier searches a step.
    assert only_group(3, peers_at_step=4, run_peers=4, min_group_size=1)
    assert only_group(3, peers_at_step=4, run_peers=4, min_group_size=3)
    # Two more peers could form a group of 2, not of the run's minimum of 3.
    assert not only_group(3, peers_at_step=5, run_peers=5, min_group_size=2)
    assert only_group(4, peers_at_step=6, run_peers=6, min_group_size=3)
    # However few the others at its step, a group that holds no majority of the run's members is not alone:
    # another group may hold peers whose records this one has not seen.
    assert not only_group(2, peers_at_step=2, run_peers=4, min_group_size=1)
    assert not only_group(3, peers_at_step=3, run_peers=6, min_group_size=1)
    assert only_group(64, peers_at_step=64, run_peers=64, min_group_size=1)


def test_the_second_tiers_window_waits_for_later_groups_and_leaves_room_for_the_round_and_hand_off():
    # The run's defaults: T = 30 s. Members wait 4T from the end of their first tier; the window lasts
    # until 2T of that wait is left, so a representative that starts at once waits up to 60 s for groups
    # that end their first tier later, one that attested for 50 s waits 10 s, and none less than the run's.
    assert (MEMBER_WAIT_TIMEOUTS, ROUND_ROOM_TIMEOUTS) == (4, 2)
    assert second_window_s(run_window_s=4.0, waited_s=0.0, averaging_timeout_s=30.0) == 60.0
    assert second_window_s(run_window_s=4.0, waited_s=50.0, averaging_timeout_s=30.0) == 10.0
    assert second_window_s(run_window_s=4.0, waited_s=59.0, averaging_timeout_s=30.0) == 4.0


def test_a_second_tier_search_closes_only_once_its_groups_hold_every_peer_at_the_step():
    here = {"a", "b", "c", "d", "e"}
    assert covers(here, {"a", "b", "c", "d", "e"})
    assert not covers(here, {"a", "b", "c"}), "the group of d and e has not joined"
    # One peer in no group cannot form one of its own (everyone else is in the second tier): not waited for.
    assert covers(here, {"a", "b", "c", "d"}) and covers(here, {"a", "b", "c", "d"}, fewest=1)
    # With groups of at least 3, two peers in no group cannot form one either.
    assert not covers(here, {"a", "b"}, fewest=3) and covers(here, {"a", "b", "c"}, fewest=3)
    # Peers no record shows at the step (a lagging record) may be in a group: more members never hurt.
    assert covers({"a", "b"}, {"a", "b", "x"})
    # Records of peers that never join a group (Sybils, or peers gone) hold the window only beyond 5%: one
    # of 40 does not, three of 40 do.
    forty = [f"p{i}" for i in range(40)]
    assert covers(forty, set(forty[:39]))
    assert not covers(forty, set(forty[:37]))


def test_a_certificate_covers_its_listed_members_only_with_a_majority_of_fresh_admitted_signers():
    def group(members: list[str], signed: list[int]) -> dict:
        return {"members": members, "signed": [[i, b"s" * 64] for i in signed]}

    admitted = {"s1", "s2", "s3", "h1", "h2", "h3", "h4"}
    counts = admitted.__contains__
    honest = group(["h1", "h2", "h3", "h4"], [0, 1, 2])
    assert covered_peers([honest], counts) == {"h1", "h2", "h3", "h4"}, "a majority signed: all of it counts"
    # One admitted identity and two throwaway keys nobody admitted list two honest peers of another group.
    throwaway = group(["s1", "t1", "t2", "h5", "h6"], [0, 1, 2])
    assert covered_peers([throwaway], counts) == set()
    # Signers count once a step: three Sybils cannot vouch for different honest peers in two certificates.
    first, second = (
        group(["s1", "s2", "s3", "h5", "h6"], [0, 1, 2]),
        group(["s1", "s2", "s3", "h7"], [0, 1, 2]),
    )
    assert covered_peers([first, second], counts) == {"s1", "s2", "s3", "h5", "h6"}
    assert covered_peers([group(["s1", "h5", "h6"], [0])], counts) == set(), "one of three is no majority"


def test_a_followers_entry_counts_toward_closing_the_window_only_if_it_opens_under_its_own_key():
    from types import SimpleNamespace

    from hivemind.p2p import PeerID

    from swarm.averaging.matchmaking import closing_rule

    keys = [SigningKey.generate() for _ in range(3)]

    def entry(key: SigningKey) -> bytes:
        return make_entry(key, PREFIX, GroupEntryBody(schema_hash=bytes(32), weight=1.0, commit=bytes(32)))

    seen: list[set[str]] = []
    full = closing_rule(
        lambda claims: seen.append(set(claims)) or len(claims) >= 2, prefix=PREFIX, schema_hash=bytes(32),
        signed=True, max_age_s=60.0, limit=64,
    )  # fmt: skip
    followers = {
        PeerID.from_base58(keys[0].peer_id): SimpleNamespace(gather=entry(keys[0])),
        PeerID.from_base58(keys[1].peer_id): SimpleNamespace(gather=entry(keys[2])),  # signed by another
    }
    assert not full(followers) and seen[-1] == {keys[0].peer_id}
    followers[PeerID.from_base58(keys[2].peer_id)] = SimpleNamespace(gather=b"not an entry")
    assert not full(followers) and seen[-1] == {keys[0].peer_id}
    followers[PeerID.from_base58(keys[2].peer_id)] = SimpleNamespace(gather=entry(keys[2]))
    assert not full(followers), "a follower is judged by the entry it first joined with in this search"


def _group(
    keys: list[SigningKey], rep: int, *, signers: list[int], listed: list[str] = (), mine=MINE
) -> dict:
    """A certificate of ``keys``' group (plus ``listed`` peers) for ``keys[rep]``, signed by ``signers``."""
    group_id, members = os.urandom(20), [k.peer_id for k in keys] + list(listed)
    facts = (group_id, mine["step"], mine["state_hash"], keys[rep].peer_id, 12.0, bytes(32), members)
    signed = {i: sign_attestation(keys[i], *facts) for i in signers}
    return certificate(group_id, members, 12.0, bytes(32), signed)


def test_a_search_closes_early_only_on_checked_certificates_and_checks_nothing_that_could_not_close_it():
    from swarm.averaging import tiercert
    from swarm.averaging.tiers import EarlyClose

    a = [SigningKey.generate() for _ in range(3)]  # another honest group
    b = [SigningKey.generate() for _ in range(3)]
    throwaway = [SigningKey.generate() for _ in range(3)]
    admitted = {k.peer_id for k in a + b}
    fitted: list[str] = []

    def fits(body, signer):
        fitted.append(signer)
        return certificate_misfit(body.extra, signer=signer, step=MINE["step"], state_hash=MINE["state_hash"],
                                  refusal=None)  # fmt: skip

    def closing(waiting):
        return EarlyClose(waiting=lambda: waiting, fits=fits, counts=admitted.__contains__, step=MINE["step"],
                          state_hash=MINE["state_hash"], min_members=2)  # fmt: skip

    def body(group):
        return GroupEntryBody(
            schema_hash=bytes(32), weight=12.0, commit=bytes(32), extra={**MINE, "group": group}
        )

    waiting = {k.peer_id for k in a + b}
    honest_a, honest_b = body(_group(a, 0, signers=[0, 1])), body(_group(b, 0, signers=[0, 1, 2]))
    # A's group alone cannot close it: nothing is checked.
    rule = closing(waiting)
    assert not rule({a[0].peer_id: honest_a}) and fitted == []
    # Both groups: checked once each, and it closes.
    assert rule({a[0].peer_id: honest_a, b[0].peer_id: honest_b}) and rule.closed
    assert sorted(fitted) == sorted([a[0].peer_id, b[0].peer_id])
    rule({a[0].peer_id: honest_a, b[0].peer_id: honest_b})
    assert len(fitted) == 2, "once per search"
    # A made-up group of throwaway keys listing B's members: its claim could close the window, but its
    # counted signers (none) are no majority, so it is never given the full check and counts for nothing.
    fitted.clear()
    made_up = body(_group(throwaway, 0, signers=[0, 1, 2], listed=[k.peer_id for k in b]))
    rule = closing(waiting)
    assert not rule({a[0].peer_id: honest_a, throwaway[0].peer_id: made_up}) and not rule.closed
    assert fitted == [a[0].peer_id]
    # Malformed claims are left out without an exception, and do not stop the others from closing it.
    broken = {**MINE, "group": {"members": "not a list", "signed": [[0]]}}
    rule = closing(waiting)
    bad = GroupEntryBody(schema_hash=bytes(32), weight=1.0, commit=bytes(32), extra=broken)
    assert rule({"x": bad, a[0].peer_id: honest_a, b[0].peer_id: honest_b})
    # A claim naming admitted signers with bad signatures costs the signatures up to the first bad one.
    calls = []
    real = tiercert.attestation_holds

    def counting(*args):
        calls.append(args[0])
        return real(*args)

    forged = _group(throwaway, 0, signers=[0, 1, 2], listed=[k.peer_id for k in b])
    forged["signed"] = [[3, bytes(64)], [4, bytes(64)], [5, bytes(64)]] + forged["signed"]
    tiercert.attestation_holds = counting
    try:
        rule = closing(waiting)
        assert not rule({a[0].peer_id: honest_a, throwaway[0].peer_id: body(forged)})
    finally:
        tiercert.attestation_holds = real
    assert (
        calls.count(b[0].peer_id) == 1
        and len([c for c in calls if c in admitted - {a[0].peer_id, a[1].peer_id}]) == 1
    )


def test_only_a_groups_members_get_its_outcome_and_only_once_it_is_posted():
    async def scenario():
        board = TierBoard()
        group_id = os.urandom(20)
        with pytest.raises(ProtocolError, match="represents no such group"):
            await board.wait(group_id, "a", b"", open_s=0.1, timeout_s=1.0)
        board.open(group_id, ["a", "b"], holds=lambda member, signature: signature == b"ok")
        with pytest.raises(ProtocolError, match="not a member"):
            await board.wait(group_id, "stranger", b"ok", open_s=0.1, timeout_s=0.2)
        with pytest.raises(asyncio.TimeoutError):
            await board.wait(group_id, "b", b"bad", open_s=0.1, timeout_s=0.2)
        assert await board.majority(group_id, timeout_s=0.1) is None, (
            "a signature that does not hold counts not"
        )
        waiting = asyncio.create_task(board.wait(group_id, "b", b"ok", open_s=0.1, timeout_s=5.0))
        board.attest(group_id, "a", b"ok")
        assert await board.majority(group_id, timeout_s=2.0) == {0: b"ok", 1: b"ok"}
        board.post(group_id, TierOutcome(alone=True))
        assert (await waiting).alone

    asyncio.run(scenario())


def test_a_peer_that_fell_behind_adopts_exactly_what_the_round_applied_and_nothing_of_another_state():
    group_input = torch.randn(NUMEL)
    header, chunks, keys = second_tier(group_input=group_input)
    members_got = check_all(header, chunks, group_input, keys)

    def adopter(mine):
        return TierCheck(
            header, prefix=PREFIX, schema_hash=SCHEMA, numel=NUMEL, mine=mine, representative=None,
            contribution=None, weight=0.0, max_age_s=60.0, certify=None, refusal=None,
        )  # fmt: skip

    check = adopter(MINE)
    for (part, chunk), message in zip(check.expected(), chunks, strict=True):
        check.take(part, chunk, message)
    assert torch.equal(check.output, members_got), "the adopter moves to exactly what the members applied"
    handed_on = list(check.outcome().answers())
    assert handed_on[0].entries == header.entries and [a.chunk for a in handed_on[1:]] == chunks
    with pytest.raises(ProtocolError, match="another step or state"):
        adopter({"step": MINE["step"], "state_hash": "cd" * 32})
    forged = apb.PartChunk()
    forged.CopyFrom(chunks[0])
    forged.data = CODEC.encode(torch.zeros(len(forged.data) // 2))
    with pytest.raises(ProtocolError, match="part 0 chunk 0"):
        adopter(MINE).take(0, 0, forged)
