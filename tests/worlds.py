"""A small trained run of the toy world (01 -> 02 -> 03 with the stage libraries), shared by the tests that need
a draft that has really learned something: the doctor, the speculative servers, the real vLLM."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

# Seed of the toy build and of the trained fixtures. Trained-number tests must pass for any value (their margins
# hold across CPUs and seeds): `EAGLE3NB_TEST_SEED=1 pytest ...` checks that they do.
SEED = int(os.environ.get("EAGLE3NB_TEST_SEED", "0"))
# Torch threads of the trained fixtures: 1 by default (on two shared cores extra threads stall each other, and
# runs repeat bit for bit); tools/variations.py also runs the trained-number tests at 2 (another reduction order).
THREADS = int(os.environ.get("EAGLE3NB_TEST_THREADS", "1"))

# Trained well past every line a test judges it by: 40 steps left the draft at ~1.18x against the doctor's 1.2x
# warn line on one CPU (a coin toss); 200 steps give held-out first-token acceptance ~0.8 and tau ~4 here.
TRAIN_STEPS = 200


def under_ci() -> bool:
    """Any truthy ``CI`` (``true``, ``1``, ``yes``...): CI services spell it differently."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no", "off")


def requires_vllm() -> pytest.MarkDecorator:
    """The mark of the real-vLLM tests: skipped with the reason where vLLM cannot run; under CI that is an error.
    Its ``tier`` puts every test it marks in the ``engine`` tier (tests/conftest.py reads it)."""
    from eagle3nb.serve.vllm import unavailable_reason

    reason = unavailable_reason()
    if reason and under_ci():
        raise RuntimeError(f"CI must test against the real vLLM, but: {reason}")
    return pytest.mark.skipif(reason is not None, reason=reason or "", tier="engine")


def write_run(folder: Path, stages: dict[str, dict]) -> Path:
    """``folder/<stage>.yaml`` for each stage's values (paths as strings)."""
    folder.mkdir(parents=True, exist_ok=True)
    for stage, values in stages.items():
        (folder / f"{stage}.yaml").write_text(yaml.safe_dump({k: str(v) if isinstance(v, Path) else v
                                                              for k, v in values.items()}))
    return folder


def build_trained_run(out: Path, model_dir: Path, server_url: str, seed: int = 0, synth01: dict | None = None,
                      **train03: object) -> dict:
    """01 against ``server_url``, 02 extracted, 03 trained (``synth01``, ``train03``: more 01_synth / 03_train
    values); returns ``{"run", "out", "stages"}``."""
    import torch

    from eagle3nb.hidden.stage import run as extract
    from eagle3nb.params import from_dict
    from eagle3nb.params_yaml import run_params
    from eagle3nb.synth.stage import run as synth
    from eagle3nb.train.stage import run as train

    stages = {
        "01_synth": {"model_path": model_dir, "vllm_url": server_url, "max_samples": 32, "seed": seed,
                     "max_completion_tokens": 128, "output_dir": out / "01_synth", **(synth01 or {})},
        "02_hidden_states": {"model_path": model_dir, "synth_dir": out / "01_synth", "max_length": 512,
                             "output_dir": out / "02_hidden_states"},
        "03_train": {"data_dir": out / "02_hidden_states", "output_dir": out / "03_train", "max_length": 512,
                     "batch_tokens": 2048, "max_steps": TRAIN_STEPS, "lr": 5e-3, "eval_every": 0, "save_every": 1000,
                     "seed": seed, **train03},
        "04_acceptance": {"model_path": model_dir, "draft_dir": out / "03_train" / "draft",
                          "data_dir": out / "02_hidden_states", "output_dir": out / "04_acceptance"},
    }
    run = write_run(out / "params" / "healthy", stages)
    synth(from_dict("01_synth", run_params(run, "01_synth")))
    extract(from_dict("02_hidden_states", run_params(run, "02_hidden_states")))
    # One thread: on a 2-core machine shared with other test runs, torch's thread pool spins and a step
    # takes ~15x longer.
    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        train(from_dict("03_train", run_params(run, "03_train")))
    finally:
        torch.set_num_threads(threads)
    return {"run": run, "out": out, "stages": stages}


def family_world(name: str, toy: str, **train03: object) -> tuple:
    """A family module's three shared worlds, as module fixtures named ``<name>``, ``<name>_embedded`` and
    ``<name>_trained``: the family's toy target (``toy``, e.g. ``toy:kimi``), the embedded server on it, and the
    suite's trained run on it (01 from an embedded server of its own, 02 in-process, 03 with ``train03``), built in
    the background as the session starts (tests/background.py). Assign them to the module's names of the same
    spelling: ``kimi, kimi_embedded, kimi_trained = family_world("kimi", "toy:kimi", ...)``."""
    from background import register

    register(name, "toy", spec=toy)
    register(f"{name}_trained", "trained_run", spec=toy, threads=THREADS, seed=SEED, **train03)

    @pytest.fixture(scope="module", name=name)
    def target_dir(_project_env) -> Path:
        from eagle3nb.toy import resolve_model_path

        return resolve_model_path(toy)

    @pytest.fixture(scope="module", name=f"{name}_embedded")
    def embedded(request):
        from eagle3nb.launch import start_server

        with start_server(request.getfixturevalue(name)) as server:
            yield server

    @pytest.fixture(scope="module", name=f"{name}_trained")
    def trained(background, tmp_path_factory) -> dict:
        return background.result(f"{name}_trained", tmp_path_factory.mktemp(name))

    return target_dir, embedded, trained
