"""The 03_train parameters. Defaults = the embedded demo (toy target, smoke-sized draft)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationInfo, create_model, field_validator, model_validator
from pydantic.fields import FieldInfo

from eagle3nb.drafts import DEFAULT, PACKAGES, fresh_num_layers, method_layer_ids, packages, params_readers, rules
from eagle3nb.params import ParamsError, StageParams, register
from eagle3nb.paths import resolve

STAGE = "03_train"

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


def method_fields() -> dict[str, tuple[Any, Any]]:
    """Every registered draft package's own 03 settings (its ``PARAMS``: name -> (type, Field)), in the registry's
    order, each help opened by the methods reading it (their rules' ``params``; EAGLE-3's, 03's baseline, by none):
    a method's settings live with it, and a package registered in one line brings them to 03."""
    fields: dict[str, tuple[Any, Any]] = {}
    for package in packages():
        for key, (kind, info) in getattr(package, "PARAMS", {}).items():
            if key in fields:
                raise ValueError(f"03 setting {key!r} is declared by two draft packages; declare it in one and name it "
                                 "in the other's rules' params")
            read_by = readers(key)
            described = f"{read_by}: {info.description}" if read_by else info.description
            fields[key] = (kind, FieldInfo.merge_field_infos(info, description=described))
    return fields


class StageSettings(StageParams):
    """03's own settings, before the draft packages' (:func:`method_fields`) join them in :class:`TrainParams`."""

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
    num_layers: int | None = Field(
        None, ge=1, validate_default=True,
        description="from scratch: draft decoder layers (vLLM's num_hidden_layers); null = the method's own depth ("
                    + ", ".join(f"{m}: {fresh_num_layers(m)}" for m in PACKAGES) + "), the checkpoint's own when "
                    "fine-tuning (init_from); EAGLE-3's first layer reads embedding + feature, the later ones only "
                    "the residual stream; each costs one more layer per draft step")
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
        if rules(self.method).check is not None and (problem := rules(self.method).check(self)):
            raise ValueError(problem)  # the method's own settings, checked by its package
        if rules(self.method).block:
            n = rules(self.method).drafts_per_block(self.block_size)
            k = self.num_speculative_tokens
            if k > n or (k != n and not rules(self.method).serves_shorter):  # vLLM sizes its block by k
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
        ``layer_ids``, the target's ``num_layers``, ``layers_for``: the draft whose recipe chose them) that 02 chose
        by recipe for another draft: 03's method or depth changed after 02 ran. Ids the user set in 02
        (``layers_for`` null), or states recorded without it, are taken as stored."""
        chosen_for = meta.get("layers_for")
        if not chosen_for:
            return
        want, have = method_layer_ids(self.method, meta["num_layers"], self.num_layers), list(meta["layer_ids"])
        if have != want:
            raise ParamsError(f"method {self.method} reads target layers {want} by its recipe, but 02 stored {have}, "
                              f"chosen for a {chosen_for['method']} draft: re-run 02_hidden_states for this run "
                              f"(it extracts {want} for 03's method), or set 02's aux_layer_ids: {have} to train on "
                              "these")

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


# 03's schema: its own settings, then each registered draft package's (a method's settings live with it).
TrainParams = register(STAGE)(create_model(
    "TrainParams", __base__=StageSettings, __module__=__name__, **method_fields(),
    __doc__='Parameters of ``notebooks/03_train.ipynb`` (see docs/ARCHITECTURE.md "03_train output").'))
