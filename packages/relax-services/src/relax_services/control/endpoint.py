"""The running driver's control endpoint: how ``relax scale RUN_DIR rollout=N`` reaches the run.

The channel is a Unix domain socket served by the driver (the ``relax train`` process), in a directory of its own
that only the run's owner may enter (``tempfile.mkdtemp``: mode 0700; the socket itself 0600), named in
``RUN_DIR/control.json`` (``socket``, ``pid``) while the run goes and removed when it ends. Why a local socket and not
a named Ray actor in the run's namespace: the file permissions make it the owner's alone (Ray has no access control:
anyone who reaches the cluster could call a named actor), a request needs no Ray driver connection (seconds, and the
cluster's address) and works the same on a local Ray and on a cluster, and the socket lives exactly as long as the
driver that can act on it, so a finished run answers at once that it is not running.

Protocol: one JSON object per line each way (``{"op": "scale", "role": "rollout", "count": N}`` → ``{"ok": true,
...}`` or ``{"error": "..."}``). Requests are served one at a time, in order: the server thread hands each to the
controller's loop (:meth:`ControlEndpoint.pending`), which carries it out between its ticks and answers.

Light: the standard library only.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shutil
import socket
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["CONTROL_FILE", "ControlEndpoint", "EndpointError", "JsonObject", "PendingRequest", "send_request"]

JsonObject = dict[str, object]
"""A JSON object: a request or an answer."""

CONTROL_FILE = "control.json"
"""The run folder's file naming the driver's socket while the run goes."""

_ANSWER_TIMEOUT_S = 1800.0
"""Longest a request waits for the controller's answer (a scale-out builds a process and its model)."""


class EndpointError(RuntimeError):
    """A request could not be delivered or was refused; the message says why (for the command line)."""


@dataclass
class PendingRequest:
    """A request waiting for the controller's answer."""

    request: JsonObject
    answer: JsonObject = field(default_factory=dict)
    done: threading.Event = field(default_factory=threading.Event)

    def reply(self, answer: JsonObject) -> None:
        """Answer the request (the server thread sends it back)."""
        self.answer = answer
        self.done.set()


class ControlEndpoint:
    """Serves the run's control socket from a thread of the driver; :meth:`close` ends it and removes its files.

    Args:
        run_dir: The run folder, where ``control.json`` names the socket.
    """

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self._dir = Path(tempfile.mkdtemp(prefix="relax-ctl-"))  # mode 0700: the owner's only
        self.path = self._dir / "control.sock"
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(str(self.path))
        os.chmod(self.path, 0o600)
        self._sock.listen(8)
        self._sock.settimeout(0.2)
        self._requests: queue.Queue[PendingRequest] = queue.Queue()
        self._stop = threading.Event()
        info = run_dir / CONTROL_FILE
        tmp = info.with_suffix(".tmp")
        tmp.write_text(json.dumps({"socket": str(self.path), "pid": os.getpid()}), encoding="utf-8")
        tmp.replace(info)
        self._thread = threading.Thread(target=self._serve, name="relax-control", daemon=True)
        self._thread.start()

    def pending(self) -> PendingRequest | None:
        """The next request to carry out, or None."""
        try:
            return self._requests.get_nowait()
        except queue.Empty:
            return None

    def close(self) -> None:
        """Stop serving (a request still waiting is answered that the run ended) and remove the socket and
        ``control.json``."""
        self._stop.set()
        self._thread.join(timeout=5.0)
        with contextlib.suppress(OSError):
            self._sock.close()
        while (left := self.pending()) is not None:
            left.reply({"error": "the run ended before the request was carried out"})
        with contextlib.suppress(OSError):
            (self.run_dir / CONTROL_FILE).unlink()
        shutil.rmtree(self._dir, ignore_errors=True)

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                self._answer(conn)

    def _answer(self, conn: socket.socket) -> None:
        conn.settimeout(10.0)
        try:
            line = conn.makefile("r", encoding="utf-8").readline()
            request = json.loads(line)
            if not isinstance(request, dict):
                raise ValueError("a request is a JSON object")
        except (OSError, ValueError) as exc:
            answer: JsonObject = {"error": f"bad request: {exc}"}
        else:
            pending = PendingRequest(request)
            self._requests.put(pending)
            while not pending.done.wait(0.2):
                if self._stop.is_set():
                    pending.reply({"error": "the run ended before the request was carried out"})
            answer = pending.answer
        with contextlib.suppress(OSError):
            conn.settimeout(10.0)
            conn.sendall((json.dumps(answer) + "\n").encode())


def send_request(run_dir: Path, request: JsonObject, timeout_s: float = _ANSWER_TIMEOUT_S) -> JsonObject:
    """Send ``request`` to the driver of the run in ``run_dir`` and return its answer.

    Raises:
        EndpointError: the run is not running (no ``control.json``, or its driver is gone), or the driver refused
            the request (its message).
    """
    info = run_dir / CONTROL_FILE
    if not run_dir.is_dir():
        raise EndpointError(f"{run_dir} is not a run folder")
    if not info.is_file():
        raise EndpointError(
            f"the run in {run_dir} is not running (no {CONTROL_FILE}: it finished, stopped or has not started yet)"
        )
    where = json.loads(info.read_text(encoding="utf-8"))
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout_s)
            sock.connect(where["socket"])
            sock.sendall((json.dumps(request) + "\n").encode())
            line = sock.makefile("r", encoding="utf-8").readline()
    except (FileNotFoundError, ConnectionRefusedError) as exc:
        raise EndpointError(
            f"the run in {run_dir} is not running (its driver, pid {where.get('pid')}, is gone: {exc})"
        ) from None
    if not line:
        raise EndpointError(f"the driver of {run_dir} closed the connection without answering (the run ended?)")
    answer: JsonObject = json.loads(line)
    if "error" in answer:
        raise EndpointError(str(answer["error"]))
    return answer
