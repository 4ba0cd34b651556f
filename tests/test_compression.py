"""Wire codecs: each round-trips within its stated error, is as small as documented, refuses hostile
bytes with a ProtocolError naming the sender, and keeps real rounds bit-identical and verifiable."""

from __future__ import annotations

import asyncio
import math
import struct

import numpy as np
import pytest
import torch

from protocols.errors import ConfigError, ProtocolError
from swarm.averaging.aggregators import get_aggregator
from swarm.averaging.averager import Averager
from swarm.averaging.compression import FP16_MAX, TOPK_BLOCK, get_codec
from swarm.averaging.evidence import aggregation_seed, parse_evidence
from swarm.averaging.validation import fair_weights
from swarm.byzantine.attacks import make_attack
from swarm.config import RunConfig

pytestmark = pytest.mark.timeout(120)

N = 3 * TOPK_BLOCK + 1234  # three full topk blocks and a partial one
CODECS = ["fp16", "none", "int8", "topk"]


def randn(numel: int = N, seed: int = 0) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed))


def roundtrip(codec, values: torch.Tensor, *, contribution: bool = False) -> torch.Tensor:
    if contribution:
        return codec.decode_contribution(codec.encode_contribution(values), values.numel(), sender="peerA")
    return codec.decode(codec.encode(values), values.numel(), sender="peerA")


# --- round trips, sizes and determinism ------------------------------------------------------------------


@pytest.mark.parametrize("name", CODECS)
def test_every_codec_round_trips_within_its_stated_error(name):
    codec, x = get_codec(name), randn()
    y = roundtrip(codec, x)
    assert y.dtype == torch.float32 and y.shape == x.shape
    bound = {
        "fp16": x.abs() * 2**-11 + 2**-24,  # fp16 rounding
        "none": torch.zeros(N),
        "int8": torch.full((N,), float(x.abs().max()) / 254 * (1 + 1e-6)),  # half a level of the chunk
        # An aggregate keeps every nonzero value, at half a level of its block's scale.
        "topk": torch.cat([b.abs().max().expand(b.numel()) for b in x.split(TOPK_BLOCK)]) / 254 * (1 + 1e-6),
    }[name]
    assert bool(((y - x).abs() <= bound).all())
    assert len(codec.encode(x)) <= codec.max_bytes(N)


def test_a_topk_contribution_keeps_the_largest_values_of_each_block_ties_to_the_lower_index():
    codec = get_codec("topk", topk_density=0.01)
    x = randn()
    y = roundtrip(codec, x, contribution=True)
    for block, (xb, yb) in enumerate(zip(x.split(TOPK_BLOCK), y.split(TOPK_BLOCK), strict=True)):
        k = math.ceil(0.01 * xb.numel())
        kept = torch.nonzero(yb).flatten()
        assert len(kept) == k, f"block {block} keeps {len(kept)} values, not {k}"
        assert set(kept.tolist()) == set(torch.topk(xb.abs(), k).indices.tolist())
        scale = float(xb[kept].abs().max()) / 127
        assert bool(((yb[kept] - xb[kept]).abs() <= scale / 2 * (1 + 1e-6)).all())
    # Equal magnitudes: the lower indices win; zeros are never sent.
    ties = torch.tensor([0.0, 1.0, -1.0, 1.0, 0.5] * 20)
    kept = torch.nonzero(roundtrip(get_codec("topk", topk_density=0.03), ties, contribution=True)).flatten()
    assert kept.tolist() == [1, 2, 3]
    assert get_codec("topk").encode_contribution(torch.zeros(10)) == struct.pack("<Hf", 0, 0.0)


def test_compressed_codecs_are_as_small_as_documented():
    x = randn(1 << 18, seed=1)
    fp16, int8 = len(get_codec("fp16").encode(x)), len(get_codec("int8").encode(x))
    topk = len(get_codec("topk", topk_density=0.01).encode_contribution(x))
    assert int8 == 4 + x.numel() and fp16 / int8 > 1.99, "int8: a byte a value, half of fp16"
    # 41 values of each 4096-value block, 3 bytes each, plus a 6-byte header: 129 bytes, 63x fewer than fp16.
    assert topk == 64 * (6 + 41 * 3) and fp16 / topk > 60
    assert fp16 / topk >= 30
    # The worst case, every value sent, stays within max_bytes and bytes_per_value.
    codec = get_codec("topk")
    assert len(codec.encode(x)) == codec.max_bytes(x.numel()) <= codec.bytes_per_value * x.numel()


@pytest.mark.parametrize("name", ["int8", "topk"])
def test_encodings_are_pinned_and_deterministic(name):
    codec, x = get_codec(name), randn(seed=2)
    assert codec.encode_contribution(x) == codec.encode_contribution(x.clone())
    assert codec.encode(x) == codec.encode(x.double())
    # The format itself, on a vector small enough to spell out: scale 127 / 127, round half to even.
    small = torch.tensor([127.0, -63.5, 0.0, 2.5])
    scale = struct.pack("<f", 1.0)
    if name == "int8":
        assert codec.encode(small) == scale + bytes([127, 256 - 64, 0, 2])
    else:
        assert codec.encode(small) == struct.pack("<H", 3) + scale + struct.pack("<3H", 0, 1, 3) + bytes(
            [127, 256 - 64, 2]
        )


@pytest.mark.parametrize("name", CODECS)
def test_empty_vectors_and_saturation(name):
    codec = get_codec(name)
    assert roundtrip(codec, torch.zeros(0)).numel() == 0
    big = roundtrip(codec, torch.tensor([1e30, -1e30, 1.0]))
    assert torch.isfinite(big).all() and (name == "none" or float(big.abs().max()) <= FP16_MAX)


@pytest.mark.parametrize("name", ["fp16", "int8", "topk"])
def test_a_non_finite_input_makes_a_message_every_receiver_refuses(name):
    codec, x = get_codec(name), randn()
    x[TOPK_BLOCK + 5] = float("nan")
    for data in (codec.encode(x), codec.encode_contribution(x)):
        with pytest.raises(ProtocolError, match="peerA"):
            codec.decode(data, N, sender="peerA")


def test_codec_choice_comes_from_the_run_config():
    assert get_codec("topk", topk_density=0.05).schema != get_codec("topk", topk_density=0.01).schema
    assert get_codec("int8").schema == "int8" and get_codec("fp16").schema == "fp16"
    with pytest.raises(ConfigError, match="topk_density"):
        get_codec("topk", topk_density=0.0)
    with pytest.raises(ConfigError, match="available: fp16, none, int8, topk"):
        get_codec("int4")
    diloco = {"sync": "diloco", "compression": "topk"}
    run = RunConfig(run_id="r", training={**diloco, "topk_density": 0.02})
    assert run.training.topk_density == 0.02
    for bad in (0, 1.5):
        with pytest.raises(ValueError, match="topk_density"):
            RunConfig(run_id="r", training={**diloco, "topk_density": bad})


def test_an_outer_overlap_run_defaults_to_plain_outer_sgd_and_keeps_an_outer_optimizer_it_names():
    # Momentum 0.9 on pseudo-gradients that land one window late overshot (docs/diloco.md, "Recipes").
    diloco = {"sync": "diloco", "compression": "int8", "outer_overlap": True}
    late = RunConfig(run_id="r", training=diloco).outer_optimizer
    assert (late.lr, late.momentum, late.nesterov) == (1.0, 0.0, False)
    spelled = RunConfig.parse({"run_id": "r", "training": {**diloco, "outer_overlap": "true"}})
    assert spelled.outer_optimizer == late
    nesterov = {"lr": 0.7, "momentum": 0.9, "nesterov": True}
    named = RunConfig(run_id="r", training=diloco, outer_optimizer=nesterov).outer_optimizer
    assert (named.lr, named.momentum, named.nesterov) == (0.7, 0.9, True)
    on_time = RunConfig(run_id="r", training={**diloco, "outer_overlap": False}).outer_optimizer
    assert (on_time.lr, on_time.momentum, on_time.nesterov) == (0.7, 0.9, True)
    # What a coordinator serves names its outer optimizer, so peers read the same one back.
    served = RunConfig(run_id="r", training=diloco)
    assert RunConfig.parse(served.model_dump()).outer_optimizer == late


def test_a_topk_run_defaults_to_plain_outer_sgd_and_keeps_an_outer_optimizer_it_names():
    diloco = {"sync": "diloco", "compression": "topk"}
    sparse = RunConfig(run_id="r", training=diloco)
    assert (sparse.outer_optimizer.lr, sparse.outer_optimizer.momentum) == (1.0, 0.0)
    assert not sparse.outer_optimizer.nesterov and sparse.training.topk_feedback_decay == 0.95
    named = RunConfig(run_id="r", training=diloco, outer_optimizer={"lr": 0.5})
    assert (named.outer_optimizer.lr, named.outer_optimizer.momentum) == (0.5, 0.0)
    nesterov = RunConfig(run_id="r", training=diloco, outer_optimizer={"momentum": 0.9, "nesterov": True})
    assert (nesterov.outer_optimizer.lr, nesterov.outer_optimizer.momentum) == (1.0, 0.9)
    dense = RunConfig(run_id="r", training={**diloco, "compression": "int8"})
    assert (dense.outer_optimizer.lr, dense.outer_optimizer.momentum) == (0.7, 0.9)
    # What a coordinator serves names its outer optimizer, so peers read the same one back.
    assert RunConfig.parse(sparse.model_dump()).outer_optimizer == sparse.outer_optimizer
    with pytest.raises(ValueError, match="topk_feedback_decay"):
        RunConfig(run_id="r", training={**diloco, "topk_feedback_decay": 1.5})


# --- hostile bytes ---------------------------------------------------------------------------------------


def topk_message(counts, scales, indices, levels) -> bytes:
    return b"".join(
        [
            np.asarray(counts, "<u2").tobytes(),
            np.asarray(scales, "<f4").tobytes(),
            np.asarray(indices, "<u2").tobytes(),
            np.asarray(levels, np.int8).tobytes(),
        ]
    )


NAN, INF = float("nan"), float("inf")
INT8_CASES = {
    "truncated": (struct.pack("<f", 1.0) + bytes(99), "sent 103 bytes where 100 int8 values (104 bytes)"),
    "extra": (struct.pack("<f", 1.0) + bytes(101), "sent 105 bytes"),
    "NaN scale": (struct.pack("<f", NAN) + bytes(100), "scale of nan"),
    "infinite scale": (struct.pack("<f", INF) + bytes(100), "scale of inf"),
    "negative scale": (struct.pack("<f", -1.0) + bytes(100), "scale of -1.0"),
    "scale that overflows": (struct.pack("<f", 3e38) + bytes(100), "a finite number >= 0"),
    "level -128": (struct.pack("<f", 1.0) + bytes([128]) + bytes(99), "level -128"),
}
# Messages of 5000 values: a full block of 4096 and one of 904.
TOPK_CASES = {
    "shorter than its header": (bytes(11), "fewer than the 12-byte header"),
    "huge count": (topk_message([65535, 0], [1, 1], [], []), "65535 values for block 0 of 4096"),
    "count beyond a partial block": (topk_message([0, 905], [1, 1], [], []), "905 values for block 1 of 904"),
    "truncated": (topk_message([2, 0], [1, 1], [1, 2], [5, 5])[:-1], "2 topk values in 2 blocks"),
    "extra": (topk_message([2, 0], [1, 1], [1, 2], [5, 5]) + b"\0", "where 2 topk values"),
    "NaN scale": (topk_message([1, 0], [NAN, 1], [3], [1]), "scale of nan"),
    "negative scale": (topk_message([1, 0], [1, -0.0], [3], [1]), "scale of -0.0"),
    "index past its block": (topk_message([0, 1], [1, 1], [904], [1]), "beyond the end of its block"),
    "unsorted indices": (topk_message([2, 0], [1, 1], [7, 3], [1, 1]), "do not strictly increase"),
    "repeated index": (topk_message([2, 0], [1, 1], [3, 3], [1, 1]), "do not strictly increase"),
    "level -128": (topk_message([1, 0], [1, 1], [3], [-128]), "level -128"),
}


@pytest.mark.parametrize("case", INT8_CASES)
def test_hostile_int8_bytes_are_refused_naming_the_sender(case):
    data, message = INT8_CASES[case]
    with pytest.raises(ProtocolError, match=f"^peerA .*{message}".replace("(", r"\(").replace(")", r"\)")):
        get_codec("int8").decode(data, 100, sender="peerA")


@pytest.mark.parametrize("case", TOPK_CASES)
def test_hostile_topk_bytes_are_refused_naming_the_sender(case):
    data, message = TOPK_CASES[case]
    with pytest.raises(ProtocolError, match="^peerA .*" + message):
        get_codec("topk").decode(data, 5000, sender="peerA")


def test_indices_that_increase_across_a_block_boundary_are_fine_and_blocks_land_in_place():
    values = get_codec("topk").decode(topk_message([1, 1], [1, 0.5], [4000, 2], [3, -4]), 5000, sender="p")
    assert torch.nonzero(values).flatten().tolist() == [4000, 4098]
    assert values[4000] == 3 and values[4098] == -2


def test_a_contribution_with_more_than_its_share_is_refused():
    codec = get_codec("topk", topk_density=0.01)
    dense = codec.encode(randn(5000))  # a valid aggregate, but 41 + 10 values are a sender's share
    assert codec.decode(dense, 5000, sender="peerA").count_nonzero() > 51
    with pytest.raises(ProtocolError, match="peerA sent 4096 values for block 0 of 4096 values; at most 41"):
        codec.decode_contribution(dense, 5000, sender="peerA")


@pytest.mark.parametrize("name", CODECS)
def test_random_and_mutated_bytes_never_crash_a_decoder(name):
    codec, numel = get_codec(name), 5000
    rng = np.random.default_rng(0)
    valid = codec.encode_contribution(randn(numel))
    for trial in range(300):
        data = bytearray(valid)
        if trial % 3 == 0:
            data = bytearray(rng.bytes(int(rng.integers(0, 2 * len(valid)))))
        else:
            for position in rng.integers(0, len(data), size=int(rng.integers(1, 8))):
                data[position] = int(rng.integers(0, 256))
        try:
            values = codec.decode(bytes(data), numel, sender="peerA")
        except ProtocolError as e:
            assert str(e).startswith("peerA ")
        else:
            assert values.shape == (numel,) and bool(torch.isfinite(values).all())


# --- real rounds -----------------------------------------------------------------------------------------

NUMEL = 20_011  # three parts of about 6670 values: a full topk block and a partial one each


def averagers(keyed_dhts, prefix: str, **kwargs) -> list[Averager]:
    kwargs.setdefault("aggregator", "mean")
    return [
        Averager(
            d, prefix=prefix, numel=NUMEL, matchmaking_time_s=1.0, signing_key=k, data_plane=False, **kwargs
        )
        for d, k in keyed_dhts
    ]


async def one_round(keyed_dhts, compression: str, aggregator: str) -> tuple[Averager, dict, list, list]:
    """A clean round among the three peers: (an averager, each peer's input, results, runners)."""
    group = averagers(
        keyed_dhts, f"codec-{compression}-{aggregator}", aggregator=aggregator, compression=compression,
        topk_density=0.05,
    )  # fmt: skip
    inputs = {a.dht.peer_id.to_base58(): randn(NUMEL, seed=i) for i, a in enumerate(group)}
    for averager in group:
        await averager.start()
    outcomes = await asyncio.gather(
        *[a.average(inputs[a.dht.peer_id.to_base58()], 1.0, expected_size=3) for a in group]
    )
    assert all(o is not None and len(o[0].peer_ids) == 3 for o in outcomes), "the three peers met"
    runners = [a.rounds.recent[o[0].group_id] for a, o in zip(group, outcomes, strict=True)]
    await asyncio.gather(*(r.revealed for r in runners))
    for averager in group:
        await averager.shutdown()
    return group[0], inputs, [o[1] for o in outcomes], runners


@pytest.mark.timeout(240)  # three DHT peers start first: slow on a loaded 2-core machine
@pytest.mark.parametrize("compression", ["int8", "topk"])
def test_a_compressed_round_is_bit_identical_and_what_each_peer_sent_is_what_reducers_decoded(
    keyed_dhts, compression
):
    async def both():  # one event loop for both rounds, as a peer's averagers share one
        return [await one_round(keyed_dhts, compression, rule) for rule in ("mean", "centered_clip")]

    for aggregator, (averager, inputs, results, runners) in zip(
        ("mean", "centered_clip"), asyncio.run(both()), strict=True
    ):
        codec = averager.codec
        assert all(r.complete and not r.dropped for r in results)
        assert all(torch.equal(r.vector, results[0].vector) for r in results), "peers hold the same bits"
        sent = {runner.members[runner.index]: r.sent for runner, r in zip(runners, results, strict=True)}
        runner = runners[0]
        for peer, vector in inputs.items():  # what the wire carried of each peer's vector, every chunk
            for part in range(3):
                lo, hi = runner.chunk_range(part, 0)
                assert torch.equal(sent[peer][lo:hi], roundtrip(codec, vector[lo:hi], contribution=True))
        for reducer in runners:  # the inputs each reducer kept for validators: what their senders recorded
            lo, hi = reducer.chunk_range(reducer.index, 0)
            assert len(reducer.reducer.evidence[0]) == 3
            for item in reducer.reducer.evidence[0]:
                decoded = codec.decode_contribution(item.data, hi - lo, sender="x")
                assert torch.equal(decoded, sent[reducer.members[item.sender_index]][lo:hi])
        # The result is the rule over what was sent, encoded once: recomputed here bit for bit.
        rule, stacked = get_aggregator(aggregator), torch.stack([sent[p] for p in runner.members])
        for part in range(3):
            lo, hi = runner.chunk_range(part, 0)
            seed = aggregation_seed(runner.group_id, part, 0)
            expected = rule(stacked[:, lo:hi].contiguous(), fair_weights([1.0] * 3), seed=seed)
            assert torch.equal(results[0].vector[lo:hi], roundtrip(codec, expected))

        # Near the mean of what was sent (three randn inputs: centered_clip clips nothing here, and its
        # length, the median of the senders' projections, is within a few percent of the mean's) ...
        def near(mean: torch.Tensor, atol: float, result=results[0].vector, aggregator=aggregator) -> bool:
            if aggregator == "mean":
                return torch.allclose(result, mean, atol=atol)
            cosine = float(torch.nn.functional.cosine_similarity(result, mean, dim=0))
            return cosine > 1 - atol / 10 and abs(float(result.norm() / mean.norm()) - 1) < 0.03

        assert near(stacked.mean(0), 0.02)
        if compression == "int8":  # ... which for int8 is the mean of the inputs, within the quantization
            assert near(torch.stack(list(inputs.values())).mean(0), 0.05)
        else:  # ... and for topk holds about 3 x 5% of the coordinates, the rest left to error feedback
            assert 0.10 < float((results[0].vector != 0).float().mean()) <= 0.16


@pytest.mark.timeout(240)  # three DHT peers start first: slow on a loaded 2-core machine
@pytest.mark.parametrize("compression", ["int8", "topk"])
def test_a_bad_reducer_is_proven_wrong_under_compression(keyed_dhts, compression):
    accusations = []

    async def accuse(accused, evidence, verdict):
        accusations.append((accused, evidence, verdict))

    attack = make_attack("bad_reducer", None, group_size=3, attackers=1)
    group = averagers(
        keyed_dhts, f"bad-reducer-{compression}", aggregator="centered_clip", compression=compression,
        sender_timeout_s=2.0, verify_probability=1.0, accuse=accuse,
    )  # fmt: skip
    group[2].hooks = attack
    attacker = group[2].dht.peer_id.to_base58()

    async def scenario():
        for averager in group:
            await averager.start()
        for step in range(6):  # a round's draw may miss the attacker's part (at most 1/4 of the time)
            vectors = [randn(NUMEL, seed=10 * step + i) for i in range(3)]
            await asyncio.gather(
                *[a.average(v, 1.0, expected_size=3) for a, v in zip(group, vectors, strict=True)]
            )
            for averager in group:
                await averager.checks_done(60)
            if accusations:
                break
        for averager in group:
            await averager.shutdown()

    asyncio.run(scenario())
    assert accusations, "no validator caught the bad reducer"
    codec = get_codec(compression)
    for accused, evidence, verdict in accusations:
        assert accused == attacker and "differs from the rule's result" in verdict
        # The coordinator's judge, from the evidence's bytes, agrees.
        judged = parse_evidence(evidence.to_bytes()).judge(
            get_aggregator("centered_clip"), codec, vector_numel=NUMEL
        )
        assert judged is not None and "differs from the rule's result" in judged
