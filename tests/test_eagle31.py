"""EAGLE-3.1's two options (vLLM 0.32's ``fc_norm`` / ``norm_output`` draft config keys): per-aux-state norms
before fc, and the post-norm state fed back; decoding, export, 03's default (EAGLE-3.1 for a fresh draft). The real
vLLM serves 03's default drafts in tests/test_vllm.py."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from tiny_drafts import H, inputs, tiny_draft

from eagle3nb.drafts import load_draft
from eagle3nb.drafts.eagle3.layouts import save_draft

V31 = {"fc_norm": True, "norm_output": True}


@torch.no_grad()
def test_fc_norm_normalises_each_aux_state_before_fc():
    m = tiny_draft(fc_norm=True)
    aux, _, _ = inputs()
    aux[..., :H] *= 100.0  # one layer's scale far above the others'
    eps = m.config.rms_norm_eps
    chunks = [aux[..., i * H:(i + 1) * H] for i in range(3)]
    normed = [m.fc_norm[i].weight * c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + eps)
              for i, c in enumerate(chunks)]
    want = torch.cat(normed, -1) @ m.fc.weight.T
    torch.testing.assert_close(m.fuse(aux), want, rtol=1e-5, atol=1e-5)
    plain = tiny_draft()  # the same seed: the same fc, without the norms
    assert not torch.allclose(plain.fuse(aux), want, rtol=1e-3, atol=1e-3)
    assert {f"fc_norm.{i}.weight" for i in range(3)} <= set(m.state_dict())
    assert not any(k.startswith("fc_norm") for k in plain.state_dict())


@torch.no_grad()
def test_norm_output_feeds_back_the_post_norm_state():
    m, pre = tiny_draft(norm_output=True), tiny_draft()
    aux, ids, pos = inputs()
    g = m.fuse(aux)
    out, logits = m(g, ids, pos)
    h, want_logits = pre(g, ids, pos)  # the same weights: h is the pre-norm state
    torch.testing.assert_close(out, m.norm(h), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(logits, want_logits, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(out, h, atol=1e-3)


@pytest.mark.parametrize("fmt", ["eagle3", "speculators"])
def test_31_export_round_trips_bit_identical_with_the_keys_vllm_reads(tmp_path, fmt):
    m = tiny_draft(**V31)
    aux, ids, pos = inputs()
    with torch.no_grad():
        want = m(m(m.fuse(aux), ids, pos)[0], ids, pos + 1)  # two steps: the fed-back feature matters
    save_draft(m, tmp_path, format=fmt)
    back = load_draft(tmp_path)
    assert back.config.fc_norm and back.config.norm_output
    with torch.no_grad():
        got = back(back(back.fuse(aux), ids, pos)[0], ids, pos + 1)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["fc_norm"] is True and cfg["norm_output"] is True  # top-level in both layouts, as vLLM reads them
    tensors = load_file(tmp_path / "model.safetensors")
    assert all(tensors[f"fc_norm.{i}.weight"].shape == (H,) for i in range(3))  # vLLM: model.fc_norm.{i}.weight


@pytest.mark.parametrize("fmt", ["eagle3", "speculators"])
def test_a_30_export_carries_no_31_keys(tmp_path, fmt):
    save_draft(tiny_draft(), tmp_path, format=fmt)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert "fc_norm" not in cfg and "norm_output" not in cfg
    assert not any(k.startswith("fc_norm") for k in load_file(tmp_path / "model.safetensors"))
    back = load_draft(tmp_path)
    assert not back.config.fc_norm and not back.config.norm_output


def test_run_config_omits_the_31_options_when_off_so_older_runs_resume():
    from eagle3nb.train.checkpoint import run_config
    from eagle3nb.train.params import TrainParams

    off = TrainParams(fc_norm=False, norm_output=False)
    assert "fc_norm" not in run_config(off, 1) and "norm_output" not in run_config(off, 1)
    on = run_config(TrainParams(fc_norm=True, norm_output=True), 1)
    assert on["fc_norm"] is True and on["norm_output"] is True


def test_a_fresh_draft_is_31_by_default_and_a_resumed_run_keeps_its_own_choice(tmp_path):
    """03's default (null) is EAGLE-3.1 for a fresh draft, but a run whose checkpoints were made before that
    default (no fc_norm in their settings) resumes as the EAGLE-3.0 draft it is, and one made with it as EAGLE-3.1;
    explicit values win, and a fine-tune (init_from) is left to its checkpoint's layout."""
    from draft_shapes import meta_of, shaped, target_dir

    from eagle3nb.train.build import with_recipe_defaults
    from eagle3nb.train.checkpoint import run_config
    from eagle3nb.train.params import TrainParams

    llama = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 8, "num_attention_heads": 4,
             "intermediate_size": 128, "vocab_size": 100}
    meta = meta_of(target_dir(tmp_path / "target", llama), llama)
    fresh = shaped(TrainParams(), meta, 50)
    assert fresh.fc_norm and fresh.norm_output
    assert not shaped(TrainParams(fc_norm=False, norm_output=False), meta, 50).fc_norm

    ckpt = tmp_path / "checkpoints"
    ckpt.mkdir()
    resolved = with_recipe_defaults(TrainParams(), ckpt)
    assert (resolved.fc_norm, resolved.norm_output) == (True, True)
    assert run_config(resolved, 1)["fc_norm"] is True  # what a new run's checkpoints record
    torch.save({"run_config": run_config(TrainParams(fc_norm=False, norm_output=False), 1)}, ckpt / "step-00000010.pt")
    older = with_recipe_defaults(TrainParams(), ckpt)
    assert (older.fc_norm, older.norm_output) == (False, False)
    assert run_config(older, 1) == run_config(TrainParams(fc_norm=False, norm_output=False), 1)
    assert with_recipe_defaults(TrainParams(resume=False), ckpt).fc_norm is True
    assert with_recipe_defaults(TrainParams(fc_norm=True), ckpt).fc_norm is True
    tuned = with_recipe_defaults(TrainParams(init_from=str(tmp_path)), ckpt)
    assert tuned.fc_norm is None and tuned.norm_output is None
