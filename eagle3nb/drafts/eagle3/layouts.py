"""An EAGLE-3 draft on disk.

Two checkpoint layouts load and save (docs/DESIGN-FACTS.md "The checkpoint layout vLLM and SGLang load"): the
EAGLE-3 layout (``midlayer.*``, config ``LlamaForCausalLMEagle3`` + ``eagle_config``; vLLM and SGLang load it,
AQ-MedAI drafters and SpecForge exports use it) and the speculators layout (``layers.0.*``,
``speculators_model_type: eagle3``). A draft of ``num_layers`` > 1 writes every layer as ``layers.{i}.*`` in both
layouts, the names vLLM's eagle3 models give their ``num_hidden_layers`` layers (a one-layer EAGLE-3 export keeps
``midlayer.*``, byte for byte as before); SGLang reads the EAGLE-3 layout with its own layer ids
(``draft_config_json(model, "sglang")``, 03's ``draft-sglang/``). A parallel-drafting (P-EAGLE) draft adds what
vLLM 0.32's llama_eagle3 / deepseek_eagle3 load under ``parallel_drafting``: the config key ``mask_token_id`` and
the tensor ``mask_hidden`` [1, 3 x target_hidden_size] (EAGLE-3 layout only: vLLM's speculators ``peagle`` parser
drops EAGLE-3.1's keys).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from eagle3nb.drafts.base import WEIGHTS_FILE, DraftMismatchError, Misfit, read_tensors
from eagle3nb.drafts.eagle3.model import MLA_KEYS, Eagle3Config, Eagle3Draft
from eagle3nb.families import MLA_ARCHS
from eagle3nb.layers import to_sglang
from eagle3nb.progress import write_json_atomic

# config.json architectures of a Llama midlayer (the first is what we write); an MLA one's: families.MLA_ARCHS.
LLAMA_ARCHS = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
# EAGLE-3.1's config keys, top-level in both layouts (vLLM 0.32 reads them in llama_eagle3 / deepseek_eagle3, and
# its speculators parser copies them from a speculators config); written only when on, so 3.0 exports stay as they were.
EAGLE31_KEYS = ("fc_norm", "norm_output")


# ---- load / save ----------------------------------------------------------------------------------


def claims(d: dict[str, Any]) -> bool:
    """Whether ``d`` (a config.json) is an EAGLE-3 draft's: a speculators config of type eagle3, or one whose
    architectures, if it names any, are all EAGLE-3 drafts'."""
    kind = d.get("speculators_model_type")
    if kind is not None:
        return kind == "eagle3"
    return all(a in LLAMA_ARCHS + MLA_ARCHS for a in d.get("architectures") or [])


def _config_from_json(d: dict[str, Any], path: Path) -> Eagle3Config:
    """The draft's shape from an EAGLE-3-layout or speculators-layout config.json."""
    if d.get("speculators_model_type") is not None:
        if d["speculators_model_type"] != "eagle3":
            raise DraftMismatchError(f"{path}/config.json: speculators_model_type is "
                                     f"{d['speculators_model_type']!r}; only 'eagle3' drafts are supported")
        layer = dict(d["transformer_layer_config"])
        cfg = Eagle3Config.from_llama_dict(
            layer, draft_vocab_size=d.get("draft_vocab_size") or layer["vocab_size"],
            target_hidden_size=d.get("target_hidden_size"), aux_layer_ids=d.get("eagle_aux_hidden_state_layer_ids"),
            num_layers=int(layer.get("num_hidden_layers", 1)), **{k: bool(d.get(k, False)) for k in EAGLE31_KEYS})
        if d.get("norm_before_residual"):
            raise DraftMismatchError(f"{path}: norm_before_residual=true drafts are not supported "
                                     "(the residual would be the normed feature)")
        return cfg
    if "hidden_size" not in d:
        raise DraftMismatchError(f"{path}/config.json is neither an EAGLE-3 draft config (LlamaForCausalLMEagle3) "
                                 "nor a speculators config (speculators_model_type)")
    archs = d.get("architectures") or []
    arch = [a for a in archs if a not in LLAMA_ARCHS + MLA_ARCHS]
    if arch:
        raise DraftMismatchError(f"{path}: architecture {arch[0]} is not an EAGLE-3 draft this package reads "
                                 f"({', '.join(LLAMA_ARCHS + MLA_ARCHS)})")
    mla = None
    if any(a in MLA_ARCHS for a in archs):
        missing = [k for k in MLA_KEYS if k not in d]
        if missing:
            raise DraftMismatchError(f"{path}/config.json: an MLA draft ({archs[0]}) without {', '.join(missing)}")
        mla = {k: d[k] for k in MLA_KEYS}
    ids = d.get("eagle_aux_hidden_state_layer_ids") or (d.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids")
    return Eagle3Config.from_llama_dict(d, aux_layer_ids=list(ids) if ids else None, mla=mla,
                                        num_layers=int(d.get("num_hidden_layers", 1)),
                                        mask_token_id=d.get("mask_token_id"))


def _normalise_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Map the layouts onto ours: ``layers.0.`` -> ``midlayer.``, ``layers.{i}.`` -> ``deeper.{i-1}.``, strip a
    ``model.`` prefix."""
    out = {}
    for name, t in tensors.items():
        if name.startswith("model."):
            name = name[len("model."):]
        if name.startswith("layers."):
            index, rest = name[len("layers."):].split(".", 1)
            name = f"midlayer.{rest}" if index == "0" else f"deeper.{int(index) - 1}.{rest}"
        out[name] = t
    return out


def _layout_name(name: str, layers_named: bool) -> str:
    """Our tensor name as a layout writes it: with ``layers_named`` (speculators, or a deeper draft) the
    midlayer is ``layers.0.`` and ``deeper.{j}.`` is ``layers.{j+1}.``, vLLM's module names."""
    if not layers_named:
        return name
    if name.startswith("midlayer."):
        return "layers.0." + name[len("midlayer."):]
    if name.startswith("deeper."):
        index, rest = name[len("deeper."):].split(".", 1)
        return f"layers.{int(index) + 1}.{rest}"
    return name


def load_draft(path: str | Path, embed_tokens: torch.Tensor | None = None, device: str | torch.device = "cpu",
               dtype: torch.dtype | None = torch.float32, lm_head: torch.Tensor | None = None) -> Eagle3Draft:
    """Load an EAGLE-3 draft (EAGLE-3 or speculators layout). ``embed_tokens`` [V, H] is the target's embedding,
    needed when the checkpoint does not carry one (e.g. ``HiddenStates(data_dir).embed_tokens()``); an EAGLE-3
    checkpoint always carries its own head rows, so the target's ``lm_head`` is not read."""
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise FileNotFoundError(f"{cfg_file} not found; point at a draft checkpoint folder (config.json + "
                                "model.safetensors)")
    cfg = _config_from_json(json.loads(cfg_file.read_text()), path)
    tensors = _normalise_names(read_tensors(path))
    model = Eagle3Draft(cfg)
    expected = dict(model.state_dict())
    if "embed_tokens.weight" not in tensors:
        if embed_tokens is None:
            raise DraftMismatchError(f"{path} has no embed_tokens.weight; pass the target's embedding "
                                     "(load_draft(dir, embed_tokens=HiddenStates(data_dir).embed_tokens()))")
        tensors["embed_tokens.weight"] = embed_tokens
    if "d2t" not in tensors and "t2d" not in tensors and cfg.draft_vocab_size == cfg.vocab_size:
        tensors["d2t"] = torch.zeros(cfg.draft_vocab_size, dtype=torch.int64)  # identity map
        tensors["t2d"] = torch.ones(cfg.vocab_size, dtype=torch.bool)
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise DraftMismatchError(f"{path}: tensors do not match an EAGLE-3 draft: missing {missing}, "
                                 f"unexpected {unexpected}")
    for name, t in tensors.items():
        if tuple(t.shape) != tuple(expected[name].shape):
            raise DraftMismatchError(f"{path}: tensor {name} has shape {tuple(t.shape)} but config.json implies "
                                     f"{tuple(expected[name].shape)}")
    tensors["d2t"] = tensors["d2t"].to(torch.int64)
    tensors["t2d"] = tensors["t2d"].to(torch.bool)
    model.load_state_dict(tensors)
    if dtype is not None:
        model.to(dtype)  # floating tensors only; d2t/t2d keep their integer/bool types
    return model.to(device).eval()


def draft_config_json(model: Eagle3Draft, format: str = "eagle3", dtype: torch.dtype | None = None,
                      verifier: str | None = None, num_speculative_tokens: int = 3) -> dict[str, Any]:
    """The config.json vLLM (``eagle3``), SGLang (``sglang``: the same with its output-of-layer ids) or speculators
    (``speculators``) expect for this draft."""
    if format == "sglang":
        d = draft_config_json(model, "eagle3", dtype)
        if "eagle_aux_hidden_state_layer_ids" in d:
            ids = to_sglang(d["eagle_aux_hidden_state_layer_ids"])
            d["eagle_aux_hidden_state_layer_ids"] = ids
            d["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = ids
        return d
    cfg = model.config
    dtype = dtype or model.fc.weight.dtype
    dtype_name = str(dtype).removeprefix("torch.")
    ids = list(cfg.aux_layer_ids) if cfg.aux_layer_ids is not None else None
    on31 = {k: True for k in EAGLE31_KEYS if getattr(cfg, k)}
    if format != "eagle3" and cfg.mask_token_id is not None:
        raise DraftMismatchError(f"a parallel-drafting draft has no {format} layout here (vLLM's speculators peagle "
                                 "parser drops fc_norm / norm_output): export it as eagle3")
    if format != "eagle3" and cfg.mla is not None:
        raise DraftMismatchError(f"an MLA draft has no {format} layout (speculators' eagle3 speculator is a Llama "
                                 "layer): export it as eagle3, vLLM's deepseek_eagle3 draft")
    if format == "eagle3":
        arch = MLA_ARCHS[0] if cfg.mla is not None else LLAMA_ARCHS[0]
        d = {"architectures": [arch], **cfg.llama_dict(), **cfg.extra,
             "draft_vocab_size": cfg.draft_vocab_size, "target_hidden_size": cfg.target_hidden_size,
             "torch_dtype": dtype_name, **on31}
        if cfg.mask_token_id is not None:  # vLLM's parallel_drafting reads its mask slots' token id from here
            d["mask_token_id"] = cfg.mask_token_id
        if ids is not None:
            d["eagle_aux_hidden_state_layer_ids"] = ids  # vLLM reads the top-level key
            d["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True}
        return d
    if format == "speculators":
        return {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "speculators_version": "0.3.0",
            "transformer_layer_config": {**cfg.llama_dict(), **cfg.extra},
            "draft_vocab_size": cfg.draft_vocab_size,
            "target_hidden_size": cfg.target_hidden_size,
            "norm_before_residual": False,
            **on31,
            "eagle_aux_hidden_state_layer_ids": ids,
            "torch_dtype": dtype_name,
            "speculators_config": {
                "algorithm": "eagle3",
                "default_proposal_method": "greedy",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": num_speculative_tokens}],
                "verifier": {"name_or_path": verifier, "architectures": []},
            },
        }
    raise ValueError(f"format must be 'eagle3', 'sglang' or 'speculators', got {format!r}")


def save_draft(model: Eagle3Draft, path: str | Path, format: str = "eagle3", dtype: torch.dtype | None = None,
               include_embed: bool = True, verifier: str | None = None, num_speculative_tokens: int = 3) -> Path:
    """Write ``config.json`` + ``model.safetensors`` in the EAGLE-3 layout (``midlayer.*``; vLLM/SGLang; a deeper
    draft ``layers.{i}.*``) or the speculators layout (``layers.{i}.*``). Files are written to temporary names
    and renamed."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = draft_config_json(model, format, dtype, verifier, num_speculative_tokens)
    tensors = {}
    layers_named = format == "speculators" or model.config.num_layers > 1
    state = model.state_dict()
    if model.config.draft_vocab_size == model.config.vocab_size:
        # A draft over the whole vocabulary: vLLM builds no d2t parameter for it and refuses one in the file, so
        # lm_head's rows go in target order (d2t then the identity) and the maps stay out (load_draft rebuilds them).
        order = torch.argsort(model.draft_to_target(torch.arange(model.config.draft_vocab_size)))  # shape: [V]
        state = {k: v for k, v in state.items() if k not in ("d2t", "t2d")}
        state["lm_head.weight"] = state["lm_head.weight"][order]  # row j = target id j's logit
    for name, t in state.items():
        if name == "embed_tokens.weight" and not include_embed:
            continue
        if t.is_floating_point() and dtype is not None:
            t = t.to(dtype)
        tensors[_layout_name(name, layers_named)] = t.detach().cpu().contiguous()
    tmp = path / f".{WEIGHTS_FILE}.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.replace(path / WEIGHTS_FILE)
    write_json_atomic(path / "config.json", config)
    return path



def tensor_problems(config: dict[str, Any], shapes: dict[str, list[int]], hidden_size: int) -> list[Misfit]:
    """What an EAGLE-3 checkpoint's tensors (``shapes``: name -> shape, as its files hold them) lack or shape wrong
    for a target of ``hidden_size``: its fc fuses three aux states, its own head has ``draft_vocab_size`` rows, and
    d2t / t2d map its vocabulary onto the target's."""
    fix = "train the draft for this target (03_train) or pick a checkpoint made for it"
    dv = config.get("draft_vocab_size")
    fc, head = shapes.get("fc.weight"), shapes.get("lm_head.weight")
    problems = []
    if fc is None or fc[1] != 3 * hidden_size:
        problems.append((f"fc.weight {fc} does not take 3 x {hidden_size} = {3 * hidden_size} inputs", fix))
    if head is None or head[0] != dv:
        problems.append((f"lm_head.weight {head} does not have draft_vocab_size {dv} rows", fix))
    if "d2t" not in shapes or "t2d" not in shapes:
        problems.append(("has no d2t/t2d tensors", "export the draft with its vocab map"))
    return problems
