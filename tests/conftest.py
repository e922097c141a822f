"""Shared fixtures: the toy world is built once per test run (and cached across runs by its settings)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from worlds import SEED

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session", autouse=True)
def _project_env(tmp_path_factory):
    """Tests resolve relative params against the repo and keep the toy build cache in one place."""
    os.environ.setdefault("EAGLE3NB_ROOT", str(ROOT))
    os.environ.setdefault("EAGLE3NB_CACHE", str(ROOT / ".cache"))
    yield


@pytest.fixture(scope="session")
def toy_smoke(_project_env) -> Path:
    """The smoke-size toy target (tokenizer + trained Llama), built once and cached."""
    from eagle3nb.toy import build

    return build(size="smoke", seed=SEED)


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module's training: on two cores shared with other processes it is faster than
    two (their threads stall each other), and runs repeat bit for bit (the resume tests compare exactly)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def embedded(toy_smoke):
    """The embedded server on the smoke toy (reasoning parser on), shared by every test that only reads it."""
    from eagle3nb.launch import start_server

    with start_server(toy_smoke) as handle:
        yield handle


@pytest.fixture(scope="session")
def trained(tmp_path_factory, toy_smoke, embedded) -> dict:
    """A small healthy run with a well-trained draft (``tests/worlds.py``): ``{"run", "out", "stages"}``."""
    from worlds import build_trained_run

    return build_trained_run(tmp_path_factory.mktemp("trained"), toy_smoke, embedded.url, seed=SEED)
