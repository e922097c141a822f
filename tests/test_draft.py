"""eagle3nb.drafts.eagle3 (model and layouts): decoding cache, the training-time-test attention, checkpoint
layouts, fit errors."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file
from tiny_drafts import MLA, VD, H, T, V, inputs, tiny_draft

from eagle3nb.drafts import DraftMismatchError, check_fits, load_draft
from eagle3nb.drafts.eagle3.cache import DraftCache, TTTCache
from eagle3nb.drafts.eagle3.layouts import save_draft
from eagle3nb.drafts.eagle3.model import Eagle3Draft

# The draft variants every decoding test holds: Llama attention, DeepSeek's latent attention with and without a
# low-rank query, and EAGLE-3.1's per-aux-state norms with the post-norm state fed back.
ATTENTIONS = {"llama": {}, "mla": {"mla": MLA}, "mla-qlora": {"mla": {**MLA, "q_lora_rank": 12}},
              "eagle3.1": {"fc_norm": True, "norm_output": True}}


@pytest.mark.parametrize("attention", list(ATTENTIONS))
@torch.no_grad()
def test_decoding_with_cache_equals_one_causal_pass_and_crop_rewinds(attention):
    m = tiny_draft(**ATTENTIONS[attention])
    aux, ids, pos = inputs()
    g = m.fuse(aux)
    _, full = m(g, ids, pos)
    cache = DraftCache()
    _, first = m(g[:, :5], ids[:, :5], pos[:, :5], cache)
    steps = [m(g[:, t:t + 1], ids[:, t:t + 1], pos[:, t:t + 1], cache)[1] for t in range(5, T)]
    assert cache.length == T
    torch.testing.assert_close(torch.cat([first, *steps], 1), full, rtol=1e-5, atol=1e-5)
    cache.crop(7)  # drop "rejected" positions 7.., then decode position 7 again
    assert cache.length == 7
    again = m(g[:, 7:8], ids[:, 7:8], pos[:, 7:8], cache)[1]
    torch.testing.assert_close(again, full[:, 7:8], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("attention", list(ATTENTIONS))
@pytest.mark.parametrize("dense", [False, True])
@torch.no_grad()
def test_ttt_step_i_sees_causal_step0_keys_plus_its_own_diagonal(dense, attention):
    """Each TTT step, at every position t, equals decoding i tokens ahead of t with a KV cache: prefill the
    target features 0..t, then feed the draft's own feature back at positions t+1..t+i. Both ways of computing
    the TTT attention (element-wise diagonal; fused attention with a block mask) are held to it."""
    m = tiny_draft(**ATTENTIONS[attention])
    aux, ids, pos = inputs(B=1)
    steps = 3
    step_ids = [torch.roll(ids, -i, dims=1) for i in range(steps)]  # any token per (step, position)
    cache, hidden, ttt = TTTCache(dense=dense), m.fuse(aux), []
    for i in range(steps):
        hidden, logits = m(hidden, step_ids[i], pos + i, cache)
        ttt.append((hidden, logits))
    assert cache.steps == steps
    for t in range(T):
        dc = DraftCache()
        h, logits = m(m.fuse(aux[:, :t + 1]), ids[:, :t + 1], pos[:, :t + 1], dc)
        h, logits = h[:, -1:], logits[:, -1:]
        torch.testing.assert_close(logits, ttt[0][1][:, t:t + 1], rtol=1e-5, atol=1e-5)
        for i in range(1, steps):
            h, logits = m(h, step_ids[i][:, t:t + 1], torch.tensor([[t + i]]), dc)
            torch.testing.assert_close(logits, ttt[i][1][:, t:t + 1], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(h, ttt[i][0][:, t:t + 1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", ["eagle3", "speculators"])
def test_export_then_load_gives_bit_identical_logits(tmp_path, fmt):
    m = tiny_draft()
    aux, ids, pos = inputs()
    with torch.no_grad():
        want = m(m.fuse(aux), ids, pos)[1]
    save_draft(m, tmp_path, format=fmt)
    back = load_draft(tmp_path)
    with torch.no_grad():
        got = back(back.fuse(aux), ids, pos)[1]
    assert torch.equal(got, want)
    assert torch.equal(back.d2t, m.d2t) and torch.equal(back.t2d, m.t2d)
    cfg = json.loads((tmp_path / "config.json").read_text())
    tensors = load_file(tmp_path / "model.safetensors")
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    if fmt == "eagle3":
        assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama"
        assert cfg["num_hidden_layers"] == 1 and cfg["draft_vocab_size"] == VD and cfg["vocab_size"] == V
        assert cfg["target_hidden_size"] == H
        assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # vLLM reads the top-level key
        assert cfg["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [2, 4, 5], "use_aux_hidden_state": True}
        assert "midlayer.self_attn.q_proj.weight" in tensors and tensors["fc.weight"].shape == (H, 3 * H)
        assert tensors["midlayer.self_attn.q_proj.weight"].shape == (4 * 8, 2 * H)
    else:
        assert cfg["speculators_model_type"] == "eagle3" and cfg["transformer_layer_config"]["vocab_size"] == V
        assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
        assert "layers.0.hidden_norm.weight" in tensors and not any(k.startswith("midlayer.") for k in tensors)


def test_midlayer_and_layers0_checkpoints_are_the_same_model(tmp_path):
    m = tiny_draft()
    save_draft(m, tmp_path / "a", format="eagle3")
    save_draft(m, tmp_path / "b", format="speculators")
    a, b = load_draft(tmp_path / "a"), load_draft(tmp_path / "b")
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert a.config == b.config


def test_checkpoint_without_embedding_needs_the_targets(tmp_path):
    m = tiny_draft()
    save_draft(m, tmp_path, include_embed=False)
    assert "embed_tokens.weight" not in load_file(tmp_path / "model.safetensors")
    with pytest.raises(DraftMismatchError, match="embed_tokens"):
        load_draft(tmp_path)
    back = load_draft(tmp_path, embed_tokens=m.embed_tokens.weight.detach())
    assert torch.equal(back.embed_tokens.weight, m.embed_tokens.weight)


@pytest.mark.parametrize("fmt", ["eagle3", "speculators"])
def test_a_whole_vocabulary_draft_exports_without_vocab_maps_in_target_order(tmp_path, fmt):
    """draft_vocab_size == vocab_size: vLLM builds no d2t parameter and refuses one in the file ("no module or
    parameter named 'draft_id_to_target_id'"), so the export has neither map and lm_head's rows in target order
    (here from a shuffled map, the general case); loading rebuilds the identity and the same target-id logits."""
    m = Eagle3Draft(dataclasses.replace(tiny_draft().config, draft_vocab_size=V)).eval()
    perm = torch.randperm(V, generator=torch.Generator().manual_seed(3))  # draft id i -> target id perm[i]
    m.set_vocab(perm - torch.arange(V), torch.ones(V, dtype=torch.bool))
    aux, ids, pos = inputs()
    with torch.no_grad():
        logits = m(m.fuse(aux), ids, pos)[1]  # shape: [B, T, V] over draft ids
    want = torch.empty_like(logits)
    want[..., perm] = logits  # the same logits indexed by target id
    save_draft(m, tmp_path, format=fmt)
    assert not {"d2t", "t2d"} & set(load_file(tmp_path / "model.safetensors"))
    back = load_draft(tmp_path)
    assert torch.equal(back.d2t, torch.zeros(V, dtype=torch.int64)) and bool(back.t2d.all())
    with torch.no_grad():
        assert torch.equal(back(back.fuse(aux), ids, pos)[1], want)


def test_bf16_export_and_transformers5_rope_keys_load(tmp_path):
    m = tiny_draft(rope_theta=1e6, rope_scaling={"rope_type": "linear", "factor": 2.0})
    save_draft(m, tmp_path, dtype=torch.bfloat16)
    assert load_file(tmp_path / "model.safetensors")["fc.weight"].dtype == torch.bfloat16
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["torch_dtype"] == "bfloat16"
    # the same config as transformers 5 writes it: rope settings under rope_parameters
    rope = {"rope_theta": cfg.pop("rope_theta"), **cfg.pop("rope_scaling")}
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "rope_parameters": rope}))
    back = load_draft(tmp_path)
    assert back.config.rope_theta == 1e6 and back.config.rope_scaling["factor"] == 2.0
    assert torch.equal(back.rotary.inv_freq, m.rotary.inv_freq)


def test_mismatched_checkpoint_errors_name_both_sides():
    cfg = tiny_draft().config
    with pytest.raises(DraftMismatchError) as e:
        check_fits(cfg, hidden_size=64, vocab_size=V + 1, layer_ids=[2, 4, 5], draft="ckpt X", data="data Y")
    msg = str(e.value)
    assert "target hidden size: ckpt X has 32" in msg and "data Y has 64" in msg
    assert f"ckpt X has {V}, data Y has {V + 1}" in msg
    with pytest.raises(DraftMismatchError, match=r"SGLang.*add 1"):
        check_fits(cfg, hidden_size=H, vocab_size=V, layer_ids=[3, 5, 6])
    check_fits(cfg, hidden_size=H, vocab_size=V, layer_ids=[2, 4, 5])  # fits: no error
    with pytest.raises(DraftMismatchError, match="width 10"):
        tiny_draft().fuse(torch.zeros(1, 2, 10))


def test_shape_mismatch_in_checkpoint_is_named(tmp_path):
    save_draft(tiny_draft(), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 64}))
    with pytest.raises(DraftMismatchError,
                       match=r"midlayer\.mlp\.\w+_proj\.weight has shape .* but config.json implies"):
        load_draft(tmp_path)


def test_unknown_or_incomplete_draft_architectures_are_named(tmp_path):
    save_draft(tiny_draft(), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "architectures": ["MedusaModel"]}))
    with pytest.raises(DraftMismatchError, match="architectures \\['MedusaModel'\\] is not a draft this package reads"):
        load_draft(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "architectures": ["Eagle3DeepseekV2ForCausalLM"]}))
    with pytest.raises(DraftMismatchError, match="MLA draft .* without kv_lora_rank"):
        load_draft(tmp_path)


@pytest.mark.parametrize("attention", ["mla", "mla-qlora"])
def test_mla_draft_exports_as_vllms_deepseek_eagle3_and_loads_back(tmp_path, attention):
    """vLLM's deepseek_eagle3 reads architectures Eagle3DeepseekV2ForCausalLM under a model_type it keeps for a
    draft (deepseek_v2: it rewrites deepseek_v3 into its MTP drafter), the MLA widths, and these tensor names."""
    m = tiny_draft(**ATTENTIONS[attention])
    aux, ids, pos = inputs()
    with torch.no_grad():
        want = m(m.fuse(aux), ids, pos)[1]
    save_draft(m, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    mla = ATTENTIONS[attention]["mla"]
    assert cfg["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and cfg["model_type"] == "deepseek_v2"
    assert {k: cfg[k] for k in mla} == mla and cfg["num_attention_heads"] == 4
    names = {k for k in load_file(tmp_path / "model.safetensors") if k.startswith("midlayer.self_attn.")}
    query = ({"q_a_proj", "q_a_layernorm", "q_b_proj"} if mla["q_lora_rank"] else {"q_proj"})
    assert names == {f"midlayer.self_attn.{n}.weight" for n in
                     query | {"kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"}}
    back = load_draft(tmp_path)
    with torch.no_grad():
        assert torch.equal(back(back.fuse(aux), ids, pos)[1], want)
    with pytest.raises(DraftMismatchError, match="no speculators layout"):
        save_draft(m, tmp_path / "spec", format="speculators")


@torch.no_grad()
def test_mla_attention_equals_transformers_deepseek_v3_attention():
    """Our MLA midlayer attention is DeepSeek-V3's (transformers' class: interleaved rotary on the shared rotary
    key, latent-normed keys and values, 1/sqrt(nope + rope) scale), over the 2H concatenation it reads."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    m = tiny_draft(**ATTENTIONS["mla"])
    ours = m.midlayer.self_attn
    hf_cfg = DeepseekV3Config(hidden_size=2 * H, num_attention_heads=4, num_key_value_heads=4, **MLA,
                              rope_interleave=True, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                              rms_norm_eps=m.config.rms_norm_eps, max_position_embeddings=64)
    hf_cfg._attn_implementation = "eager"
    hf = DeepseekV3Attention(hf_cfg, layer_idx=0).eval()
    for name in ("q_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj"):
        getattr(hf, name).weight.copy_(getattr(ours, name).weight)
    hf.o_proj.weight.zero_()
    hf.o_proj.weight[:H] = ours.o_proj.weight  # its o_proj maps back to 2H: our H outputs are its first H
    x = torch.randn(2, T, 2 * H)
    pos = torch.arange(T).expand(2, T)
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None].expand(2, 1, T, T)
    want = hf(x, position_embeddings=DeepseekV3RotaryEmbedding(hf_cfg)(x, pos), attention_mask=mask)[0][..., :H]
    cos, sin = m.rotary(x, pos)
    got = ours(x, cos, sin, None, None)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
