"""The test suite's process, set up as the commands set up theirs (pyproject's pytest ``addopts`` loads
this module with ``-p lab.testsession``).

Imported before conftest.py, it sets the process environment first (``swarm.procenv``: gRPC loaded
without fork handlers). Its fork server copy (``swarm.forkserver``) is made when pytest's command
starts, after pytest's plugin imports (which record warnings into a list) and outside its output
capture, so the copy holds Python's own warning display and the real standard streams: the tests' DHT
nodes, coordinators and peers forked from it (``lab.forked``) show their warnings, and a DHT node's
output goes where the test's does (each child is sent the parent's stdout and stderr).
"""

from __future__ import annotations

import swarm.procenv  # noqa: F401  # isort: skip  (before grpc loads)

import contextlib

import pytest

from lab.localswarm import COMMAND_MODULES
from swarm import forkserver


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    capture = config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture is not None else contextlib.nullcontext():
        forkserver.start(preload=COMMAND_MODULES)
