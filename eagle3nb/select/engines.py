"""The user's engine, one server at a time: the target plainly, or serving one candidate at its k as the method its
checkpoint declares (``eagle3nb.drafts.served_method``). ``vllm`` is the real vLLM (``start_vllm``, each server
writing the profile of its rounds), ``embedded`` eagle3nb's own server (no profile). A candidate the engine refuses
is not an error of the selection: :func:`refusal` reads the engine's own reason from its log."""

from __future__ import annotations

import json
import re
from pathlib import Path

from eagle3nb.drafts import ServingError, served_method
from eagle3nb.launch import ServerHandle, start_server
from eagle3nb.serve.vllm import start_vllm
from eagle3nb.vllm_config import draft_spec

# What a refused start's error says, in the order it is looked for in the server's log: pydantic's refusal of a
# config (vLLM's VllmConfig: "Value error, Model Runner V2 requires Triton. [type=value_error"), then the first
# exception line that is not the "initialization failed" wrapping it.
_VALUE_ERROR = re.compile(r"\bValue error, (.*?)\s*\[type=")
_RAISED = re.compile(r"\b(\w+(?:Error|Exception)): (.*)")
_LOG = re.compile(r"its output \((\S+)\)")


def start(P, draft: Path | None = None, k: int | None = None, rounds: Path | None = None) -> ServerHandle:
    """The engine ``P.engine`` serving the target plainly (``draft`` None) or with ``draft`` at ``k``; vLLM writes
    its rounds' profile to ``rounds``."""
    if P.engine == "vllm":
        if draft is None:
            return start_vllm(P.model_path, "plain", family=P.family, rounds=rounds)
        return start_vllm(P.model_path, served_method(draft), draft_dir=draft, num_speculative_tokens=k,
                          family=P.family, rounds=rounds)
    return start_server(P.model_path, draft_dir=draft, num_speculative_tokens=k or 3,
                        trust_remote_code=P.trust_remote_code)


def refusal(error: Exception) -> str:
    """The engine's own reason for not starting, one line: from the server's log named in the error (a refused
    config, else its first exception), else the error's first line; a draft the project's own serving check refused
    before any server started (``eagle3nb.drafts.check_serving``) says so."""
    text = str(error)
    if isinstance(error, ServingError):
        return f"refused before the engine started, by eagle3nb's serving check: {text.splitlines()[0][:300]}"
    found = _LOG.search(text)
    log = Path(found.group(1)) if found else None
    lines = log.read_text(errors="replace").splitlines() if log is not None and log.exists() else text.splitlines()
    for line in lines:
        if m := _VALUE_ERROR.search(line):
            return m.group(1)
    for line in lines:
        m = _RAISED.search(line)
        if m and "initialization failed" not in line and "WARNING" not in line:
            return f"{m.group(1)}: {m.group(2)}"[:300]
    return text.splitlines()[0][:300] if text else type(error).__name__


def serve_command(P, draft: Path, k: int) -> str:
    """How to serve the picked draft on the user's engine: vLLM's flags (``vllm_config.draft_spec``; add the target's
    own, its reasoning parser and parallelism), or eagle3nb's own server."""
    if P.engine == "vllm":
        spec = draft_spec(draft, k, served_method(draft))
        return f"vllm serve {P.model_dir} --speculative-config '{json.dumps(spec)}'"
    return f"eagle3nb serve --model {P.model_path} --draft {draft} --num-speculative-tokens {k}"
