"""Project hygiene the README promises: one dependency list, clean notebooks, the agreed layout."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


def _name(req: str) -> str:
    return re.split(r"[<>=!~\[; ]", req.strip(), maxsplit=1)[0].lower().replace("_", "-")


def test_environment_yml_lists_the_same_dependencies_as_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = set(project["dependencies"]) | set(project["optional-dependencies"]["dev"])
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip_section = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d)
    listed = {p for p in pip_section if not p.startswith("-e")}
    assert any(d == "python=3.11" for d in env["dependencies"] if isinstance(d, str))
    assert {_name(p): p for p in listed} == {_name(p): p for p in wanted}, (
        "environment.yml and pyproject.toml disagree: keep the same requirement strings in both"
    )


def test_torch_is_not_pinned_to_one_release():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    torch_req = next(d for d in project["dependencies"] if _name(d) == "torch")
    assert "==" not in torch_req


def test_notebooks_are_committed_without_outputs_and_have_a_parameters_cell():
    notebooks = sorted((ROOT / "notebooks").glob("*.ipynb"))
    assert [p.stem for p in notebooks] == ["01_synth", "02_hidden_states", "03_train", "04_acceptance",
                                                  "05_refresh", "06_select"]
    for path in notebooks:
        nb = json.loads(path.read_text())
        for cell in nb["cells"]:
            assert not cell.get("outputs"), f"{path.name} has outputs: clear them before committing"
            assert not cell.get("execution_count"), f"{path.name} has execution counts: clear them"
        tagged = [c for c in nb["cells"] if "parameters" in c.get("metadata", {}).get("tags", [])]
        assert len(tagged) == 1, f"{path.name} needs exactly one cell tagged 'parameters'"
        src = "".join(tagged[0]["source"])
        for line in src.splitlines():
            if "=" in line and not line.lstrip().startswith("#"):
                assert "#" in line, f"{path.name}: parameter line without '# help': {line!r}"


def test_library_sets_no_matplotlib_backend():
    for path in (ROOT / "eagle3nb").rglob("*.py"):
        text = path.read_text()
        assert "matplotlib.use(" not in text and "MPLBACKEND" not in text, path


def test_top_level_layout():
    for name in ["notebooks", "eagle3nb", "params", "outputs", "tests", "environment.yml", "README.md",
                 "pyproject.toml", ".ci/run", "benchmarks", "Makefile", ".gitignore", "outputs/README.md"]:
        assert (ROOT / name).exists(), name
    for run in ["demo", "smoke", "kimi-k2.5-10k"]:
        for stage in ["01_synth", "02_hidden_states", "03_train", "04_acceptance"]:
            assert (ROOT / "params" / run / f"{stage}.yaml").exists(), f"params/{run}/{stage}.yaml"


def test_real_vllm_is_required_under_any_truthy_ci(monkeypatch):
    import eagle3nb.serve.vllm as vllm

    from worlds import requires_vllm, under_ci

    for value in ("true", "1", "yes", "True"):
        monkeypatch.setenv("CI", value)
        assert under_ci(), value
    for value in ("", "0", "false", "no"):
        monkeypatch.setenv("CI", value)
        assert not under_ci(), value
    monkeypatch.setattr(vllm, "unavailable_reason", lambda: "no vLLM here")
    assert requires_vllm().kwargs["reason"] == "no vLLM here"  # outside CI: skipped, with the reason
    monkeypatch.setenv("CI", "1")
    with pytest.raises(RuntimeError, match="CI must test against the real vLLM, but: no vLLM here"):
        requires_vllm()
