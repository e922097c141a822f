"""What every fix shares: its log line, and the guard that keeps one fix's failure from stopping vLLM.

vLLM calls a general plugin's ``register()`` unguarded (``vllm.plugins.load_general_plugins``): an exception there
aborts the server's start. The fixes reach into vLLM's private names (``_expand``, ``_get_attn_isa``,
``cpu_attn_get_scheduler_metadata``'s keywords, ``register_kernels``, ``MultipleOf``), which a later vLLM may rename
or change, so each runs under :func:`guarded`: a fix that cannot install, or whose patch does not remove the defect
its probe found, logs one ``eagle3nb_vllm_fixes.<fix> skipped: <why>`` warning and vLLM starts without it (the
launcher, ``eagle3nb.serve.vllm.start_vllm``, repeats those lines after the start).
"""

from __future__ import annotations

from collections.abc import Callable


class NotFixed(RuntimeError):
    """A patch that its own probe, run again after applying it, still finds defective (the patch was undone)."""


def log(fix: str, line: str, warning: bool = False) -> str:
    """``line`` in vLLM's server log, from the ``vllm.eagle3nb_vllm_fixes.<fix>`` logger (vLLM's logging config
    handles the "vllm" tree); returns the line, prefixed ``eagle3nb_vllm_fixes.<fix>: ``."""
    from vllm.logger import init_logger

    line = f"eagle3nb_vllm_fixes.{fix}: {line}"
    logger = init_logger(f"vllm.eagle3nb_vllm_fixes.{fix}")
    (logger.warning if warning else logger.info)(line)
    return line


def guarded(fix: str, step: Callable[[], object], without: str) -> None:
    """Run ``step`` (a fix's install or check); any exception becomes one warning naming the fix, why it was
    skipped and ``without`` (what vLLM gets wrong without it), and vLLM goes on."""
    try:
        step()
    except Exception as e:  # a renamed private name, a changed signature, a failed probe: never stop vLLM
        why = str(e) if isinstance(e, NotFixed) else f"{type(e).__name__}: {e}"
        log(fix, f"skipped: {why}; vLLM runs without this fix: {without}", warning=True)
