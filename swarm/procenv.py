"""Process settings that third-party libraries read once, when they load; the CLIs import this module
before anything else.

gRPC installs fork handlers at load time, and at each fork while its threads run (the p2p daemon's and
the DHT process's starts) prints ``fork_posix.cc:71 ... skipping fork() handlers``. No process here
forks to go on using gRPC in the child (children are started by fork + exec), so fork support is off;
gRPC's own log shows errors only. A value the user set in the environment is kept.
"""

from __future__ import annotations

import os

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
