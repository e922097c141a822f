"""The gpu tier's world: what its session fixtures (tests/gpu/conftest.py) build and its tests share, the
tolerances' sizes, and the skip marks that make the tier skip at once on a machine without a usable GPU.

Everything runs on the smoke toy; the CPU float32 reference is built in a process that sees no GPU, and each GPU
run is compared with it. This module imports no torch at import time: ``make test`` on a CPU collects the tier for
the price of its imports, and ``tests/test_params.py`` reads :data:`BLOCK_DRAFTERS` before any torch import.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from eagle3nb.drafts import block_methods, get, rules
from eagle3nb.layers import default_aux_layer_ids

ROOT = Path(__file__).resolve().parents[2]
VLLM_GPU_VENV = ROOT / ".venv-vllm-gpu"
# Set by `make gpu-check`: install vLLM's GPU build into .venv-vllm-gpu/ when it is missing (a few minutes), with
# the pip requirement in INSTALL_SPEC_ENV (default: vllm==<the tested release>).
INSTALL_ENV, INSTALL_SPEC_ENV = "EAGLE3NB_GPU_INSTALL_VLLM", "EAGLE3NB_GPU_VLLM_SPEC"
BUDGET_S = 600.0  # the 10 minutes a GPU is lent for, from the tier's first test
N_SAMPLES, MAX_NEW = 32, 96  # 01: the target's greedy answers to the first toy:train prompts
N_PROMPTS, MAX_TOKENS, K = 16, 64, 3  # speculative decoding: toy:heldout prompts, tokens each, drafted tokens
VERIFY_PROMPTS = 64  # vllm_block_verification: sampled T=1 prompts (16 spread our decoder's tau by +-7%)
SHORT_STEPS, LONG_STEPS = 20, 200  # 03: the device comparison runs; the draft that is served (tau ~4 at 200)
# Issue 24's recipes, each one factor on the EAGLE-3.0 baseline (whatever 03's defaults are), and the tolerance
# of its final loss on cuda vs CPU (Muon: torch.optim.Muon orthogonalises in bf16 on both devices, and the two
# devices round its matrix products differently).
BASELINE = {"fc_norm": False, "norm_output": False}
RECIPES: dict[str, tuple[dict[str, Any], float]] = {
    "eagle3.1": ({"fc_norm": True, "norm_output": True}, 1e-2),
    "num_layers=2": ({**BASELINE, "num_layers": 2}, 1e-2),
    "loss=lk_lambda": ({**BASELINE, "loss": "lk_lambda"}, 1e-2),
    "muon": ({**BASELINE, "optimizer": "muon"}, 5e-2),
}
SERVED_RECIPE = {"fc_norm": True, "norm_output": True, "num_layers": 2}  # both layouts vLLM builds differently
# Every registered block drafter, as vLLM serves it (docs/block-drafters.md): block 4, 2 layers, k = the block's
# drafts (DFlash: the block less its anchor; DSpark: the block). Read from the registry: a method registered
# tomorrow is trained and served by the tier without an edit here.
BLOCK_DRAFTERS: dict[str, dict[str, Any]] = {
    m: {"method": m, "block_size": 4, "num_layers": 2, "num_speculative_tokens": rules(m).drafts_per_block(4)}
    for m in block_methods()}
WIDTH_COSTS = (0.0, 0.02, 0.1, 0.5, 2.0)  # vllm_adaptive_verification: b of t(n) = 1 + b*n, plain steps per token
GPU = "cuda"  # the device under test; CPU float32 is the reference
NO_GPU_FIX = "run `make gpu-check` on a machine with an NVIDIA GPU"


def block_package_files() -> tuple[str, ...]:
    """The source files (repository paths) of every registered block drafter's package: what ``block_drafter``
    runs on the GPU through the method's own model, objective, layouts and drafting."""
    from eagle3nb.drafts import PACKAGES

    dirs = set()
    for m in block_methods():
        package = importlib.import_module(PACKAGES[m]) if isinstance(PACKAGES[m], str) else PACKAGES[m]
        if getattr(package, "__file__", None):  # a package registered in a test's one line has no files
            dirs.add(Path(package.__file__).parent)
    return tuple(sorted(str(f.relative_to(ROOT)) for d in dirs for f in d.glob("*.py") if f.name != "__init__.py"))


def adaptive_methods() -> tuple[str, ...]:
    """The block drafters whose draft estimates its own acceptance (``DraftMethod.confidences``: DSpark's head),
    which vLLM's adaptive verification sizes its verify budget from."""
    return tuple(m for m in block_methods() if get(m).confidences is not None)


# ---------------------------------------------------------------------------------------------- the skip marks


@functools.cache
def cuda_state() -> tuple[bool, str, str]:
    """(usable, why not, what to do): torch's view, and nvidia-smi's when torch sees no GPU (a CPU build of torch
    cannot use one)."""
    import torch

    if torch.cuda.is_available():
        return True, "", ""
    smi = shutil.which("nvidia-smi")
    listed = ""
    if smi:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            listed = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20).stdout.strip()
    if listed:
        return False, (f"nvidia-smi lists {listed.splitlines()[0]!r} but torch {torch.__version__} "
                       f"(CUDA {torch.version.cuda}) cannot use it"), (
            "reinstall torch from PyPI, whose Linux x86-64 wheels carry CUDA: `.venv/bin/pip install "
            f"--force-reinstall torch=={torch.__version__.split('+')[0]}`, then rerun")
    return False, "no CUDA device", NO_GPU_FIX


def needs_cuda() -> pytest.MarkDecorator:
    """The tier's module-level mark: skipped, with the reason, where torch has no usable CUDA device (a GPU torch
    cannot use is the ``cuda_device`` test's failure, which names the fix)."""
    usable, why, fix = cuda_state()
    return pytest.mark.skipif(not usable, reason=f"{why}: {fix if fix == NO_GPU_FIX else 'see cuda_device'}")


def needs_a_gpu() -> pytest.MarkDecorator:
    """``cuda_device``'s mark: skipped only where no GPU is there at all, so a GPU that torch cannot use fails."""
    usable, why, fix = cuda_state()
    return pytest.mark.skipif(fix == NO_GPU_FIX, reason=f"{why}: {fix}")


# ---------------------------------------------------------------------------------------------- measures


def rel(a: Any, b: Any) -> float:
    """||a - b|| / ||b|| (float64), the one error measure of the tensor comparisons."""
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def fmt(x: float | None) -> str:
    return "none" if x is None else f"{x:.3f}"


def within(name: str, value: float, limit: float) -> str:
    """``name value <= limit`` (or ``>``): a measured value against its tolerance, for a line or a message."""
    mark = "<=" if value <= limit else "> "
    return f"{name} {value:.2e} {mark} {limit:.0e}"


def versus_local(tau: float, local: float, share: float) -> str:
    """An acceptance length measured on the GPU against CPU local decoding of the same draft, and the share they
    may differ by."""
    return f"acceptance length {tau:.3f} vs CPU local decoding {local:.3f} (within {share:.0%})"


def reads_differently(what: str) -> str:
    """What to do when ``what`` accepts outside CPU local decoding's share."""
    return (f"{what} reads the draft differently from eagle3nb.decoder on CPU (layer ids, norms, vocab map, dtype); "
            "compare the two on one prompt")


def loss_gaps(a: dict[str, Any], b: dict[str, Any]) -> tuple[float, float]:
    """Relative gaps between two 03 runs' metrics: initial held-out loss, final training loss."""
    e0 = abs(a["initial_heldout"]["loss"] - b["initial_heldout"]["loss"]) / b["initial_heldout"]["loss"]
    return e0, abs(a["final_loss"] - b["final_loss"]) / b["final_loss"]


def compared_losses(a: dict[str, Any], b: dict[str, Any], what: str, initial: float,
                    final: float) -> tuple[str, float, float]:
    """(measured, initial gap, final gap) of run ``a`` against ``b`` (:func:`loss_gaps`), the measured line naming
    ``what`` is compared and the tolerances of the initial held-out loss and the final loss."""
    e0, e1 = loss_gaps(a, b)
    return (f"{what}: {within('initial held-out loss', e0, initial)}, {within('final loss', e1, final)} after "
            f"{SHORT_STEPS} steps"), e0, e1


@dataclass
class Budget:
    """The 10 minutes, counted from the tier's first test: installing and starting vLLM take what is left."""

    deadline: float = field(default_factory=lambda: time.monotonic() + BUDGET_S)

    def left(self) -> float:
        return self.deadline - time.monotonic()


# ---------------------------------------------------------------------------------------------- the runs


def extract_values(work: Path, toy: Path, name: str, dtype: str, storage: str) -> dict[str, Any]:
    """02's parameters for one extraction of the reference samples into ``work/02-<name>``."""
    return {"synth_dir": str(work / "data" / "01"), "model_path": str(toy), "dtype": dtype, "storage": storage,
            "output_dir": str(work / f"02-{name}"), "run_name": "gpu-check"}


def build_reference(work: Path, toy: Path, budget: Budget) -> dict[str, Path]:
    """The CPU reference, made in a process that sees no GPU: 01 = the target's greedy answers, 02 in fp32
    (stored exactly, with top-k storage, and with the whole vocabulary as the draft's, which a block drafter
    needs). Paths: ``synth``, ``cpu-fp32``, ``cpu-topk``, ``cpu-full``; its output goes to the test's capture."""
    code = (f"import json, sys\nsys.path.insert(0, {str(ROOT)!r})\n"
            "from testkit.heldout import greedy_hidden_states\nfrom eagle3nb.hidden.stage import run\n"
            "from eagle3nb.params import from_dict\na = json.loads(sys.argv[1])\n"
            "greedy_hidden_states(a['toy'], 'toy:train', a['n'], a['max_new'], a['out'])\n"
            "run(from_dict('02_hidden_states', a['topk']))\nrun(from_dict('02_hidden_states', a['full']))")
    config = json.loads((toy / "config.json").read_text())
    vocab = config["vocab_size"]
    args = {"toy": str(toy), "n": N_SAMPLES, "max_new": MAX_NEW, "out": str(work / "data"),
            "topk": extract_values(work, toy, "cpu-topk", "float32", "topk"),
            # the layers named (EAGLE-3's), so every method trains on them: states 02 chose by a method's recipe
            # are refused to another method's fresh draft
            "full": {**extract_values(work, toy, "cpu-full", "float32", "fp32"), "draft_vocab_size": vocab,
                     "aux_layer_ids": default_aux_layer_ids(config["num_hidden_layers"])}}
    subprocess.run([sys.executable, "-c", code, json.dumps(args)], check=True,
                   env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, timeout=max(60.0, budget.left()))
    return {"synth": work / "data" / "01", "cpu-fp32": work / "data" / "02", "cpu-topk": work / "02-cpu-topk",
            "cpu-full": work / "02-cpu-full"}


def train_values(work: Path, data_dir: Path, name: str, device: str, autocast: str, steps: int) -> dict[str, Any]:
    """03's values the tier's runs share (only the device, the precision and the recipe differ between them)."""
    return {"data_dir": str(data_dir), "output_dir": str(work / f"03-{name}"), "device": device,
            "autocast": autocast, "max_steps": steps, "ttt_steps": 3, "lr": 5e-3, "max_length": 512,
            "batch_tokens": 2048, "eval_every": 0, "save_every": 1000, "holdout_fraction": 0.2, "resume": False,
            "run_name": "gpu-check"}


def train(work: Path, data_dir: Path, name: str, device: str, autocast: str, steps: int,
          **recipe: Any) -> dict[str, Any]:
    """03 into ``work/03-<name>`` on ``data_dir`` (the CPU reference, so only the training device differs between
    runs); ``recipe``: more 03 values. Its metrics."""
    from eagle3nb.params import from_dict
    from eagle3nb.train.stage import run

    return run(from_dict("03_train", {**train_values(work, data_dir, name, device, autocast, steps), **recipe}))


def train_online(work: Path, toy: Path, reference: dict[str, Path]) -> dict[str, Any]:
    """03 with ``data_source: online`` on cuda: the target computes the states on the GPU for each micro-batch
    (02's transformers backend, fp32), on the reference samples and with the reference's draft vocabulary."""
    import yaml

    from eagle3nb.params import from_dict
    from eagle3nb.train.stage import run

    data = work / "02-online"
    data.mkdir(parents=True, exist_ok=True)
    shutil.copy(reference["cpu-fp32"] / "draft_vocab.safetensors", data)  # the reference's vocabulary
    hp = work / "02-online.yaml"
    hp.write_text(yaml.safe_dump({**extract_values(work, toy, "online", "float32", "fp32"), "draft_vocab_size": 256}))
    return run(from_dict("03_train", {**train_values(work, data, "online", GPU, "off", SHORT_STEPS),
                                      "data_source": "online", "hidden_params": str(hp)}))


# ---------------------------------------------------------------------------------------------- vLLM on the GPU


class VllmInstall:
    """vLLM's GPU build in ``.venv-vllm-gpu/``: found, or installed in a background thread from the tier's first
    test (pip downloads while the GPU trains), every step bounded by what is left of the budget less the 150 s
    vLLM's servers need; the steps' output in ``log``."""

    def __init__(self, log: Path, budget: Budget, install: bool, spec: str):
        self.log, self.budget, self.install, self.spec = log, budget, install, spec
        self.python = VLLM_GPU_VENV / "bin" / "python"
        self.result: tuple[str, str, str] | None = None  # (status: pass / fail / skip, measured, what to do)
        self.thread = threading.Thread(target=self._run, name="vllm-gpu-install", daemon=True)

    def start(self) -> VllmInstall:
        self.thread.start()
        return self

    def _probe(self) -> subprocess.CompletedProcess:
        """vLLM's import in .venv-vllm-gpu/, printing its version."""
        return subprocess.run([str(self.python), "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                              text=True, timeout=max(30.0, self.budget.left() - 150))

    def _run(self) -> None:
        try:
            self.result = self._install()
        except Exception as e:  # a step that timed out or could not start
            self.result = ("fail", f"installing vLLM's GPU build failed: {type(e).__name__}: {e} (output in "
                           f"{self.log})", f"install it by hand: {self.python} -m pip install '{self.spec}'")

    def _install(self) -> tuple[str, str, str]:
        if self.python.exists():
            found = self._probe()
            if found.returncode == 0:
                return "pass", f"vLLM {found.stdout.strip().splitlines()[-1]} already in {VLLM_GPU_VENV.name}/", ""
        if not self.install:
            return ("skip", f"vLLM's GPU build is not installed in {VLLM_GPU_VENV.name}/",
                    f"`make gpu-check` installs it ({INSTALL_ENV}=1; a few minutes)")
        if self.budget.left() < 240:
            return ("fail", f"only {self.budget.left():.0f} s left of the {BUDGET_S:.0f} s budget, too little to "
                    "install vLLM", "rerun `make gpu-check`: earlier tests are quicker the second time (toy cached)")
        t0 = time.monotonic()
        with self.log.open("w") as out:
            for cmd in ([sys.executable, "-m", "venv", str(VLLM_GPU_VENV)],
                        [str(self.python), "-m", "pip", "install", "-q", self.spec]):
                done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT,
                                      timeout=max(30.0, self.budget.left() - 150))
                if done.returncode:
                    return ("fail", f"`{' '.join(cmd[-3:])}` exited with {done.returncode} (output in {self.log})",
                            f"install vLLM's GPU build by hand: {self.python} -m pip install '{self.spec}'")
            probe = self._probe()
            out.write(probe.stdout + probe.stderr)
        if probe.returncode:
            return ("fail", f"vLLM's GPU build does not import after its install (output in {self.log})",
                    f"reinstall it by hand: {self.python} -m pip install --force-reinstall '{self.spec}'")
        return ("pass", f"installed {self.spec} (vLLM {probe.stdout.strip().splitlines()[-1]}) into "
                f"{VLLM_GPU_VENV.name}/ in {time.monotonic() - t0:.0f} s", "")

    def wait(self) -> tuple[str, str, str]:
        """The install's (status, measured, what to do), once its thread ends or the budget runs out."""
        self.thread.join(timeout=max(0.0, self.budget.left()))
        return self.result or ("fail", f"installing vLLM's GPU build did not end within the {BUDGET_S:.0f} s budget "
                               f"(output in {self.log})", "rerun `make gpu-check`: the install resumes from pip's "
                               "cache, or install it by hand first")


def start_gpu_vllm(toy: Path, budget: Budget, mode: str, **kw: Any) -> Any:
    """The project's launcher with the GPU flags (cpu=False: vLLM's own connector, compiled); the ``vllm_gpu``
    fixture points it at .venv-vllm-gpu/. Its wait for the server is bounded by what is left of the budget."""
    from eagle3nb.serve.vllm import start_vllm

    if budget.left() < 60:
        pytest.fail(f"only {budget.left():.0f} s left of the {BUDGET_S:.0f} s budget, too little to start vLLM  -> "
                    "rerun `make gpu-check` (vLLM stays installed, so this part gets more time)", pytrace=False)
    return start_vllm(toy, mode, cpu=False, timeout=budget.left() - 30, **kw)
