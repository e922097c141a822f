"""eagle3nb doctor in the toy world: a small healthy run (built with the stage libraries against the embedded
server) passes every check, and each known fault, planted in a copy of it, fails the matching check with a
message that names the cause and the fix."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
import torch

from eagle3nb.cli import main
from eagle3nb.doctor import CHECKS, FAIL, PASS, STAGE_CHECKS, WARN, DoctorError, check_stage, render, run_checks
from eagle3nb.doctor.context import STREAM_PROBES
from eagle3nb.synth.faults import FaultServer

from worlds import write_run


def by_name(report) -> dict:
    return {r.name: r for r in report}


@pytest.fixture(scope="module")
def server(embedded):
    return embedded


@pytest.fixture(scope="module")
def healthy(trained) -> dict:
    """The shared trained run (conftest ``trained``): 01 against the embedded server, 02 extracted, 03 trained."""
    return trained


def variant(healthy: dict, folder: Path, **changes: dict) -> Path:
    """The healthy run's params with some stages' values changed."""
    stages = {s: {**v, **changes.get(s, {})} for s, v in healthy["stages"].items()}
    return write_run(folder, stages)


def faulty_draft(healthy: dict, dest: Path, config=None, tensors=None) -> Path:
    """A copy of the healthy draft with its config.json and/or tensors edited."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(healthy["out"] / "03_train" / "draft", dest)
    if config:
        cfg = json.loads((dest / "config.json").read_text())
        config(cfg)
        (dest / "config.json").write_text(json.dumps(cfg))
    if tensors:
        t = load_file(str(dest / "model.safetensors"))
        tensors(t)
        save_file(t, str(dest / "model.safetensors"))
    return dest


# -- the healthy run -----------------------------------------------------------------------------------------------

def test_healthy_run_passes_every_check(healthy):
    report = run_checks(healthy["run"])
    assert [r.name for r in report] == CHECKS
    assert all(r.status == PASS for r in report), render(report)


def test_notebook_cell_runs_its_stage_checks(healthy):
    from eagle3nb.params import from_dict
    from eagle3nb.params_yaml import run_params

    P = from_dict("03_train", run_params(healthy["run"], "03_train"))
    report = check_stage("03_train", P)
    assert [r.name for r in report] == STAGE_CHECKS["03_train"]
    assert "layer_ids" in repr(report) and "<table>" in report._repr_html_()
    assert not report.failed, render(report)


# -- 1. server -------------------------------------------------------------------------------------------------------

def test_server_without_reasoning_parser_fails(toy_smoke, tmp_path):
    from eagle3nb.errors import user_message
    from eagle3nb.families import detect
    from eagle3nb.launch import start_server
    from eagle3nb.params import from_dict
    from eagle3nb.params_yaml import run_params

    with start_server(toy_smoke, reasoning_parser=False) as bare:
        run = write_run(tmp_path / "run", {"01_synth": {"model_path": toy_smoke, "vllm_url": bare.url,
                                                        "max_completion_tokens": 128}})
        r = by_name(run_checks(run, "01"))["server"]
        with pytest.raises(DoctorError) as stop:  # the notebook's strict check-up
            check_stage("01_synth", from_dict("01_synth", run_params(run, "01_synth")), strict=True)
    assert r.status == FAIL, r
    assert "without a reasoning parser" in r.measured and "message.reasoning empty" in r.measured
    assert "--reasoning-parser kimi_k2" in r.fix
    # the stop's first line (all a terminal may show) carries the first failure and its fix, flag included
    first = user_message(stop.value).splitlines()[0]
    assert "server" in first and detect(toy_smoke).parser_flag("vllm") in first and r.fix in first, first


# Faults a loaded server produces now and then: not a 400 (no retry fixes it) nor a hang (it only costs time).
TRANSIENT_FAULTS = ("500", "503", "429", "drop", "malformed", "nochoice")


def flaky_run(folder: Path, toy: Path, url: str) -> Path:
    """01_synth params against ``url`` with a short retry policy (2 retries, 50 ms first backoff)."""
    return write_run(folder, {"01_synth": {"model_path": toy, "vllm_url": url, "max_completion_tokens": 128,
                                           "max_retries": 2, "retry_backoff_s": 0.05}})


def test_probes_retry_a_flaky_server_like_the_run(server, toy_smoke, tmp_path):
    with FaultServer(fault_rate=0.2, faults=TRANSIENT_FAULTS, seed=22, upstream=server.url) as flaky:
        planned = [flaky.plan(FaultServer.key([{"role": "user", "content": q}])) for q in STREAM_PROBES]
        assert all(planned), planned  # seed 22 faults both probe conversations (drop, 429; nochoice, 500)
        report = by_name(run_checks(flaky_run(tmp_path / "run", toy_smoke, flaky.url), "01"))
    assert report["server"].status == PASS, report["server"]
    assert report["token_stream"].status == PASS, report["token_stream"]
    assert sum(f != "ok" for _, f in flaky.served) == sum(map(len, planned))  # every planned fault was met


def test_server_that_keeps_failing_or_is_dead_fails_after_the_retries(toy_smoke, tmp_path):
    with FaultServer(fault_rate=1.0, faults=("503",), max_faults=99) as down:
        assert all(len(down.plan(FaultServer.key([{"role": "user", "content": q}]))) >= 6 for q in STREAM_PROBES)
        r = by_name(run_checks(flaky_run(tmp_path / "down", toy_smoke, down.url), "01"))["server"]
    assert r.status == FAIL and "gave up after 3 attempts" in r.measured, r
    # 3 probes x (max_retries + 1): the openai client adds no retries of its own, later checks reuse the failure
    assert len(down.served) == 9


def test_dead_server_is_unreachable_in_seconds_under_the_default_retries(toy_smoke, tmp_path):
    """A refused connection (nothing listens) is final before the work: 01's default policy would first wait out
    its backoff on each probe (at least half of every delay, jittered), the check-up says so at once."""
    from eagle3nb.families import detect
    from eagle3nb.synth.client import BACKOFF_CAP_S
    from eagle3nb.synth.params import SynthParams

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    run = write_run(tmp_path / "dead", {"01_synth": {"model_path": toy_smoke, "vllm_url": dead}})
    fields = SynthParams.model_fields
    retries, backoff = fields["max_retries"].default, fields["retry_backoff_s"].default
    old_wait = sum(0.5 * min(BACKOFF_CAP_S, backoff * 2**i) for i in range(retries))  # the least one probe waited
    run_checks(write_run(tmp_path / "warm", {"01_synth": {"model_path": toy_smoke, "vllm_url": dead}}), "01")
    t0 = time.monotonic()  # the imports and tokenizer load warm: what is left is the checks and their probes
    r = by_name(run_checks(run, "01"))["server"]
    took = time.monotonic() - t0
    assert r.status == FAIL and "not reachable" in r.measured and "connection refused" in r.measured, r
    assert "start the server" in r.fix and detect(toy_smoke).parser_flag() in r.fix
    assert took < min(10.0, old_wait / 2), (took, old_wait)


# -- 2. token stream ------------------------------------------------------------------------------------------------

def split_think_tokenizer(model_dir: Path, dest: Path) -> Path:
    """The target with a tokenizer that no longer knows <think>/</think> as special tokens, so they
    tokenize into pieces (what a wrong tokenizer backend does to Kimi's think tokens)."""
    dest.mkdir()
    for f in model_dir.iterdir():
        if f.name not in ("tokenizer.json", "tokenizer_config.json"):
            (dest / f.name).symlink_to(f)
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    tok["added_tokens"] = [a for a in tok["added_tokens"] if "think" not in a["content"]]
    (dest / "tokenizer.json").write_text(json.dumps(tok))
    cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    for key in ("extra_special_tokens", "additional_special_tokens"):
        if key in cfg:
            cfg[key] = [t for t in cfg[key] if "think" not in t]
    (dest / "tokenizer_config.json").write_text(json.dumps(cfg))
    return dest


def test_split_think_tokens_fail_token_stream(healthy, server, toy_smoke, tmp_path):
    split = split_think_tokenizer(toy_smoke, tmp_path / "split-tokenizer")
    run = variant(healthy, tmp_path / "run", **{"01_synth": {"model_path": split}})
    report = by_name(run_checks(run, "01"))
    r = report["token_stream"]
    assert r.status == FAIL, r
    assert "'<think>' encodes to" in r.measured and "'</think>' encodes to" in r.measured
    assert "server ids differ from our chat-template rendering" in r.measured  # and the streams disagree
    assert "single special tokens" in r.fix
    assert report["server"].status == PASS  # the server itself is fine: the fault is on our side


# -- 3. thinking -----------------------------------------------------------------------------------------------------

def test_thinking_data_vs_serving_mode(healthy, tmp_path):
    r = by_name(run_checks(healthy["run"], "03", serving_thinking=False))["thinking"]
    assert r.status == FAIL and "serving runs with thinking off" in r.measured, r
    assert "chat_template_kwargs {'thinking': true}" in r.fix
    assert by_name(run_checks(healthy["run"], "03", serving_thinking=True))["thinking"].status == PASS
    # without --serving-thinking, a stage's check-up takes the mode 04 serves with
    run = variant(healthy, tmp_path / "run", **{"04_acceptance": {"thinking": False}})
    r = by_name(run_checks(run, "03"))["thinking"]
    assert r.status == FAIL and "04_acceptance's thinking" in r.measured, r


# -- 4. layer ids ------------------------------------------------------------------------------------------------------

def test_sglang_convention_ids_under_vllm_fail_naming_the_off_by_one(healthy, tmp_path):
    from eagle3nb.layers import to_sglang

    def sglang_ids(cfg):
        ids = to_sglang(cfg["eagle_aux_hidden_state_layer_ids"])
        cfg["eagle_aux_hidden_state_layer_ids"] = cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = ids

    draft = faulty_draft(healthy, tmp_path / "draft", config=sglang_ids)
    run = variant(healthy, tmp_path / "run", **{"04_acceptance": {"draft_dir": draft}})
    r = by_name(run_checks(run, "04", serving_engine="vllm"))["layer_ids"]
    assert r.status == FAIL, r
    assert "SGLang/SpecForge" in r.measured and "off-by-one" in r.measured
    # the same ids are right for SGLang, which adds one
    assert by_name(run_checks(run, "04", serving_engine="sglang"))["layer_ids"].status == PASS


def test_missing_layer_ids_fail_and_cli_exits_nonzero(healthy, tmp_path, capsys):
    def drop_ids(cfg):
        cfg.pop("eagle_aux_hidden_state_layer_ids", None)
        cfg.get("eagle_config", {}).pop("eagle_aux_hidden_state_layer_ids", None)

    draft = faulty_draft(healthy, tmp_path / "draft", config=drop_ids)
    run = variant(healthy, tmp_path / "run", **{"04_acceptance": {"draft_dir": draft}})
    assert main(["doctor", str(run), "--stage", "04", "--json"]) == 1
    r = {x["name"]: x for x in json.loads(capsys.readouterr().out)}["layer_ids"]
    assert r["status"] == "fail"
    assert "no top-level eagle_aux_hidden_state_layer_ids" in r["measured"] and "silently" in r["measured"]


# -- 5. shapes and vocab ---------------------------------------------------------------------------------------------

def test_d2t_t2d_that_disagree_fail(healthy, tmp_path):
    def swap_one(t):
        # t2d drops draft id 3's target and marks an id outside the draft vocab instead: sizes still agree
        t2d = t["t2d"]
        t2d[3 + int(t["d2t"][3])] = False
        t2d[int((~t2d).nonzero()[-1])] = True

    draft = faulty_draft(healthy, tmp_path / "draft", tensors=swap_one)
    run = variant(healthy, tmp_path / "run", **{"04_acceptance": {"draft_dir": draft}})
    r = by_name(run_checks(run, "04"))["shapes_vocab"]
    assert r.status == FAIL, r
    assert "d2t and t2d disagree" in r.measured and "first: draft 3" in r.measured


# -- 6. data health -------------------------------------------------------------------------------------------------

def test_data_health_counts_turns_and_flags_untrained_dataset_turns(healthy, tmp_path):
    """Records of multi-turn conversations answered with multi_turn: last (each the conversation's third turn, its
    first two the dataset's text): the check counts the turns and says most assistant turns train nothing."""
    from eagle3nb.data.samples import read_records

    rows = list(read_records(healthy["out"] / "01_synth"))
    for r in rows:
        r["turn"] = r["turns"] = 3
    synth = tmp_path / "synth"
    synth.mkdir()
    (synth / "samples-00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = variant(healthy, tmp_path / "run", **{"02_hidden_states": {"synth_dir": synth}})
    r = by_name(run_checks(run, "02"))["data_health"]
    ok = sum(x["status"] == "ok" for x in rows)
    assert r.details["turns"]["dataset_turns_untrained"] == 2 * ok and r.details["turns"]["later_turn_ok"] == ok
    assert r.status in (WARN, FAIL) and f"multi_turn: last trains {ok} of {3 * ok} assistant turns" in r.line(), r
    healthy_r = by_name(run_checks(healthy["run"], "02"))["data_health"]
    assert healthy_r.details["turns"]["dataset_turns_untrained"] == 0 and "multi_turn" not in healthy_r.fix


def test_reasoning_wrappers_lost_and_truncations_fail_data_health(healthy, toy_smoke, tmp_path):
    from eagle3nb.data.samples import read_records
    from eagle3nb.data.stream import Template

    think = set(Template(toy_smoke, True).think_ids)
    rows = list(read_records(healthy["out"] / "01_synth"))
    for r in rows[:8]:  # the story's bug: reasoning and answer joined without the think tokens
        keep = [i for i, t in enumerate(r["input_ids"]) if t not in think]
        r["input_ids"] = [r["input_ids"][i] for i in keep]
        r["loss_mask"] = [r["loss_mask"][i] for i in keep]
    for r in rows[8:12]:
        r["status"], r["finish_reason"] = "truncated", "length"
    synth = tmp_path / "synth"
    synth.mkdir()
    (synth / "samples-00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = variant(healthy, tmp_path / "run", **{"02_hidden_states": {"synth_dir": synth}})
    r = by_name(run_checks(run, "02"))["data_health"]
    assert r.status == FAIL, r
    # the counts come from the rows this test wrote (what the toy answered differs by a sample across CPUs)
    thinking = [r for r in rows if r["status"] == "ok" and r.get("thinking")]
    stripped = sum(1 for r in rows[:8] if r in thinking)
    assert stripped >= 6, f"the fixture must strip the think tokens of ok thinking samples ({stripped} of 8 are)"
    assert f"{stripped}/{len(thinking)} ok thinking samples have no <think> token" in r.measured, r.measured
    assert "the story's bug" in r.measured
    truncated = sum(1 for r in rows if r["status"] == "truncated")
    ok = sum(1 for r in rows if r["status"] == "ok")
    assert truncated >= 4 and f"{len(rows)} samples: {ok} ok, {truncated} truncated" in r.measured


# -- 7. disk ---------------------------------------------------------------------------------------------------------

def test_projected_size_beyond_free_space_fails(healthy, tmp_path):
    small = tmp_path / "small"
    small.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(small)],
                             capture_output=True).returncode == 0
    try:
        if mounted:  # a real 256 KB file system: the run's ~1 MB of hidden states cannot fit
            changes = {"02_hidden_states": {"output_dir": small / "02"}}
        else:  # no permission to mount: project a run far larger than this machine's real free disk
            changes = {"01_synth": {"max_samples": 10**12}, "02_hidden_states": {"output_dir": small / "02"}}
        run = variant(healthy, tmp_path / "run", **changes)
        r = by_name(run_checks(run, "02"))["disk"]
    finally:
        if mounted:
            subprocess.run(["umount", str(small)], check=True)
    assert r.status == FAIL, r
    assert r.details["need"] > r.details["free"] and str(small) in r.details["path"]
    assert "compact storage" in r.fix


# -- 8. draft sanity -------------------------------------------------------------------------------------------------

def randomize(t):
    gen = torch.Generator().manual_seed(0)
    for name, x in t.items():
        if x.is_floating_point() and name != "embed_tokens.weight":
            t[name] = torch.randn(x.shape, generator=gen, dtype=x.dtype) * 0.5


def test_random_weight_draft_fails_with_ranked_causes(healthy, tmp_path):
    from eagle3nb.layers import to_sglang

    draft = faulty_draft(healthy, tmp_path / "draft", tensors=randomize)
    run = variant(healthy, tmp_path / "run", **{"04_acceptance": {"draft_dir": draft}})
    r = by_name(run_checks(run, "04"))["draft_sanity"]
    assert r.status == FAIL and "near chance" in r.measured, r
    assert "1. too little training" in r.fix  # every other check passed: undertraining is what remains

    def sglang_ids(cfg):
        cfg["eagle_aux_hidden_state_layer_ids"] = to_sglang(cfg["eagle_aux_hidden_state_layer_ids"])

    draft2 = faulty_draft(healthy, tmp_path / "draft2", config=sglang_ids, tensors=randomize)
    run2 = variant(healthy, tmp_path / "run2", **{"04_acceptance": {"draft_dir": draft2}})
    r2 = by_name(run_checks(run2, "04"))["draft_sanity"]
    assert r2.status == FAIL and r2.details["likely_causes"][0].startswith("aux layer ids"), r2


def test_block_drafter_on_a_dead_mask_row_fails_in_one_line(healthy, toy_smoke, tmp_path):
    """A DFlash draft without a trained ``mask_embedding.pt`` whose mask id reads the toy's pad row (all zeros)
    fails draft_sanity in one line naming the row, before any acceptance is measured; with its file it does not."""
    from safetensors.torch import load_file

    from eagle3nb.drafts.dflash.layouts import MASK_FILE, save_draft
    from eagle3nb.drafts.dflash.model import DFlashDraft, from_target

    eagle = json.loads((healthy["out"] / "03_train" / "draft" / "config.json").read_text())
    draft = DFlashDraft(from_target(json.loads((toy_smoke / "config.json").read_text()), block_size=4,
                                    aux_layer_ids=eagle["eagle_aux_hidden_state_layer_ids"]))
    target = load_file(toy_smoke / "model.safetensors")
    draft.set_target(target["model.embed_tokens.weight"], target["lm_head.weight"])
    folder = save_draft(draft, tmp_path / "dflash")
    (folder / MASK_FILE).unlink()
    run = variant(healthy, tmp_path / "run", **{"04_acceptance": {"draft_dir": folder}})
    r = by_name(run_checks(run, "04"))["draft_sanity"]
    assert r.status == FAIL and "\n" not in r.measured and "per_position" not in r.details, r
    assert f"mask_token_id {draft.config.mask_token_id}" in r.measured and "dead input" in r.measured, r
    save_draft(draft, folder)  # with its trained mask input: judged as any draft
    assert "per_position" in by_name(run_checks(run, "04"))["draft_sanity"].details


def test_server_check_names_the_engine_and_warns_on_an_untested_vllm(healthy):
    from eagle3nb import __version__
    from eagle3nb.doctor.checks.server import _engine_problems
    from eagle3nb.vllm_config import TESTED_VERSION

    r = by_name(run_checks(healthy["run"], "01"))["server"]
    assert r.status == PASS and f"(embedded server {__version__})" in r.measured, r
    old = _engine_problems("http://h:8000/v1", {"engine": "vllm", "version": "0.10.1"})
    assert [p[0] for p in old] == [WARN]
    assert "0.10.1" in old[0][1] and "message.reasoning_content" in old[0][1] and "return_token_ids" in old[0][1]
    assert _engine_problems("http://h:8000/v1", {"engine": "vllm", "version": TESTED_VERSION}) == []
    assert _engine_problems("http://h:8000/v1", {"engine": "eagle3nb", "version": "0.0.1"}) == []
