"""04_acceptance's parameters: the draft and held-out data to judge, the target, the servers to benchmark and
the costs the prediction uses (docs/ARCHITECTURE.md "04_acceptance output")."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from eagle3nb.data.prompts import NAMED_SETS, PromptsError, named_set
from eagle3nb.drafts import method_of, rules
from eagle3nb.params import ParamsError, TargetParams, register
from eagle3nb.paths import resolve

STAGE = "04_acceptance"


class Endpoint(BaseModel):
    """One OpenAI-compatible server to benchmark."""

    model_config = ConfigDict(extra="forbid")
    label: str = Field(description="name in tables and plots, e.g. baseline / eagle3")
    url: str = Field(description="base URL, http://host:8000 (/v1 added when missing)")
    model: str | None = Field(None, description="served model name; null = ask /v1/models")
    metrics_url: str | None = Field(None, description="Prometheus page; null = <host>/metrics")
    k: int | None = Field(None, ge=1, le=16, description="draft length the server was started with (vLLM "
                                                         "num_speculative_tokens), the k of its rows in the sweep; "
                                                         "null = as many as its /metrics counts (none: no draft)")
    rounds: str | None = Field(None, description="the profile of its served rounds: the file vLLM, started with "
                                                 "EAGLE3NB_VLLM_ROUNDS=<file> and the project's plugin, writes "
                                                 "(docs/vllm.md); 04 then predicts its speedup from its own step "
                                                 "costs. null = none")

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError(f"{v!r} is not a URL: use http://host:port")
        v = v.rstrip("/")
        return v if v.endswith("/v1") else v + "/v1"


@register(STAGE)
class AcceptParams(TargetParams):
    """Parameters of ``notebooks/04_acceptance.ipynb`` (docs/ARCHITECTURE.md "04_acceptance output")."""

    draft_dir: str | None = Field(None, description="the draft to judge (EAGLE-3 or speculators layout); default "
                                                    "outputs/<run_name>/03_train/draft")
    data_dir: str | None = Field(None, description="held-out hidden states (02_hidden_states layout); default "
                                                   "outputs/<run_name>/02_hidden_states")
    model_path: str = Field("toy:demo", description="the target in Hugging Face layout, or toy:smoke / toy:demo")
    output_dir: str | None = Field(None, description="where metrics.json and figures go; default "
                                                     "outputs/<run_name>/04_acceptance")
    k: int = Field(3, ge=1, le=16, description="drafted tokens per target step (vLLM num_speculative_tokens)")
    max_k: int = Field(6, ge=1, le=16, description="offline: chain length for the tau(k) curve, k = 1..max_k")
    temperature: float = Field(0.0, ge=0.0, description="sampling temperature served (online) and estimated offline "
                                                        "besides greedy; 0 = greedy")
    offline_samples: int | None = Field(200, ge=1, description="held-out samples used offline; null = all")
    local_prompts: int = Field(8, ge=0, description="prompts decoded here plainly and speculatively (lossless check, "
                                                    "speed); 0 = skip (target too big for this machine)")
    endpoints: Literal["embedded"] | list[Endpoint] = Field("embedded", description="'embedded' (the notebook serves "
                                                                                    "the target without and with the "
                                                                                    "draft) or a list of {label, url}; "
                                                                                    "the first is the speedup baseline")
    ks: list[int] | None = Field(None, description="embedded: draft lengths k to sweep, one speculative server started "
                                                   "per k (a server's k is fixed at its start); null = 1..max_k (a "
                                                   "block drafter: [k], it serves its block's k only). Listed "
                                                   "endpoints declare their own k instead")
    concurrency_levels: list[int] = Field([1, 2, 4, 8, 16], description="concurrent requests per benchmark level "
                                                                        "(where speculation stops paying, by k)")
    num_prompts: int = Field(16, ge=1, description="requests per concurrency level")
    benchmarks: list[str] = Field([], description="public prompt sets (mt-bench, humaneval, sharegpt) or files decoded "
                                                  "here speculatively: one acceptance row per set in the public "
                                                  "drafters' layout, later turns answered on-policy")
    benchmark_prompts: int = Field(8, ge=1, description="prompts per benchmark set (the first ones)")
    prompts: str = Field("toy:heldout", description="prompt set (JSONL / parquet / datasets folder, or toy:heldout) "
                                                    "for the local check and the benchmark")
    max_tokens: int = Field(64, ge=1, description="tokens generated per request / local prompt")
    thinking: bool = Field(True, description="chat-template thinking switch for the prompts (as served)")
    thinking_kwarg: str = Field("auto", description="chat-template kwarg for thinking; auto = the family's (Kimi "
                                                    "'thinking', Qwen3 'enable_thinking', docs/families.md)")
    cost_ratio: float | None = Field(None, ge=0.0, description="draft step / target step cost c; null = measured here "
                                                               "on the target and draft")
    overhead: float | None = Field(None, ge=0.0, description="extra cost of a verify pass over a decode step (fraction "
                                                             "of a step); null = measured here")
    api_key_env: str | None = Field(None, description="NAME of the environment variable holding the endpoints' API key "
                                                      "(never the key)")
    seed: int = Field(0, description="seed of sampled local decoding")

    @field_validator("concurrency_levels")
    @classmethod
    def _levels(cls, v: list[int]) -> list[int]:
        if not v or any(c < 1 for c in v):
            raise ValueError("give at least one concurrency level, each >= 1")
        return v

    @model_validator(mode="after")
    def _k(self) -> "AcceptParams":
        if self.max_k < self.k:
            raise ValueError(f"max_k ({self.max_k}) must be >= k ({self.k}): the tau(k) curve must include k")
        if isinstance(self.endpoints, list) and len({e.label for e in self.endpoints}) != len(self.endpoints):
            raise ValueError("endpoint labels must be unique")
        if self.ks is not None:
            if self.endpoints != "embedded":
                raise ValueError("ks sweeps the embedded server; for listed endpoints give each its k (one server per "
                                 "k: vLLM's num_speculative_tokens is fixed at its start)")
            if not self.ks or any(not 1 <= k <= 16 for k in self.ks) or len(set(self.ks)) != len(self.ks):
                raise ValueError(f"ks {self.ks}: give distinct draft lengths, each 1..16")
        return self

    @property
    def sweep_ks(self) -> list[int]:
        """The draft lengths the embedded benchmark serves: ``ks``, else k = 1..max_k for a chain drafter (the best k
        changes with the concurrency: ``best_k_by_concurrency``), just ``k`` for a block drafter (it serves its
        block's k only)."""
        if self.ks:
            return self.ks
        config = self.draft_path / "config.json"
        block = config.exists() and rules(method_of(json.loads(config.read_text()), str(config)).name).block
        return [self.k] if block else list(range(1, self.max_k + 1))

    @property
    def draft_path(self) -> Path:
        return resolve(self.draft_dir) if self.draft_dir else self.out_dir(None, "03_train") / "draft"

    @property
    def data_path(self) -> Path:
        return self.out_dir(self.data_dir, "02_hidden_states")

    def check_paths(self) -> None:
        src = self.params_file or "the notebook's parameters cell"
        if not (self.draft_path / "config.json").exists():
            raise ParamsError(f"parameter 'draft_dir' in {src}: {self.draft_path} has no config.json; run 03_train "
                              "first or point draft_dir at a draft checkpoint folder")
        if not (self.data_path / "index.json").exists():
            raise ParamsError(f"parameter 'data_dir' in {src}: {self.data_path} has no index.json; run "
                              "02_hidden_states first or point data_dir at held-out hidden states")
        if not self.model_path.startswith("toy:") and not (resolve(self.model_path) / "config.json").exists():
            raise ParamsError(f"parameter 'model_path' in {src}: {resolve(self.model_path)} has no config.json; "
                              "point it at the target's Hugging Face folder")
        for name in self.benchmarks:
            if name in NAMED_SETS:
                try:
                    named_set(name)
                except PromptsError as e:
                    raise ParamsError(f"parameter 'benchmarks' in {src}: {e}") from None
            elif not resolve(name).exists():
                raise ParamsError(f"parameter 'benchmarks' in {src}: {resolve(name)} does not exist; name a public set "
                                  f"({', '.join(NAMED_SETS)}) or a prompt file")
        if self.local_prompts == 0 and (self.cost_ratio is None or self.overhead is None):
            raise ParamsError(f"{src}: local_prompts is 0, so costs cannot be measured here; set cost_ratio and "
                              "overhead (e.g. 0.05 and 0.1 for a 1-layer draft of a 61-layer target)")
        if self.endpoints == "embedded" and not self.model_path.startswith("toy:") \
                and self.local_prompts == 0:
            raise ParamsError(f"parameter 'endpoints' in {src} is 'embedded' but the target is not loaded here "
                              "(local_prompts: 0); list your servers as [{label: baseline, url: ...}, {label: "
                              "eagle3, url: ...}]")
