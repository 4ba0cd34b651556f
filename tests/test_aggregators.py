"""Robust aggregation rules: they resist a minority of attackers, reproduce bit for bit, and refuse bad input."""

from __future__ import annotations

import threading

import pytest
import torch

from protocols.errors import ConfigError, InvalidContribution
from swarm.averaging.aggregators import aggregator_config, get_aggregator
from swarm.averaging.validation import fair_weights, validate_contribution, validate_weight
from swarm.byzantine import make_attack

pytestmark = pytest.mark.timeout(60)

ROBUST = ("centered_clip", "trimmed_mean", "coordinate_median")
D = 4096


def _group(n: int, seed: int = 0) -> torch.Tensor:
    """``n`` honest gradients: one true gradient plus independent noise of the same scale."""
    g = torch.Generator().manual_seed(seed)
    true = torch.randn(D, generator=g)
    return true + torch.randn(n, D, generator=g)


def _ones(n: int) -> torch.Tensor:
    return torch.ones(n, dtype=torch.float64)


def _with_attackers(honest: torch.Tensor, attackers: int, attack: str, options: dict) -> torch.Tensor:
    n = honest.shape[0] + attackers
    sent = [
        make_attack(attack, options, group_size=n, attackers=attackers, seed=i).contribution(
            honest[i], step=3
        )
        for i in range(attackers)
    ]
    return torch.cat([torch.stack(sent), honest])


# --- robustness ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [5, 8])
@pytest.mark.parametrize(
    "attack, options",
    [
        ("sign_flip", {"scale": 10.0}),
        ("random_direction", {"norm_ratio": 100.0}),
        ("ipm", {"epsilon": 100.0}),
    ],
)
def test_robust_rules_stay_near_the_honest_mean_while_mean_is_pulled_away(n: int, attack: str, options: dict):
    f = (n - 1) // 2  # the most attackers the threat model allows: f < n/2
    honest = _group(n - f, seed=n)
    honest_mean = honest.mean(dim=0)
    # How far one honest gradient is from the honest mean: the scale any estimate is judged on.
    spread = float((honest - honest_mean).norm(dim=1).mean())
    contributions = _with_attackers(honest, f, attack, options)

    mean_error = float((get_aggregator("mean")(contributions, _ones(n), seed=0) - honest_mean).norm())
    assert mean_error > 5 * spread, (
        f"the attack should defeat a plain mean ({mean_error:.1f} vs {spread:.1f})"
    )
    for rule in ROBUST:
        result = get_aggregator(rule)(contributions, _ones(n), seed=0)
        error = float((result - honest_mean).norm())
        assert error < spread, f"{rule} under {attack}: {error:.1f} from the honest mean, spread {spread:.1f}"


def test_a_huge_claimed_weight_does_not_buy_a_robust_rule():
    honest = _group(5)
    attacker = make_attack("huge_weight", group_size=6, attackers=1)
    contributions = torch.cat([attacker.contribution(honest[0], step=0)[None], honest])
    claimed = torch.tensor([attacker.weight(1.0)] + [1.0] * 5, dtype=torch.float64)
    honest_mean = honest.mean(dim=0)

    mean_error = float((get_aggregator("mean")(contributions, claimed, seed=0) - honest_mean).norm())
    assert mean_error > 0.99 * float(2 * honest[0].norm()) - float(honest_mean.norm())
    for rule in ROBUST:
        aggregate = get_aggregator(rule)
        # The claim is capped at the median weight: the attacker counts exactly like an honest sender.
        assert torch.equal(
            aggregate(contributions, claimed, seed=0), aggregate(contributions, _ones(6), seed=0)
        )


def test_alie_stays_inside_the_spread_and_robust_rules_keep_it_bounded():
    honest = _group(6, seed=11)
    attackers = 2
    # Colluders estimate the honest statistics from their own honest gradients.
    sent = [
        make_attack("alie", group_size=8, attackers=attackers, seed=i).contribution(
            honest[i], step=0, peers=honest[:attackers]
        )
        for i in range(attackers)
    ]
    contributions = torch.cat([torch.stack(sent), honest])
    honest_mean = honest.mean(dim=0)
    spread = float((honest - honest_mean).norm(dim=1).mean())
    for rule in ROBUST:
        result = get_aggregator(rule)(contributions, _ones(8), seed=0)
        assert float((result - honest_mean).norm()) < spread


# --- the rules themselves ------------------------------------------------------------------------------


def test_mean_is_the_weighted_average_it_always_was():
    x = _group(4)
    w = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
    expected = (w.float()[:, None] * x).sum(dim=0) / w.float().sum()
    assert torch.equal(get_aggregator("mean")(x, w, seed=0), expected)
    assert torch.equal(get_aggregator("mean")(x, torch.zeros(4, dtype=torch.float64), seed=0), x.mean(dim=0))


def test_coordinate_median_and_trimmed_mean_match_their_definitions():
    for n in (3, 4, 7, 70):  # 70 rows take the sort path instead of the comparator network
        x = _group(n, seed=n)
        ordered = x.sort(dim=0).values
        median = ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2
        assert torch.allclose(get_aggregator("coordinate_median")(x, _ones(n), seed=0), median, atol=1e-6)
        kept = ordered[1 : n - 1]
        trimmed = get_aggregator("trimmed_mean", {"trim": 1})(x, _ones(n), seed=0)
        assert torch.allclose(trimmed, kept.mean(dim=0), atol=1e-5)
    # trim_fraction rounds down; trimming never removes every value.
    x = _group(5)
    assert torch.equal(
        get_aggregator("trimmed_mean", {"trim_fraction": 0.2})(x, _ones(5), seed=0),
        get_aggregator("trimmed_mean", {"trim": 1})(x, _ones(5), seed=0),
    )
    assert torch.equal(
        get_aggregator("trimmed_mean", {"trim": 100})(x, _ones(5), seed=0),
        get_aggregator("coordinate_median")(x, _ones(5), seed=0),
    )


def test_centered_clip_with_a_huge_radius_is_the_mean_and_converges_to_a_fixed_point():
    x = _group(6)
    clip = {"magnitude": "clipped"}  # the clipped center itself, before its length is set
    wide = get_aggregator("centered_clip", {"tau": 1e9, "iterations": 1, "tolerance": 0, **clip})(
        x, _ones(6), seed=0
    )
    assert torch.allclose(wide, x.mean(dim=0), atol=1e-5)

    converged = get_aggregator("centered_clip", {"iterations": 100, "tolerance": 0, **clip})(
        x, _ones(6), seed=0
    )
    diffs = x - converged
    radius = float((x - x.median(dim=0).values).norm(dim=1).median())
    clipped = diffs * torch.clamp(radius / diffs.norm(dim=1, keepdim=True), max=1.0)
    # At the fixed point the clipped differences cancel out.
    assert float(clipped.mean(dim=0).norm()) < 1e-3 * radius


@pytest.mark.parametrize(
    "attack, options",
    [("sign_flip", {"scale": 1.0}), ("sign_flip", {"scale": 0.01}), ("ipm", {"epsilon": 0.1})],
)
def test_centered_clip_keeps_the_honest_length_when_two_of_five_pull_toward_zero(attack: str, options: dict):
    # Pseudo-gradients of many local steps point much the same way (pairwise cosine about 0.9 in the
    # tiny DiLoCo run); two senders that send them reversed, scaled down to nearly nothing, or a tenth of
    # the honest mean reversed each pull the clipped center toward zero by up to the radius.
    g = torch.Generator().manual_seed(7)
    honest = torch.randn(D, generator=g) + 0.3 * torch.randn(3, D, generator=g)
    x = _with_attackers(honest, 2, attack, options)
    mean = honest.mean(dim=0)
    direction = mean / mean.norm()

    def length(options: dict) -> float:
        return float(get_aggregator("centered_clip", options)(x, _ones(5), seed=0) @ direction) / float(
            mean.norm()
        )

    assert length({"magnitude": "clipped"}) < 0.9, "the clipped center alone is shrunk"
    assert 0.95 < length({}) < 1.05, "at the median projection it keeps the honest length"


def test_the_length_is_never_shorter_than_clipped_and_no_longer_than_an_honest_projection_allows():
    # Two of five send far along the honest mean, nothing, or far against it. The default is never shorter
    # than the clipped center, and never longer than it or than the longest honest projection onto it.
    g = torch.Generator().manual_seed(8)
    honest = torch.randn(D, generator=g) + 0.3 * torch.randn(3, D, generator=g)
    mean = honest.mean(dim=0)
    for sent in (1000.0 * mean, torch.zeros(D), -1000.0 * mean):
        x = torch.cat([torch.stack([sent, sent]), honest])
        result = get_aggregator("centered_clip")(x, _ones(5), seed=0)
        clipped = get_aggregator("centered_clip", {"magnitude": "clipped"})(x, _ones(5), seed=0)
        honest_along = honest @ (result / result.norm())
        assert float(clipped.norm()) <= float(result.norm())
        assert float(result.norm()) <= max(float(clipped.norm()), float(honest_along.max())) * (1 + 1e-5)
        assert float(torch.nn.functional.cosine_similarity(result, mean, dim=0)) > 0.95


@pytest.mark.parametrize("seed", range(3))
def test_every_step_gradients_that_do_not_agree_get_the_clipped_center(seed: int):
    # Nearly orthogonal gradients (every-step training, few samples a sender): one sender of three could
    # steer the length onto a direction of its choosing, so below the agreement the clipped center stands.
    x = torch.randn(3, D, generator=torch.Generator().manual_seed(seed))
    clipped = get_aggregator("centered_clip", {"magnitude": "clipped"})(x, _ones(3), seed=0)
    assert torch.equal(get_aggregator("centered_clip")(x, _ones(3), seed=0), clipped)


def test_centered_clip_stops_early_once_a_step_is_short():
    x = _with_attackers(_group(5), 2, "sign_flip", {"scale": 5.0})
    w = _ones(7)
    one = get_aggregator("centered_clip", {"iterations": 1, "tolerance": 0})(x, w, seed=0)
    # Every step is an average of vectors no longer than the radius, so tolerance 1 stops after one step.
    stopped = get_aggregator("centered_clip", {"iterations": 100, "tolerance": 1.0})(x, w, seed=0)
    full = get_aggregator("centered_clip", {"iterations": 100, "tolerance": 0})(x, w, seed=0)
    assert torch.equal(stopped, one)
    assert not torch.equal(full, one)


def test_absolute_tau_is_in_the_units_of_the_values():
    x = _group(5) * 1000
    relative = get_aggregator("centered_clip")(x, _ones(5), seed=0)
    tiny = get_aggregator(
        "centered_clip", {"tau_mode": "absolute", "tau": 1e-6, "iterations": 1, "magnitude": "clipped"}
    )
    median = get_aggregator("coordinate_median")(x, _ones(5), seed=0)
    # A radius of 1e-6 for values of size 1000 barely moves from the starting median.
    assert float((tiny(x, _ones(5), seed=0) - median).norm()) <= 1e-6 * 1.0001
    assert float((relative - median).norm()) > 1.0


@pytest.mark.parametrize("rule", ROBUST + ("mean",))
def test_one_and_two_senders(rule: str):
    aggregate = get_aggregator(rule)
    x = _group(2)
    one = aggregate(x[:1], torch.tensor([3.0], dtype=torch.float64), seed=0)
    # The mean divides 3x by 3 (rounding); robust rules return the one sender's values as they are.
    assert torch.allclose(one, x[0], atol=1e-6) if rule == "mean" else torch.equal(one, x[0])
    two = aggregate(x, torch.tensor([1.0, 1e6], dtype=torch.float64), seed=0)
    if rule == "mean":
        assert torch.allclose(two, x[1], atol=1e-4)  # the mean trusts the claim
    else:
        # Two senders, nothing to tell the honest one: the midpoint, whatever weights they claim.
        assert torch.allclose(two, (x[0] + x[1]) / 2, atol=1e-6)


@pytest.mark.parametrize("rule", ROBUST)
def test_robust_rules_leave_out_non_finite_and_weightless_senders(rule: str):
    aggregate = get_aggregator(rule)
    x = _group(5)
    bad = torch.cat([x, torch.full((1, D), float("nan")), x[:1] * 1e6])
    w = torch.tensor([1.0] * 5 + [1.0, 0.0], dtype=torch.float64)
    assert torch.equal(aggregate(bad, w, seed=0), aggregate(x, _ones(5), seed=0))
    with pytest.raises(InvalidContribution, match="non-finite"):
        aggregate(torch.full((3, 8), float("inf")), _ones(3), seed=0)


def test_aggregate_refuses_malformed_arguments():
    aggregate = get_aggregator("centered_clip")
    with pytest.raises(ValueError, match="float32"):
        aggregate(torch.zeros(3, 4, dtype=torch.float64), _ones(3), seed=0)
    with pytest.raises(ValueError, match="one weight per sender"):
        aggregate(torch.zeros(3, 4), _ones(2), seed=0)
    with pytest.raises(ValueError, match="no contributions"):
        aggregate(torch.zeros(0, 4), _ones(0), seed=0)


# --- determinism ---------------------------------------------------------------------------------------


def _all_rules() -> list[tuple[str, dict]]:
    return [(r, {}) for r in ("mean", *ROBUST)] + [(r, {"bucket_size": 2}) for r in ("mean", *ROBUST)]


@pytest.mark.parametrize("rule, options", _all_rules())
def test_results_are_bit_identical_across_calls_and_thread_counts(rule: str, options: dict):
    x = _with_attackers(_group(6), 2, "sign_flip", {"scale": 3.0})
    w = torch.tensor([1.0, 5.0, 1.0, 2.0, 1.0, 1.0, 3.0, 1.0], dtype=torch.float64)
    aggregate = get_aggregator(rule, options)
    first = aggregate(x, w, seed=42)
    assert torch.equal(first, aggregate(x.clone(), w.clone(), seed=42))
    # A validator re-running the rule on another machine has another thread count.
    results = {}

    def run(threads: int) -> None:
        torch.set_num_threads(threads)
        results[threads] = aggregate(x, w, seed=42)

    before = torch.get_num_threads()
    try:
        for threads in (1, 3):
            worker = threading.Thread(target=run, args=(threads,))
            worker.start()
            worker.join(30)
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(first, r) for r in results.values()) and len(results) == 2


def test_bucketing_is_driven_by_the_seed():
    # One attacker of 8 spoils at most one of 4 buckets (f attackers can spoil f buckets: f * s < n / 2).
    x = _with_attackers(_group(7), 1, "sign_flip", {"scale": 3.0})
    aggregate = get_aggregator("centered_clip", {"bucket_size": 2})
    assert torch.equal(aggregate(x, _ones(8), seed=7), aggregate(x, _ones(8), seed=7))
    outputs = {aggregate(x, _ones(8), seed=s).numpy().tobytes() for s in range(6)}
    assert len(outputs) > 1, "different seeds must shuffle the buckets differently"
    # Bucket means of honest data keep the rule near the honest mean.
    honest_mean = x[1:].mean(dim=0)
    spread = float((x[1:] - honest_mean).norm(dim=1).mean())
    assert float((aggregate(x, _ones(8), seed=7) - honest_mean).norm()) < spread


# --- options and validation ----------------------------------------------------------------------------


def test_bad_options_name_the_field_and_the_allowed_values():
    with pytest.raises(ConfigError, match="field 'tau'"):
        aggregator_config("centered_clip", {"tau": 0})
    with pytest.raises(ConfigError, match="'relative' or 'absolute'"):
        aggregator_config("centered_clip", {"tau_mode": "scaled"})
    with pytest.raises(ConfigError, match=r"unknown field 'trim_count'.*known fields: bucket_size, trim"):
        aggregator_config("trimmed_mean", {"trim_count": 1})
    with pytest.raises(ConfigError, match="either trim or trim_fraction"):
        aggregator_config("trimmed_mean", {"trim": 1, "trim_fraction": 0.1})
    with pytest.raises(ConfigError, match="available: centered_clip, coordinate_median, mean, trimmed_mean"):
        aggregator_config("krum")


def test_validation_refuses_nan_wrong_size_dtype_and_norm_naming_the_sender():
    good = torch.ones(10)
    assert torch.equal(validate_contribution(good.half(), 10, max_norm=4.0, sender="peerA"), good)
    poisoned = make_attack("nan", {"fraction": 0.2}, group_size=4, attackers=1).contribution(good, step=0)
    with pytest.raises(InvalidContribution, match=r"peerA has 2 non-finite values"):
        validate_contribution(poisoned, 10, sender="peerA")
    with pytest.raises(InvalidContribution, match="has 9 values, expected 10"):
        validate_contribution(torch.ones(9), 10)
    with pytest.raises(InvalidContribution, match="dtype torch.int64"):
        validate_contribution(torch.ones(10, dtype=torch.int64), 10)
    with pytest.raises(InvalidContribution, match=r"shape \(2, 5\)"):
        validate_contribution(torch.ones(2, 5), 10)
    with pytest.raises(InvalidContribution, match="norm 31.6228, above the bound 10"):
        validate_contribution(torch.full((10,), 10.0), 10, max_norm=10.0)
    with pytest.raises(InvalidContribution, match="list, not a tensor"):
        validate_contribution([1.0] * 10, 10)  # type: ignore[arg-type]


def test_weights_are_validated_and_clipped_to_a_fair_share():
    assert validate_weight(8, max_weight=16) == 8.0
    for claim, problem in (
        (float("nan"), "finite"),
        (-1.0, "finite"),
        (17, "above the limit"),
        ("x", "number"),
    ):
        with pytest.raises(InvalidContribution, match=problem):
            validate_weight(claim, max_weight=16, sender="peerB")
    assert fair_weights([1.0, 2.0, 1e6]).tolist() == [1.0, 2.0, 2.0]
    assert fair_weights([4.0, 1e9]).tolist() == [4.0, 4.0]
    assert fair_weights([float("inf"), -3.0, 2.0, 5.0]).tolist() == [0.0, 0.0, 2.0, 2.0]
    assert fair_weights([3.0, 3.0, 3.0], max_weight=2.0).tolist() == [2.0, 2.0, 2.0]
    assert fair_weights([0.0, 0.0]).tolist() == [0.0, 0.0]
