"""Every registered block drafter (``eagle3nb.drafts.block_methods()``) on the GPU against the same weights on CPU
in fp32: a fresh draft of the method built as 03 builds it, its export loaded onto cuda, one micro-batch's loss
through the method's own objective, and lossless greedy speculative decoding with the draft on cuda. A method
registered tomorrow is tested here the day it is registered."""

from __future__ import annotations

import pytest
from gpu_world import BLOCK_DRAFTERS, GPU, MAX_TOKENS, block_package_files, needs_cuda, train_values, within

from eagle3nb.drafts import block_methods

pytestmark = needs_cuda()
NOISE = 0.05  # every trained weight moved this far (std) off its fresh start: heads that start at identity (DFlash2's
# convolutions, its selector) then take part, and the numbers compared do not need a trained draft


@pytest.mark.covers(*block_package_files(), fix="see the method's package under eagle3nb/drafts/")
@pytest.mark.parametrize("method", block_methods())
def test_block_drafter(method, work, reference, prompts, record_property):
    """A seeded fresh ``method`` draft (``train.build.build_draft``, 03's; its weights moved off their start), saved
    in vLLM's layout and loaded onto cuda (``drafts.load_draft(device="cuda")``): one micro-batch's loss through the
    method's objective (evaluation's fixed anchors) on cuda within 1e-4 (relative) of CPU fp32's, and greedy
    speculative decoding with target and draft on cuda (04's ``compare_with_plain``, k = the block's drafts) equal
    to the target's own greedy output. (The offline simulation, the package's ``offline.py``, moves tensors the
    same way as the loss.)"""
    import copy
    import tempfile

    import torch

    from eagle3nb.accept.local import compare_with_plain
    from eagle3nb.data.reader import HiddenStates
    from eagle3nb.decoder.reference import plain_generate
    from eagle3nb.drafts import get, load_draft
    from eagle3nb.hf import DECODER, load_target
    from eagle3nb.params import from_dict
    from eagle3nb.train.build import build_draft

    data = HiddenStates(reference["cpu-full"])
    P = from_dict("03_train", {**train_values(work, reference["cpu-full"], f"block-{method}", "cpu", "off", 1),
                               **BLOCK_DRAFTERS[method]})
    cpu, _ = build_draft(P, data)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in cpu.parameters():
            if p.requires_grad:
                p.add_(NOISE * torch.randn(p.shape, generator=g))
    targets = {GPU: load_target(data.meta["model_path"], trust_remote_code=False, use=DECODER).to(GPU)}
    targets["cpu"] = copy.deepcopy(targets[GPU]).to("cpu")
    with tempfile.TemporaryDirectory() as tmp:  # the GPU's copy through the export and its loader's device move
        k = BLOCK_DRAFTERS[method]["num_speculative_tokens"]
        get(method).save(cpu, tmp, get(method).layouts[0], num_speculative_tokens=k)
        drafts = {"cpu": cpu, GPU: load_draft(tmp, embed_tokens=targets[GPU].get_input_embeddings().weight.detach(),
                                              device=GPU, lm_head=targets[GPU].get_output_embeddings().weight.detach())}
    _, ids, eos = prompts
    answer = plain_generate(targets["cpu"], ids[0], MAX_TOKENS, 0.0, eos)
    seq, mask = ids[0] + answer, [0] * len(ids[0]) + [1] * len(answer)
    loss = {}
    with torch.no_grad():
        for dev, m in drafts.items():
            out = targets[dev](input_ids=torch.tensor([seq], device=dev), output_hidden_states=True)
            batch = {"aux": torch.cat([out.hidden_states[i][0] for i in m.config.aux_layer_ids], -1)[None],
                     "input_ids": torch.tensor([seq], device=dev), "loss_mask": torch.tensor([mask], device=dev),
                     "target_probs": out.logits.softmax(-1), "target_argmax": out.logits.argmax(-1)}
            loss[dev] = float(get(method).objective(m, P).eval()(batch)[0])
    gap = abs(loss[GPU] - loss["cpu"]) / max(abs(loss["cpu"]), 1e-9)
    decoded = compare_with_plain(targets[GPU], drafts[GPU], [ids[0]], k, MAX_TOKENS, 0.0, eos)
    measured = (f"{method} (k={k}): {within('loss relative gap', gap, 1e-4)} (cuda {loss[GPU]:.5f}, CPU "
                f"{loss['cpu']:.5f}); greedy speculative decoding on cuda "
                f"{'is' if decoded['identical_to_target'] else 'is NOT'} the target's, acceptance length "
                f"{decoded['acceptance_length']:.3f}")
    record_property("measured", measured)
    assert gap <= 1e-4, (f"{measured}  -> {method}'s loss on GPU differs from CPU: check the .to(device) moves in its "
                         "package's objective.py and model.py")
    assert decoded["identical_to_target"], (f"{measured}  -> block decoding on GPU is not lossless: check its "
                                            "package's drafting.py and model.py")
