"""What ``swarm-sim`` leaves behind: the log folder it names is kept when asked (``--keep-logs``) or when
the rehearsal failed, and removed otherwise; where it was kept is printed."""

from __future__ import annotations

import contextlib

import pytest

from lab.rehearsal import Rehearsal
from lab.simconfig import SimConfig, build_run

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    "keep, outcome, kept",
    [(False, "ok", False), (True, "ok", True), (False, "not ok", True), (False, "raised", True)],
)
def test_the_named_log_folder_is_kept_when_asked_or_when_the_run_failed(keep, outcome, kept, capsys):
    expected = pytest.raises(RuntimeError) if outcome == "raised" else contextlib.nullcontext()
    with expected, Rehearsal(SimConfig(keep=keep)) as rehearsal:
        (rehearsal.root / "peer0.log").write_text("joined run")
        if outcome == "raised":
            raise RuntimeError("a peer crashed")
        rehearsal.finish({}, outcome == "ok", "done")
    try:
        assert (rehearsal.root / "peer0.log").exists() == kept
        assert (f"logs kept in {rehearsal.root}" in capsys.readouterr().err) == kept
    finally:
        if kept:
            (rehearsal.root / "peer0.log").unlink()
            rehearsal.root.rmdir()


def test_the_sims_group_floor_keeps_an_honest_majority_unless_told_otherwise():
    """With f attackers every group holds 2f + 1 peers at least, and the honest peers alone reach the floor
    once there are 3f + 1 peers; below that the floor stays 2f + 1 unless ``--min-group-size`` says (the
    trust table's 6 peers with f = 2 pass 4, so that the run goes on once its attackers are banned)."""
    floor = lambda **kw: build_run(SimConfig(model_size="tiny", **kw)).training.min_group_size  # noqa: E731
    assert floor(peers=3) == 3
    assert floor(peers=3, byzantine=1, attack="huge_weight") == 3, (
        "no group of one honest peer and its attacker"
    )
    assert floor(peers=8, byzantine=2, attack="sign_flip") == 6
    assert floor(peers=6, byzantine=2, attack="denier") == 5
    assert floor(peers=6, byzantine=2, attack="denier", min_group_size=4) == 4
    with pytest.raises(ValueError, match="min_group_size"):
        SimConfig(min_group_size=0)
