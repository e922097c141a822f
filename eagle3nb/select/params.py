"""06_select's parameters: the candidate recipes and their training budget, the engine they are served on, the load
they are judged at (the user's concurrencies and weights, or a traffic log's arrival rate), and what is sent
(docs/select.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from eagle3nb.accept.params import AcceptParams
from eagle3nb.drafts import DEFAULT, PACKAGES
from eagle3nb.params import ParamsError, TargetParams, register
from eagle3nb.paths import resolve
from eagle3nb.select.candidates import check_all

STAGE = "06_select"


class Candidate(BaseModel):
    """One recipe of the user's list: its name, method and the k it is served at, plus any 03 setting (the keys 03's
    schema knows); ``draft`` judges a draft already trained instead of training one."""

    model_config = ConfigDict(extra="allow")
    name: str = Field(description="its name in tables and figures")
    method: str = Field(DEFAULT, description="the draft algorithm (eagle3nb.drafts)")
    num_speculative_tokens: int = Field(ge=1, le=16, description="the k it is served at (vLLM's "
                                                                 "num_speculative_tokens)")
    draft: str | None = Field(None, description="an existing draft folder judged as it is (no training); null = "
                                                "trained by 03 on the run's data")

    @field_validator("method")
    @classmethod
    def _known(cls, v: str) -> str:
        if v not in PACKAGES:
            raise ValueError(f"unknown method {v!r}: use one of {', '.join(PACKAGES)}")
        return v

    @property
    def settings(self) -> dict[str, Any]:
        """Its own 03 settings (everything but name and draft)."""
        return {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens,
                **(self.model_extra or {})}


@register(STAGE)
class SelectParams(TargetParams):
    """Parameters of ``notebooks/06_select.ipynb`` (docs/select.md)."""

    model_path: str = Field("toy:demo", description="the target in Hugging Face layout, or toy:smoke / toy:demo")
    synth_dir: str | None = Field(None, description="01_synth's samples every candidate trains on; default "
                                                    "outputs/<run_name>/01_synth")
    candidates: list[Candidate] | None = Field(None, description="the recipes to try, each {name, method, "
                                                                 "num_speculative_tokens, any 03 setting} (or a "
                                                                 "draft: folder to judge as it is); null = every "
                                                                 "registered method's own recipes (its rules' "
                                                                 "recipes)")
    method_settings: dict[str, dict[str, Any]] = Field({}, description="03 settings per method, given to each "
                                                                       "candidate of it (an MLA target's EAGLE-3 "
                                                                       "drafts: {<method>: {draft_attention: mla}})")
    train: dict[str, Any] = Field({}, description="03 settings every candidate's training gets (lr, batch_tokens, "
                                                  "max_length, ...); a candidate's own win")
    hidden: dict[str, Any] = Field({}, description="02 settings of the extractions (max_length, storage, "
                                                   "draft_vocab_size of the drafts with a reduced vocabulary, ...)")
    steps: int = Field(300, ge=1, description="03's optimizer steps per candidate training (its max_steps)")
    budget_minutes: float | None = Field(None, gt=0, description="wall-time budget for training: once spent, no "
                                                                 "further candidate is trained (the report lists "
                                                                 "them); null = none")
    engine: Literal["vllm", "embedded"] = Field("embedded", description="where each candidate is served: vllm (the "
                                                                        "real vLLM, its CPU build here) or embedded "
                                                                        "(eagle3nb serve, for a machine without "
                                                                        "vLLM)")
    concurrencies: list[int] = Field(list(AcceptParams.model_fields["concurrency_levels"].default),
                                     description="concurrent requests each candidate and the plain server are "
                                                 "measured at; in a run folder, 04's concurrency_levels")
    weights: list[float] | None = Field(None, description="each concurrency's weight in the user's load (the pick's "
                                                          "weighted mean speedup); null = equal, or the traffic "
                                                          "log's")
    traffic: str | None = Field(None, description="a request log with arrival times (a gateway's JSONL log with "
                                                  "timestamps, or vLLM's request log): its arrival rate gives the "
                                                  "weights by Little's law; null = weights (or equal)")
    window_s: float = Field(60.0, gt=0, description="traffic: seconds per window of the arrival rate")
    prompts: str = Field("toy:heldout", description="prompt set sent to every server (JSONL / parquet / datasets "
                                                    "folder, or toy:heldout)")
    num_prompts: int = Field(32, ge=1, description="requests per concurrency level")
    tau_requests: int = Field(16, ge=1, description="requests sent one at a time to each candidate for the "
                                                    "per-request acceptance length (the counters read around each)")
    max_tokens: int = Field(64, ge=1, description="tokens generated per request")
    temperature: float = Field(0.0, ge=0.0, description="sampling temperature served")
    thinking: bool = Field(True, description="chat-template thinking switch for the prompts (as served)")
    thinking_kwarg: str = Field("auto", description="chat-template kwarg for thinking; auto = the family's")
    output_dir: str | None = Field(None, description="default outputs/<run_name>/06_select")

    @field_validator("concurrencies")
    @classmethod
    def _levels(cls, v: list[int]) -> list[int]:
        if not v or any(c < 1 for c in v) or len(set(v)) != len(v):
            raise ValueError("give at least one concurrency, each >= 1 and each once")
        return sorted(v)

    @field_validator("method_settings")
    @classmethod
    def _methods(cls, v: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        unknown = sorted(set(v) - set(PACKAGES))
        if unknown:
            raise ValueError(f"method_settings names {', '.join(unknown)}: use registered methods "
                             f"({', '.join(PACKAGES)})")
        return v

    @model_validator(mode="after")
    def _load(self) -> "SelectParams":
        if self.weights is not None and (len(self.weights) != len(self.concurrencies) or sum(self.weights) <= 0
                                         or any(w < 0 for w in self.weights)):
            raise ValueError(f"weights {self.weights}: give one weight >= 0 per concurrency {self.concurrencies}, "
                             "not all 0")
        if self.weights is not None and self.traffic:
            raise ValueError("give weights or traffic (whose arrival rate makes the weights), not both")
        if self.candidates is not None:
            names = [c.name for c in self.candidates]
            if not names or len(set(names)) != len(names):
                raise ValueError(f"candidates {names}: give at least one, each name once")
        try:  # every candidate's 03 settings, as 03 itself would refuse them, before any work
            check_all(self.candidates, self.train, self.method_settings, self.hidden, self.params_file or STAGE)
        except ParamsError as e:
            raise ValueError(str(e)) from None
        return self

    @property
    def synth_path(self) -> Path:
        return self.out_dir(self.synth_dir, "01_synth")

    def check_paths(self) -> None:
        src = self.params_file or "the notebook's parameters cell"
        trained = self.candidates is None or any(c.draft is None for c in self.candidates)
        if trained and not any(self.synth_path.glob("samples-*.jsonl")):
            raise ParamsError(f"parameter 'synth_dir' in {src}: {self.synth_path} holds no 01 samples "
                              "(samples-*.jsonl): run 01_synth first or point synth_dir at its folder")
        for c in self.candidates or []:
            if c.draft and not (resolve(c.draft) / "config.json").exists():
                raise ParamsError(f"candidate {c.name!r} in {src}: its draft {resolve(c.draft)} has no config.json; "
                                  "point draft at a draft folder (03_train's draft/) or leave it out to train one")
        if self.traffic and not resolve(self.traffic).exists():
            raise ParamsError(f"parameter 'traffic' in {src}: {resolve(self.traffic)} does not exist; point it at a "
                              "request log with arrival times, or set weights")
