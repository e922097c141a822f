"""The speculators side of ``bench_peer.py``; runs in ``.venv-speculators/`` (speculators 0.9.0, its own env), as a
file (it imports nothing of ours: eagle3nb is not installed there).

    .venv-speculators/bin/python benchmarks/_peer_speculators.py PLAN.json

PLAN: ``{"mode": "ships" | "logits" | "train", "method": a speculators model type (our method's name: the
``speculators_model_type`` our speculators layout writes), "block": whether it drafts in blocks (our registry's
rules), "draft": speculators-layout folder (the shared initial weights), "threads", ...}``: a chain draft (EAGLE-3)
reads ``ttt_steps`` and ``decay``, the block drafters ``gamma`` and ``max_anchors``. Writes ``PLAN["out"]`` (JSON)
and, for ``logits``, ``PLAN["logits_file"]``. ``ships``: the model types the installed speculators ships (its
``SpeculatorModel`` registry, the peer table ``bench_peer.peer_methods`` meets our registry with), nothing loaded.

Everything trains through speculators' own code: ``Eagle3DraftModel`` (attention ``eager``: flex attention has no
CPU backward), its losses (``eager``: the fused ones need Triton), its ``shift_batch``, its multipack sampler and
``CollateFn`` (``_setup_dataloader``) and its ``Trainer.train_epoch``. Two things are adapted to a CPU, at run
time only: the trainer's device (``get_local_rank`` -> ``"cpu"``; it moves the model to ``local_rank``, i.e. cuda:0),
its step timer's ``torch.accelerator.synchronize()`` (a no-op: there is no accelerator, and a CPU is synchronous),
and the dataset, a ``BaseDataset`` over the per-sample files vLLM's ``extract_hidden_states`` writes (the layout
its ``FileTransfer`` reads: ``token_ids [T]``, ``hidden_states [T, 4, H]``), plus ``loss_mask [T]`` (its
ArrowDataset keeps that in the arrow table instead).

The block drafters (``DFlashDraftModel``, ``DSparkDraftModel``, ``DFlash2DraftModel``) read the same files unshifted
(its CLI gives them no ``preprocess``: position t holds the aux states, token and final state of t, the model picks
each slot's target position itself), train with the kwargs their own ``get_trainer_kwargs`` builds, and keep their
``embed_tokens`` frozen: the mask slots read the table's ``mask_token_id`` row, so that row is set to the shared
initial ``mask_embedding.pt`` on load (the loader reads no such file) and stays it through training.
"""

from __future__ import annotations

import inspect
import json
import sys
import time
from pathlib import Path


def load_model(draft_dir: str):
    """Speculators' model of the folder (whichever its config names), eager attention, fp32, the target's weights
    reloaded; a block drafter's mask row set to the folder's ``mask_embedding.pt``."""
    import torch
    from speculators import SpeculatorModel, SpeculatorModelConfig

    config = SpeculatorModelConfig.from_pretrained(draft_dir)
    config.transformer_layer_config._attn_implementation = "eager"  # noqa: SLF001
    model = SpeculatorModel.from_pretrained(draft_dir, config=config, dtype=torch.float32)
    model.load_verifier_weights()  # embed_tokens / verifier_lm_head (draft rows of the target head), verifier_norm
    mask = Path(draft_dir) / "mask_embedding.pt"
    if mask.exists():
        state = torch.load(mask, weights_only=True)
        with torch.no_grad():
            model.embed_tokens.weight[state["mask_token_id"]] = state["embedding"].float()
    return model.float()


def block_sample(path: str, dtype) -> dict:
    """One per-sample file -> a block drafter's keyword arguments (unshifted, as its training reads them)."""
    import torch
    from safetensors.torch import load_file

    f = load_file(path)
    T = f["token_ids"].shape[0]
    return {"hidden_states": f["hidden_states"][None, :, :-1].flatten(2).to(dtype),
            "input_ids": f["token_ids"].long()[None], "loss_mask": f["loss_mask"].long()[None],
            "verifier_last_hidden_states": f["hidden_states"][None, :, -1].to(dtype),
            "document_ids": torch.zeros(1, T, dtype=torch.long), "position_ids": torch.arange(T)[None]}


def block_logits(plan: dict) -> dict:
    """A block drafter's logits where its loss receives them (DFlash2: the unary ones), its targets' logits and
    aligned loss mask, on one sample with every anchor (``max_anchors`` = all of them: its ``select_anchors``
    then takes every loss-masked position before the last block, in order)."""
    import torch
    from safetensors.torch import save_file

    model = load_model(plan["draft"]).eval()
    core = sys.modules[type(model).__module__]
    signature = inspect.signature(core.compute_metrics)
    seen = {}

    def capture(*args, **kw):
        # its loss's arguments by name: the logits it takes first (a selector's unary ones, a Markov head's biased
        # ones), the targets' logits and the aligned loss mask, wherever each model's call passes them
        given = signature.bind(*args, **kw).arguments
        seen["logits"], seen["targets"], seen["mask"] = next(iter(given.values())), given["targets"], \
            given["loss_mask"]
        return torch.zeros(()), {}

    core.compute_metrics = capture
    batch = block_sample(plan["sample"], torch.float32)
    with torch.no_grad():
        model(**batch, max_anchors=plan["max_anchors"])
    save_file({k: v[0].contiguous() for k, v in seen.items()}, plan["logits_file"])
    return {"anchors": plan["max_anchors"]}


def sample_batch(path: str, dtype):
    """One per-sample file -> the model's keyword arguments, through speculators' own shift_batch."""
    import torch
    from safetensors.torch import load_file
    from speculators.models.eagle3.data import shift_batch

    f = load_file(path)
    T = f["token_ids"].shape[0]
    raw = {"hidden_states": f["hidden_states"][:, :-1].flatten(1).to(dtype), "input_ids": f["token_ids"].long(),
           "verifier_last_hidden_states": f["hidden_states"][:, -1].to(dtype), "loss_mask": f["loss_mask"].bool(),
           "lengths": torch.tensor([T]), "position_ids": torch.arange(T)}
    b = shift_batch(raw)
    b.pop("lengths")
    out = {k: v[None] for k, v in b.items()}
    out["document_ids"] = torch.zeros_like(out["input_ids"])
    return out


def logits(plan: dict) -> dict:
    """EAGLE-3: per-TTT-step draft logits and the loss targets' logits on one sample, with the shared initial
    weights."""
    import torch
    from safetensors.torch import save_file

    model = load_model(plan["draft"]).eval()
    steps = []
    hook = model.lm_head.register_forward_hook(lambda m, i, o: steps.append(o.detach()[0].clone()))
    batch = sample_batch(plan["sample"], torch.float32)
    from speculators.losses import resolve_loss_config

    with torch.no_grad():
        model(**batch, ttt_steps=plan["ttt_steps"], ttt_step_loss_decay=plan["decay"],
              loss_config=resolve_loss_config("kl_div", "eager"))
        targets = model.verifier_lm_head(model.verifier_norm(batch["verifier_last_hidden_states"]))[0]
    hook.remove()
    save_file({**{f"step{j}": s.contiguous() for j, s in enumerate(steps)}, "targets": targets.contiguous()},
              plan["logits_file"])
    return {"steps": len(steps)}


def train(plan: dict) -> dict:
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file
    from speculators.losses import resolve_loss_config
    from speculators.models.eagle3.data import shift_batch
    from speculators.train import trainer as trainer_mod
    from speculators.train.data import BaseDataset
    from speculators.train.dataloader import _setup_dataloader

    files = [str(p) for p in sorted(Path(plan["data"]).glob("*.safetensors"))]
    block = plan["block"]

    class PerSampleFiles(BaseDataset):
        def _compute_approx_lengths(self):
            out = []
            for p in files:
                with safe_open(p, "pt") as f:
                    out.append(f.get_slice("token_ids").get_shape()[0])
            return out

        def __len__(self):
            return len(files)

        def _get_raw_data(self, index):
            f = load_file(files[index])
            return {"hidden_states": f["hidden_states"][:, :-1].flatten(1), "input_ids": f["token_ids"].long(),
                    "verifier_last_hidden_states": f["hidden_states"][:, -1], "loss_mask": f["loss_mask"].bool()}

    torch.manual_seed(plan["seed"])
    model = load_model(plan["draft"])
    dataset = PerSampleFiles(max_len=plan["total_seq_len"], hidden_states_dtype=torch.float32)
    hidden = model.config.transformer_layer_config.hidden_size
    loader = _setup_dataloader(dataset, plan["total_seq_len"], hidden, num_workers=0, num_target_layers=3,
                               preprocess=None if block else shift_batch, seed=plan["seed"])
    trainer_mod.get_local_rank = lambda: "cpu"  # the trainer moves the model to local_rank (cuda:0 otherwise)
    # its step timer syncs the accelerator; a CPU has none (and is synchronous)
    if not torch.accelerator.is_available():
        torch.accelerator.synchronize = lambda *a, **k: None
    if block:  # its own kwargs (loss, decay gamma, anchors; DSpark's and DFlash2's extra losses: their defaults)
        kwargs, _ = type(model).get_trainer_kwargs(loss_fn="kl_div", loss_implementation="eager",
                                                   dflash_decay_gamma=plan["gamma"], max_anchors=plan["max_anchors"])
    else:
        kwargs = {"ttt_steps": plan["ttt_steps"], "ttt_step_loss_decay": plan["decay"],
                  "loss_config": resolve_loss_config("kl_div", "eager")}
    cfg = trainer_mod.TrainerConfig(
        lr=plan["lr"], num_epochs=plan["epochs"], save_path=plan["save_path"], train_call_kwargs=kwargs,
        val_call_kwargs=kwargs, weight_decay=plan["weight_decay"], scheduler_type="cosine",
        scheduler_warmup_ratio=plan["warmup_ratio"], hidden_states_dtype=torch.float32, log_freq=10**9)
    trainer = trainer_mod.Trainer(model, cfg, loader, None)
    epoch_tokens = sum(dataset.approx_lengths)  # sample tokens, counted as ours counts them
    times = []
    for epoch in range(plan["epochs"]):
        t = time.perf_counter()
        trainer.train_epoch(epoch)
        times.append(time.perf_counter() - t)
    model.save_pretrained(plan["out_draft"])
    mask = Path(plan["draft"]) / "mask_embedding.pt"
    if mask.exists():  # its frozen mask row, for our loader (which reads the file, not a table)
        Path(plan["out_draft"], mask.name).write_bytes(mask.read_bytes())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"epoch_s": times, "epoch_tokens": epoch_tokens, "steps_per_epoch": len(loader),
            "tokens_per_s": epoch_tokens * len(times) / sum(times), "trainable_params": trainable,
            "frozen": sorted(n for n, p in model.named_parameters() if not p.requires_grad)}


def ships(plan: dict) -> dict:
    """The model types this speculators ships: its registry's names (a draft's ``speculators_model_type``)."""
    from speculators import SpeculatorModel

    return {"types": sorted(SpeculatorModel.registry)}


def main() -> None:
    plan = json.loads(Path(sys.argv[1]).read_text())
    import torch

    torch.set_num_threads(plan["threads"])
    import logging

    logging.disable(logging.INFO)
    mode = "block_logits" if plan["mode"] == "logits" and plan["block"] else plan["mode"]
    result = {"ships": ships, "logits": logits, "block_logits": block_logits, "train": train}[mode](plan)
    from importlib.metadata import version

    result["speculators"] = version("speculators")
    Path(plan["out"]).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
