"""The target and the draft 04 judges, loaded through ``hf`` (float32, one device: 04 compares tokens one for
one with the target's own decoding) and checked to fit each other and the held-out data before any work."""

from __future__ import annotations

import json

from eagle3nb.accept.params import AcceptParams
from eagle3nb.data.reader import HiddenStates
from eagle3nb.drafts import check_fits, load_draft
from eagle3nb.hf import DECODER, compute_device, load_target, load_tokenizer


def load_models(P: AcceptParams, need_target: bool = True):
    """(target or None, draft, tokenizer) for the stage, after checking that the draft fits both the held-out
    data and the target (sizes, vocabulary, aux layers), so a mismatch stops here, naming both sides. The
    draft gets the target's embedding (and head: a block drafter's) when its checkpoint carries none."""
    model_dir = P.model_dir
    tokenizer = load_tokenizer(model_dir, trust_remote_code=P.trust_remote_code)
    data = HiddenStates(P.data_path)
    target = None
    if need_target:
        target = load_target(model_dir, trust_remote_code=P.trust_remote_code, use=DECODER)
        embed, head = target.get_input_embeddings().weight.detach(), target.get_output_embeddings().weight.detach()
    else:
        embed, head = data.embed_tokens(), data.lm_head()
    draft = load_draft(P.draft_path, embed_tokens=embed, lm_head=head, device=compute_device())
    meta = data.meta
    check_fits(draft.config, hidden_size=meta["hidden_size"], vocab_size=meta["vocab_size"],
               layer_ids=meta["layer_ids"], num_layers=meta["num_layers"], draft=f"the draft {P.draft_path}",
               data=f"the held-out data {P.data_path}")
    tc = json.loads((model_dir / "config.json").read_text())
    tc = tc.get("text_config") or tc
    check_fits(draft.config, hidden_size=tc["hidden_size"], vocab_size=tc["vocab_size"], layer_ids=None,
               num_layers=tc["num_hidden_layers"], draft=f"the draft {P.draft_path}", data=f"the target {model_dir}")
    return target, draft, tokenizer
