"""The draft 03 trains: fresh from the target (its embedding and lm_head rows), or a checkpoint to fine-tune."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from eagle3nb import drafts
from eagle3nb.drafts import DraftMismatchError, check_fits, load_draft
from eagle3nb.drafts.eagle3.layouts import EAGLE31_KEYS
from eagle3nb.toy import resolve_model_path
from eagle3nb.train.checkpoint import checkpoints
from eagle3nb.train.params import TrainParams


def target_config(meta: dict[str, Any]) -> dict[str, Any]:
    """The target's config.json (text part), from the model path 02 recorded; {} when it cannot be read."""
    model_path = str(meta.get("model_path") or "")
    if model_path.startswith("toy:"):
        path = Path(resolve_model_path(model_path))
    else:
        path = Path(model_path)
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return cfg.get("text_config") or cfg


def with_recipe_defaults(P: TrainParams, ckpt_dir: Path | None = None) -> TrainParams:
    """EAGLE-3.1's options left null, made concrete: on in a fresh draft (03's default), the choice a resumed run's
    checkpoints in ``ckpt_dir`` were made with (absent, so off, in every run from before the default), and for a
    fine-tune (``init_from``) left to the checkpoint's own layout."""
    auto = [k for k in EAGLE31_KEYS if getattr(P, k) is None]
    if not auto or P.init_path is not None:
        return P
    last = checkpoints(ckpt_dir)[-1:] if ckpt_dir is not None and P.resume else []
    before = torch.load(last[0], map_location="cpu", weights_only=False, mmap=True)["run_config"] if last else None
    return P.model_copy(update={k: True if before is None else bool(before.get(k, False)) for k in auto})


def fresh_draft(P, data) -> Any:
    """A new draft of ``P.method`` shaped by its package (``fresh``) on the target's embedding and head; its
    vocabulary must be the data's, whose target distributions the loss reads."""
    meta = data.meta
    tc = target_config(meta)
    if not tc:
        raise DraftMismatchError(f"cannot read the target's config.json at {meta.get('model_path')!r} to shape a "
                                 f"fresh {P.method} draft")
    P.check_states(meta)
    model = drafts.get(P.method).fresh(P, data, tc)
    if model.config.draft_vocab_size != data.d2t.shape[0]:
        raise DraftMismatchError(
            f"method {P.method} drafts over the target's whole vocabulary ({model.config.draft_vocab_size} ids) but "
            f"the data {P.data_path} holds distributions over a draft vocabulary of {data.d2t.shape[0]}: re-run "
            f"02_hidden_states with draft_vocab_size: {model.config.draft_vocab_size}")
    return model


def build_draft(P, data) -> tuple[Any, dict[str, Any]]:
    """(draft in float32 on CPU, notes for metrics.json). Fresh drafts start from the target's embedding and
    the target's lm_head rows for the draft vocabulary, so step 0 already speaks the target's language."""
    meta = data.meta
    d2t, t2d = data.d2t, data.t2d
    if P.init_path is None:
        return fresh_draft(P, data), {"init": "fresh"}
    init = P.init_path
    model = load_draft(init, embed_tokens=data.embed_tokens(), lm_head=data.lm_head())
    if drafts.of(model).name != P.method:
        raise DraftMismatchError(f"init_from: checkpoint {init} is a {drafts.of(model).title} draft, but method is "
                                 f"{P.method}: set method: {drafts.of(model).name} to fine-tune it")
    check_fits(model.config, hidden_size=meta["hidden_size"], vocab_size=meta["vocab_size"],
               layer_ids=meta["layer_ids"], num_layers=meta.get("num_layers"),
               draft=f"checkpoint {init}", data=f"hidden states {P.data_path}")
    drafts.of(model).check_usable(model, f"init_from: checkpoint {init}")
    model.config.aux_layer_ids = list(meta["layer_ids"])
    asked = [k for k in EAGLE31_KEYS if getattr(P, k) and not getattr(model.config, k)]
    if asked:
        raise DraftMismatchError(f"{', '.join(asked)}: true shapes a fresh draft, but checkpoint {init} has none; "
                                 "set them to null (the checkpoint's own layout) to fine-tune it, or init_from: null "
                                 "to train an EAGLE-3.1 draft")
    # null resolved to the method's depth, which here means the checkpoint's own (the params can no longer tell)
    if P.num_layers not in (drafts.fresh_num_layers(P.method), model.config.num_layers):
        raise DraftMismatchError(f"num_layers: {P.num_layers} shapes a fresh draft, but checkpoint {init} has "
                                 f"{model.config.num_layers}; set num_layers: null (the checkpoint's own depth) to "
                                 "fine-tune it, or init_from: null to train a draft of that depth")
    if getattr(P, "parallel_drafting", False) and model.config.mask_token_id is None:
        raise DraftMismatchError(f"parallel_drafting: true shapes a fresh draft, but checkpoint {init} has no "
                                 "mask_token_id / mask_hidden; set it to false to fine-tune it (a parallel-drafting "
                                 "checkpoint stays one either way), or init_from: null to train a P-EAGLE draft")
    notes: dict[str, Any] = {"init": str(init)}
    if not (torch.equal(model.d2t, d2t) and torch.equal(model.t2d, t2d)):
        ours = set(model.draft_to_target(torch.arange(model.config.draft_vocab_size)).tolist())
        shared = len(ours & set((d2t + torch.arange(d2t.shape[0])).tolist()))
        if not P.remap_vocab:
            raise DraftMismatchError(
                f"draft vocabulary: checkpoint {init} has {model.config.draft_vocab_size} ids, the data "
                f"{P.data_path} has {d2t.shape[0]} ids ({shared} shared). Set remap_vocab: true to keep the "
                "checkpoint's lm_head rows for the shared ids (the rest start from the target's lm_head), or "
                "re-run 02_hidden_states with a draft vocabulary that matches the checkpoint")
        model = remap_vocab(model, d2t, t2d, data.lm_head())
        notes["vocab_remap"] = {"shared": shared, "new": d2t.shape[0] - shared}
    return model, notes


def remap_vocab(model: Any, d2t: torch.Tensor, t2d: torch.Tensor, target_lm_head: torch.Tensor) -> Any:
    """The same draft over another draft vocabulary: lm_head rows follow their target ids."""
    old_ids = model.draft_to_target(torch.arange(model.config.draft_vocab_size))
    row_of = {int(t): r for r, t in enumerate(old_ids)}
    new_ids = d2t + torch.arange(d2t.shape[0])
    rows = torch.stack([model.lm_head.weight[row_of[int(t)]] if int(t) in row_of else target_lm_head[t]
                        for t in new_ids])
    cfg = model.config
    cfg.draft_vocab_size = d2t.shape[0]
    new = type(model)(cfg)
    state = {k: v for k, v in model.state_dict().items() if k not in ("lm_head.weight", "d2t")}
    new.load_state_dict({**state, "lm_head.weight": rows, "d2t": d2t, "t2d": t2d})
    return new
