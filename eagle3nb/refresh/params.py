"""05_refresh's parameters: the traffic to learn from, the current draft and its data, the budget of requests
regenerated on-policy, the fine-tune and the gate's seeds (docs/refresh.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from eagle3nb.params import ParamsError, TargetParams, register
from eagle3nb.paths import resolve

STAGE = "05_refresh"


@register(STAGE)
class RefreshParams(TargetParams):
    """Parameters of ``notebooks/05_refresh.ipynb`` (docs/refresh.md)."""

    model_path: str = Field("toy:demo", description="the target in Hugging Face layout, or toy:smoke / toy:demo")
    traffic: str = Field("toy:heldout", description="the requests served: a gateway's JSONL request log, vLLM's "
                                                     "request log (--enable-log-requests at log level DEBUG), a "
                                                     "folder of them, or a prompt set (toy:heldout)")
    group_by: list[Literal["tag", "domain", "script", "turns", "length"]] = Field(
        ["domain"], description="what groups the traffic: the log's own tag, or the request's domain (tools, code, "
                                "math, chat), script, turns or length bucket; several join as domain/turns")
    tag_allowlist: list[str] | None = Field(None, description="with group_by tag: globs of the gateway tags kept "
                                                             "as group names (math-app, support-*); any other tag "
                                                             "is hashed to tag-<8 hex>. null = every tag that reads "
                                                             "as a name (words, short numbers: team-a, math-app v2); "
                                                             "ids and random strings are hashed (docs/refresh.md)")
    per_group: int = Field(32, ge=2, description="requests sampled per group (uniformly from the whole log); half are "
                                                 "held out to measure and gate (at least 8 with several seeds, 4 "
                                                 "with one), the rest may become refresh data")
    draft_dir: str | None = Field(None, description="the current draft; default outputs/<run_name>/03_train/draft")
    synth_dir: str | None = Field(None, description="the current draft's training data (01_synth's folder), replayed "
                                                    "in the refresh; default outputs/<run_name>/01_synth")
    vllm_url: str = Field("embedded", description="the server that answers the refresh's requests on-policy "
                                                  "(http://host:8000), or embedded")
    api_key_env: str | None = Field(None, description="NAME of the environment variable holding the server's key")
    budget: int = Field(64, ge=1, description="traffic requests answered on-policy for the refresh, shared among the "
                                              "groups in proportion to the speedup each loses")
    replay: float = Field(0.5, ge=0.0, lt=1.0, description="share of the refresh's training data replayed from the "
                                                           "current draft's own (so it does not forget the rest)")
    max_completion_tokens: int = Field(256, ge=1, description="token budget of each regenerated answer")
    steps: int = Field(100, ge=1, description="fine-tune steps from the current draft (03's max_steps)")
    lr: float = Field(1e-3, gt=0, description="fine-tune peak learning rate")
    opd_steps: int = Field(0, ge=0, description="on-policy distillation after the fine-tune, per seed (03's max_steps "
                                               "with loss opd over the refreshed draft's own replayed proposals); "
                                               "0 = off. The gate judges the distilled drafts; metrics say both")
    opd_lr: float = Field(2e-4, gt=0, description="on-policy distillation's peak learning rate (a fifth of the "
                                                  "fine-tune's: its few scored tokens, at the fine-tune's rate, "
                                                  "cost the groups it has none of)")
    opd_rounds: int = Field(4, ge=1, description="on-policy distillation: decoding rounds kept per refresh request, "
                                                 "spread over its answer")
    seeds: list[int] = Field([0, 1], min_length=1, description="one refreshed draft per seed; with several, the gate "
                                                               "chooses one on half of each group's held-out "
                                                               "requests and judges it on the other half")
    k: int = Field(3, ge=1, le=16, description="drafted tokens per target step when measuring and predicting")
    max_tokens: int = Field(64, ge=1, description="tokens decoded per held-out request when measuring acceptance")
    offline: bool = Field(False, description="also measure the current draft offline per group: 01 answers the "
                                             "held-out requests, 02 extracts, 04's offline acceptance by group "
                                             "(no local decoding: what a target too big for this machine allows)")
    cost_ratio: float | None = Field(None, gt=0, description="draft/target step cost for the expected speedup; null = "
                                                             "04's measured value beside the draft's run")
    overhead: float | None = Field(None, ge=0, description="verify overhead for the expected speedup; null = 04's")
    served_ab: Literal["none", "vllm"] = Field("none", description="also serve the current and the refreshed draft "
                                                                   "with the real vLLM on the weak group's held-out "
                                                                   "requests and compare vLLM's own acceptance")
    output_dir: str | None = Field(None, description="default outputs/<run_name>/05_refresh")

    @property
    def draft_path(self) -> Path:
        return self.out_dir(self.draft_dir, "03_train/draft")

    @property
    def synth_path(self) -> Path:
        return self.out_dir(self.synth_dir, "01_synth")

    def check_paths(self) -> None:
        if not self.traffic.startswith("toy:") and not resolve(self.traffic).exists():
            raise ParamsError(f"traffic {resolve(self.traffic)} does not exist: point it at a request log file or "
                              "folder (docs/refresh.md)")
        if not (self.draft_path / "config.json").exists():
            raise ParamsError(f"draft_dir {self.draft_path} holds no draft (config.json): run 03 first or set "
                              "draft_dir")
