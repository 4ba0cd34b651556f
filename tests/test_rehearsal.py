"""What ``swarm-sim`` leaves behind: the log folder it names is kept when asked (``--keep-logs``) or when
the rehearsal failed, and removed otherwise; where it was kept is printed."""

from __future__ import annotations

import contextlib

import pytest

from lab.rehearsal import Rehearsal
from lab.simconfig import SimConfig

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
