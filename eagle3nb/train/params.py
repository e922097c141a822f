"""The 03_train parameters. Defaults = the embedded demo (toy target, smoke-sized draft)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from eagle3nb.drafts import DEFAULT, PACKAGES, fresh_num_layers, method_layer_ids, params_readers, rules
from eagle3nb.params import ParamsError, StageParams, register
from eagle3nb.params_yaml import run_params
from eagle3nb.paths import resolve

STAGE = "03_train"
HIDDEN_STAGE = "02_hidden_states"  # whose run-folder params say whether its layers were the user's choice

# The settings only some methods read (each method's MethodRules.params, in the registry's order): a run of a method
# leaves the others' out of its resume check.
METHOD_KEYS = tuple(dict.fromkeys(key for m in PACKAGES for key in rules(m).params))
# Settings that change the loss curve: resuming with a different value is refused (the curve would not be one run).
CURVE_KEYS = ("data_dir", "init_from", "ttt_steps", "step_decay", "lr", "weight_decay", "warmup_ratio", "epochs",
              "max_steps", "max_length", "batch_tokens", "grad_clip", "seed", "holdout_fraction",
              "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "remap_vocab",
              "autocast", "draft_attention", "fc_norm", "norm_output", "num_layers", "loss", "lk_eta", "optimizer",
              "parallel_drafting", "method", *METHOD_KEYS)
# The registered methods' names, the values 03's method takes.
Method = Literal[tuple(PACKAGES)]


def one_of(names: list[str]) -> str:
    """``a, b or c``."""
    return f"{', '.join(names[:-1])} or {names[-1]}" if len(names) > 1 else names[0]


def readers(key: str) -> str:
    """The methods reading ``key``, as its help opens: ``dflash / dspark``."""
    return " / ".join(params_readers(key))


@register(STAGE)
class TrainParams(StageParams):
    """Parameters of ``notebooks/03_train.ipynb`` (see docs/ARCHITECTURE.md "03_train output")."""

    data_dir: str | None = Field(None, description="02_hidden_states' output folder; default "
                                                   "outputs/<run_name>/02_hidden_states")
    data_source: Literal["stored", "online", "hybrid"] = Field("stored", description="stored: read 02's shards; "
                                                                                     "online: the target computes each "
                                                                                     "micro-batch's states from 01's "
                                                                                     "samples as training goes "
                                                                                     "(nothing stored; one target pass "
                                                                                     "per token per epoch); hybrid: "
                                                                                     "online in the first epoch, "
                                                                                     "stored in 02's storage as it "
                                                                                     "goes and read back later")
    hidden_params: str | None = Field(None, description="data_source online/hybrid: 02's parameters (params/<run>/ or "
                                                        "its 02_hidden_states.yaml: target, aux layers, draft vocab, "
                                                        "storage, backend incl. vllm_url); null = the folder of "
                                                        "params_file, else params/<run_name>/")
    method: Method = Field(
        DEFAULT, description="the draft algorithm (eagle3nb.drafts): "
                             + one_of([f"{m} ({rules(m).summary})" for m in PACKAGES]) + "; a block drafter reads "
                             "the layers 02 extracts for it (its recipe's spread when 02's aux_layer_ids is unset, "
                             "docs/block-drafters.md) and needs 02's draft_vocab_size = the target's vocabulary")
    init_from: str | None = Field(None, description="a draft checkpoint folder to fine-tune (EAGLE-3 or speculators "
                                                    "layout, e.g. the AQ-MedAI Kimi drafter); null = start fresh from "
                                                    "the target's embedding and lm_head rows")
    output_dir: str | None = Field(None, description="checkpoints, metrics and the exported draft; default "
                                                     "outputs/<run_name>/03_train")
    ttt_steps: int = Field(7, ge=1, description="EAGLE-3's training-time-test unroll length (draft steps trained per "
                                                   "position)")
    step_decay: float = Field(0.8, gt=0, le=1, description="loss weight of TTT step i is step_decay**i")
    lr: float = Field(3e-3, gt=0, description="peak AdamW learning rate (the toy draft is tiny; big drafts 1e-4, "
                                              "fine-tuning 5e-5)")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    warmup_ratio: float = Field(0.05, ge=0, lt=1, description="share of the steps with linear warmup before the cosine "
                                                              "decay")
    epochs: int = Field(12, ge=1, description="passes over the training split (ignored when max_steps is set)")
    max_steps: int | None = Field(None, ge=1, description="optimizer steps to run (cycling over epochs); null = epochs")
    max_length: int = Field(2048, ge=4, description="tokens kept per sample (longer samples are cut, and counted)")
    batch_tokens: int = Field(2048, ge=4, description="padded tokens per micro-batch (samples x longest sample)")
    grad_accum: int = Field(1, ge=1, description="micro-batches per optimizer step per process; global batch = "
                                                 "grad_accum x processes")
    grad_clip: float = Field(0.5, gt=0, description="gradient-norm clip")
    eval_every: int = Field(50, ge=0, description="held-out evaluation every N steps (also at the start and the end); "
                                                  "0 = start and end only")
    save_every: int = Field(50, ge=1, description="checkpoint every N steps (and at the end); a killed run resumes "
                                                  "from the last one")
    keep_checkpoints: int = Field(2, ge=1, description="checkpoints kept on disk (oldest removed)")
    seed: int = Field(0, description="seed for initialisation and data order")
    holdout_fraction: float = Field(0.1, ge=0, lt=1, description="share of samples (chosen by id hash) held out for "
                                                                 "accuracy and simulated acceptance length")
    intermediate_size: int | None = Field(None, ge=1, description="from scratch: draft MLP width; null = the target's")
    num_attention_heads: int | None = Field(None, ge=1,
                                            description="from scratch: attention heads; null = the target's")
    num_key_value_heads: int | None = Field(None, ge=1, description="from scratch: KV heads; null = the target's")
    head_dim: int | None = Field(None, ge=1, description="from scratch: head width; null = the target's")
    draft_attention: Literal["llama", "mla"] = Field(
        "llama", description="from scratch: the midlayer's attention: llama (the published drafters' layer, served "
                             "by vLLM and SGLang on GPUs) or mla (an MLA target's own latent attention and widths: "
                             "vLLM's deepseek_eagle3 draft, the one stock vLLM's CPU build serves beside an MLA "
                             "target)")
    fc_norm: bool | None = Field(None, description="EAGLE-3.1's RMSNorm on each of the three aux states before fc, "
                                                    "so no layer's scale dominates the fused feature (vLLM reads "
                                                    "fc_norm from the draft's config.json); null = true for a fresh "
                                                    "draft (EAGLE-3.1 beat EAGLE-3.0 on both toys, docs/recipes.md), "
                                                    "the run's own when resuming one started without it, the "
                                                    "checkpoint's own when fine-tuning (init_from)")
    norm_output: bool | None = Field(None, description="EAGLE-3.1's post-norm state, not the pre-norm one, fed back "
                                                        "as the next draft step's feature (vLLM's norm_output key); "
                                                        "null as fc_norm: true for a fresh draft")
    num_layers: int | None = Field(
        None, ge=1, validate_default=True,
        description="from scratch: draft decoder layers (vLLM's num_hidden_layers); null = the method's own depth ("
                    + ", ".join(f"{m}: {fresh_num_layers(m)}" for m in PACKAGES) + "), the checkpoint's own when "
                    "fine-tuning (init_from); EAGLE-3's first layer reads embedding + feature, the later ones only "
                    "the residual stream; each costs one more layer per draft step")
    parallel_drafting: bool = Field(False, description="from scratch: a P-EAGLE draft (arXiv 2602.01469) that proposes "
                                                       "all k tokens in one forward: k-1 mask positions (the target's "
                                                       "pad token, else its last id, and a learned mask_hidden) after "
                                                       "the last token, trained in the TTT unroll as vLLM's "
                                                       "parallel_drafting feeds them; needs ttt_steps >= "
                                                       "num_speculative_tokens and export_format eagle3")
    loss: Literal["forward_kl", "reverse_kl", "tv", "jsd", "lk_alpha", "lk_lambda", "opd"] = Field(
        "forward_kl", description="the TTT loss per position against the target's distribution p (the draft's: q): "
                                  "forward_kl (EAGLE-3's soft cross-entropy, KL(p||q) + H(p)), reverse_kl "
                                  "KL(q||p), tv (total variation 1/2 sum|p-q| = 1 - acceptance), jsd "
                                  "(Jensen-Shannon), lk_alpha (-log acceptance) or lk_lambda (lambda KL(p||q) + "
                                  "(1-lambda)(1 - acceptance), lambda = exp(-lk_eta acceptance)): the LK losses "
                                  "of arXiv 2602.23881, acceptance = sum min(p, q)), or opd (on-policy "
                                  "distillation over 05's replayed proposals: KL(q||p) where the target rejected "
                                  "the drafted token, loss_mask 2, KL(p||q) where it accepted it)")
    lk_eta: float = Field(3.0, ge=0, description="loss lk_lambda: how fast the weight moves from KL to TV as the "
                                                 "acceptance grows (the paper's best: 3)")
    block_size: int = Field(8, ge=2, description=f"{readers('block_size')}: block slots per draft forward (the "
                                                 "anchor then masks); DFlash drafts block_size-1 tokens a round, "
                                                 "DSpark block_size: num_speculative_tokens is that (DFlash, "
                                                 "DFlash2: or fewer, exported as the served block of k+1)")
    block_causal: bool = Field(False, description=f"{readers('block_causal')}: each slot attends only to the slots "
                                                   "before it in its block (vLLM's dflash_config.causal), so a block "
                                                   "served shorter than trained drafts what its first slots drafted "
                                                   "in training; false = the whole block (the papers')")
    anchors_per_seq: int = Field(512, ge=1, description=f"{readers('anchors_per_seq')}: blocks trained per sequence, "
                                                        "anchored at random generated tokens (all of them when fewer)")
    block_loss: Literal["kl", "ce"] = Field("kl", description=f"{readers('block_loss')}: per slot KL to the target's "
                                                              "distribution, or CE on its argmax")
    block_weighting: Literal["decay", "dpace"] = Field(
        "decay", description=f"{readers('block_weighting')}: the block positions' weights: decay exp(-i/block_gamma) "
                             "(DFlash), or dpace (D-PACE, arXiv 2605.18810: suffix sums of the running products of "
                             "the draft's own confidence, the gradient of the expected accepted length)")
    block_gamma: float = Field(4.0, gt=0, description=f"{readers('block_gamma')}: decay's gamma (DSpark's confidence "
                                                      "loss uses it too)")
    dpace_alpha: float = Field(0.5, ge=0, le=1, description=f"{readers('dpace_alpha')}, weighting dpace: the "
                                                            "confidence's smoothing (1 - alpha) q + alpha")
    markov_rank: int = Field(32, ge=1, description=f"{readers('markov_rank')}: rank r of the Markov head (V x r, "
                                                   "r x V)")
    confidence_weight: float = Field(1.0, ge=0, description=f"{readers('confidence_weight')}: weight of the "
                                                            "confidence head's loss")
    conv_kernel_size: int = Field(2, ge=1, description=f"{readers('conv_kernel_size')}: taps of each layer's "
                                                       "grouped dynamic convolutions within the block (at most "
                                                       "block_size)")
    conv_group_size: int = Field(16, ge=1, description=f"{readers('conv_group_size')}: hidden channels sharing one "
                                                       "dynamic kernel (must divide the draft's hidden size)")
    selector_rank: int = Field(256, ge=1, description=f"{readers('selector_rank')}: rank of the candidate "
                                                      "selector's codebooks (2 x V x r)")
    selector_top_k: int = Field(16, ge=1, description=f"{readers('selector_top_k')}: unary candidates the selector "
                                                      "rescores per slot")
    optimizer: Literal["adamw", "muon"] = Field("adamw", description="adamw, or muon (torch.optim.Muon) on the "
                                                                     "hidden 2-D weight matrices with AdamW on the "
                                                                     "rest (norms, lm_head); one lr for both "
                                                                     "(Muon's update scaled to AdamW's RMS)")
    remap_vocab: bool = Field(False, description="fine-tuning with a checkpoint whose draft vocabulary differs from "
                                                 "the data's: carry its lm_head rows over for shared tokens (others "
                                                 "from the target's lm_head) instead of stopping")
    autocast: Literal["auto", "bf16", "off"] = Field("auto", description="bf16 autocast: auto = on where the device "
                                                                         "supports it (CUDA with bf16), off on CPU")
    device: str = Field("auto", description="auto (cuda:LOCAL_RANK if available, else cpu), cpu, cuda, cuda:N")
    resume: bool = Field(True, description="continue from the last checkpoint in output_dir (settings must match)")
    export_format: Literal["eagle3", "speculators", "both"] = Field(
        "eagle3", description="eagle3: output_dir/draft for vLLM/SGLang; speculators: output_dir/draft-speculators; "
                              "both")
    export_dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="dtype of the exported weights (bfloat16 for big drafts)")
    keep_best: bool = Field(True, description="export the weights of the best held-out evaluation, the start's "
                                              "included (a fine-tune that only got worse exports its checkpoint); "
                                              "false: the last step's (05_refresh, which judges by its own gate)")
    export_embed_tokens: bool = Field(True, description="include the (frozen, target's) embedding in the export; false "
                                                        "for big vocabularies (vLLM then shares the target's)")
    num_speculative_tokens: int = Field(3, ge=1, description="k in the printed vLLM/SGLang serving flags")

    @field_validator("num_layers")
    @classmethod
    def _method_depth(cls, v: int | None, info: ValidationInfo) -> int | None:
        """null = the method's own depth, resolved here once, so every reader (the fresh draft, the resume check,
        the printed and saved parameters) sees the int (method is declared above, so already validated)."""
        if v is None and "method" in info.data:  # a method that failed validation is reported on its own
            return fresh_num_layers(info.data["method"])
        return v

    def default_of(self, name: str) -> Any:
        """num_layers' default is its method's depth, what null resolved to."""
        return fresh_num_layers(self.method) if name == "num_layers" else super().default_of(name)

    @model_validator(mode="after")
    def _sizes(self) -> "TrainParams":
        if self.batch_tokens < self.max_length:
            raise ValueError(f"batch_tokens ({self.batch_tokens}) must be at least max_length ({self.max_length}) "
                             "so the longest sample fits in a micro-batch")
        if self.parallel_drafting and self.ttt_steps < max(2, self.num_speculative_tokens):
            raise ValueError(f"parallel_drafting trains one mask position per TTT step after the first: ttt_steps "
                             f"({self.ttt_steps}) must be at least num_speculative_tokens "
                             f"({self.num_speculative_tokens}) and 2")
        if self.parallel_drafting and self.draft_attention == "mla":
            raise ValueError("parallel_drafting with draft_attention: mla has no engine to serve it (vLLM 0.32's "
                             "deepseek_eagle3 draft has no mask_hidden; SGLang has no parallel drafting): set "
                             "parallel_drafting: false for an MLA draft, or draft_attention: llama")
        if self.parallel_drafting and self.export_format != "eagle3":
            raise ValueError(f"parallel_drafting exports vLLM's eagle3 layout (mask_token_id + mask_hidden) only: set "
                             f"export_format: eagle3, not {self.export_format}")
        if rules(self.method).block:
            n = rules(self.method).drafts_per_block(self.block_size)
            k = self.num_speculative_tokens
            if rules(self.method).serves_shorter and k < n:  # trained at block_size, exported and served at k + 1
                if "conv_kernel_size" in rules(self.method).params and self.conv_kernel_size > k + 1:
                    raise ValueError(f"method {self.method}: served at num_speculative_tokens {k}, a block of {k + 1} "
                                     f"slots, shorter than conv_kernel_size ({self.conv_kernel_size}): set "
                                     f"conv_kernel_size to at most {k + 1}")
            elif k != n:  # vLLM sizes the block it runs by num_speculative_tokens
                most = "at most" if rules(self.method).serves_shorter else "exactly"
                raise ValueError(f"method {self.method}: a block of {self.block_size} drafts {n} tokens, so "
                                 f"num_speculative_tokens ({k}) must be {most} {n} (vLLM would run a block of {k} "
                                 f"drafts, not the one trained): set block_size or num_speculative_tokens")
            if self.parallel_drafting or self.draft_attention != "llama":
                raise ValueError(f"parallel_drafting and draft_attention shape an EAGLE-3 draft; method "
                                 f"{self.method} has its own (leave them at false / llama)")
            if self.block_causal and "block_causal" not in rules(self.method).params:
                raise ValueError(f"block_causal is read by {readers('block_causal')} only; method {self.method} "
                                 "trains its whole block (leave block_causal at false)")
            if self.loss != "forward_kl":  # the block objective reads block_loss; loss would be ignored
                raise ValueError(f"loss: {self.loss} is EAGLE-3's training-time-test loss; method {self.method} "
                                 "trains with block_loss (kl | ce) and block_weighting: leave loss at forward_kl")
        return self

    def check_states(self, meta: dict[str, Any]) -> None:
        """Refuse, in one line naming 02's ``aux_layer_ids``, a fresh draft on states (02's ``meta``: their
        ``layer_ids``, the target's ``num_layers``) whose layers 02 chose by default for another method: this run
        folder's 02 params leave aux_layer_ids unset, and 03's method changed after 02 ran. Ids set in 02 are the
        user's choice, and data from outside a run folder is taken as stored."""
        folder = Path(self.params_file).parent if self.params_file else None
        if folder is None or not (folder / f"{HIDDEN_STAGE}.yaml").is_file():
            return
        if run_params(folder, HIDDEN_STAGE).get("aux_layer_ids") is not None:
            return
        want, have = method_layer_ids(self.method, meta["num_layers"], self.num_layers), list(meta["layer_ids"])
        if have != want:
            raise ParamsError(f"method {self.method} reads target layers {want} by its recipe, but 02 stored {have}, "
                              f"chosen for another method before 03's method was {self.method}: re-run "
                              f"02_hidden_states (its aux_layer_ids unset extracts {want}), or set aux_layer_ids: "
                              f"{have} in {folder / HIDDEN_STAGE}.yaml to train on these")

    @property
    def data_path(self) -> Path:
        return self.out_dir(self.data_dir, "02_hidden_states")

    @property
    def init_path(self) -> Path | None:
        return resolve(self.init_from) if self.init_from else None

    def check_paths(self) -> None:
        """init_from and the device (data_dir is made by 02, which may not have run yet when a run is validated)."""
        src = self.params_file or "the notebook's parameters cell"
        if self.device.startswith("cuda"):
            import torch

            index = int(self.device.partition(":")[2] or 0) if self.device.partition(":")[2].isdigit() else 0
            if not torch.cuda.is_available() or index >= torch.cuda.device_count():
                build = " (this torch is a CPU build)" if torch.version.cuda is None else ""
                raise ParamsError(f"parameter 'device' in {src} is {self.device!r}, but torch sees "
                                  f"{torch.cuda.device_count()} GPU(s) here{build}: use device: auto (the GPU "
                                  f"where there is one, else cpu) or cpu")
        if self.optimizer == "muon":
            from eagle3nb.train.optim import MuonUnavailable, muon_class

            try:
                muon_class()
            except MuonUnavailable as e:
                raise ParamsError(f"parameter 'optimizer' in {src}: {e}") from None
        init = self.init_path
        if init is not None and not (init / "config.json").exists():
            raise ParamsError(f"parameter 'init_from' in {src}: {init} has no config.json; point it at a draft "
                              "checkpoint folder (config.json + model.safetensors) or set it to null to train "
                              "from scratch")
