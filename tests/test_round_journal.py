"""The round journal (``swarm.journal``) and the per-step figures ``swarm-sim`` computes from it
(``lab.roundfigures``): what a scale rehearsal reports per step."""

from __future__ import annotations

from pathlib import Path

import pytest

from lab.roundfigures import steady_downloads, step_figures
from lab.simconfig import SimConfig, build_run
from protocols.errors import ConfigError
from swarm import journal


def test_a_journal_keeps_each_round_and_download_and_skips_a_line_cut_short(tmp_path: Path):
    path = tmp_path / "peer" / "rounds.jsonl"
    handler = journal.open_journal(path)
    try:
        journal.record("round", 3, outcome="applied", group="ab" * 8, size=4, sent=100, state_hash="h")
        journal.record("download", 5, state_hash="k", mib=1.5)
    finally:
        journal.close_journal(handler)
    journal.record("round", 9, outcome="applied")  # closed: not written
    with path.open("a") as f:
        f.write('{"event": "round", "step": 1')  # a kill in the middle of a write
    rows = journal.read_journal(path)
    assert [(r["event"], r["step"]) for r in rows] == [("joined", 0), ("round", 3), ("download", 5)]
    assert rows[1]["size"] == 4 and rows[1]["state_hash"] == "h"


def test_a_journal_that_cannot_be_written_names_the_setting(tmp_path: Path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="round_journal"):
        journal.open_journal(tmp_path / "file" / "rounds.jsonl")  # a directory that is a file


def _round(step: int, group: str, size: int, state: str, sent: float, outcome: str = "applied") -> dict:
    return {"event": "round", "step": step, "outcome": outcome, "group": group, "size": size,
            "state_hash": state, "sent": sent, "form_s": 0.5}  # fmt: skip


def test_two_groups_at_one_step_show_as_two_updates_and_the_downloads_that_follow():
    joined = {"event": "joined", "step": 0}
    journals = {
        # Step 0: one group of 3. Step 1: groups g1 (a, b) and g2 (c) apply different averages; c then
        # downloads a's state of step 2. d joins at step 2 and downloads it too, before any round.
        "a": [joined, _round(0, "g0", 3, "s1", 10), _round(1, "g1", 2, "s2", 25)],
        "b": [joined, _round(0, "g0", 3, "s1", 10), _round(1, "g1", 2, "s2", 22)],
        "c": [joined, _round(0, "g0", 3, "s1", 10), _round(1, "-", 0, "", 14, outcome="no_group"),
              _round(1, "g2", 1, "s2-alone", 14), {"event": "download", "step": 2, "state_hash": "s2"}],
        "d": [joined, {"event": "download", "step": 2, "state_hash": "s2"}],
    }  # fmt: skip
    figures = step_figures(journals, steps=3)
    assert [f["groups"] for f in figures] == [1, 2, 0]
    assert figures[0]["same_update"] and not figures[1]["same_update"]
    assert figures[1]["distinct_results"] == 2 and figures[1]["largest_group"] == 2
    assert figures[1]["round_tries"] == 4, "the failed try counts as a try"
    assert figures[1]["state_downloads"] == 2 and figures[1]["joiner_downloads"] == 1
    # Bytes of step 1 for each peer that applied it: a 15, b 12, c 4 (its failed try included).
    assert figures[1]["bytes_sent_per_peer"] == pytest.approx((15 + 12 + 4) / 3)
    assert steady_downloads(figures, after_steps=1) == 1, "c was in line; d was a joiner"
    assert steady_downloads(figures, after_steps=2) == 0


def test_a_restart_starts_a_new_life_whose_first_download_is_a_joiners():
    journals = {
        "a": [{"event": "joined", "step": 0}, _round(0, "g", 2, "s1", 5), _round(1, "h", 2, "s2", 9),
              {"event": "joined", "step": 0}, {"event": "download", "step": 3, "state_hash": "s3"}],
    }  # fmt: skip
    figures = step_figures(journals, steps=3)
    assert figures[2]["state_downloads"] == 1 and figures[2]["joiner_downloads"] == 1
    assert steady_downloads(figures) == 0
    assert [f["lives_ended"] for f in figures] == [0, 0, 1], (
        "its first life ended at step 2, after applying 1"
    )


def test_a_peer_killed_mid_round_is_counted_where_its_groupmate_applied_alone():
    joined = {"event": "joined", "step": 0}
    journals = {
        # a and b apply step 0 together; at step 1 b is killed after the round, before writing it down, and
        # restarts. c never ends a life: only the lives a later ``joined`` line ends are counted.
        "a": [joined, _round(0, "g", 2, "s1", 5), _round(1, "h", 2, "s2", 9)],
        "b": [joined, _round(0, "g", 2, "s1", 5), joined, {"event": "download", "step": 2, "state_hash": "s2"}],
        "c": [joined, _round(0, "-", 0, "", 1, outcome="no_group")],
    }  # fmt: skip
    figures = step_figures(journals, steps=2)
    assert [(f["peers_applied"], f["lives_ended"]) for f in figures] == [(2, 0), (1, 1)]


def test_the_sim_keeps_the_runs_group_semantics_when_groups_are_capped():
    capped = build_run(SimConfig(peers=32, max_group_size=8, model_size="tiny"))
    assert (capped.training.max_group_size, capped.training.min_group_size) == (8, 1)
    attacked = build_run(SimConfig(peers=32, max_group_size=8, byzantine=2, attack="sign_flip"))
    assert attacked.training.min_group_size == 5, "an honest majority in every group: 2f + 1"
    assert build_run(SimConfig(peers=4)).training.min_group_size == 4, "uncapped: every peer in every round"
    with pytest.raises(ValueError, match="--min-group-size 9 is more than --max-group-size 8"):
        SimConfig(peers=32, max_group_size=8, min_group_size=9)
