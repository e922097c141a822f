"""trust_remote_code: Python code a model folder ships (its auto_map) runs only when the stage's params turn it
on; with the default, a folder that needs it stops with an error naming the parameter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from eagle3nb.doctor import FAIL, PASS, run_checks
from eagle3nb.hf import RemoteCodeRequired
from eagle3nb.params import ParamsError, from_dict


def remote_code_folder(toy: Path, dest: Path) -> Path:
    """The toy target with its tokenizer and model classes as Python files in the folder; importing one
    touches ``ran-<module>`` beside the folder (transformers runs a copy, so the path is absolute)."""
    dest.mkdir()
    for f in toy.iterdir():
        if f.name not in ("tokenizer_config.json", "config.json"):
            (dest / f.name).symlink_to(f)
    for module, base in (("remote_tok", "PreTrainedTokenizerFast"), ("remote_model", "LlamaForCausalLM")):
        (dest / f"{module}.py").write_text(
            f"from pathlib import Path\nPath({str(dest.parent / f'ran-{module}')!r}).touch()\n"
            f"from transformers import {base}\n\n\nclass Remote({base}):\n    pass\n")
    tok = json.loads((toy / "tokenizer_config.json").read_text())
    (dest / "tokenizer_config.json").write_text(json.dumps(
        {**tok, "tokenizer_class": "Remote", "auto_map": {"AutoTokenizer": [None, "remote_tok.Remote"]}}))
    cfg = json.loads((toy / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps({**cfg, "auto_map": {"AutoModelForCausalLM": "remote_model.Remote"}}))
    return dest


@pytest.fixture
def folder(toy_smoke, tmp_path) -> Path:
    return remote_code_folder(toy_smoke, tmp_path / "model")


def ran(folder: Path, module: str) -> bool:
    return (folder.parent / f"ran-{module}").exists()


def test_off_by_default_on_the_stages_that_load_the_target():
    for stage in ("01_synth", "02_hidden_states", "04_acceptance"):
        assert from_dict(stage, {}, check_paths=False).trust_remote_code is False
    with pytest.raises(ParamsError, match="trust_remote_code"):  # 03 loads no model: not its parameter
        from_dict("03_train", {"trust_remote_code": True}, check_paths=False)


def test_tokenizer_code_runs_only_when_trusted(folder, tmp_path):
    def token_stream(trust: bool):
        run = tmp_path / f"run-{trust}"  # common.yaml: 01, 02 and 04 all take both keys
        run.mkdir()
        (run / "common.yaml").write_text(yaml.safe_dump({"model_path": str(folder), "trust_remote_code": trust}))
        return next(r for r in run_checks(run, "02") if r.name == "token_stream")

    r = token_stream(False)  # the doctor loads the template as the stage would
    assert r.status == FAIL and "set trust_remote_code: true" in r.measured, r
    assert not ran(folder, "remote_tok")
    assert token_stream(True).status == PASS and ran(folder, "remote_tok")


def test_model_code_runs_only_when_trusted(folder):
    from eagle3nb.data.head import target_info
    from eagle3nb.hidden.sources import TransformersSource
    from eagle3nb.hidden.vllm_backend import vllm_command

    def source(trust: bool) -> TransformersSource:
        P = from_dict("02_hidden_states", {"model_path": str(folder), "trust_remote_code": trust}, check_paths=False)
        return TransformersSource(P, folder, target_info(folder), [2, 4, 5])

    assert type(source(False).model).__name__ == "LlamaForCausalLM" and not ran(folder, "remote_model")
    assert type(source(True).model).__name__ == "Remote" and ran(folder, "remote_model")
    assert "--trust-remote-code" not in vllm_command(str(folder), [2, 4, 5], 8)
    assert "--trust-remote-code" in vllm_command(str(folder), [2, 4, 5], 8, trust_remote_code=True)


def test_acceptance_refuses_the_folder_code_by_default(folder):
    from eagle3nb.accept.models import load_models

    P = from_dict("04_acceptance", {"model_path": str(folder)}, check_paths=False)
    with pytest.raises(RemoteCodeRequired, match="set trust_remote_code: true in the stage's params"):
        load_models(P)
    assert not ran(folder, "remote_tok") and not ran(folder, "remote_model")


def test_the_embedded_server_runs_folder_code_when_trusted(folder):
    """The embedded server loads the target through the stages' loader (``hf.load_target``), so the stage's
    trust_remote_code reaches it (``start_server(trust_remote_code=True)``; off, it refuses as the stages do)."""
    from eagle3nb.launch import start_server

    with start_server(folder, trust_remote_code=True, timeout=60):
        assert ran(folder, "remote_tok") and ran(folder, "remote_model")
