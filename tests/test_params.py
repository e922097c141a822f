"""Parameter validation: every problem names the key, the file and the fix, before any work starts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from eagle3nb.drafts import rules
from eagle3nb.params import STAGES, ParamsError, from_dict, schema_for
from eagle3nb.params_notebook import NOTEBOOKS, parameters_cell
from eagle3nb.params_yaml import load_yaml, run_params

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("run", ["demo", "smoke", "kimi-k2.5-10k"])
@pytest.mark.parametrize("stage", STAGES)
def test_shipped_params_are_valid(run, stage):
    values = run_params(ROOT / "params" / run, stage)
    # types and keys only: input paths come from earlier stages (and /shared/... from the production machine)
    params = from_dict(stage, values, check_paths=False)
    assert params.run_name == run


def test_unknown_key_names_key_file_and_suggestion(tmp_path):
    values = {"run_name": "x", "params_file": "params/x/01_synth.yaml", "max_sample": 10}
    with pytest.raises(ParamsError) as e:
        from_dict("01_synth", values)
    msg = str(e.value)
    assert "'max_sample'" in msg and "params/x/01_synth.yaml" in msg and "max_samples" in msg


def test_wrong_type_names_key_and_file():
    with pytest.raises(ParamsError) as e:
        from_dict("01_synth", {"params_file": "p.yaml", "max_samples": "many"})
    msg = str(e.value)
    assert "'max_samples'" in msg and "p.yaml" in msg and "'many'" in msg


@pytest.mark.parametrize("method, over, names", [
    ("dflash", {"block_size": 8, "num_speculative_tokens": 8}, ["num_speculative_tokens", "must be at most 7"]),
    ("dspark", {"block_size": 8, "num_speculative_tokens": 4}, ["num_speculative_tokens", "must be exactly 8"]),
    ("dflash2", {"block_size": 8, "num_speculative_tokens": 2, "conv_kernel_size": 4},
     ["conv_kernel_size to at most 3"]),
    ("dspark", {"block_size": 4, "num_speculative_tokens": 4, "parallel_drafting": True}, ["parallel_drafting"]),
    ("dflash", {"block_size": 4, "num_speculative_tokens": 3, "loss": "opd"}, ["loss: opd", "block_loss"]),
    ("dspark", {"block_size": 4, "num_speculative_tokens": 4, "block_causal": True},
     ["block_causal is read by", "only; method dspark trains its whole block"]),
])
def test_a_block_drafter_refuses_eagle3s_own_settings_before_work(method, over, names):
    """Settings the block objective or vLLM's block would not honour stop 03 with a line that names them."""
    with pytest.raises(ParamsError) as e:
        from_dict("03_train", {"params_file": "p.yaml", "method": method, **over}, check_paths=False)
    assert all(n in str(e.value) for n in names), str(e.value)
    ok = {k: v for k, v in over.items() if k not in ("parallel_drafting", "loss", "conv_kernel_size", "block_causal")}
    ok["num_speculative_tokens"] = ok["block_size"] - (method != "dspark")
    assert from_dict("03_train", {"method": method, **ok}, check_paths=False).method == method


def test_03s_num_layers_null_is_the_methods_own_depth_resolved_once_without_torch():
    """num_layers left out or null is the method's depth (its package's NUM_LAYERS, through the registry), an int
    from validation on (the fresh draft, the resume check and the saved params read it), shown as the default in
    the changed-parameters table; a value given wins. Validating loads no torch: the runner validates every stage
    in its own process (~0.6 s, a subprocess)."""
    code = """if True:
        import json, sys
        from eagle3nb.drafts import PACKAGES, fresh_num_layers, rules
        from eagle3nb.params import from_dict
        from eagle3nb.params_notebook import changed_table
        block = {m: {"block_size": 4, "num_speculative_tokens": rules(m).drafts_per_block(4)} for m in PACKAGES
                 if rules(m).block}
        out = {}
        for m in PACKAGES:
            over = {"method": m, **block.get(m, {})}
            left_out, null = (from_dict("03_train", v, check_paths=False) for v in (over, {**over, "num_layers": None}))
            given = from_dict("03_train", {**over, "num_layers": 5}, check_paths=False)
            out[m] = [fresh_num_layers(m), left_out.num_layers, null.num_layers, given.num_layers,
                      [r[0] for r in changed_table(null).rows], [r[1:3] for r in changed_table(given).rows
                                                                 if r[0] == "num_layers"]]
        print(json.dumps({"methods": out, "torch": "torch" in sys.modules}))
    """
    got = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                    check=True).stdout)
    assert got["torch"] is False
    depths = {m: row[0] for m, row in got["methods"].items()}
    # EAGLE-3's one layer; the block drafters' two, measured (docs/recipes.md)
    assert depths == {m: 2 if rules(m).block else 1 for m in depths}
    for m, (depth, left_out, null, given, changed, given_row) in got["methods"].items():
        assert left_out == null == depth and given == 5
        assert "num_layers" not in changed and given_row == [["5", repr(depth)]]


def test_missing_path_names_key_file_and_fix(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(ParamsError) as e:
        from_dict("01_synth", {"params_file": "p.yaml", "prompts": str(missing), "model_path": "toy:smoke"})
    msg = str(e.value)
    assert "'prompts'" in msg and "p.yaml" in msg and str(missing) in msg


def test_a_key_given_instead_of_its_variable_name_is_refused_without_echoing_it():
    secret = "sk-live-0123456789abcdef"
    with pytest.raises(ParamsError) as e:
        from_dict("01_synth", {"params_file": "p.yaml", "api_key_env": secret}, check_paths=False)
    assert "'api_key_env'" in str(e.value) and "NAME of an environment variable" in str(e.value)
    assert secret not in str(e.value)


def test_malformed_yaml_names_file_and_line(tmp_path):
    bad = tmp_path / "01_synth.yaml"
    bad.write_text("max_samples: 10\nconcurrency: [1, 2\n")
    with pytest.raises(ParamsError) as e:
        load_yaml(bad)
    assert str(bad) in str(e.value) and "line" in str(e.value)


def test_common_yaml_is_layered_under_the_stage_file(tmp_path):
    run = tmp_path / "myrun"
    run.mkdir()
    (run / "common.yaml").write_text("max_samples: 7\nconcurrency: 3\nnot_a_synth_key: 1\n")
    (run / "01_synth.yaml").write_text("concurrency: 5\n")
    values = run_params(run, "01_synth")
    assert values["max_samples"] == 7 and values["concurrency"] == 5
    assert "not_a_synth_key" not in values  # common keys apply only to stages that know them
    assert values["run_name"] == "myrun" and values["params_file"].endswith("01_synth.yaml")


def test_papermill_cli_rejects_an_unknown_key_before_work(tmp_path):
    bad = tmp_path / "01_synth.yaml"
    bad.write_text("run_name: smoke\nconcurency: 4\n")
    out = tmp_path / "out.ipynb"
    proc = subprocess.run(
        [sys.executable, "-m", "papermill", str(ROOT / "notebooks" / "01_synth.ipynb"), str(out), "-f", str(bad),
         "--cwd", str(ROOT)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode != 0
    assert "ParamsError" in proc.stderr and "'concurency'" in proc.stderr and "concurrency" in proc.stderr


@pytest.mark.parametrize("stage", list(NOTEBOOKS))
def test_notebook_parameters_cells_are_generated_from_the_schemas(stage):
    """Defaults live in the schema only: `make params-cells` writes the cells, and a hand edit is drift."""
    nb = json.loads((ROOT / NOTEBOOKS[stage]).read_text())
    cell = next(c for c in nb["cells"] if "parameters" in c.get("metadata", {}).get("tags", []))
    assert "".join(cell["source"]) == parameters_cell(stage), "run `make params-cells`"


@pytest.mark.parametrize("stage", list(NOTEBOOKS))
def test_papermill_reads_every_parameter_of_the_cell(stage):
    """papermill's own parser (``papermill --help-notebook``, and the names it checks a run's values against)
    sees every schema field: a line it cannot parse drops the name, and every run with it then warns "Passed
    unknown parameter"."""
    import papermill

    seen = papermill.inspect_notebook(str(ROOT / NOTEBOOKS[stage]))
    assert set(seen) == set(schema_for(stage).model_fields)


@pytest.mark.parametrize("stage", STAGES)
def test_demo_params_list_only_what_differs_from_the_defaults(stage):
    """The schema's defaults are the demo's, so params/demo/ states nothing a default already says."""
    cls = schema_for(stage)
    values = load_yaml(ROOT / "params" / "demo" / f"{stage}.yaml")
    same = [k for k, v in values.items() if k != "run_name" and cls.model_fields[k].default == v]
    assert same == []


def test_a_method_registered_in_one_line_is_03s_with_its_rules_without_torch():
    """03's method names and each method's rules come from the registry: a package registered in one line (a fake
    block drafter whose anchor slot drafts nothing, reading markov_rank) is a value 03's method takes, with its
    summary in the help, its depth as num_layers' null, k = block_size - 1 checked, its own setting's help naming
    it, and a GPU-check row, without an edit to train/params.py; validating still loads no torch."""
    code = """if True:
        import importlib.util, json, sys, types
        from eagle3nb import drafts
        fake = types.ModuleType("fake_draft")
        fake.NUM_LAYERS = 3
        fake.RULES = {"fake": drafts.MethodRules(summary="a test's block drafter", block=True,
                                                 params=("block_size", "markov_rank", "fake_width"))}
        from pydantic import Field
        fake.PARAMS = {"fake_width": (int, Field(4, ge=1, description="its own width"))}
        sys.modules["fake_draft"] = fake
        drafts.PACKAGES["fake"] = fake
        from eagle3nb.params import ParamsError, from_dict
        from eagle3nb.train.params import METHOD_KEYS, TrainParams

        def refusal(values):
            try:
                from_dict("03_train", values, check_paths=False)
            except ParamsError as e:
                return str(e)
        P = from_dict("03_train", {"method": "fake", "block_size": 5, "num_speculative_tokens": 4}, check_paths=False)
        spec = importlib.util.spec_from_file_location("gpu_world", "tests/gpu/gpu_world.py")
        gpu_check = importlib.util.module_from_spec(spec)
        sys.modules["gpu_world"] = gpu_check
        torch_before = "torch" in sys.modules
        spec.loader.exec_module(gpu_check)
        print(json.dumps({
            "method": P.method, "num_layers": P.num_layers, "torch": torch_before,
            "k_refused": refusal({"method": "fake", "block_size": 5, "num_speculative_tokens": 5}),
            "unknown": refusal({"method": "nope"}), "registered": [m for m in drafts.PACKAGES if m != "fake"],
            "last_summary": drafts.rules([m for m in drafts.PACKAGES if m != "fake"][-1]).summary,
            "help": TrainParams.model_fields["method"].description,
            "markov_help": TrainParams.model_fields["markov_rank"].description,
            "own_help": TrainParams.model_fields["fake_width"].description, "own": P.fake_width,
            "own_refused": refusal({"method": "fake", "block_size": 5, "num_speculative_tokens": 4, "fake_width": 0}),
            "method_keys": list(METHOD_KEYS), "gpu_check": gpu_check.BLOCK_DRAFTERS.get("fake")}))
    """
    got = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                    cwd=ROOT).stdout)
    assert got["torch"] is False
    assert (got["method"], got["num_layers"]) == ("fake", 3)
    assert "a block of 5 drafts 4 tokens" in got["k_refused"] and "must be exactly 4" in got["k_refused"]
    assert "Input should be " + ", ".join(f"'{m}'" for m in got["registered"]) + " or 'fake'" in got["unknown"]
    assert f"{got['last_summary']}) or fake (a test's block drafter); " in got["help"]
    assert got["markov_help"].startswith("dspark / fake: rank r of the Markov head")
    assert (got["own_help"], got["own"]) == ("fake: its own width", 4)  # its own setting, declared in its package
    assert "parameter 'fake_width'" in got["own_refused"] and "greater than or equal to 1" in got["own_refused"]
    assert got["method_keys"].count("markov_rank") == 1 and "block_size" in got["method_keys"]
    assert got["gpu_check"] == {"method": "fake", "block_size": 4, "num_layers": 2, "num_speculative_tokens": 3}


def test_every_methods_rules_name_03_settings_and_its_package_serves_the_methods_it_rules():
    """A method's rules name settings 03 has (else 03's resume check would drop a key no run reads), and each
    package rules exactly the methods the registry says it serves."""
    from eagle3nb.drafts import PACKAGES, rules
    from eagle3nb.train.params import TrainParams

    unknown = {m: [k for k in rules(m).params if k not in TrainParams.model_fields] for m in PACKAGES}
    assert all(not keys for keys in unknown.values()), unknown
    for package in set(PACKAGES.values()):
        served = sorted(m for m, p in PACKAGES.items() if p == package)
        assert sorted(package.RULES) == served, package.__name__
