"""The test suite's process, set up as the commands set up theirs (pyproject's pytest ``addopts`` loads
this module with ``-p lab.testsession``).

A ``-p`` plugin is imported before pytest captures output, records warnings or loads conftest.py, so
the fork server copy made here (``swarm.forkserver``) is the process as a command's would be: gRPC
loaded without fork handlers (``swarm.procenv``), the real standard streams, Python's own warning
display. The tests' DHT nodes, coordinators and peers are forked from it (``lab.forked``); a forked
copy taken inside pytest's capture would write its library loggers' output into whichever test ran.
"""

from __future__ import annotations

import swarm.procenv  # noqa: F401  # isort: skip  (before grpc loads)

from lab.localswarm import COMMAND_MODULES
from swarm import forkserver

forkserver.start(preload=COMMAND_MODULES)
