"""Smoke runs of the benchmarks (``--quick``) so that they keep running as the code under them changes.

Each script runs in its own process group, which the test kills whole if the run overstays its bound: the
benchmarks start peers, DHT nodes and p2p daemons that must not outlive the test.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUN_TIMEOUT_S = 300

pytestmark = [pytest.mark.slow, pytest.mark.timeout(RUN_TIMEOUT_S + 30)]


def run_benchmark(script: str, *args: str) -> str:
    process = subprocess.Popen(
        [sys.executable, f"benchmarks/{script}", "--quick", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"{script} --quick ran past {RUN_TIMEOUT_S}s:\n{output[-4000:]}")
    finally:
        # Whatever the script left behind (it should leave nothing) goes with its process group.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 0, f"{script} --quick exited with {process.returncode}:\n{output[-4000:]}"
    return output


def test_allreduce_benchmark_compares_ours_with_hivemind_and_gloo(tmp_path: Path):
    output = run_benchmark("bench_allreduce.py", "--json", str(tmp_path / "allreduce.json"))

    assert "ours/hivemind" in output and "ours/gloo" in output
    row = re.search(r"^\s*2\s+1M\s+fp16 \|(?P<seconds>[^|]*)\|\s*(?P<hm>\S+)\s+(?P<gloo>\S+)", output, re.M)
    assert row, f"no result row for 2 peers x 1M fp16:\n{output[-4000:]}"
    assert re.fullmatch(r"\d+\.\d+x", row["hm"]) and re.fullmatch(r"\d+\.\d+x", row["gloo"]), row.group(0)
    cells = json.loads((tmp_path / "allreduce.json").read_text())["cells"]
    assert {c["system"] for c in cells} == {"ours", "hivemind", "gloo"}
    assert all(c["median_s"] and c["median_s"] > 0 for c in cells)


def test_load_benchmark_prices_both_systems_slowdown_beside_busy_loops(tmp_path: Path):
    output = run_benchmark("bench_allreduce_load.py", "--json", str(tmp_path / "load.json"))

    assert re.search(r"ours' slowdown over hivemind's: \d+\.\d+x", output), output[-4000:]
    summary = json.loads((tmp_path / "load.json").read_text())["summary"]
    assert {"ours", "hivemind"} <= set(summary) and summary["ratio"] > 0
    assert all(summary[s]["quiet_s"] > 0 and summary[s]["busy_s"] > 0 for s in ("ours", "hivemind"))


def test_training_benchmark_reports_utilization_throughput_and_traffic(tmp_path: Path):
    output = run_benchmark("bench_training.py", "--json", str(tmp_path / "training.json"))

    assert re.search(r"compute utilization: \d+\.\d%", output), output[-4000:]
    assert re.search(r"samples/s: \d+\.\d+", output), output[-4000:]
    assert re.search(r"bytes on the wire per sample: \d+", output), output[-4000:]
    result = json.loads((tmp_path / "training.json").read_text())
    assert 0 < result["utilization"] <= 1 and result["samples_per_s"] > 0
    # Two peers average every step, so every sample costs some bytes on the wire.
    assert result["bytes_per_sample"] > 0 and all(p["rounds_ok"] >= 1 for p in result["peers"])


def test_aggregation_benchmark_prices_robust_rules_against_mean(tmp_path: Path):
    output = run_benchmark("bench_aggregation.py", "--json", str(tmp_path / "aggregation.json"))

    assert re.search(r"^\s*4\s+256K chunk \|.*\d+\.\d+x", output, re.M), output[-4000:]
    row = re.search(r"^\s*3\s+1M \|\s+(\d+\.\d+)\s+(\d+\.\d+) \|\s+(\d+\.\d+)x", output, re.M)
    assert row, f"no round row for 3 peers x 1M:\n{output[-4000:]}"
    result = json.loads((tmp_path / "aggregation.json").read_text())
    assert {s["case"] for s in result["steps"]} == {"chunk", "vector"}
    for step in result["steps"]:
        assert set(step["seconds"]) >= {"mean", "centered_clip", "trimmed_mean", "coordinate_median"}
        assert all(seconds > 0 for seconds in step["seconds"].values())
    assert {r["system"] for r in result["rounds"]} == {"mean", "centered_clip"}
    assert all(r["median_s"] and r["median_s"] > 0 for r in result["rounds"])


def test_pipeline_benchmark_reports_throughput_under_failure_and_the_square_cube_ratio(tmp_path: Path):
    output = run_benchmark("bench_pipeline.py", "--json", str(tmp_path / "pipeline.json"))

    assert re.search(r"all alive: \d+\.\d samples/s", output), output[-4000:]
    assert re.search(r"one replica of stage 1 killed: \d+\.\d samples/s", output), output[-4000:]
    result = json.loads((tmp_path / "pipeline.json").read_text())
    assert result["throughput"]["lost_microbatches"] == 0
    assert result["throughput"]["one_killed_samples_per_s"] > 0
    assert re.search(r"one process, whole model, \d+ threads: \d+\.\d samples/s", output), output[-4000:]
    breakdown = result["throughput"]["breakdown"]
    assert sorted(r["stage"] for r in breakdown) == [0, 0, 1, 1] and all(
        r["compute_s"] > 0 for r in breakdown
    )
    rows = result["square_cube"]
    assert [r["d_model"] for r in rows] == [64, 128, 256]
    # Traffic doubles with d while compute more than doubles: the ratio falls from the first to the last.
    assert rows[-1]["comm_to_compute"] < rows[0]["comm_to_compute"]


def test_peer_benchmark_measures_each_setting_and_checkpointing_cuts_activations(tmp_path: Path):
    output = run_benchmark("bench_peer.py", "--json", str(tmp_path / "peer.json"))

    checkpointing = r"fp32 checkpointing: activations \d+\.\d+x smaller, [+-]\d+% compute"
    assert re.search(checkpointing, output), output[-4000:]
    assert re.search(r"bf16/fp32 speed: \d+\.\d+x", output), output[-4000:]
    result = json.loads((tmp_path / "peer.json").read_text())
    assert set(result["models"]) == {"demo", "4x"}
    for model in result["models"].values():
        rows = {(r["precision"], r["checkpointing"]): r for r in model["rows"]}
        assert set(rows) == {(p, c) for p in ("fp32", "bf16") for c in (False, True)}
        assert all(r["median"] > 0 and len(r["seconds"]) == 2 for r in rows.values())
        for precision in ("fp32", "bf16"):
            on, off = rows[precision, True]["memory"], rows[precision, False]["memory"]
            assert 0 < on["activation_mib"] < off["activation_mib"]
    assert [q["precision"] for q in result["quality"]] == ["fp32", "bf16", "bf16"]
    assert all(0 < q["val_loss"] < 10 for q in result["quality"])


def test_wan_benchmark_measures_rounds_on_capped_links(tmp_path: Path):
    output = run_benchmark("bench_wan.py", "--json", str(tmp_path / "wan.json"))

    rows = json.loads((tmp_path / "wan.json").read_text())
    # One row: a peer behind NAT on capped links is tests/test_wanlab.py's.
    assert [(r["up_mbit"], r["nat"]) for r in rows] == [(20.0, 0)], output[-4000:]
    for row in rows:
        assert row["identical"] and row["sent_mb_per_step"] > 0 and row["averaging_s"] > 0
        # The kernel held the cap: no 2-second window of any peer's uplink ran much above it.
        assert 0 < row["peak_use"] <= 1.1, row


def test_diloco_benchmark_compares_outer_steps_with_every_step_at_equal_samples(tmp_path: Path):
    output = run_benchmark("bench_diloco.py", "--json", str(tmp_path / "diloco.json"))

    rows = json.loads((tmp_path / "diloco.json").read_text())
    assert [(r["sync"], r["codec"]) for r in rows] == [("every_step", "fp16"), ("diloco", "int8")], output
    anchor, diloco = rows
    assert anchor["identical"] and diloco["identical"]
    # An outer step of int8 pseudo-gradients carries H steps' samples for half the bytes of one fp16 step.
    assert diloco["fewer_bytes"] > 4, output[-3000:]
    assert diloco["val_loss"] < diloco["initial_val_loss"], output[-3000:]


def test_diloco_recipes_train_every_recipe_at_equal_samples_in_one_process(tmp_path: Path):
    output = run_benchmark("diloco_recipes.py", "--json", str(tmp_path / "recipes.json"))

    rows = json.loads((tmp_path / "recipes.json").read_text())
    assert [r["name"] for r in rows] == ["every_step", "int8 H=10", "topk H=10", "int8 H=10 overlap"], output
    every_step, int8, topk, overlap = rows
    # Equal samples: 20 steps of 2 x 8 samples against 2 windows of 10 inner steps of 2 x 8, whose rounds
    # all land (overlap: the second window's would land one window later, after the run).
    assert (every_step["steps"], int8["steps"], topk["steps"], overlap["steps"]) == (20, 2, 2, 1)
    assert all(r["val_loss"] < r["initial_val_loss"] for r in rows), output[-3000:]
    assert every_step["loss_ratio"] == 1.0 and int8["loss_ratio"] > 0


def test_diloco_recipes_replay_attackers_and_the_default_rule_keeps_the_honest_length(tmp_path: Path):
    # 2 of 5 peers send their pseudo-gradient reversed: the mean shrinks to about a fifth of the honest
    # mean; the run's centered_clip keeps its direction and, at the median projection, its length.
    recipe = "int8 H=10 windows=2 attack=sign_flip f=2"
    output = run_benchmark(
        "diloco_recipes.py", "--peers", "5", "--recipes", recipe, f"{recipe} rule=mean",
        "--json", str(tmp_path / "recipes.json"),
    )  # fmt: skip
    robust, mean = json.loads((tmp_path / "recipes.json").read_text())
    assert robust["steps"] == mean["steps"] == 2, output[-3000:]
    assert all(cosine > 0.95 and 0.9 < length < 1.1 for _, cosine, length in robust["spread"]), robust[
        "spread"
    ]
    assert all(length < 0.5 for _, _, length in mean["spread"]), mean["spread"]
    assert robust["val_loss"] < mean["val_loss"], output[-3000:]


def test_honest_cost_benchmark_replays_the_demo_under_each_rule(tmp_path: Path):
    output = run_benchmark("bench_honest_cost.py", "--json", str(tmp_path / "cost.json"))

    assert re.search(
        r"^batches 0\s+centered_clip \| val 0:\d\.\d{3}  1:\d\.\d{3}  2:\d\.\d{3} \|", output, re.M
    ), output
    results = {r["rule"]: r for r in json.loads((tmp_path / "cost.json").read_text())["results"]}
    assert set(results) == {"mean", "centered_clip", "trimmed_mean"}
    assert results["mean"]["cosine_to_mean"] == pytest.approx([1.0, 1.0], abs=1e-4)
    # Every rule starts from the same weights and validation batches; every rule's run learns.
    assert len({r["val_history"][0][1] for r in results.values()}) == 1
    assert all(r["val_history"][-1][1] < r["val_history"][0][1] for r in results.values())


def test_byzantine_table_prints_each_repeat_against_its_own_clean_run_and_refuses_an_unknown_rule():
    # The table itself runs real swarms (tens of minutes, docs/robustness.md); here its report of two
    # repeats, each attacked cell compared with the clean run of its own repeat, and its argument check.
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import byzantine_table
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    cell = lambda loss, banned: {"final_val_loss": loss, "banned": banned, "honest_agree": True,  # noqa: E731
                                 "honest_banned": 0}  # fmt: skip
    cells = {
        "clean": [{"final_val_loss": 4.0}, {"final_val_loss": 5.0}],
        "runs": [
            {"attack": "ipm", "f": 2, "repeat": 0, "centered_clip": cell(4.2, 0)},
            {
                "attack": "ipm",
                "f": 2,
                "repeat": 1,
                "centered_clip": {**cell(4.5, 2), "ban_steps": ["0", "-"]},
            },
        ],
    }
    row = byzantine_table.table(cells, ["centered_clip"]).splitlines()[-1]
    assert (
        row
        == "| `ipm` | 2 | 4.2000 / 4.5000 | +5.0% / -10.0% | 4.0000 / 5.0000 | 0/2 / 2/2 at 0,- | yes | 0 |"
    )
    # The step a ban names; and the floor of a row's runs: an honest majority in every group, which the
    # honest peers alone still reach once the attackers are banned.
    assert byzantine_table.ban_step("... (80 samples at step 3, part 0 chunk 0)") == "3"
    assert byzantine_table.ban_step("signed a weight no loop signs") == "-"
    assert [byzantine_table.group_floor(n, f, None) for n, f in ((7, 2), (10, 3), (12, 2))] == [5, 7, 10]
    result = subprocess.run(
        [sys.executable, "benchmarks/byzantine_table.py", "--rules", "median,mean"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2 and "--rules 'median,mean'" in result.stderr
    # 5 peers of which 2 attack: no floor keeps both, and the table says so instead of stalling.
    result = subprocess.run(
        [sys.executable, "benchmarks/byzantine_table.py", "--peers", "5", "--f", "2"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2 and "rehearse 7 peers or more" in result.stderr


def test_ban_table_reads_the_step_of_the_proven_lie_and_the_honest_replays_and_refuses_too_few_peers():
    # The table runs real swarms (40-60 s a cell, docs/robustness.md); here what it makes of a report.
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import ban_table
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    honest = {"byzantine": False, "banned": False, "param_hash": "h", "senders_checked": 3.0,
              "senders_outliers": 1.0, "senders_caught": 1.0, "senders_fit_scored": 2.0, "sender_fit_s": 0.5,
              "sender_replay_s": 1.5, "compute_s": 10.0}  # fmt: skip
    attacker = {"byzantine": True, "banned": True, "contributed_samples": 40.0,
                "ban_reason": "sent a contribution 2 away ... (40 samples at step 3, part 1 chunk 0)"}  # fmt: skip
    per_step = [{"step": s, "largest_group": 4 if s < 2 else 3} for s in range(8)]  # the attacker in 2 steps
    report = {
        "peers": [attacker, honest, honest, honest],
        "steps": 8,
        "final_val_loss": 3.1,
        "per_step": per_step,
    }
    row = {"replay_outliers": "on", **ban_table.summary(report)}
    assert (row["ban_step"], row["replays"], row["outlier_replays"], row["honest_identical"]) == (
        3,
        9,
        3,
        True,
    )
    assert ban_table.line("diloco", "sign_flip", row) == (
        "| diloco | `sign_flip` | on | yes | 3 | 40 | 2 | 9 (3) | 0.38 (15.0%) | 3 | 0 | 6 (5.0%) | 3.1000 | yes |"
    )
    result = subprocess.run(
        [sys.executable, "benchmarks/ban_table.py", "--peers", "3"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2 and "--peers" in result.stderr


def test_rehearsals_fail_a_kill_without_a_move_or_an_attack_that_banned_an_honest_peer():
    # The rehearsals run real swarms for minutes (docs/pipeline.md); here what each check makes of a report.
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import rehearsals
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    replica = lambda name, stage: {"name": name, "stage": stage, "step": 14, "param_hash": f"h{stage}"}  # noqa: E731
    killed = {
        "initial_val_loss": 5.5, "final_val_loss": 5.1, "lost_microbatches": 0, "moves": {"stage0-0": 1},
        "trainers": [{"microbatches_completed": 100, "microbatches_waiting": 4, "microbatches_issued": 104}],
        "killed": [{"stage": 1, "name": "stage1-0"}], "replaced": [{"stage": 0, "name": "stage0-new"}],
        "stages": [{"stage": 0, "replicas": [replica("stage0-1", 0), replica("stage0-new", 0)]},
                   {"stage": 1, "replicas": [replica("stage1-1", 1), replica("stage0-0", 1)]}],
    }  # fmt: skip
    assert all(ok for ok, _ in rehearsals.check_pipeline_kill(killed, 14))
    unmoved = {**killed, "moves": {}}
    failed = [what for ok, what in rehearsals.check_pipeline_kill(unmoved, 14) if not ok]
    assert failed == ["replicas moved 0 times (one must, three against one)"]
    attacked = {
        "initial_val_loss": 5.5, "final_val_loss": 5.2, "lost_microbatches": 0,
        "byzantine": ["stage1-0", "trainer0"], "banned": ["stage1-0", "trainer2"],
        "trainers": [{"name": "trainer2", "microbatches_completed": 12}],
        "stages": [{"stage": 0, "replicas": [replica("stage0-0", 0)]}],
    }  # fmt: skip
    attacked["stages"][0]["replicas"][0]["step"] = 3
    failed = [what for ok, what in rehearsals.check_pipeline_attacks(attacked, 3) if not ok]
    assert failed == ["no honest peer banned"]
    # The demo's learning curve: the run measured (a rise of 11% after warmup passes), one that spiked.
    assert all(
        ok for ok, _ in rehearsals.check_demo_spike({"val_history": [5.34, 4.35, 4.62, 4.18, 3.67, 3.60]}, 9)
    )
    spiked = [
        what
        for ok, what in rehearsals.check_demo_spike({"val_history": [5.34, 4.35, 8.7, 4.1, 3.6]}, 9)
        if not ok
    ]
    assert len(spiked) == 1 and "25% above" in spiked[0]
    # A provable attacker: banned for its lie, and never an honest peer.
    peer = lambda name, **more: {"name": name, "param_hash": "h", "byzantine": False, "banned": False, **more}  # noqa: E731
    run = {"initial_val_loss": 5.4, "final_val_loss": 5.2, "final_param_hash": "h",
           "peers": [peer("peer0"), peer("peer2"), peer("peer1", byzantine=True, banned=True, ban_reason="x y z")]}  # fmt: skip
    assert all(ok for ok, _ in rehearsals.check_provable("y z")(run, 6))
    run["peers"][0]["banned"] = True
    failed = [what for ok, what in rehearsals.check_provable("y z")(run, 6) if not ok]
    assert failed == ["no honest peer banned"]
    result = subprocess.run(
        [sys.executable, "benchmarks/rehearsals.py", "--only", "pipeline_kill,nope"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2 and "unknown rehearsal 'nope'" in result.stderr
