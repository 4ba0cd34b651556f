"""A local swarm's coordinator and peers forked from the rehearsal's fork server, not started anew.

``python -m peer.cli join ...`` starts an interpreter that imports torch, hivemind and gRPC before
``main`` runs: about 2.5 s of CPU and 200 MiB of private memory per process, which on a 2-core machine
is most of what a rehearsal of many peers costs. A rehearsal that started its fork server
(``swarm.forkserver.start`` with the commands' modules preloaded) forks each command from that copy
instead and calls the same ``main(argv)`` the command line does, in a session of its own, with its
output in its log, its own environment and working directory, and the exit an interpreter makes
(non-daemon threads joined, exit handlers run). A command behind a prefix (a WAN lab host's ``ip netns
exec``) is still started anew.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import io
import os
import subprocess
import sys
import threading
import time
from multiprocessing import util
from pathlib import Path

from swarm import forkserver
from swarm.forkserver import ForkServerError

# The commands a rehearsal forks, and the name each forked process shows (``ps -e``, ``top``): a fork's
# command line is the rehearsal's, so the name is how ``swarm-peer pause`` knows a forked peer.
COMMANDS = {"peer.cli": "swarm-peer", "coordinator.cli": "swarm-coord"}
SESSION_TIMEOUT_S = 30.0  # for a forked child to lead its own session (its first step)


def forkable(args: list[str]) -> bool:
    """Whether ``python ARGS`` is a command this process can fork from its fork server."""
    return len(args) >= 2 and args[0] == "-m" and args[1] in COMMANDS and forkserver.running()


class ForkedCommand:
    """``python -m MODULE ARGS`` forked from this process's fork server, with the part of
    ``subprocess.Popen``'s interface a local swarm uses (``pid``, ``returncode``, ``poll``, ``wait``,
    ``send_signal``, ``terminate``, ``kill``)."""

    def __init__(self, args: list[str], *, log_path: Path, env: dict[str, str], cwd: Path) -> None:
        if not forkable(args):
            raise ValueError(f"cannot fork python {' '.join(args[:2])}: not a command of {sorted(COMMANDS)}")
        self.args = [sys.executable, *args]
        self._popen = forkserver.ForkServerPopen(_Command(args[1], args[2:], str(log_path), env, str(cwd)))
        self.pid = self._popen.pid
        self._await_session()

    def _await_session(self) -> None:
        """Return once the child leads its own session, as ``Popen(start_new_session=True)`` does: a
        group kill (the reaper's, ``LocalSwarm.kill_all``) must reach it and what it starts."""
        deadline = time.monotonic() + SESSION_TIMEOUT_S
        while self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                if os.getsid(self.pid) == self.pid:
                    return
            if time.monotonic() >= deadline:
                self.kill()
                raise ForkServerError(
                    f"the forked child did not lead a session within {SESSION_TIMEOUT_S:.0f}s"
                )
            time.sleep(0.002)

    @property
    def returncode(self) -> int | None:
        return self._popen.returncode

    def poll(self) -> int | None:
        return self._popen.poll()

    def wait(self, timeout: float | None = None) -> int:
        code = self._popen.wait(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return code

    def send_signal(self, signum: int) -> None:
        self._popen.send_signal(signum)

    def terminate(self) -> None:
        self._popen.terminate()

    def kill(self) -> None:
        self._popen.kill()


class _Command:
    """What the forked child runs (``forkserver._run_child`` calls ``_bootstrap``)."""

    def __init__(self, module: str, argv: list[str], log_path: str, env: dict[str, str], cwd: str) -> None:
        self.module, self.argv, self.log_path, self.env, self.cwd = module, argv, log_path, env, cwd
        self.name = COMMANDS[module]

    def _bootstrap(self) -> int:
        os.setsid()
        log = os.open(self.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        for target, source in ((0, null), (1, log), (2, log)):
            os.dup2(source, target)
        os.close(log)
        os.close(null)
        # As PYTHONUNBUFFERED gives a started interpreter: each write reaches the log at once.
        sys.stdin = open(0, closefd=False)  # noqa: SIM115 - the process's own stdin, kept open
        sys.stdout = io.TextIOWrapper(open(1, "wb", 0, closefd=False), write_through=True)  # noqa: SIM115
        sys.stderr = io.TextIOWrapper(open(2, "wb", 0, closefd=False), write_through=True)  # noqa: SIM115
        os.environ.clear()
        os.environ.update(self.env)
        os.chdir(self.cwd)
        sys.argv = [self.name, *self.argv]
        util._finalizer_registry.clear()
        util._run_after_forkers()
        try:
            code = importlib.import_module(self.module).main(self.argv)
        except SystemExit as e:
            code = e.code
        except BaseException:  # noqa: BLE001 - what an interpreter prints for an uncaught exception
            sys.excepthook(*sys.exc_info())
            code = 1
        finally:
            threading._shutdown()
            atexit._run_exitfuncs()
        if code is None:
            return 0
        if not isinstance(code, int):
            print(code, file=sys.stderr)
            return 1
        return code
