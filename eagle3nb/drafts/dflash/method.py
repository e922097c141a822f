"""DFlash's, DSpark's and DFlash2's ``DraftMethod``s (the package's ``METHODS``): built here, apart from the
package's light ``__init__``, because their modules load torch. DSpark and DFlash2 are DFlash with heads: the same
model, objective, layouts, drafting and offline simulation, their heads on (``heads``). A draft on this backbone
with modules of its own (LiLiCorr's) subclasses ``DFlash`` and names them (``layouts_module`` ...)."""

from __future__ import annotations

from typing import Any

from eagle3nb.drafts.base import DraftMethod, given
from eagle3nb.drafts.dflash import calibration, drafting, layouts, model, objective, offline, serving


class DFlash(DraftMethod):
    """The block drafter: one forward drafts a block from the target's states at an anchor."""

    # the modules its contract is served by (a draft on this backbone names its own); before ``layouts``, the formats,
    # which the class body rebinds
    layouts_module, offline_module, serving_module = layouts, offline, serving
    objective_class, drafting_class = objective.BlockObjective, drafting.BlockDrafting
    name, title = "dflash", "DFlash"
    layouts = layouts.LAYOUTS
    unit = objective.BlockObjective.unit

    def heads(self, P: Any) -> dict[str, Any]:
        """The method's own ``DFlashConfig`` fields from 03's params (DFlash: whether the block is causal)."""
        return {"causal": P.block_causal}

    def claims(self, config):
        return layouts.claimer(self.name)(config)

    def load(self, path, embed_tokens=None, device="cpu", dtype=None, lm_head=None):
        return self.layouts_module.load_draft(path, embed_tokens, device, **given(dtype=dtype), lm_head=lm_head)

    def save(self, model, path, format, dtype=None, include_embed=None, verifier=None, num_speculative_tokens=None):
        return self.layouts_module.save_draft(model, path, format, dtype, **given(include_embed=include_embed),
                                              verifier=verifier, num_speculative_tokens=num_speculative_tokens)

    def config_json(self, model, format, dtype=None, verifier=None, num_speculative_tokens=None):
        return self.layouts_module.draft_config_json(model, format, dtype, verifier, num_speculative_tokens)

    def objective(self, model, P):
        return self.objective_class.from_params(model, P)

    def drafting(self, model, k, device):
        return self.drafting_class(model, k, device)

    def chain_acceptance(self, model, item, target_argmax, target_probs, steps, temperature):
        return self.offline_module.chain_acceptance(model, item, target_argmax, target_probs, steps, temperature)

    def fresh(self, P, data, target_config):
        return model.fresh_draft(P, data.meta, target_config, data.embed_tokens(), data.lm_head(), **self.heads(P))

    def serving_problems(self, path, config, how):
        return self.serving_module.serving_problems(path, config, how)

    def tensor_problems(self, config, shapes, hidden_size):
        return self.layouts_module.tensor_problems(config, shapes, hidden_size)

    def check_usable(self, draft, where):
        model.check_mask_input(draft, where)


class DSpark(DFlash):
    """DFlash with a Markov head (the block sampled left to right) and a confidence head, calibrated after training
    and read by adaptive verification."""

    name, title = "dspark", "DSpark"

    def heads(self, P: Any) -> dict[str, Any]:
        return {"markov_rank": P.markov_rank}

    def calibrate(self, objective_, held_batches):
        return calibration.calibrate(objective_, held_batches)

    def confidences(self, draft, item, target_argmax):
        return offline.block_confidences(draft, item, target_argmax)


class DFlash2(DFlash):
    """DFlash with grouped dynamic convolutions and a candidate selector."""

    name, title = "dflash2", "DFlash2"

    def heads(self, P: Any) -> dict[str, Any]:
        return {"causal": P.block_causal, **{k: getattr(P, k) for k in layouts.DFLASH2_KEYS}}


METHODS = {m.name: m for m in (DFlash(), DSpark(), DFlash2())}
