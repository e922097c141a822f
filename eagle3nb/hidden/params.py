"""The 02_hidden_states parameters. Defaults = the embedded demo (toy target, transformers backend)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from eagle3nb.drafts import DEFAULT, PACKAGES
from eagle3nb.params import ParamsError, TargetParams, register
from eagle3nb.paths import resolve

STAGE = "02_hidden_states"
SYNTH_STATUSES = ("ok", "truncated", "no_reasoning", "error")

# Settings that change the stored data: a different value against an existing output_dir is refused
# (or, with force, the old shards are discarded).
DATA_KEYS = ("model_path", "aux_layer_ids", "max_length", "storage", "topk", "draft_vocab_size", "statuses",
             "max_samples", "shard_tokens", "dtype", "backend")


@register(STAGE)
class HiddenParams(TargetParams):
    """Parameters of ``notebooks/02_hidden_states.ipynb`` (see docs/ARCHITECTURE.md "02_hidden_states output")."""

    synth_dir: str | None = Field(None, description="01_synth's output folder; default outputs/<run_name>/01_synth")
    model_path: str = Field("toy:demo", description="the target in Hugging Face layout (the model 01 sampled from), or "
                                                    "toy:smoke / toy:demo")
    output_dir: str | None = Field(None, description="where shards go; default outputs/<run_name>/02_hidden_states")
    aux_layer_ids: list[int] | None = Field(None, description="aux layers in HF hidden_states / vLLM ids (input of "
                                                              "layer i); null = those draft_method's recipe reads: "
                                                              "EAGLE-3's [2, L//2, L-3], a block drafter's spread")
    draft_method: Literal[tuple(PACKAGES)] = Field(
        DEFAULT, description="the draft method these states are for (03's method), whose recipe's layers are "
                             "extracted when aux_layer_ids is null; in a run folder the run's plan hands it 03's "
                             "method (set it only to override)")
    draft_num_layers: int | None = Field(None, ge=1, description="that draft's decoder layers (a block drafter reads "
                                                                 "one target layer per layer); null = the method's "
                                                                 "own depth; in a run folder, 03's num_layers")
    max_length: int = Field(2048, ge=2, description="tokens kept per sample (longer samples are cut, and counted)")
    tokens_per_batch: int = Field(4096, ge=1, description="token budget of one forward pass (batch x longest sample in "
                                                          "it)")
    shard_tokens: int = Field(16384, ge=1, description="tokens per shard file; a killed run redoes at most one shard")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field("auto", description="compute dtype of the target; "
                                                                                         "auto = float32 on CPU, "
                                                                                         "bfloat16 on GPU")
    storage: Literal["bf16", "fp8", "topk", "fp32"] = Field("bf16", description="bf16: 3 aux + final state in bf16 (8H "
                                                                                "bytes/token); fp8: e4m3 with "
                                                                                "per-token scales (~half); topk: fp8 "
                                                                                "aux + the target's top-k draft-vocab "
                                                                                "log-probs instead of the final state; "
                                                                                "fp32: exact, for checks")
    topk: int = Field(32, ge=1, description="probabilities kept per token with storage: topk")
    backend: Literal["transformers", "vllm"] = Field("transformers", description="transformers: load the target here; "
                                                                                 "vllm: drive a vLLM server started "
                                                                                 "with extract_hidden_states (see the "
                                                                                 "notebook)")
    vllm_url: str | list[str] | None = Field(None, description="backend vllm: the server (http://host:8000), or a "
                                                              "list of servers kept busy together (a failed "
                                                              "request is sent again on another); each must write "
                                                              "its files where this machine can read them")
    vllm_model: str | None = Field(None, description="backend vllm: served model name; null = ask /v1/models")
    api_key_env: str | None = Field(None, description="backend vllm: NAME of the environment variable holding the API "
                                                      "key (never the key)")
    concurrency: int = Field(8, ge=1, description="backend vllm: requests in flight per server")
    request_timeout_s: float = Field(600.0, gt=0, description="backend vllm: seconds before a request is retried")
    max_retries: int = Field(6, ge=0, description="backend vllm: retries per request (on another server where "
                                                  "there is one) on refused connections, timeouts and 5xx")
    retry_backoff_s: float = Field(1.0, gt=0, description="backend vllm: first retry delay in seconds; doubles per "
                                                          "retry (with jitter, capped at 60 s)")
    draft_vocab_size: int = Field(256, ge=1, description="draft vocabulary size: the most frequent target ids over "
                                                         "loss-masked tokens (32000 for big models)")
    vocab_from: str | None = Field(None, description="keep the draft vocabulary of this earlier 02 folder (its "
                                                     "draft_vocab.safetensors) instead of choosing one from these "
                                                     "samples: data for a draft already trained on it (05's on-policy "
                                                     "distillation, whose few scored tokens would choose another)")
    statuses: list[str] = Field(["ok"], description="01_synth sample statuses to use (ok, truncated, no_reasoning, "
                                                    "error)")
    max_samples: int | None = Field(None, ge=1, description="use only the first N samples (by id order); null = all")
    allow_partial_synth: bool = Field(False, description="use a 01_synth output that is not finished (01 stopped and "
                                                         "not resumed) or ends in a torn line; off: 02 refuses it")
    verify_sha256: bool = Field(True, description="on resume re-hash finished shards (size and header are always "
                                                  "checked)")
    force: bool = Field(False, description="start even if the projected disk use exceeds free space; discard shards "
                                           "made with other settings")

    @field_validator("statuses")
    @classmethod
    def _statuses(cls, v: list[str]) -> list[str]:
        bad = [s for s in v if s not in SYNTH_STATUSES]
        if bad or not v:
            raise ValueError(f"statuses must be a non-empty subset of {list(SYNTH_STATUSES)}")
        return v

    @model_validator(mode="after")
    def _backend(self) -> "HiddenParams":
        if self.backend == "vllm" and not self.vllm_url:
            raise ValueError("backend 'vllm' needs vllm_url (http://host:8000 of a server started with "
                             "extract_hidden_states; the notebook shows the command line)")
        for url in self.urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"vllm_url {url!r} is not a URL: use http://host:port, or a list of them")
        if len(set(self.urls)) != len(self.urls):
            raise ValueError(f"vllm_url lists a server twice ({self.urls}): give each server once")
        return self

    @property
    def urls(self) -> list[str]:
        """``vllm_url`` as a list (empty without one)."""
        return [self.vllm_url] if isinstance(self.vllm_url, str) else list(self.vllm_url or [])

    @property
    def synth_path(self) -> Path:
        return self.out_dir(self.synth_dir, "01_synth")

    def data_config(self) -> dict:
        """The data-affecting settings, stored with the shards and compared on resume (``vocab_from`` only when
        set, so data made before it existed keeps its key)."""
        return {**{k: getattr(self, k) for k in DATA_KEYS}, **({"vocab_from": self.vocab_from} if self.vocab_from
                                                               else {})}

    def check_paths(self) -> None:
        src = self.params_file or "the notebook's parameters cell"
        if not self.model_path.startswith("toy:") and not (resolve(self.model_path) / "config.json").exists():
            raise ParamsError(f"parameter 'model_path' in {src}: {resolve(self.model_path)} has no config.json; point "
                              "it at the target's Hugging Face folder (the model 01_synth sampled from)")
