"""03 on the GPU: the fused training-time-test attention, bf16 autocast, a training step in fp32, issue 24's
recipes, the online data source and the export, each against the same work on CPU in fp32 (same seed and data)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from gpu_world import GPU, RECIPES, SHORT_STEPS, compared_losses, loss_gaps, needs_cuda, rel, train_online, within

pytestmark = needs_cuda()


@pytest.mark.covers("eagle3nb/drafts/eagle3/cache.py", fix="see eagle3nb/drafts/eagle3/cache.py TTTCache")
def test_ttt_attention(record_property):
    """``TTTCache.attend`` takes fused ``scaled_dot_product_attention`` with a block mask on CUDA (``dense=None``
    -> ``q.is_cuda``): fused and element-wise on cuda vs the CPU fp32 element-wise reference, fp32 within 1e-5 and
    bf16 within 2e-2 (bf16 keeps 8 bits, one rounding is 3.9e-3); the cuda default is the fused path."""
    import torch

    from eagle3nb.drafts.eagle3.cache import TTTCache

    g = torch.Generator().manual_seed(0)
    B, nh, T, d, steps = 2, 4, 384, 32, 4
    qkv = [[torch.randn(B, nh, T, d, generator=g) for _ in range(3)] for _ in range(steps)]

    def unroll(dense: bool | None, device: str, dtype) -> torch.Tensor:
        cache = TTTCache(dense=dense)
        return torch.stack([cache.attend(*(x.to(device, dtype) for x in step), None).float().cpu() for step in qkv])

    ref = unroll(False, "cpu", torch.float32)
    fused32, elem32 = unroll(True, GPU, torch.float32), unroll(False, GPU, torch.float32)
    fused16, elem16 = unroll(True, GPU, torch.bfloat16), unroll(False, GPU, torch.bfloat16)
    default = unroll(None, GPU, torch.bfloat16)
    errs = [("fused fp32", rel(fused32, ref), 1e-5), ("element-wise fp32", rel(elem32, ref), 1e-5),
            ("fused bf16", rel(fused16, ref), 2e-2), ("element-wise bf16", rel(elem16, ref), 2e-2)]
    measured = ", ".join(within(n, e, lim) for n, e, lim in errs) + f" (vs CPU fp32, {steps} TTT steps, T={T})"
    record_property("measured", measured)
    for name, err, limit in errs:
        assert err <= limit, (f"{name}: {measured}  -> fix TTTCache.attend in eagle3nb/drafts/eagle3/cache.py: its "
                              "fused (dense) path must equal the element-wise one")
    assert torch.equal(default, fused16), (f"{measured}; the cuda default is NOT the fused path  -> TTTCache(dense="
                                           "None) must take the fused path on CUDA (long sequences do not fit "
                                           "otherwise)")


@pytest.mark.covers("eagle3nb/train/distributed.py", "eagle3nb/train/params.py",
                    fix="see eagle3nb/train/distributed.py autocast_for")
def test_autocast_bf16(short_runs, record_property):
    """``train.distributed.autocast_for("auto")`` turns bf16 autocast on: 03 on cuda under autocast vs on CPU in
    fp32: initial held-out loss within 2e-2, final loss finite and within 10%."""
    import torch

    from eagle3nb.train.distributed import autocast_for

    with autocast_for("auto", torch.device(GPU)):
        on = torch.is_autocast_enabled(GPU) and torch.get_autocast_dtype(GPU) == torch.bfloat16
    a, b = short_runs["cuda-bf16"], short_runs["cpu"]
    e0, e1 = loss_gaps(a, b)
    measured = (f"autocast {'on (bf16)' if on else 'OFF'}; {within('initial held-out loss', e0, 2e-2)}, "
                f"final loss {a['final_loss']:.4f} vs CPU fp32 {b['final_loss']:.4f} ({within('rel', e1, 1e-1)}) "
                f"after {SHORT_STEPS} steps")
    record_property("measured", measured)
    fix = ("bf16 autocast training drifts from fp32: check autocast_for in eagle3nb/train/distributed.py and the "
           "float() casts of the loss in eagle3nb/drafts/eagle3/objective.py")
    assert on, f"{measured}  -> {fix}"
    assert math.isfinite(a["final_loss"]), f"{measured}  -> {fix}"
    assert e0 <= 2e-2, f"{measured}  -> {fix}"
    assert e1 <= 1e-1, f"{measured}  -> {fix}"


@pytest.mark.covers("eagle3nb/train/stage.py", "eagle3nb/train/loop.py", "eagle3nb/train/distributed.py",
                    "eagle3nb/drafts/eagle3/objective.py", "eagle3nb/train/data.py", "eagle3nb/train/checkpoint.py",
                    fix="see eagle3nb/train/loop.py Trainer")
def test_train_step(short_runs, record_property):
    """03 on cuda in fp32 (TTT objective with the fused attention, AdamW, clipping, ``DeviceTargets``, ``collate``
    to cuda) vs on CPU: initial held-out loss within 1e-4, final within 1e-2."""
    a, b = short_runs["cuda-fp32"], short_runs["cpu"]
    measured, e0, e1 = compared_losses(a, b, "fp32 on cuda vs CPU", 1e-4, 1e-2)
    measured += f" ({a['tokens_per_s']:.0f} vs {b['tokens_per_s']:.0f} tok/s)"
    record_property("measured", measured)
    fix = ("03 on GPU differs from CPU: check the device moves in eagle3nb/train/data.py (collate, DeviceTargets) "
           "and loop.py")
    assert e0 <= 1e-4, f"{measured}  -> {fix}"
    assert e1 <= 1e-2, f"{measured}  -> {fix}"


@pytest.mark.covers("eagle3nb/train/loop.py", "eagle3nb/drafts/eagle3/objective.py", "eagle3nb/train/optim.py",
                    "eagle3nb/drafts/eagle3/model.py", "eagle3nb/drafts/eagle3/cache.py",
                    fix="see eagle3nb/train/loop.py Trainer")
def test_train_recipes(recipe_runs, record_property):
    """Each of issue 24's recipes, one factor on the EAGLE-3.0 baseline (``fc_norm: false, norm_output: false``
    set explicitly): EAGLE-3.1, ``num_layers: 2``, ``loss: lk_lambda``, ``optimizer: muon``, on cuda in fp32 vs on
    CPU: initial held-out loss within 1e-4, final within RECIPES' tolerance (1e-2; Muon 5e-2)."""
    gaps = {name: loss_gaps(runs["cuda"], runs["cpu"]) for name, runs in recipe_runs.items()}
    measured = f"fp32 on cuda vs CPU after {SHORT_STEPS} steps: " + "; ".join(
        f"{name} {within('initial', e0, 1e-4)}, {within('final', e1, RECIPES[name][1])}"
        for name, (e0, e1) in gaps.items())
    record_property("measured", measured)
    fix = ("a recipe trains differently on GPU: see eagle3nb/drafts/eagle3/model.py (fc_norm, the deeper layers), "
           "eagle3nb/drafts/eagle3/objective.py divergence and eagle3nb/train/optim.py")
    assert set(gaps) == set(RECIPES), f"recipes trained: {sorted(gaps)}  -> {fix}"
    for name, (e0, e1) in gaps.items():
        assert e0 <= 1e-4, f"{name}: {measured}  -> {fix}"
        assert e1 <= RECIPES[name][1], f"{name}: {measured}  -> {fix}"


@pytest.mark.covers("eagle3nb/hidden/online.py", "eagle3nb/train/sources.py",
                    fix="see eagle3nb/hidden/online.py OnlineStates")
def test_online_source(work, toy, reference, short_runs, record_property):
    """03 with ``data_source: online`` on cuda (``hidden.online.OnlineStates``: the target computes each
    micro-batch's states on the GPU, fp32) vs stored fp32 states trained on cuda: initial held-out loss within
    1e-4, final within 1e-3."""
    measured, e0, e1 = compared_losses(train_online(work, toy, reference), short_runs["cuda-fp32"],
                                       "online vs stored (fp32, cuda)", 1e-4, 1e-3)
    record_property("measured", measured)
    fix = ("03's online source on GPU differs from stored states: check the device moves in eagle3nb/hidden/online.py "
           "(head, source) and eagle3nb/train/sources.py")
    assert e0 <= 1e-4, f"{measured}  -> {fix}"
    assert e1 <= 1e-3, f"{measured}  -> {fix}"


@pytest.mark.covers("eagle3nb/train/export.py", "eagle3nb/drafts/eagle3/layouts.py",
                    fix="see eagle3nb/train/export.py export and eagle3nb/drafts/eagle3/layouts.py load_draft")
def test_export(work, served, record_property):
    """03's export of a draft trained on cuda: ``drafts.load_draft(device="cuda")`` equals the last checkpoint's
    weights exactly, and the SGLang copy is written."""
    import torch

    from eagle3nb.drafts import load_draft
    from eagle3nb.train.checkpoint import checkpoints

    last = checkpoints(work / "03-served" / "checkpoints")[-1]
    trained = torch.load(last, map_location="cpu", weights_only=False)["model"]
    loaded = load_draft(served["draft_dir"], device=GPU).state_dict()
    bad = [k for k, v in trained.items() if not torch.equal(loaded[k].cpu(), v.cpu())]
    sglang = (Path(served["sglang_draft_dir"]) / "config.json").exists()
    measured = (f"{len(trained)} tensors of {last.name} vs load_draft(device='cuda'): {len(bad)} differ"
                f"{f' ({bad[:3]})' if bad else ''}; SGLang copy {'written' if sglang else 'MISSING'}")
    record_property("measured", measured)
    fix = "export in eagle3nb/train/export.py must write exactly the trained weights (draft.to('cpu') first)"
    assert not bad, f"{measured}  -> {fix}"
    assert sglang, f"{measured}  -> {fix}"
