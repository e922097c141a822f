"""Starting a server on a port the project chose: a port another process takes between the choice and the server's
bind is replaced by a fresh one (``eagle3nb.launch.launch``), and a server that lost its port is never taken for the
process that won it. A port the user named is refused instead (tests/test_bad_input.py)."""

from __future__ import annotations

import socket
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

import eagle3nb.launch as launch_module
from eagle3nb.launch import launch

# A server as small as they come: binds --port (as every server does, SO_REUSEADDR) and answers /health.
HEALTH_SERVER = """
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer
class H(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *a):
        pass
port = int(sys.argv[sys.argv.index("--port") + 1])
HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def held_port() -> socket.socket:
    """A socket listening on a port, as another process's server would."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


def test_a_chosen_port_taken_before_the_server_binds_it_is_replaced(monkeypatch, capsys):
    """The first port handed out is taken by another listener right after it was chosen (the race bind(0)-and-close
    leaves open): the server fails to bind it, and launch starts it again on the next chosen port."""
    taker = held_port()
    taken = taker.getsockname()[1]
    draws = [taken]
    real = launch_module.free_port
    monkeypatch.setattr(launch_module, "free_port", lambda host: draws.pop(0) if draws else real(host))
    try:
        handle = launch([sys.executable, "-c", HEALTH_SERVER, "--port", "0"], "127.0.0.1", 0, "probe", timeout=30)
    finally:
        taker.close()
    try:
        assert handle.port != taken and not draws
        assert f"--port {handle.port}" in " ".join(handle.proc.args)
        assert "was taken before the server bound it" in capsys.readouterr().out
    finally:
        handle.stop()


def test_a_server_answering_on_the_chosen_port_must_be_the_one_started(monkeypatch):
    """Another process answers /health on the chosen port while the started process holds no port at all: its
    answer is not taken for the new server's (the listener belongs to neither it nor a child of it), and once every
    try is spent launch says so in one line."""

    class Health(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()

        def log_message(self, *a):
            pass

    other = HTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    monkeypatch.setattr(launch_module, "free_port", lambda host: other.server_address[1])
    monkeypatch.setattr(launch_module, "_held", lambda host, port: False)
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)", "--port", "0"]
    try:
        with pytest.raises(launch_module.InputError, match=r"^probe: 5 ports chosen on 127\.0\.0\.1 were each taken"):
            launch(sleeper, "127.0.0.1", 0, "probe", timeout=30)
    finally:
        other.shutdown()
