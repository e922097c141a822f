"""03_train on real 02 output of the toy target: learning, fine-tuning, export, resume after kill -9, DDP."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from eagle3nb.data.reader import HiddenStates
from eagle3nb.data.split import split_holdout
from eagle3nb.drafts import DraftMismatchError, load_draft
from eagle3nb.drafts.eagle3.layouts import save_draft
from eagle3nb.params import from_dict
from eagle3nb.train.checkpoint import ResumeMismatch, checkpoints
from eagle3nb.train.data import DeviceTargets
from eagle3nb.train.loop import TrainingDiverged
from eagle3nb.train.report import read_metrics
from eagle3nb.train.stage import run

from train_data import child_env, kill_after, make_hidden_states
from worlds import SEED

# Small and quick: 3 TTT steps, a few dozen steps, micro-batches of ~4 samples.
BASE = dict(run_name="test", ttt_steps=3, max_length=256, batch_tokens=400, lr=3e-3, warmup_ratio=0.05,
            eval_every=0, save_every=100, holdout_fraction=0.2, seed=SEED)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory, toy_smoke) -> Path:
    return make_hidden_states(tmp_path_factory.mktemp("hidden"), toy_smoke, n=40, draft_vocab_size=96, seed=SEED)


pytestmark = pytest.mark.usefixtures("one_thread")


def params(data_dir: Path, out: Path, **over):
    return from_dict("03_train", {**BASE, "data_dir": str(data_dir), "output_dir": str(out), **over})


def curve(out: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(out) if r["kind"] == "train"]


@pytest.fixture(scope="module")
def trained(data_dir, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("scratch")
    return out, run(params(data_dir, out, max_steps=40, lr=5e-3, export_format="both"))


def heldout_acceptance(draft, data_dir: Path) -> dict:
    """04's offline acceptance (its own chains over the target's argmax, not the TTT code under test) on the
    samples 03 held out."""
    from eagle3nb.accept.offline import offline_acceptance

    data = HiddenStates(data_dir)
    _, held = split_holdout([s["id"] for s in data.meta["samples"]], BASE["holdout_fraction"])
    return offline_acceptance(draft, data, k=3, max_k=3, indices=held)


def test_trained_from_scratch_beats_untrained_and_exports_for_vllm_and_sglang(trained, data_dir):
    from eagle3nb.train.build import build_draft

    out, result = trained
    before, after = result["initial_heldout"], result["heldout"]
    assert before["positions"] == after["positions"] > 50
    # Judged by 04's offline acceptance, so a shift bug shared by the TTT loss and its metric cannot pass.
    # Measured here on 210 held-out positions: acceptance length (k=3) 1.01 untrained -> 1.83 after 40 steps,
    # alpha_1 0.01 -> 0.52. The lines 1.4 and 0.25 sit near the middle: ~0.4 and ~0.25 of room either way.
    data = HiddenStates(data_dir)
    fresh = heldout_acceptance(build_draft(params(data_dir, out), data)[0], data_dir)
    judged = heldout_acceptance(load_draft(out / "draft", embed_tokens=data.embed_tokens()), data_dir)
    assert fresh["positions"] == judged["positions"] > 50
    assert fresh["acceptance_length"] < 1.4 < judged["acceptance_length"], (fresh, judged)
    assert fresh["per_position"][0] < 0.25 < judged["per_position"][0]
    rows = read_metrics(out)
    assert [r["step"] for r in rows if r["kind"] == "train"] == list(range(1, 41))
    assert json.loads((out / "metrics.json").read_text())["heldout"] == after
    assert json.loads((out / "progress.json").read_text())["state"] == "done"
    # the export: EAGLE-3 layout with the data's vLLM ids; SGLang's copy with output-of-layer ids
    meta = json.loads((data_dir / "index.json").read_text())
    cfg = json.loads((out / "draft" / "config.json").read_text())
    assert cfg["eagle_aux_hidden_state_layer_ids"] == meta["layer_ids"] == [2, 4, 5]
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert cfg["vocab_size"] == meta["vocab_size"] and cfg["draft_vocab_size"] == 96
    sg = json.loads((out / "draft-sglang" / "config.json").read_text())
    assert sg["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    assert (out / "draft-sglang" / "model.safetensors").samefile(out / "draft" / "model.safetensors")
    vocab = load_file(data_dir / "draft_vocab.safetensors")
    tensors = load_file(out / "draft" / "model.safetensors")
    assert torch.equal(tensors["d2t"], vocab["d2t"]) and torch.equal(tensors["t2d"], vocab["t2d"])
    spec = json.loads((out / "draft-speculators" / "config.json").read_text())
    assert spec["speculators_config"]["verifier"]["name_or_path"] == meta["model_path"]
    a, b = load_draft(out / "draft").state_dict(), load_draft(out / "draft-speculators").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert '--speculative-config \'{"method": "eagle3", "model": "' in result["serve"]["vllm"]
    assert "--speculative-draft-model-path" in result["serve"]["sglang"]
    # 03's default fresh draft is EAGLE-3.1, and the SGLang command says what an SGLang without it would do
    assert cfg["fc_norm"] is True and cfg["norm_output"] is True and "fc_norm.0.weight" in tensors
    assert "fc_norm, norm_output" in result["serve"]["sglang_note"]


def test_finetune_starts_at_the_checkpoints_quality(trained, data_dir, tmp_path):
    out, result = trained
    ft = run(params(data_dir, tmp_path, init_from=str(out / "draft"), max_steps=1, lr=1e-7))
    assert ft["init"] == str(out / "draft")
    start = ft["initial_heldout"]
    assert start["acc"] == pytest.approx(result["heldout"]["acc"], abs=1e-9)
    assert start["acceptance_length"] > result["initial_heldout"]["acceptance_length"] + 0.4


def test_checkpoint_that_does_not_fit_the_data_is_refused_before_training(trained, data_dir, tmp_path):
    out, _ = trained
    bad = tmp_path / "bad"
    model = load_draft(out / "draft")
    model.config.aux_layer_ids = [1, 3, 4]  # SGLang numbering of the same layers
    save_draft(model, bad)
    with pytest.raises(DraftMismatchError, match=r"has \[1, 3, 4\], hidden states .* has \[2, 4, 5\].*add 1"):
        run(params(data_dir, tmp_path / "o1", init_from=str(bad), max_steps=1))
    # another draft vocabulary: refused unless asked to remap (rows follow their target ids)
    model = load_draft(out / "draft")
    model.d2t[:3] = torch.tensor([5, 5, 5]) - torch.arange(3)  # maps 3 ids elsewhere: another vocabulary
    save_draft(model, bad)
    with pytest.raises(DraftMismatchError, match="draft vocabulary: checkpoint .* remap_vocab"):
        run(params(data_dir, tmp_path / "o2", init_from=str(bad), max_steps=1))
    r = run(params(data_dir, tmp_path / "o3", init_from=str(bad), max_steps=1, remap_vocab=True))
    assert r["vocab_remap"]["new"] > 0 and not (tmp_path / "o2" / "draft").exists()


def test_nan_loss_stops_with_step_and_samples(trained, data_dir, tmp_path):
    out, _ = trained
    model = load_draft(out / "draft")
    with torch.no_grad():
        model.fc.weight[0, 0] = float("nan")
    save_draft(model, tmp_path / "nan")
    with pytest.raises(TrainingDiverged, match=r"NaN/inf at step 1 .*micro-batch 0 with samples \['toy-"):
        run(params(data_dir, tmp_path / "o", init_from=str(tmp_path / "nan"), max_steps=3))


# ---- resume and multi-process: both compared to one uninterrupted single-process run --------------------

RUN = dict(max_steps=30, grad_accum=2, eval_every=10)


@pytest.fixture(scope="module")
def reference(data_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("reference")
    run(params(data_dir, out, **RUN))
    return out


def final_state(out: Path) -> dict[str, torch.Tensor]:
    return torch.load(checkpoints(out / "checkpoints")[-1], weights_only=False)["model"]


def params_dir(tmp_path: Path, values: dict) -> Path:
    """params/<run>/03_train.yaml as a run folder holds it, for ``python -m eagle3nb.train`` / torchrun."""
    d = tmp_path / "params" / "test"
    d.mkdir(parents=True)
    (d / "03_train.yaml").write_text(yaml.safe_dump(values))
    return d


def test_resume_after_kill9_follows_the_uninterrupted_curve(reference, data_dir, tmp_path):
    out = tmp_path / "out"
    values = {**BASE, **RUN, "data_dir": str(data_dir), "output_dir": str(out), "save_every": 1}
    killed_at = kill_after(params_dir(tmp_path, values), out, 4)
    assert 4 <= killed_at < 30
    run(from_dict("03_train", values))
    assert curve(out) == curve(reference)  # exactly: same batches, same optimizer state, same order
    want, got = final_state(reference), final_state(out)
    assert all(torch.equal(want[k], got[k]) for k in want)
    evals = [r["step"] for r in read_metrics(out) if r["kind"] == "eval"]
    assert evals == [0, 10, 20, 30]
    # a finished run run again (the notebook after a torchrun run): nothing retrained, the same report
    again = run(from_dict("03_train", values))
    assert curve(out) == curve(reference) and again["heldout"]["step"] == 30


def test_resume_with_changed_settings_is_refused_and_resume_false_starts_over(reference, data_dir, tmp_path):
    """Continuing checkpoints under another lr would mix two runs in one curve: refused, naming the setting and
    the ways out; ``resume: false`` drops the old checkpoints and trains from step 0 under the new settings (Muon
    here, whose run then resumes exactly from a checkpoint: both optimizers' states restored)."""
    out = tmp_path / "out"
    shutil.copytree(reference, out)
    with pytest.raises(ResumeMismatch, match=r"other settings \(lr: checkpoint 0\.003, now 0\.001\).*resume: false"):
        run(params(data_dir, out, **RUN, lr=1e-3))
    muon = dict(RUN, lr=1e-3, optimizer="muon", save_every=10)  # the new settings: Muon on the weight matrices
    run(params(data_dir, out, **muon, resume=False))
    assert [r["step"] for r in read_metrics(out) if r["kind"] == "train"] == list(range(1, 31))
    assert curve(out)[0] == curve(reference)[0] and curve(out)[1:] != curve(reference)[1:]  # from the start
    assert {torch.load(c, weights_only=False)["run_config"]["lr"] for c in checkpoints(out / "checkpoints")} == {1e-3}
    # Muon and AdamW both resume exactly: from the step-20 checkpoint the last 10 steps come out bit for bit
    blob = torch.load(checkpoints(out / "checkpoints")[-1], weights_only=False)
    assert set(blob["optimizer"]) == {"muon", "adamw"} and blob["optimizer"]["muon"]["state"]
    again = tmp_path / "again"
    shutil.copytree(out, again)
    checkpoints(again / "checkpoints")[-1].unlink()
    run(params(data_dir, again, **muon))
    assert curve(again) == curve(out)
    want, got = final_state(out), final_state(again)
    assert all(torch.equal(want[k], got[k]) for k in want)


def test_the_old_num_layers_default_resumes_eagle3_and_refuses_a_block_drafter_naming_it(reference, data_dir,
                                                                                         tmp_path):
    """num_layers null is now the method's depth. An EAGLE-3 run saved at 1 (the old default: its checkpoints
    record no num_layers, as every run's before) resumes unchanged with params that leave num_layers out. A block
    drafter run saved at the old 1 and resumed without num_layers would now train 2 layers: refused in one line
    naming num_layers with both values (restoring num_layers: 1 resumes it), as is 2 -> 1, whose left-out 1 was
    not compared before (1.3 s: the finished run run again, nothing trained; the rest reads one checkpoint)."""
    from eagle3nb.train.checkpoint import load_checkpoint, run_config

    out = tmp_path / "out"
    shutil.copytree(reference, out)
    last = checkpoints(out / "checkpoints")[-1]
    blob = torch.load(last, weights_only=False)
    assert "num_layers" not in blob["run_config"]
    again = run(params(data_dir, out, **RUN))
    assert again["heldout"]["step"] == 30 and curve(out) == curve(reference)  # resumed at the end: nothing retrained

    block = dict(RUN, method="dflash", block_size=4)

    def refusal(saved: int, now: int | None) -> str:
        """The line resuming with ``now`` gives on a block drafter run saved at ``saved`` layers."""
        torch.save({**blob, "run_config": run_config(params(data_dir, out, **block, num_layers=saved), 1)}, last)
        with pytest.raises(ResumeMismatch) as e:
            load_checkpoint(last, None, None, None, run_config(params(data_dir, out, **block, num_layers=now), 1))
        return str(e.value)

    assert "other settings (num_layers: checkpoint 1, now 2). Restore them to resume" in refusal(1, None)
    assert "other settings (num_layers: checkpoint 2, now 1). Restore them to resume" in refusal(2, 1)


def test_the_resume_check_holds_the_settings_of_the_runs_method_and_no_other_methods():
    """A run's resume check holds the settings its method reads (its rules' params: a block drafter's block, DSpark's
    heads), none of another method's (changing one the run never reads resumes it), and an EAGLE-3 run's no
    method, as every run's before there was a choice (so their checkpoints resume)."""
    from eagle3nb.train.checkpoint import run_config

    over = {"eagle3": {}, "dflash": {"block_size": 4, "num_speculative_tokens": 3},
            "dspark": {"block_size": 4, "num_speculative_tokens": 4}}
    cfg = {m: run_config(from_dict("03_train", {"method": m, **o}, check_paths=False), 1) for m, o in over.items()}
    assert not {"method", "block_size", "anchors_per_seq", "markov_rank"} & cfg["eagle3"].keys()
    assert (cfg["dflash"]["method"], cfg["dflash"]["block_size"]) == ("dflash", 4)
    assert not {"markov_rank", "confidence_weight"} & cfg["dflash"].keys()
    assert (cfg["dspark"]["markov_rank"], cfg["dspark"]["block_size"]) == (32, 4)
    # block_causal: left out at false, as every block run had before it existed (theirs resume), held when true
    assert "block_causal" not in cfg["dflash"]
    causal = run_config(from_dict("03_train", {"method": "dflash", **over["dflash"], "block_causal": True},
                                  check_paths=False), 1)
    assert causal["block_causal"] is True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_gloo_processes_equal_one_process_with_the_same_global_batch(reference, data_dir, tmp_path):
    out = tmp_path / "out"
    values = {**BASE, **RUN, "data_dir": str(data_dir), "output_dir": str(out)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), "-m", "eagle3nb.train", str(params_dir(tmp_path, values)),
           "--set", "grad_accum=1"]
    done = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "2 process(es) x grad_accum 1" in done.stdout
    assert json.loads((out / "metrics.json").read_text())["processes"] == 2
    assert curve(out) == pytest.approx(curve(reference), rel=1e-5)
    want, got = final_state(reference), final_state(out)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-5)
    ev = [r for r in read_metrics(out) if r["kind"] == "eval"]
    ref = [r for r in read_metrics(reference) if r["kind"] == "eval"]
    assert [a for r in ev for a in r["acc"]] == pytest.approx([a for r in ref for a in r["acc"]], abs=1e-3)


def test_device_targets_equal_the_readers(data_dir):
    """The loss targets computed on the training device are the reader's, exactly (here both on CPU)."""
    data = HiddenStates(data_dir)
    targets = DeviceTargets(data, torch.device("cpu"))
    for i in range(3):
        probs, argmax = targets(data[i])
        assert torch.equal(probs, data.target_probs(data[i])) and torch.equal(argmax, data.target_argmax(data[i]))
