"""The scale simulation (``lab.scalesim``): what it says about the second tier, and that it keeps saying it.

Each run is a seeded discrete-event model in one process (no peers are started), a few hundredths of a
second to a second of CPU each.
"""

from __future__ import annotations

import importlib.util
import json
import math
import xml.dom.minidom
from pathlib import Path

import pytest

from lab.scalesim import DEMO_NUMEL, ScaleConfig, ScaleSim, layout

pytestmark = pytest.mark.timeout(60)
ROOT = Path(__file__).resolve().parents[1]
# Links alike, so that a step's groups end their first-tier rounds together and meet in one second-tier
# window (with 10-100 Mbit/s links they often do not: see the benchmark's table).
EVEN = {"min_mbit": 50.0, "max_mbit": 50.0, "min_latency_s": 0.05, "max_latency_s": 0.05}


def test_the_demo_model_is_what_the_simulation_moves():
    from swarm.models import build_model

    assert sum(p.numel() for p in build_model("gpt", {}, seed=0).parameters()) == DEMO_NUMEL


def test_a_round_sends_what_the_butterfly_layout_says():
    lay = layout(DEMO_NUMEL, 16, "fp16")
    # Each member sends its share of every other part and its aggregate to every other member: in all,
    # 2 (k - 1) fp16 vectors, the busiest member no more than a part above its share.
    assert sum(lay.contributions) + sum(lay.aggregates) == 2 * 15 * 2 * DEMO_NUMEL
    assert (
        max(lay.contributions[i] + lay.aggregates[i] for i in range(16)) <= 2 * 2 * DEMO_NUMEL * 15 / 16 + 64
    )


def test_groups_of_16_on_even_links_without_churn_apply_one_update_at_every_step():
    result = ScaleSim(ScaleConfig(peers=48, max_group_size=16, steps=6, **EVEN)).run()
    assert result["finished"]
    assert max(r["groups"] for r in result["per_step"]) >= 3  # several groups, so the second tier ran
    assert all(r["tier2_rounds"] >= 1 for r in result["per_step"])
    assert result["same_update_fraction"] == 1.0
    assert result["downloads"] == 0 and result["steady_downloads"] == 0


def test_at_256_peers_the_second_tiers_window_keeps_most_steps_whole_where_the_runs_window_split_them_all():
    """On 10-100 Mbit/s links with churn, a step's groups end their first tier up to about 45 s apart. The
    run's few-second window (``second_window = "run"``, the code before 2026-11-30) split such steps; the
    code's window (``tiers.second_window_s``, closed once its groups hold the step's peers) keeps most
    of them whole, with fewer state downloads and fewer bytes (over 6 seeds: docs/scale.md)."""
    scenario = {
        "peers": 256,
        "max_group_size": 64,
        "steps": 6,
        "join_over_s": 60.0,
        "churn": 0.02,
        "attackers": 0.1,
    }
    before = ScaleSim(ScaleConfig(**scenario, second_window="run", late_adopt=False)).run()
    now = ScaleSim(ScaleConfig(**scenario)).run()
    assert before["same_update_fraction"] < 0.5 and before["steady_downloads"] > 100
    assert now["finished"] and now["same_update_fraction"] >= 0.75
    assert now["steady_downloads"] < before["steady_downloads"] / 2
    assert now["mean_bytes"] < before["mean_bytes"]


def test_at_512_peers_late_groups_that_adopt_keep_the_steps_whole_where_searching_split_them():
    """A group that ends its first tier after the step's other groups combined formed a second-tier round
    of its own, a second update at the step (``late_adopt = False``, the code before); now it adopts the
    step's round (``SecondTier._combined_without``): fewer split steps and state downloads (over 6 seeds:
    docs/scale.md)."""
    scenario = {
        "peers": 512,
        "max_group_size": 64,
        "steps": 6,
        "join_over_s": 60.0,
        "churn": 0.02,
        "attackers": 0.1,
    }
    before = ScaleSim(ScaleConfig(**scenario, late_adopt=False)).run()
    now = ScaleSim(ScaleConfig(**scenario)).run()
    assert before["same_update_fraction"] < 0.9 and before["steady_downloads"] > 100
    assert now["finished"] and now["same_update_fraction"] == 1.0
    assert now["steady_downloads"] < before["steady_downloads"] / 2


def test_one_tier_with_several_groups_splits_the_run():
    result = ScaleSim(ScaleConfig(peers=48, max_group_size=16, steps=6, two_tier=False)).run()
    assert max(r["groups"] for r in result["per_step"]) >= 3
    assert result["same_update_fraction"] < 1.0 or result["steady_downloads"] > 0
    assert max(r["distinct_results"] for r in result["per_step"]) >= 2


def test_bytes_per_peer_grow_at_most_logarithmically_from_64_to_1000_peers():
    sent = {}
    for peers in (64, 1000):
        result = ScaleSim(ScaleConfig(peers=peers, steps=1)).run()
        assert result["per_step"][0]["same_update"]
        sent[peers] = result["per_step"][0]["bytes_sent_mean"]
    assert sent[1000] / sent[64] <= math.log(1000) / math.log(64)


def test_an_attacker_representative_costs_only_its_own_groups_step():
    config = ScaleConfig(peers=32, max_group_size=8, steps=3, **EVEN)
    clean = ScaleSim(config)
    clean_result = clean.run()
    assert clean_result["same_update_fraction"] == 1.0
    rep, members = clean.represented[0][0]
    victims = sorted(set(members) - {rep})
    attacked = ScaleSim(config, attackers={rep})
    result = attacked.run()
    assert sorted(i for group in attacked.withheld[0] for i in group) == victims
    applied = {peer: (how, when) for peer, _, how, when in attacked.applied[0]}
    # Nobody outside the group waited: every other peer applied step 0 at the same moment as without it.
    expected = {peer: (how, when) for peer, _, how, when in clean.applied[0] if peer not in victims}
    assert {p: applied[p] for p in expected} == expected
    assert not any(applied.get(p, ("", 0))[0] == "combined" for p in victims)
    # The withheld members wait out the hand-off (90 s, longer than a step here) and then catch up: every
    # peer ends on one state, and every step still had one update.
    assert result["finished"] and result["same_update_fraction"] == 1.0
    assert len({p.pos for p in attacked.peers}) == 1


def test_the_engine_is_deterministic_for_a_seed():
    config = ScaleConfig(peers=40, max_group_size=8, steps=3, churn=0.05, attackers=0.1, join_over_s=30)
    first, again = ScaleSim(config).run(), ScaleSim(config).run()
    assert first == again
    other = ScaleSim(config.model_copy(update={"seed": 1})).run()
    assert other["per_step"] != first["per_step"]


def test_the_benchmark_writes_its_table_json_and_plot(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("scale_sim", ROOT / "benchmarks" / "scale_sim.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out_json, out_svg = tmp_path / "scale.json", tmp_path / "scale.svg"
    assert module.main(["--quick", "--json", str(out_json), "--svg", str(out_svg)]) == 0
    table = capsys.readouterr().out
    assert "| two-tier | 64 | 8 |" in table and "| one-tier | 16 | 16 |" in table
    runs = json.loads(out_json.read_text())["runs"]
    assert len(runs) == 8 and all(r["finished"] for r in runs)
    svg = xml.dom.minidom.parse(str(out_svg))
    assert len(svg.getElementsByTagName("polyline")) == 8  # 4 series in each of the 2 panels
