"""Not a fix: a vLLM that eagle3nb started ends when the process that started it is gone. A stage killed with
kill -9 (and resumed later) would otherwise leave its vLLM servers running, each holding gigabytes and a port;
``eagle3nb.serve.vllm.start_vllm`` names its own pid in :data:`ENV`, and every vLLM process (the API server, the
engine core) watches it and stops itself with SIGTERM, vLLM's own shutdown, once it has gone."""

from __future__ import annotations

import os
import signal
import threading
import time

ENV = "EAGLE3NB_EXIT_WITH_PARENT"  # the pid to outlive by no more than a second (start_vllm sets it)


def alive(pid: int) -> bool:
    """Whether a process ``pid`` exists."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, another user's
        return True
    return True


def install() -> None:
    """Start the watch when :data:`ENV` names a pid (a vLLM started by hand is left alone)."""
    pid = os.environ.get(ENV)
    if not pid:
        return

    def watch() -> None:
        while alive(int(pid)):
            time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="eagle3nb-exit-with-parent", daemon=True).start()
