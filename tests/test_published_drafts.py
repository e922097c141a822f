"""Drafts shaped like the published ones (issue 22, item 4).

A fresh draft for an MLA target (DeepseekV3 / Kimi-K2) takes the shape of the published Kimi-K2 EAGLE-3 drafters
(AQ-MedAI's: a Llama layer, every head a KV head, of the target's value width), and a checkpoint written in
AQ-MedAI's layout (``LlamaForCausalLMEagle3``, ids under ``eagle_config``, bf16, ``embed_tokens`` absent or
present) is fine-tuned by 03 and exported in the layout vLLM loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from draft_shapes import meta_of, shaped, target_dir
from safetensors.torch import load_file, save_file

from eagle3nb.data.reader import HiddenStates
from eagle3nb.drafts import load_draft
from eagle3nb.drafts.eagle3.cache import TTTCache
from eagle3nb.drafts.eagle3.layouts import draft_config_json, save_draft
from eagle3nb.drafts.eagle3.model import Eagle3Config, Eagle3Draft
from eagle3nb.families import is_mla
from eagle3nb.layers import default_aux_layer_ids
from eagle3nb.params import from_dict
from eagle3nb.train import build
from eagle3nb.train.build import build_draft
from eagle3nb.train.stage import run

from train_data import make_hidden_states
from worlds import SEED

pytestmark = pytest.mark.usefixtures("one_thread")

BASE = dict(run_name="test", ttt_steps=2, max_length=256, batch_tokens=400, lr=1e-3, warmup_ratio=0.0,
            eval_every=0, save_every=100, holdout_fraction=0.2, seed=SEED)

# moonshotai/Kimi-K2-Instruct config.json (DeepseekV3): the attention and MLP keys, with head_dim as
# transformers writes it for DeepseekV3 (= qk_rope_head_dim).
KIMI_K2 = {"model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 7168,
           "num_attention_heads": 64, "num_key_value_heads": 64, "kv_lora_rank": 512, "q_lora_rank": 1536,
           "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128, "head_dim": 64,
           "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
           "vocab_size": 163840, "rope_theta": 50000.0, "rms_norm_eps": 1e-6}
# Qwen/Qwen3-8B and meta-llama/Llama-3.1-8B-Instruct (the latter writes no head_dim).
QWEN3_8B = {"model_type": "qwen3", "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "intermediate_size": 12288, "num_hidden_layers": 36, "vocab_size": 151936}
LLAMA31_8B = {"model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
              "intermediate_size": 14336, "num_hidden_layers": 32, "vocab_size": 128256}


def train_params(**over):
    return from_dict("03_train", {**BASE, **over})


# ---- the shape of a fresh draft ---------------------------------------------------------------------------------


@pytest.mark.parametrize("nested", [False, True], ids=["kimi_k2", "kimi_k25_text_config"])
def test_fresh_draft_of_an_mla_target_is_shaped_like_the_published_kimi_drafter(tmp_path, nested):
    config = {"model_type": "kimi_k25", "text_config": KIMI_K2} if nested else KIMI_K2
    assert is_mla(config)
    cfg = shaped(train_params(), meta_of(target_dir(tmp_path, config), config), 32000)
    # AQ-MedAI's Kimi-K2 drafter: all 64 heads are KV heads, 128 wide (the value width), MLP 18432 (dense layer).
    assert cfg.hidden_size == cfg.target_hidden_size == KIMI_K2["hidden_size"]
    assert cfg.num_attention_heads == cfg.num_key_value_heads == KIMI_K2["num_attention_heads"]
    assert cfg.head_dim == KIMI_K2["v_head_dim"] != KIMI_K2["head_dim"]
    assert cfg.intermediate_size == KIMI_K2["intermediate_size"]
    assert cfg.num_attention_heads * cfg.head_dim != cfg.hidden_size  # attention projects 7168 -> 8192 and back
    assert cfg.aux_layer_ids == [2, KIMI_K2["num_hidden_layers"] // 2, KIMI_K2["num_hidden_layers"] - 3]
    assert cfg.vocab_size == KIMI_K2["vocab_size"] and cfg.draft_vocab_size == 32000


def test_mla_head_width_falls_back_to_qk_nope_and_explicit_params_win(tmp_path):
    config = {k: v for k, v in KIMI_K2.items() if k not in ("v_head_dim", "num_key_value_heads")}
    config["qk_nope_head_dim"] = 96
    cfg = shaped(train_params(), meta_of(target_dir(tmp_path / "a", config), config), 32000)
    assert cfg.head_dim == config["qk_nope_head_dim"]
    assert cfg.num_key_value_heads == config["num_attention_heads"]
    over = dict(num_attention_heads=32, num_key_value_heads=8, head_dim=160, intermediate_size=4096)
    cfg = shaped(train_params(**over), meta_of(target_dir(tmp_path / "b", KIMI_K2), KIMI_K2), 32000)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size) == (
        over["num_attention_heads"], over["num_key_value_heads"], over["head_dim"], over["intermediate_size"])
    # only heads given: the KV heads follow them (every head a KV head), not the target's count
    cfg = shaped(train_params(num_attention_heads=16), meta_of(target_dir(tmp_path / "c", KIMI_K2), KIMI_K2),
                       32000)
    assert cfg.num_attention_heads == cfg.num_key_value_heads == 16 and cfg.head_dim == KIMI_K2["v_head_dim"]


@pytest.mark.parametrize("config", [QWEN3_8B, LLAMA31_8B], ids=["qwen3", "llama31"])
def test_fresh_draft_of_a_llama_like_target_keeps_the_targets_layer_shape(tmp_path, config):
    assert not is_mla(config)
    cfg = shaped(train_params(), meta_of(target_dir(tmp_path, config), config), 32000)
    assert cfg.num_attention_heads == config["num_attention_heads"]
    assert cfg.num_key_value_heads == config["num_key_value_heads"]
    assert cfg.head_dim == config.get("head_dim", config["hidden_size"] // config["num_attention_heads"])
    assert cfg.intermediate_size == config["intermediate_size"]


def test_a_draft_whose_heads_do_not_tile_its_hidden_size_trains_and_round_trips(tmp_path):
    """Kimi's draft has 64 x 128 = 8192 attention width over a 7168 hidden size; the same at toy size."""
    mla = {**KIMI_K2, "hidden_size": 48, "num_attention_heads": 4, "num_key_value_heads": 4, "v_head_dim": 16,
           "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "head_dim": 8, "intermediate_size": 80, "vocab_size": 40,
           "num_hidden_layers": 8}
    torch.manual_seed(0)
    cfg = shaped(train_params(), meta_of(target_dir(tmp_path / "t", mla), mla), 40)
    width = cfg.num_attention_heads * cfg.head_dim
    assert width == 4 * mla["v_head_dim"] != cfg.hidden_size
    draft = Eagle3Draft(cfg)
    attn = draft.midlayer.self_attn
    assert attn.q_proj.weight.shape == (width, 2 * cfg.hidden_size)
    assert attn.k_proj.weight.shape == attn.v_proj.weight.shape == (cfg.num_key_value_heads * cfg.head_dim,
                                                                     2 * cfg.hidden_size)
    assert attn.o_proj.weight.shape == (cfg.hidden_size, width)
    B, T = 2, 5
    aux = torch.randn(B, T, 3 * cfg.target_hidden_size)
    ids = torch.randint(0, cfg.vocab_size, (B, T))
    pos = torch.arange(T).expand(B, T)
    cache = TTTCache()
    hidden = draft.fuse(aux)
    loss = torch.zeros(())
    for _ in range(2):  # two training-time-test steps
        hidden, logits = draft(hidden, ids, pos, cache=cache)
        assert hidden.shape == (B, T, cfg.hidden_size) and logits.shape == (B, T, cfg.draft_vocab_size)
        loss = loss + logits.logsumexp(-1).mean()
    loss.backward()
    assert attn.o_proj.weight.grad.abs().sum() > 0 and attn.q_proj.weight.grad.abs().sum() > 0
    back = load_draft(save_draft(draft, tmp_path / "draft"))
    assert back.config.head_dim == cfg.head_dim and back.config.num_key_value_heads == cfg.num_key_value_heads
    assert all(torch.equal(v, back.state_dict()[k]) for k, v in draft.state_dict().items())


# ---- fine-tuning a checkpoint in AQ-MedAI's layout --------------------------------------------------------------


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory, toy_smoke) -> Path:
    return make_hidden_states(tmp_path_factory.mktemp("hidden"), toy_smoke, n=20, draft_vocab_size=96, seed=SEED)


# The tiny draft's shape: like AQ-MedAI's, heads x head_dim (4 x 32) differs from the hidden size (64), every
# head is a KV head (the toy target has 1), so a checkpoint whose shape were re-derived from the target would show.
TINY = {"num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 32, "intermediate_size": 160}


def aq_medai_checkpoint(folder: Path, data: HiddenStates, with_embed: bool, ids: list[int] | None,
                        ) -> dict[str, torch.Tensor]:
    """A draft in AQ-MedAI's published layout (Kimi-K2-Instruct-eagle3's config.json keys and tensor names, bf16)
    at toy size; returns its tensors."""
    meta = data.meta
    H, V, Vd = meta["hidden_size"], meta["vocab_size"], data.d2t.shape[0]
    nh, nkv, d, inter = (TINY[k] for k in ("num_attention_heads", "num_key_value_heads", "head_dim",
                                           "intermediate_size"))
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "attention_bias": False,
        "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 6, "head_dim": d, "hidden_act": "silu",
        "hidden_size": H, "initializer_range": 0.02, "intermediate_size": inter, "max_position_embeddings": 1024,
        "mlp_bias": False, "num_attention_heads": nh, "num_hidden_layers": 1, "num_key_value_heads": nkv,
        "pretraining_tp": 1, "rms_norm_eps": 1e-6, "rope_scaling": None, "rope_theta": 1000000.0,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.52.3",
        "use_cache": True, "vocab_size": V, "draft_vocab_size": Vd,
    }
    if ids is not None:  # AQ-MedAI writes the ids under eagle_config only (SpecForge's export)
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True}
    g = torch.Generator().manual_seed(1)

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.05).to(torch.bfloat16)

    tensors = {
        "fc.weight": w(H, 3 * H),
        "midlayer.self_attn.q_proj.weight": w(nh * d, 2 * H),
        "midlayer.self_attn.k_proj.weight": w(nkv * d, 2 * H),
        "midlayer.self_attn.v_proj.weight": w(nkv * d, 2 * H),
        "midlayer.self_attn.o_proj.weight": w(H, nh * d),
        "midlayer.mlp.gate_proj.weight": w(inter, H),
        "midlayer.mlp.up_proj.weight": w(inter, H),
        "midlayer.mlp.down_proj.weight": w(H, inter),
        "midlayer.hidden_norm.weight": (1 + w(H)).to(torch.bfloat16),
        "midlayer.input_layernorm.weight": (1 + w(H)).to(torch.bfloat16),
        "midlayer.post_attention_layernorm.weight": (1 + w(H)).to(torch.bfloat16),
        "norm.weight": (1 + w(H)).to(torch.bfloat16),
        "lm_head.weight": w(Vd, H),
        "d2t": data.d2t.to(torch.int64),
        "t2d": data.t2d.to(torch.bool),
    }
    if with_embed:
        tensors["embed_tokens.weight"] = data.embed_tokens().to(torch.bfloat16)
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return tensors


def as_loaded(t: torch.Tensor) -> torch.Tensor:
    """A checkpoint tensor as load_draft holds it: floats in float32 (bf16 -> fp32 is exact), maps unchanged."""
    return t.float() if t.is_floating_point() else t


@pytest.mark.parametrize("with_embed", [False, True], ids=["embed_absent", "embed_present"])
def test_finetuning_an_aq_medai_layout_checkpoint_loads_trains_and_exports_for_vllm(data_dir, tmp_path, with_embed):
    data = HiddenStates(data_dir)
    meta = data.meta
    layer_ids = default_aux_layer_ids(meta["num_layers"])  # [2, L//2, L-3]: [2, 30, 58] on Kimi-K2's 61 layers
    assert default_aux_layer_ids(KIMI_K2["num_hidden_layers"]) == [2, 30, 58]
    assert meta["layer_ids"] == layer_ids
    ckpt = tmp_path / "Kimi-K2-Instruct-eagle3"
    tensors = aq_medai_checkpoint(ckpt, data, with_embed, ids=layer_ids)

    # 1. The draft 03 fine-tunes holds exactly the checkpoint's weights (and its shape, not the target's).
    P = train_params(data_dir=str(data_dir), output_dir=str(tmp_path / "out"), init_from=str(ckpt), max_steps=3)
    model, notes = build_draft(P, data)
    assert notes == {"init": str(ckpt)}
    assert (model.config.num_attention_heads, model.config.num_key_value_heads, model.config.head_dim,
            model.config.intermediate_size) == tuple(TINY.values())
    state = model.state_dict()
    assert all(state[k].dtype == as_loaded(t).dtype and torch.equal(state[k], as_loaded(t))
               for k, t in tensors.items())  # 03 trains in float32 whatever the checkpoint's dtype
    if not with_embed:  # vLLM shares the target's embedding; 03 takes it from the data
        assert torch.equal(state["embed_tokens.weight"], data.embed_tokens().float())

    # 2. Training moves every trained tensor; the frozen embedding and the vocabulary maps stay.
    result = run(P)
    assert result["init"] == str(ckpt)
    out = tmp_path / "out" / "draft"
    exported = load_file(out / "model.safetensors")
    trained = [k for k in tensors if k not in ("d2t", "t2d", "embed_tokens.weight")]
    moved = [k for k in trained if not torch.equal(exported[k], as_loaded(tensors[k]))]
    assert moved == trained
    assert torch.equal(exported["embed_tokens.weight"], state["embed_tokens.weight"])
    assert torch.equal(exported["d2t"], tensors["d2t"]) and torch.equal(exported["t2d"], tensors["t2d"])

    # 3. The export is the layout vLLM loads: the tensor names and config keys of the project's own export, the
    #    checkpoint's shape, and the aux ids of the data at the top level (where vLLM reads them) and in eagle_config.
    cfg = json.loads((out / "config.json").read_text())
    reference = tmp_path / "reference"
    save_draft(Eagle3Draft(Eagle3Config.from_llama_dict(cfg, aux_layer_ids=layer_ids)), reference)
    assert set(exported) == set(load_file(reference / "model.safetensors"))
    assert set(exported) == set(tensors) | {"embed_tokens.weight"}
    assert set(cfg) == set(json.loads((reference / "config.json").read_text()))
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama"
    assert cfg["num_hidden_layers"] == 1
    assert {k: cfg[k] for k in TINY} == TINY
    assert cfg["vocab_size"] == meta["vocab_size"] and cfg["draft_vocab_size"] == tensors["d2t"].shape[0]
    assert cfg["eagle_aux_hidden_state_layer_ids"] == meta["layer_ids"]
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == meta["layer_ids"]
    back = load_draft(out, embed_tokens=data.embed_tokens())
    assert all(torch.equal(back.state_dict()[k], v) for k, v in exported.items())


def test_an_aq_medai_layout_checkpoint_without_ids_takes_the_datas(data_dir, tmp_path):
    """No ids in the checkpoint: it fits when the data's are vLLM's default for the target, and the draft then
    carries the data's ids into its export."""
    data = HiddenStates(data_dir)
    ckpt = tmp_path / "no-ids"
    aq_medai_checkpoint(ckpt, data, with_embed=False, ids=None)
    assert "eagle_config" not in json.loads((ckpt / "config.json").read_text())
    model, _ = build_draft(train_params(data_dir=str(data_dir), init_from=str(ckpt)), data)
    assert model.config.aux_layer_ids == data.meta["layer_ids"]
    cfg = draft_config_json(model)
    assert cfg["eagle_aux_hidden_state_layer_ids"] == data.meta["layer_ids"]
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == data.meta["layer_ids"]


def test_a_fine_tune_keeps_the_checkpoints_depth_unless_num_layers_asks_another(data_dir, tmp_path):
    """num_layers left out (null: the method's depth, 1 for EAGLE-3) fine-tunes a 2-layer checkpoint at its own 2;
    another depth given is refused in one line that names the way out, num_layers: null (ms: tiny drafts)."""
    from eagle3nb.drafts import DraftMismatchError

    data = HiddenStates(data_dir)
    deep, _ = build_draft(train_params(data_dir=str(data_dir), num_layers=2), data)
    save_draft(deep, tmp_path / "deep")
    model, _ = build_draft(train_params(data_dir=str(data_dir), init_from=str(tmp_path / "deep")), data)
    assert model.config.num_layers == 2
    with pytest.raises(DraftMismatchError, match=r"num_layers: 3 shapes a fresh draft, .* has 2; set num_layers: null"):
        build_draft(train_params(data_dir=str(data_dir), init_from=str(tmp_path / "deep"), num_layers=3), data)


def test_a_fresh_draft_for_an_mla_target_trains_and_exports_in_the_published_shape(data_dir, tmp_path, monkeypatch):
    """03 end to end from scratch, the toy's data standing in for an MLA target's (its config made MLA-shaped)."""
    data = HiddenStates(data_dir)
    H = data.meta["hidden_size"]
    toy = build.target_config(data.meta)
    mla = {**toy, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 24, "v_head_dim": 24,
           "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 8}
    monkeypatch.setattr(build, "target_config", lambda meta: mla)
    out = tmp_path / "out"
    run(train_params(data_dir=str(data_dir), output_dir=str(out), max_steps=2))
    cfg = json.loads((out / "draft" / "config.json").read_text())
    assert cfg["hidden_size"] == H
    assert cfg["num_attention_heads"] == cfg["num_key_value_heads"] == mla["num_attention_heads"]
    assert cfg["head_dim"] == mla["v_head_dim"] and cfg["intermediate_size"] == mla["intermediate_size"]
    back = load_draft(out / "draft")
    assert back.midlayer.self_attn.o_proj.weight.shape == (H, mla["num_attention_heads"] * mla["v_head_dim"])
