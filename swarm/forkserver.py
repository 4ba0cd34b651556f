"""Child processes forked from a copy of this process made while it still ran one thread.

A spawned child starts a fresh interpreter and imports what it runs again: for the DHT's process that
is hivemind and with it torch and scipy, about 2 s of CPU before its p2p daemon starts, and as much
private memory again as the parent's own imports. Forking the running peer instead is unsafe: its gRPC
and executor threads may hold a lock at the moment of the fork, and the child would wait on it forever.

``start()``, called at a command's entry before any thread starts (``swarm.runtime.run(...,
fork_server=True)`` does), forks one copy of the process as it is then: modules imported, no thread
but the main one. Later children
(``ForkServerPopen``, a ``multiprocessing`` start method) are forked from that copy: they start at
once with everything imported, and share its memory pages until they write them. What the parent holds
by then reaches the child as ``spawn`` would send it: the process object pickled, its file descriptors
passed over a Unix socket, the parent's current environment, working directory and import path.

The copy exits when the parent does (its socket closes), and a child whose parent is gone ends itself
(``swarm.dht.SpawnedDHT``), so nothing outlives the command. A process that never called ``start()``,
or ran other threads when it did, spawns its children as before.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import io
import logging
import os
import pickle
import selectors
import signal
import socket
import struct
import sys
import threading
import traceback
from multiprocessing import context, process, reduction, util
from multiprocessing.connection import wait
from typing import Any

logger = logging.getLogger(__name__)

MAX_FDS = 64  # descriptors one child may inherit (a DHT process takes a handful)
MAX_REQUEST_BYTES = 64 << 20  # a pickled process object (a DHT's is a few KiB)
REPLY_TIMEOUT_S = 60.0  # for the server's answer to one request: a fork, even on a loaded machine
_HEADER = struct.Struct("!Q")
_PID = struct.Struct("!i")
_STATUS = struct.Struct("!i")
# Every request passes these first: where the server writes the child's exit status, and the parent's
# stdout and stderr; the process object's own descriptors follow.
_STATUS_FD, _STDOUT_FD, _STDERR_FD, _FIRST_INHERITED = 0, 1, 2, 3

_server: ForkServer | None = None
_fork_hook = False  # whether plain forks of this process forget its server (registered at the first start)
_inherited_fds: list[int] = []  # in a forked child: the descriptors its parent passed, by index


class ForkServerError(RuntimeError):
    """The fork server could not start a child (it is gone, or the request failed)."""


def start(preload: tuple[str, ...] = ()) -> bool:
    """Import the modules named in ``preload``, then fork this process's server copy, if this process
    runs no other thread; True if a server copy runs.

    Call it at a command's entry, before anything starts a thread (an event loop's executor, gRPC, a
    timer): ``preload`` what its children unpickle and run (``swarm.dht`` for a DHT node). Calling it
    again is harmless."""
    global _server
    if running():
        return True
    if sys.platform == "win32":
        return False
    for name in preload:
        importlib.import_module(name)
    if threading.active_count() != 1:
        logger.debug("children are spawned: this process already runs other threads")
        return False
    global _fork_hook
    if not _fork_hook:
        os.register_at_fork(after_in_child=_forget_server_in_a_fork)
        _fork_hook = True
    try:
        _server = ForkServer()
    except OSError as e:  # EAGAIN, ENOMEM: spawning may still work
        logger.warning(f"children are spawned: could not fork the fork server: {e}")
        return False
    return True


def running() -> bool:
    """Whether children of this process are forked from its server copy (``start()`` succeeded)."""
    return _server is not None and _server.alive()


class ForkServer:
    """The parent's end of its server copy: one Unix socket, one request at a time."""

    def __init__(self) -> None:
        parent_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        util._flush_std_streams()
        try:
            pid = os.fork()
        except OSError:
            parent_end.close()
            child_end.close()
            raise
        if pid == 0:  # the server copy
            parent_end.close()
            code = 0
            try:
                _serve(child_end)
            except BaseException:  # noqa: BLE001 - nothing may unwind into the parent's code from here
                code = 1
            finally:
                os._exit(code)
        child_end.close()
        parent_end.settimeout(REPLY_TIMEOUT_S)
        self.pid = pid
        self._socket: socket.socket | None = parent_end
        self._lock = threading.Lock()

    def alive(self) -> bool:
        return self._socket is not None

    def fork_child(self, payload: bytes, fds: list[int]) -> int:
        """Have the server fork a child that runs the pickled ``payload`` with ``fds`` passed; its pid."""
        if len(fds) > MAX_FDS or len(payload) > MAX_REQUEST_BYTES:
            raise ForkServerError(
                f"a child takes at most {MAX_FDS} descriptors and {MAX_REQUEST_BYTES} bytes"
            )
        with self._lock:
            if self._socket is None:
                raise ForkServerError("the fork server has ended")
            sent = False
            try:
                socket.send_fds(self._socket, [_HEADER.pack(len(payload))], fds)
                self._socket.sendall(payload)
                sent = True
                (pid,) = _PID.unpack(_receive(self._socket, _PID.size))
            except OSError as e:
                self._close_locked()
                raise ForkServerError(f"the fork server did not start the child: {e!r}") from None
            except BaseException:
                # A signal handler raised (Ctrl-C, a test's timeout). A request cut short leaves the
                # stream out of step, so the server is given up; a whole one is answered: the answer is
                # read, so that the next request gets its own, and the child nobody will track ended.
                if not sent:
                    self._close_locked()
                    raise
                self._abandon_answer_locked()
                raise
        if pid <= 0:
            raise ForkServerError(f"the fork server could not fork the child: {os.strerror(-pid)}")
        return pid

    def _abandon_answer_locked(self) -> None:
        try:
            (pid,) = _PID.unpack(_receive(self._socket, _PID.size))
        except BaseException:
            self._close_locked()
            raise
        if pid > 0:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def _close_locked(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(self.pid, os.WNOHANG)

    def forget(self) -> None:
        """In a plain fork of this process: drop this end without touching the parent's server."""
        if self._socket is not None:
            self._socket.close()
            self._socket = None


def _forget_server_in_a_fork() -> None:
    # A child made by a plain os.fork (a DataLoader worker, multiprocessing's fork context) must not share
    # the request stream with its parent, nor keep the server alive after the parent is gone.
    global _server
    if _server is not None:
        _server.forget()
        _server = None


def _receive(sock: socket.socket, size: int) -> bytes:
    chunks, got = [], 0
    while got < size:
        chunk = sock.recv(min(size - got, 1 << 20))
        if not chunk:
            raise ConnectionError("the fork server's socket closed")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _serve(sock: socket.socket) -> None:
    """The server copy's loop: fork a child per request, report each child's exit, end with the parent."""
    _name_this_process("swarm-forksrv")
    # A terminal's Ctrl-C reaches the whole process group: the parent decides when its children stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    # The children share this copy's pages until they write them; a collection would touch every
    # object's header and copy the pages it sits on into each child.
    gc.freeze()
    status_fds: dict[int, int] = {}  # child pid -> where its exit code is written
    selector = selectors.DefaultSelector()
    selector.register(sock, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)
    while True:
        for key, _ in selector.select():
            if key.fileobj is wake_r:
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_r, 4096)
                _reap(status_fds)
                continue
            try:
                header, fds, _, _ = socket.recv_fds(sock, _HEADER.size, MAX_FDS)
            except OSError:
                return
            if not header:
                return  # the parent is gone
            try:
                header += _receive(sock, _HEADER.size - len(header))
                (size,) = _HEADER.unpack(header)
                if size > MAX_REQUEST_BYTES or len(fds) < _FIRST_INHERITED:
                    raise ValueError(f"a request of {size} bytes with {len(fds)} descriptors")
                payload = _receive(sock, size)
            except (OSError, ValueError):
                for fd in fds:
                    os.close(fd)
                return
            try:
                pid = os.fork()
            except OSError as e:  # EAGAIN, ENOMEM: this request fails, the server goes on
                pid = -(e.errno or 1)
                for fd in fds:
                    os.close(fd)
            if pid == 0:
                selector.close()
                sock.close()
                os.close(wake_r)
                os.close(wake_w)
                for fd in status_fds.values():
                    os.close(fd)
                os._exit(_run_child(payload, fds))
            if pid > 0:
                status_fds[pid] = fds[_STATUS_FD]
                for fd in fds[_STATUS_FD + 1 :]:
                    os.close(fd)
            try:
                sock.sendall(_PID.pack(pid))
            except OSError:
                return


def _reap(status_fds: dict[int, int]) -> None:
    while status_fds:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        fd = status_fds.pop(pid, None)
        if fd is not None:
            with contextlib.suppress(OSError):
                os.write(fd, _STATUS.pack(os.waitstatus_to_exitcode(status)))
            os.close(fd)


def _run_child(payload: bytes, fds: list[int]) -> int:
    """In a forked child: take the parent's environment, working directory and import path, then run the process."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    numpy = sys.modules.get("numpy")
    if numpy is not None:  # a fresh interpreter seeds it from the OS (``random`` reseeds itself at a fork)
        numpy.random.seed()
    os.close(fds[_STATUS_FD])  # the exit status is the server's to write
    for target, source in ((1, fds[_STDOUT_FD]), (2, fds[_STDERR_FD])):
        if source != target:
            os.dup2(source, target)
            os.close(source)
    _inherited_fds[:] = fds[_FIRST_INHERITED:]
    for fd in _inherited_fds:
        os.set_inheritable(fd, False)
    try:
        # Where the parent is now, as spawn's preparation sends it; then the process, which may be of a
        # module the parent imported after the server copy was made.
        stream = io.BytesIO(payload)
        environ, cwd, path = pickle.load(stream)  # noqa: S301 - see _load
        os.environ.clear()
        os.environ.update(environ)
        os.chdir(cwd)
        sys.path[:] = path
        process_obj = _load(stream)
    except BaseException as e:  # noqa: BLE001 - report it and end this child only
        print(f"swarm fork server: could not load the child's process: {e!r}", file=sys.stderr)
        return 1
    _name_this_process(process_obj.name)
    try:
        return process_obj._bootstrap()
    except BaseException:  # noqa: BLE001 - a failure before the process's own handling began
        traceback.print_exc()
        return 1


def _name_this_process(name: str) -> None:
    """What ``ps -e`` and ``top`` show for this process (a fork's command line is its parent's)."""
    with contextlib.suppress(OSError), open("/proc/self/comm", "w") as comm:
        comm.write(name[:15])


def _load(stream: io.BytesIO) -> Any:
    current = process.current_process()
    current._inheriting = True
    try:
        # The payload is this process's parent's own pickle, received over a socketpair only it holds.
        return pickle.load(stream)  # noqa: S301
    finally:
        current._inheriting = False


class _DupFd:
    """A descriptor the parent passed to the child, by its index among those it passed."""

    def __init__(self, index: int) -> None:
        self.index = index

    def detach(self) -> int:
        return _inherited_fds[self.index]


def _standard_outputs() -> tuple[list[int], list[int]]:
    """This process's stdout and stderr, /dev/null for one it has closed; and the descriptors opened
    for that, to close once sent."""
    outputs, opened = [], []
    for fd in (1, 2):
        try:
            os.fstat(fd)
        except OSError:
            fd = os.open(os.devnull, os.O_WRONLY)
            opened.append(fd)
        outputs.append(fd)
    return outputs, opened


class ForkServerPopen:
    """``multiprocessing``'s Popen interface for a child forked by this process's server copy."""

    method = "swarm-forkserver"
    DupFd = _DupFd

    def __init__(self, process_obj: process.BaseProcess) -> None:
        if _server is None:
            raise ForkServerError("no fork server runs in this process (swarm.forkserver.start)")
        util._flush_std_streams()
        self.returncode: int | None = None
        self.finalizer = None
        self._fds: list[int] = []
        buffer = io.BytesIO()
        context.set_spawning_popen(self)
        try:
            # As spawn's preparation: the import path with '' as the directory the process started in.
            path = [process.ORIGINAL_DIR if entry == "" else entry for entry in sys.path]
            reduction.dump((dict(os.environ), os.getcwd(), path), buffer)
            reduction.dump(process_obj, buffer)
        finally:
            context.set_spawning_popen(None)
        status_r, status_w = os.pipe()
        # A spawned child's output goes where the parent's goes now (a test's capture, a log).
        outputs, opened = _standard_outputs()
        try:
            self.pid = _server.fork_child(buffer.getvalue(), [status_w, *outputs, *self._fds])
        except BaseException:
            os.close(status_r)
            raise
        finally:
            os.close(status_w)
            for fd in opened:
                os.close(fd)
        self.sentinel = status_r
        self.finalizer = util.Finalize(self, util.close_fds, (status_r,))

    def duplicate_for_child(self, fd: int) -> int:
        self._fds.append(fd)
        return len(self._fds) - 1

    def poll(self, flag: int = os.WNOHANG) -> int | None:
        if self.returncode is None:
            if not wait([self.sentinel], 0 if flag == os.WNOHANG else None):
                return None
            try:
                data = os.read(self.sentinel, _STATUS.size)
            except OSError:
                data = b""
            # No status: the server copy ended first, and a child whose parent is gone ends itself.
            self.returncode = _STATUS.unpack(data)[0] if len(data) == _STATUS.size else 255
        return self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        if self.returncode is None and not wait([self.sentinel], timeout):
            return None
        return self.poll(0)

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # an exited child's pid may already be another process's
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def close(self) -> None:
        if self.finalizer is not None:
            self.finalizer()
