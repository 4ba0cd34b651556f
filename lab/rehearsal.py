"""The skeleton both ``swarm-sim`` drivers share (data-parallel in ``sim``, SWARM pipeline in
``pipeline_sim``): a temporary directory for the logs, the processes started in it, the poll loop's bounds,
and the end of a rehearsal (the JSON report, one result line, every process stopped, the directory
removed unless ``--keep-logs`` or the rehearsal failed, and where it was kept printed).

Example::

    with Rehearsal(config) as rehearsal:
        coordinator = rehearsal.local.start_coordinator(run)
        ...
        while not done():
            rehearsal.check_children(peers)
            rehearsal.check_deadline(f"the run did not reach step {config.steps}")
            time.sleep(1.0)
        return rehearsal.finish(result, ok, line)
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from lab.localswarm import Child, LocalSwarm
from lab.simconfig import SimConfig
from protocols.errors import SwarmError


class Rehearsal:
    """One ``swarm-sim`` run's directory, processes and bounds; exiting stops everything it started.

    ``deadline`` is ``config.timeout_s`` from the start; a driver whose runs may take long moves it on
    with ``extend_deadline`` whenever the run makes progress (a stall limit rather than a wall-time one).
    ``on_exit`` callbacks (a network lab to take down, an observer to close) run, last added first,
    once the processes are killed.
    """

    def __init__(self, config: SimConfig):
        self.config = config
        self.root = Path(tempfile.mkdtemp(prefix="swarm-sim-"))
        self.local = LocalSwarm(self.root)
        self.started = time.monotonic()
        self.deadline = self.started + config.timeout_s
        self.on_exit: list[Callable[[], None]] = []
        self.keep_logs = False  # set by a failure: the logs are what explains it

    def __enter__(self) -> Rehearsal:
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.local.kill_all()
            for close in reversed(self.on_exit):
                try:
                    close()
                except Exception as e:  # the others must still run: a lab left up keeps its namespaces
                    print(f"swarm-sim: clean-up step failed: {e!r}", file=sys.stderr)
        finally:
            if self.config.keep or self.keep_logs or exc[0] is not None:
                print(f"swarm-sim: logs kept in {self.root}", file=sys.stderr, flush=True)
            else:
                shutil.rmtree(self.root, ignore_errors=True)

    def elapsed_s(self) -> float:
        return time.monotonic() - self.started

    def extend_deadline(self) -> None:
        self.deadline = time.monotonic() + self.config.timeout_s

    def check_deadline(self, what: str) -> None:
        """Raise TimeoutError(``what``) once the deadline has passed."""
        if time.monotonic() > self.deadline:
            raise TimeoutError(what)

    @staticmethod
    def check_children(children: dict[str, Child], expected_gone: set[str] = frozenset()) -> None:
        """A process that exited (other than those in ``expected_gone``) fails the rehearsal at once, with
        the end of its log: waiting for the run to finish without it would only time out."""
        for name, child in children.items():
            if name not in expected_gone and child.process.poll() is not None:
                raise SwarmError(
                    f"{name} exited with code {child.process.returncode}:\n{child.output()[-3000:]}"
                )

    def finish(self, result: dict, ok: bool, line: str) -> int:
        """Write the JSON report (``--json``), print the result line; the exit code."""
        if self.config.json_path:
            self.config.json_path.write_text(json.dumps(result, indent=2))
        print(line, flush=True)
        self.keep_logs = self.keep_logs or not ok
        return 0 if ok else 1

    def failed(self, error: Exception) -> int:
        print(f"\nswarm-sim: failed: {error}", file=sys.stderr)
        self.keep_logs = True
        return 1
