"""Shared fixtures: the shipped toy world (the same bytes on every machine), and a run that never writes under
the repository's ``outputs/``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from worlds import SEED, THREADS

ROOT = Path(__file__).resolve().parents[1]

# the measured budget: wall time per module and per shared fixture at the end of every run (tests/budget.py); the
# tiny random targets' fixtures several modules build their own of (tests/tiny_targets.py)
pytest_plugins = ["budget", "tiny_targets"]

# The tiers, assigned here only (test files carry no tier marks of their own; `make test-fast` deselects all four,
# `make test` runs everything). ``engine``: every test worlds.requires_vllm() marks, or that uses a server of the
# ``engines`` registry through its fixtures (the real vLLM); ``browser``:
# headless Chromium; ``slow``: the modules, shared fixtures and single tests whose measured cost (docs/testing.md's
# table) would push the fast tier past its 4 minutes on two cores: papermill end-to-end runs, family toy builds, long
# trainings, kill-and-resume runs in subprocesses; ``gpu``: the tests in tests/gpu/, every CUDA path against CPU float32
# (`make gpu-check` runs them on a machine with an NVIDIA GPU; elsewhere they skip at once, building nothing).
BROWSER_MODULES = {"test_browser.py"}
GPU_DIR = ROOT / "tests" / "gpu"
# papermill over the smoke run; the GLM toy, trained here; 05's refreshes (a draft trained, then fine-tuned per seed)
SLOW_MODULES = {"test_e2e.py", "test_family_glm.py", "test_refresh.py"}
# the trained runs (any fixture of that name: the session's, and a family module's own), the toys built from a
# family's real tokenizer, Kimi's trained MLA draft
SLOW_FIXTURES = {"trained", "qwen3", "gptoss", "kimi_trained", "staged", "smoke_selection"}
# single tests of fast modules that alone cost 10-20 s on a quiet machine (a toy rebuilt from its recipe, a torchrun
# killed and resumed, 02, 03 and the runner killed and resumed, two gloo ranks, a vLLM server of its own, the spread
# prompt's search of the verification G-tests): the rest stays in the inner loop
SLOW_TESTS = {"test_toy.py::test_a_fresh_rebuild_is_as_good_as_the_shipped_toy",
              "test_scale.py::test_online_under_torchrun_resumes_after_kill9_exactly",
              "test_hidden.py::test_kill_9_and_resume_gives_identical_shards",
              "test_train.py::test_two_gloo_processes_equal_one_process_with_the_same_global_batch",
              "test_train.py::test_resume_after_kill9_follows_the_uninterrupted_curve",
              "test_run.py::test_kill_9_then_resume_status_and_refusal",
              "test_run.py::test_detach_survives_its_terminal_and_refuses_a_second_run",
              "test_family_kimi.py::test_kimi_vllm_serves_a_dflash_block_drafter",
              "test_family_kimi.py::test_kimi_vllm_started_from_another_directory_has_the_fixes",
              "test_vllm_plugin.py::test_the_wheel_ships_the_plugin_and_the_installed_package_finds_it",
              "test_accept_spec.py::test_sampled_verification_keeps_the_targets_distribution_g_test"}


# Run side by side (`make test`: pytest-xdist, two workers, --dist loadgroup), each module stays in one worker (its
# module-scoped fixtures are built once) and the modules with real-vLLM tests share one worker, whose session holds
# the engines registry their toy:smoke servers are shared through; the family modules below serve only their own
# targets, so each is a group of its own that may run beside the others.
OWN_ENGINE_WORLDS = {"test_family_kimi.py", "test_family_qwen3.py", "test_family_glm.py", "test_family_gptoss.py",
                     "test_harmony.py"}


def module_of(item) -> str:
    return item.nodeid.split("::")[0].rsplit("/", 1)[-1]


def pytest_collection_modifyitems(config, items) -> None:
    _assign_tiers(items)
    engine = {module_of(item) for item in items if item.get_closest_marker("engine")}
    for item in items:
        module = module_of(item)
        item.add_marker(pytest.mark.xdist_group("engine" if module in engine - OWN_ENGINE_WORLDS else module))


def _assign_tiers(items) -> None:
    for item in items:
        module = module_of(item)
        if "engines" in item.fixturenames or any(m.kwargs.get("tier") == "engine" for m in item.iter_markers("skipif")):
            item.add_marker(pytest.mark.engine)
        if module in BROWSER_MODULES:
            item.add_marker(pytest.mark.browser)
        if item.path.parent == GPU_DIR:
            item.add_marker(pytest.mark.gpu)
        slow_test = f"{module}::{item.originalname}" in SLOW_TESTS
        # fixturenames: with what they use
        if module in SLOW_MODULES or slow_test or SLOW_FIXTURES & set(item.fixturenames):
            item.add_marker(pytest.mark.slow)


def pytest_report_header(config) -> list[str]:
    from eagle3nb.toy.shipped import digest, manifest

    return [f"toy world: shipped toy:{size} sha256 {digest(size)}" for size in sorted(manifest())] + \
        [f"trained fixtures: seed {SEED} (EAGLE3NB_TEST_SEED), {THREADS} torch thread(s) (EAGLE3NB_TEST_THREADS)"]


def _outputs_snapshot() -> dict[str, tuple[int, int]]:
    out = ROOT / "outputs"
    return {str(p.relative_to(out)): (p.stat().st_size, p.stat().st_mtime_ns) for p in out.rglob("*")
            if p.is_file()} if out.is_dir() else {}


@pytest.fixture(scope="session", autouse=True)
def _project_env(tmp_path_factory):
    """Tests resolve relative params against the repo, keep the toy rebuild cache in one place, and send every
    run's default output folders to a temporary one: a test that writes under ``outputs/`` fails here."""
    os.environ.setdefault("EAGLE3NB_ROOT", str(ROOT))
    os.environ.setdefault("EAGLE3NB_CACHE", str(ROOT / ".cache"))
    # The real vLLM servers run their model worker inside the engine-core process (vLLM's uni executor, what it
    # uses on one GPU) instead of the CPU build's separate worker process: one Python start (vLLM's import) fewer
    # per server, ~10 s of a 30-s start on two cores (docs/testing.md); the kernels and the engine are the same.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ["EAGLE3NB_OUTPUTS"] = str(tmp_path_factory.mktemp("outputs"))
    before = _outputs_snapshot()
    yield
    after = _outputs_snapshot()
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    assert not changed, f"the tests wrote under outputs/ (tests use temporary folders only): {changed[:10]}"


@pytest.fixture(scope="session", autouse=True)
def background(request, _project_env, tmp_path_factory):
    """The runner of the worlds registered in tests/background.py that this session's tests use, started as the
    session starts and handed them in the order their first users run."""
    from background import JOBS, Background

    first: dict[str, int] = {}
    for i, item in enumerate(request.session.items):
        for name in JOBS:
            if name in item.fixturenames:
                first.setdefault(name, i)
    runner = Background(tmp_path_factory.mktemp("background"), sorted(first, key=first.get))
    yield runner
    runner.close()


@pytest.fixture(scope="session", autouse=True)
def _vllm_model_info(request, _project_env):
    """vLLM's model-info cache filled in one process as the session starts, when its tests use the real vLLM
    (tests/engines.py's ``warm_model_info``): not 16 inspections of vLLM's own on a fresh machine."""
    from eagle3nb.serve.vllm import unavailable_reason

    from engines import warm_model_info

    uses_vllm = any(item.get_closest_marker("engine") for item in request.session.items)
    proc = warm_model_info() if uses_vllm and unavailable_reason() is None else None
    yield proc
    if proc is not None:
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"filling vLLM's model-info cache failed:\n{err[-3000:]}"


@pytest.fixture(scope="session")
def toy_smoke(_project_env) -> Path:
    """The shipped smoke-size toy target (tokenizer + trained Llama): the same bytes on every machine."""
    from eagle3nb.toy import shipped

    return shipped("smoke")


@pytest.fixture(scope="module")
def one_thread():
    """``THREADS`` (1 unless tools/variations.py says otherwise) torch threads for a module's training: on two
    cores shared with other processes one is faster than two (their threads stall each other), and runs repeat
    bit for bit (the resume tests compare exactly)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def embedded(toy_smoke):
    """The embedded server on the smoke toy (reasoning parser on), shared by every test that only reads it."""
    from eagle3nb.launch import start_server

    with start_server(toy_smoke) as handle:
        yield handle


@pytest.fixture(scope="session")
def engines(tmp_path_factory):
    """The session's real vLLM servers, one per (model, mode, options), shared across modules (tests/engines.py)."""
    from engines import Engines

    registry = Engines(tmp_path_factory.mktemp("engines"))
    yield registry
    registry.close()


@pytest.fixture(scope="session")
def trained(tmp_path_factory, toy_smoke, embedded) -> dict:
    """A small healthy run with a well-trained draft (``tests/worlds.py``): ``{"run", "out", "stages"}``."""
    from worlds import build_trained_run

    return build_trained_run(tmp_path_factory.mktemp("trained"), toy_smoke, embedded.url, seed=SEED)
