"""Start a server process and wait for it: ``start_server`` runs the embedded server (``eagle3nb serve``) in a
subprocess; ``launch`` is the start-and-wait-for-/health loop any server uses (the real vLLM's too).

Core, light to import: the server process loads torch, transformers and FastAPI; this module only starts it,
so a stage that needs a server for its run (01's and 04's ``embedded`` endpoints) imports nothing above it.
"""

from __future__ import annotations

import os
import random
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from eagle3nb.errors import InputError
from eagle3nb.toy import resolve_model_path

__all__ = ["start_server", "ServerHandle", "launch", "free_port"]


class ServerHandle:
    """A running ``eagle3nb serve`` subprocess. ``.url`` is ``http://HOST:PORT``, ``.base_url`` adds ``/v1``
    (what the openai client takes); its stdout+stderr go to ``.log_path``. Stop it with ``.stop()`` or a
    ``with`` block."""

    def __init__(self, proc: subprocess.Popen, host: str, port: int, log_path: Path):
        self.proc, self.host, self.port, self.log_path = proc, host, port, log_path
        self.url = f"http://{host}:{port}"
        self.base_url = self.url + "/v1"

    def log(self) -> str:
        """Everything the server printed so far."""
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 10.0) -> None:
        """Terminate, wait, then kill if it does not exit."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> "ServerHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"ServerHandle({self.base_url}, pid={self.proc.pid})"


_HANDED_OUT: set[int] = set()
_HANDED_LOCK = threading.Lock()
# A port the project chooses is drawn below the kernel's ephemeral range (Linux: 32768-60999), where no process's
# bind(0) lands (vLLM's workers bind ephemeral ports for their own sockets), with os.urandom's randomness, so two
# processes (pytest's workers, two runs) draw apart; a draw taken anyway is retried by ``launch``.
CHOSEN_PORTS = range(20000, 32768)
# Starts of a server on a fresh chosen port when the last one was taken between the choice and the server's bind.
PORT_TRIES = 5


def free_port(host: str) -> int:
    """A port free now, never handed out before by this process, drawn at random from :data:`CHOSEN_PORTS` (bind(0)
    offers the next ephemeral port to every process alike, and any process's own ephemeral binds may take it)."""
    draw = random.SystemRandom()
    with _HANDED_LOCK:
        while True:
            port = draw.choice(CHOSEN_PORTS)
            if port in _HANDED_OUT or _held(host, port):
                continue
            _HANDED_OUT.add(port)
            return port


def _held(host: str, port: int) -> bool:
    """Whether another socket holds ``port`` on ``host`` (a closed server's TIME_WAIT does not: servers bind with
    SO_REUSEADDR)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def start_server(model_dir: str | os.PathLike, *, host: str = "127.0.0.1", port: int = 0,
                 reasoning_field: str = "reasoning", reasoning_parser: bool = True, api_key_env: str | None = None,
                 draft_dir: str | os.PathLike | None = None, num_speculative_tokens: int = 3,
                 trust_remote_code: bool = False, extra_args: tuple[str, ...] | list[str] = (),
                 timeout: float = 180.0) -> ServerHandle:
    """Start ``python -m eagle3nb serve`` in a subprocess and wait until ``/health`` answers.

    ``model_dir`` is a Hugging Face folder or ``toy:smoke`` / ``toy:demo`` (built here first if not cached, so
    the build's progress shows in the caller and ``timeout`` covers only the server's start; it is served
    under that name); ``port=0`` picks a free port (another, if it is taken before the server binds it: ``launch``);
    ``trust_remote_code`` lets the folder's own code run (the stage's parameter). Raises InputError with the end of
    the server's output if it exits or is not healthy within ``timeout``.
    """
    model = str(model_dir)
    cmd = [sys.executable, "-m", "eagle3nb", "serve", "--host", host, "--port", str(port),
           "--reasoning-field", reasoning_field, "--exit-with-parent", str(os.getpid())]
    if model.startswith("toy:"):
        cmd += ["--model", str(resolve_model_path(model))]
        if "--served-model-name" not in extra_args:
            cmd += ["--served-model-name", model]
    else:
        cmd += ["--model", model]
    if not reasoning_parser:
        cmd.append("--no-reasoning-parser")
    if api_key_env:
        cmd += ["--api-key-env", api_key_env]
    if trust_remote_code:
        cmd.append("--trust-remote-code")
    if draft_dir is not None:
        cmd += ["--draft", str(draft_dir), "--num-speculative-tokens", str(num_speculative_tokens)]
    cmd += [str(a) for a in extra_args]
    return launch(cmd, host, port, "eagle3nb serve", timeout)


def launch(cmd: list[str], host: str, port: int, name: str, timeout: float,
           env: dict[str, str] | None = None) -> ServerHandle:
    """Start a server process (output to a log file) and wait until ``/health`` answers 200. Raises InputError with
    the end of its output if it exits or is not healthy within ``timeout``.

    ``port`` 0: the project chooses one (:func:`free_port`) and writes it after ``--port`` in ``cmd``. Any process may
    take a free port between the choice and the server's bind, so a server that fails to bind a chosen port, or
    finds it held before it starts, starts again on a fresh one (:data:`PORT_TRIES` in all). A port the caller named
    is refused when another process holds it: the new server would fail to bind it while the old one answered
    ``/health``, and every request meant for the new one would reach the old (a stale vLLM from a killed run did
    exactly that)."""
    chosen = port == 0
    for _ in range(PORT_TRIES if chosen else 1):
        if chosen:
            port = free_port(host)
            cmd = _with_port(cmd, port)
        elif _held(host, port):
            raise InputError(f"{name}: port {port} on {host} is already in use (a server left running by an earlier "
                             f"run? `ss -ltnp | grep :{port}` names it): stop it, or give another port")
        handle = _start(cmd, host, port, name, timeout, env)
        if handle is not None:
            return handle
        print(f"{name}: port {port} was taken before the server bound it; starting it on another", flush=True)
    raise InputError(f"{name}: {PORT_TRIES} ports chosen on {host} were each taken before the server bound it; "
                     "free some ports or give one (port)")


def _with_port(cmd: list[str], port: int) -> list[str]:
    """``cmd`` with the value after ``--port`` replaced by ``port``."""
    if "--port" not in cmd:
        raise ValueError(f"a server command launched on a chosen port needs --port: {cmd}")
    i = cmd.index("--port") + 1
    return [*cmd[:i], str(port), *cmd[i + 1:]]


# What a server prints when another process took its port (uvicorn: "[Errno 98] error while attempting to bind ...
# address already in use"; vLLM's own socket: "[Errno 98] Address already in use").
BIND_FAILED = re.compile(r"address already in use|Errno 98\b", re.IGNORECASE)


def _start(cmd: list[str], host: str, port: int, name: str, timeout: float,
           env: dict[str, str] | None) -> ServerHandle | None:
    """One start: the healthy server's handle, or None when it lost its (chosen) port to another process before it
    bound it (it exited saying so, or another process answers on it)."""
    fd, log_name = tempfile.mkstemp(prefix=f"eagle3nb-{name.replace(' ', '-')}-{port}-", suffix=".log")
    log_path = Path(log_name)
    with os.fdopen(fd, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    handle = ServerHandle(proc, host, port, log_path)
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            if BIND_FAILED.search(handle.log()):
                return None
            output = handle.log()  # its own refusal on the first line: a user error shows two lines at most
            raise InputError(f"{name} exited with code {proc.returncode} before it was ready{_reason(output)}; "
                             f"its output ({log_path}) ends with:\n{_tail(output)}")
        try:
            with urllib.request.urlopen(handle.url + "/health", timeout=2) as r:
                if r.status == 200:
                    if _listener_is_ours(proc, port):
                        return handle
                    handle.stop()
                    return None
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        if time.monotonic() > deadline:
            handle.stop()
            raise InputError(f"{name} did not answer {handle.url}/health within {timeout:.0f} s; "
                             f"its output ({log_path}) ends with:\n{_tail(handle.log())}")
        time.sleep(0.2)


def _listener_is_ours(proc: subprocess.Popen, port: int) -> bool:
    """Whether the socket listening on ``port`` belongs to ``proc`` or a child of it (True when the system does not
    say): a server that lost its port must not be taken for the one that won it."""
    import psutil

    try:
        ours = {proc.pid, *(c.pid for c in psutil.Process(proc.pid).children(recursive=True))}
        owners = {c.pid for c in psutil.net_connections("tcp")
                  if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN}
    except (psutil.Error, OSError):
        return True
    return not owners - {None} or bool(owners & ours)


# A server's refusal in its output: our commands' one line (``<prog>: error: <message>``, eagle3nb.errors.guarded),
# else a traceback's exception line (vLLM's ``ValueError: ...``).
_OUR_ERROR = re.compile(r"^\S[^:]*: error: (?P<reason>.+)$")
_EXCEPTION = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception): (?P<reason>.+)$")


def _reason(output: str) -> str:
    """``": <why>"``, the server's own refusal found in its output, or "": its last line of our commands' error
    format (wherever progress bars and prints flushed at exit put it), else its first exception line (a chained
    traceback's root cause: vLLM's engine failing to start ends with a RuntimeError pointing above)."""
    lines = [ln.strip() for ln in output.splitlines()]
    ours = [m["reason"] for m in map(_OUR_ERROR.match, lines) if m]
    raised = [m["reason"] for m in map(_EXCEPTION.match, lines) if m]
    return f": {ours[-1]}" if ours else f": {raised[0]}" if raised else ""


def _tail(text: str, lines: int = 30) -> str:
    """The last ``lines`` lines of a server's output (a progress bar's carriage returns split it into lines)."""
    return "\n".join(text.splitlines()[-lines:])
