"""The gpu tier's world as session fixtures (each built once, and only when a test asks for it), and its report:
one line per test as it ends,

    PASS|FAIL|SKIP  <test>  <measured>  -> <what to do>  [seconds]

the library's output and every traceback in ``<basetemp>/gpu_check.log`` (``make gpu-check``:
``.pytest_cache/gpu-check/gpu_check.log``, the runs' files in ``runs/`` beside it), then a summary. The lines are
printed when the session runs this tier alone (``make gpu-check``); inside ``make test`` the tier is reported as
any other. Its tests are marked ``gpu`` by tests/conftest.py (the tiers are assigned there only).
"""

from __future__ import annotations

import gc
import os
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from gpu_world import (
    BLOCK_DRAFTERS,
    GPU,
    INSTALL_ENV,
    INSTALL_SPEC_ENV,
    LONG_STEPS,
    MAX_TOKENS,
    N_PROMPTS,
    RECIPES,
    SERVED_RECIPE,
    SHORT_STEPS,
    VLLM_GPU_VENV,
    Budget,
    K,
    VllmInstall,
    build_reference,
    start_gpu_vllm,
    train,
)

# The order the tier runs in: the device first, vLLM last (it wants most of the GPU's memory, and gets what is
# left of the budget); a module not listed runs before vLLM's.
ORDER = ("test_gpu_device.py", "test_gpu_hidden.py", "test_gpu_train.py", "test_gpu_accept.py",
         "test_gpu_serve.py", "test_gpu_blocks.py", "test_gpu_vllm.py")


# ---------------------------------------------------------------------------------------------- the world


@pytest.fixture(scope="session", autouse=True)
def clock() -> Budget:
    """The 10 minutes, from the tier's first test (skipped tests never start it)."""
    return Budget()


@pytest.fixture(scope="session")
def work(tmp_path_factory) -> Path:
    """The runs' folder, ``<basetemp>/runs`` (beside the log)."""
    return tmp_path_factory.mktemp("runs", numbered=False)


@pytest.fixture(scope="session")
def toy(toy_smoke) -> Path:
    """The target: the shipped smoke toy."""
    return toy_smoke


@pytest.fixture(scope="session")
def reference(work, toy, clock) -> dict[str, Path]:
    """The CPU float32 reference data (gpu_world.build_reference): ``synth``, ``cpu-fp32``, ``cpu-topk``,
    ``cpu-full``."""
    return build_reference(work, toy, clock)


@pytest.fixture(scope="session")
def short_runs(work, reference) -> dict[str, dict[str, Any]]:
    """03 for SHORT_STEPS on the reference: on cuda under bf16 autocast, on cuda in fp32, on CPU."""
    data = reference["cpu-fp32"]
    return {"cuda-bf16": train(work, data, "cuda-bf16", GPU, "auto", SHORT_STEPS),
            "cuda-fp32": train(work, data, "cuda-fp32", GPU, "off", SHORT_STEPS),
            "cpu": train(work, data, "cpu", "cpu", "auto", SHORT_STEPS)}


@pytest.fixture(scope="session")
def recipe_runs(work, reference) -> dict[str, dict[str, dict[str, Any]]]:
    """Each recipe trained on cuda in fp32 and on CPU: ``{recipe: {"cuda": metrics, "cpu": metrics}}``."""
    return {name: {dev: train(work, reference["cpu-fp32"], f"{name}-{dev}", GPU if dev == "cuda" else "cpu", "off",
                              SHORT_STEPS, **values) for dev in ("cuda", "cpu")}
            for name, (values, _) in RECIPES.items()}


@pytest.fixture(scope="session")
def served(work, reference) -> dict[str, Any]:
    """The EAGLE-3 draft every later test uses: trained on cuda under autocast for LONG_STEPS, exported (03's
    metrics: ``draft_dir``, ``sglang_draft_dir``)."""
    return train(work, reference["cpu-fp32"], "served", GPU, "auto", LONG_STEPS)


@pytest.fixture(scope="session")
def draft_dir(served) -> Path:
    return Path(served["draft_dir"])


@pytest.fixture(scope="session")
def served_recipe(work, reference) -> Path:
    """The 2-layer EAGLE-3.1 draft vLLM serves, trained on cuda under autocast, exported."""
    return Path(train(work, reference["cpu-fp32"], "served-recipe", GPU, "auto", LONG_STEPS, **SERVED_RECIPE)
                ["draft_dir"])


@pytest.fixture(scope="session")
def block_draft(work, reference) -> Callable[[str], Path]:
    """``block_draft(method)``: the block drafter of BLOCK_DRAFTERS trained on cuda under autocast on the
    full-vocabulary reference data for the served EAGLE-3 draft's steps, exported; each trained once, when first
    asked for (a failure is kept, and leaves the other methods trainable)."""
    done: dict[str, Path | BaseException] = {}

    def draft(name: str) -> Path:
        if name not in done:
            try:
                done[name] = Path(train(work, reference["cpu-full"], f"served-{name}", GPU, "auto", LONG_STEPS,
                                        **BLOCK_DRAFTERS[name])["draft_dir"])
            except Exception as e:
                done[name] = e
                raise
        if isinstance(done[name], BaseException):
            raise RuntimeError(f"training the {name} draft failed earlier: {done[name]}")
        return done[name]

    return draft


@pytest.fixture(scope="session")
def prompts(toy) -> tuple[list[dict], list[list[int]], list[int]]:
    """The first N_PROMPTS held-out prompt rows, their chat-template ids and the end-of-turn ids."""
    from eagle3nb.data.prompts import load_prompts
    from eagle3nb.data.stream import Template

    tpl = Template(toy, True)
    rows = load_prompts("toy:heldout", N_PROMPTS)
    return rows, [tpl.prompt_ids(r["messages"]) for r in rows], [tpl.end_id]


@pytest.fixture(scope="session")
def cpu_target(toy) -> Any:
    """The target on CPU in float32: the local decoding reference."""
    import torch
    from transformers import AutoModelForCausalLM

    from eagle3nb.hf import from_pretrained

    return from_pretrained(AutoModelForCausalLM, toy, trust_remote_code=False, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def local_cpu(cpu_target, prompts) -> Callable[[Path], dict[str, Any]]:
    """``local_cpu(draft_dir)``: 04's local greedy speculative decoding of an EAGLE-3 draft on CPU (K drafts a
    round, each draft decoded once): the reference for its acceptance served on the GPU."""
    from eagle3nb.accept.local import compare_with_plain
    from eagle3nb.drafts import load_draft

    done: dict[Path, dict[str, Any]] = {}

    def local(draft: Path) -> dict[str, Any]:
        if draft not in done:
            _, ids, eos = prompts
            done[draft] = compare_with_plain(cpu_target, load_draft(draft), ids, K, MAX_TOKENS, 0.0, eos)
        return done[draft]

    return local


@pytest.fixture(scope="session", autouse=True)
def _vllm_installing(request, tmp_path_factory, clock) -> VllmInstall:
    """vLLM's GPU build found or installed in the background from the tier's first test, when a selected test
    uses it; ``make gpu-check`` asks for the install (``EAGLE3NB_GPU_INSTALL_VLLM=1``)."""
    from eagle3nb.vllm_config import TESTED_VERSION

    wanted = any({"vllm_install", "vllm_gpu"} & set(item.fixturenames) for item in request.session.items)
    install = VllmInstall(tmp_path_factory.getbasetemp() / "vllm-install.log", clock,
                          os.environ.get(INSTALL_ENV, "") not in ("", "0"),
                          os.environ.get(INSTALL_SPEC_ENV) or f"vllm=={TESTED_VERSION}")
    return install.start() if wanted else install


@pytest.fixture(scope="session")
def vllm_install(_vllm_installing) -> tuple[str, str, str]:
    """The install's (status, measured, what to do): ``skip`` when missing and not asked for."""
    status, measured, fix = _vllm_installing.wait()
    if status == "skip":
        pytest.skip(f"{measured}: {fix}")
    return status, measured, fix


@pytest.fixture(scope="session")
def vllm_gpu(vllm_install, toy, clock) -> Iterator[Callable[..., Any]]:
    """``vllm_gpu(mode, **kw)``: a vLLM server of .venv-vllm-gpu/ on the GPU (a context manager), within the
    budget; the tests using it skip when ``vllm_install`` did not pass."""
    from eagle3nb.serve.vllm import VLLM_VENV_ENV

    if vllm_install[0] != "pass":
        pytest.skip(f"needs vllm_install, which did not pass: {vllm_install[1]}")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(VLLM_VENV_ENV, str(VLLM_GPU_VENV))
        yield lambda mode, **kw: start_gpu_vllm(toy, clock, mode, **kw)


@pytest.fixture(autouse=True)
def _free_gpu_memory() -> Iterator[None]:
    """After each test, what it left on the GPU is released: vLLM, started last, wants most of the GPU's memory."""
    yield
    gc.collect()
    import torch

    torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------- the report


def last_error(text: str) -> str:
    """`` ... `` and the last error line of an exception's text after its first (a server that did not start
    carries its log's tail there, whose last error is the refusal), or nothing."""
    found = [x.strip() for x in text.strip().splitlines()[1:] if re.search(r"\w+Error:|Value error", x)]
    return f" ... {found[-1][:200]}" if found else ""


def is_gpu(nodeid: str) -> bool:
    return nodeid.startswith("tests/gpu/")


def short_name(nodeid: str) -> str:
    """A test's name in its line: ``vllm_block_drafters[dspark]`` for ``...::test_vllm_block_drafters[dspark]``."""
    return nodeid.split("::")[-1].removeprefix("test_")


@dataclass
class Report:
    """The tier's lines: printed when the session runs the tier alone; the log written whenever a gpu test ran."""

    config: pytest.Config | None = None
    active: bool = False  # the session's tests are the gpu tier's only
    log: Path | None = None
    width: int = 24  # the longest test name's, so the measurements line up
    t0: float = field(default_factory=time.monotonic)
    setup_s: dict[str, float] = field(default_factory=dict)
    statuses: list[str] = field(default_factory=list)

    def write_log(self, report: pytest.TestReport) -> None:
        if self.log is None:
            return
        with self.log.open("a") as out:
            print(f"\n--- {report.nodeid} ({report.when}: {report.outcome}, {report.duration:.1f} s) ---", file=out)
            for title, text in report.sections:
                if title.endswith(f" {report.when}"):  # a report carries its earlier phases' captures too
                    print(f"-- {title}\n{text}", file=out)
            if report.failed:
                print(report.longreprtext, file=out)

    def line(self, item_fix: str, report: pytest.TestReport) -> str | None:
        """The test's line once it ends (a skip or an error at set-up, its call, an error at teardown), else None."""
        name = short_name(report.nodeid)
        seconds = report.duration + self.setup_s.pop(report.nodeid, 0.0)
        if report.when == "setup" and report.passed:
            self.setup_s[report.nodeid] = report.duration
            return None
        if report.passed and report.when == "call":
            status, text = "PASS", "; ".join(str(v) for k, v in report.user_properties if k == "measured")
        elif report.skipped:
            status, text = "SKIP", str(report.longrepr[2] if isinstance(report.longrepr, tuple)
                                       else report.longrepr).removeprefix("Skipped: ")
        elif report.failed:
            crash = getattr(report.longrepr, "reprcrash", None)
            message = crash.message if crash else str(report.longrepr)
            kind, _, first = message.splitlines()[0].partition(": ") if message.strip() else ("", "", "")
            if kind in ("AssertionError", "Failed") and "  -> " in first:  # a comparison: "measured  -> what to do"
                text = first
            else:  # a crash (torch's own asserts included): its traceback is in the log
                text = (f"{report.when}: {message.splitlines()[0][:300]}{last_error(message)}  -> {item_fix} "
                        f"(traceback in {self.log})")
            status = "FAIL"
        else:
            return None
        self.statuses.append(status)
        measured, _, fix = text.partition("  -> ")
        return f"{status:4}  {name:{self.width}}  {measured} [{seconds:.0f} s]" + (f"  -> {fix}" if fix else "")


REPORT = Report()
FIXES: dict[str, str] = {}  # nodeid -> the test's covers mark's fix: what to do when it crashes


def pytest_configure(config: pytest.Config) -> None:
    REPORT.config = config


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tier in ORDER (the device first, vLLM last); other tests keep their places."""
    slots = [i for i, item in enumerate(items) if is_gpu(item.nodeid)]
    rank = {name: n for n, name in enumerate(ORDER)}
    ordered = sorted((items[i] for i in slots),
                     key=lambda item: rank.get(item.path.name, len(ORDER) - 1))  # stable: in-module order kept
    for i, item in zip(slots, ordered):
        items[i] = item
        mark = item.get_closest_marker("covers")
        FIXES[item.nodeid] = mark.kwargs.get("fix", "") if mark else ""


def pytest_collection_finish(session: pytest.Session) -> None:
    REPORT.active = bool(session.items) and all(is_gpu(item.nodeid) for item in session.items)
    REPORT.width = max([len(short_name(item.nodeid)) for item in session.items if is_gpu(item.nodeid)] + [0])
    REPORT.t0 = time.monotonic()


@pytest.fixture(scope="session", autouse=True)
def _gpu_log(tmp_path_factory) -> Path:
    """The log, opened when the tier's first test runs (never on a machine that skips it)."""
    REPORT.log = tmp_path_factory.getbasetemp() / "gpu_check.log"
    REPORT.log.write_text("")
    return REPORT.log


def pytest_report_teststatus(report: pytest.TestReport, config: pytest.Config) -> tuple[str, str, str] | None:
    """No progress letters for the tier's tests while it runs alone: its own lines say it."""
    if not (REPORT.active and is_gpu(report.nodeid)):
        return None
    if report.when == "call" or report.skipped or report.failed:
        category = "error" if report.failed and report.when != "call" else report.outcome
        return category, "", category.upper()
    return "", "", ""


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if not is_gpu(report.nodeid):
        return
    REPORT.write_log(report)
    text = REPORT.line(FIXES.get(report.nodeid, ""), report)
    if text is not None and REPORT.active and REPORT.config is not None:
        REPORT.config.pluginmanager.get_plugin("terminalreporter").write_line(text)


def pytest_terminal_summary(terminalreporter) -> None:
    if not REPORT.active:
        return
    counts = {s: REPORT.statuses.count(s) for s in ("PASS", "FAIL", "SKIP")}
    terminalreporter.write_line(
        f"gpu-check: {counts['PASS']} pass, {counts['FAIL']} fail, {counts['SKIP']} skip in "
        f"{time.monotonic() - REPORT.t0:.0f} s" + (f"; details in {REPORT.log}" if REPORT.log else ""))
