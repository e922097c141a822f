"""The 01_synth parameters: the story's flags plus what a careful run needs. Defaults = the embedded demo."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from eagle3nb.data.prompts import NAMED_SETS, PromptsError, named_set
from eagle3nb.params import ParamsError, TargetParams, register
from eagle3nb.paths import resolve
from eagle3nb.toy.build import SIZES

STAGE = "01_synth"

# Settings that change the generated data: changing one against an existing output_dir is refused.
DATA_KEYS = ("model_path", "served_model_name", "prompts", "thinking", "thinking_kwarg", "temperature",
             "top_p", "max_completion_tokens", "seed")


@register(STAGE)
class SynthParams(TargetParams):
    """Parameters of ``notebooks/01_synth.ipynb`` (see docs/ARCHITECTURE.md "01_synth output")."""

    model_path: str = Field("toy:demo", description="target model folder (tokenizer + chat template), or toy:smoke / "
                                                    "toy:demo")
    output_dir: str | None = Field(None, description="where samples go; default outputs/<run_name>/01_synth")
    prompts: str = Field("toy:train", description="JSONL / JSON / parquet file or HF datasets folder of prompts, a "
                                                  "public set (mt-bench, humaneval, sharegpt), or toy:train / "
                                                  "toy:heldout")
    max_samples: int | None = Field(300, ge=1, description="number of prompts to answer (the first ones); null = all")
    multi_turn: Literal["last", "every"] = Field(
        "last", description="last: answer each conversation's last user turn after the dataset's history; every: "
                            "answer every turn, each after the target's own earlier answers (one sample per turn)")
    max_completion_tokens: int = Field(256, ge=1, description="token budget per answer, reasoning included")
    concurrency: int = Field(16, ge=1, description="requests in flight at all times while work remains")
    vllm_url: str | list[str] = Field("embedded", description="server URL (http://host:8000, /v1 added when missing), "
                                                              "a list served round-robin, or 'embedded'")
    temperature: float = Field(0.7, ge=0.0, description="sampling temperature")
    top_p: float = Field(0.95, gt=0.0, le=1.0, description="nucleus sampling cutoff")
    thinking: bool = Field(True, description="ask for reasoning (sent as chat_template_kwargs: the family's switch, "
                                             "or thinking_kwarg)")
    thinking_kwarg: str = Field("auto", description="chat-template kwarg that switches thinking; auto = the family's "
                                                    "(Kimi 'thinking', Qwen3 'enable_thinking', docs/families.md)")
    return_token_ids: bool = Field(True, description="ask the server for the exact token ids (vLLM/SGLang); false = "
                                                     "re-render through the chat template")
    seed: int = Field(0, description="base sampling seed; each prompt gets its own seed derived from its id")
    max_retries: int = Field(6, ge=0, description="retries per request on 429 / 5xx / timeouts / dropped connections")
    retry_backoff_s: float = Field(1.0, gt=0, description="first retry delay in seconds; doubles per retry (with "
                                                          "jitter, capped at 60 s)")
    request_timeout_s: float = Field(600.0, gt=0, description="seconds before one request counts as timed out (then "
                                                              "retried)")
    api_key_env: str | None = Field(None, description="NAME of the environment variable holding the API key (never the "
                                                      "key itself)")
    served_model_name: str | None = Field(None, description="model name the server serves; null = ask /v1/models")
    retry_errors: bool = Field(True, description="on resume, request again the ids whose last record is error or "
                                                 "no_reasoning")
    force: bool = Field(False, description="allow data-changing settings against an existing output_dir (mixes data)")

    @field_validator("vllm_url")
    @classmethod
    def _urls(cls, v: str | list[str]) -> str | list[str]:
        urls = [v] if isinstance(v, str) else v
        if not urls:
            raise ValueError("give at least one URL, or 'embedded'")
        for u in urls:
            if u != "embedded" and not u.startswith(("http://", "https://")):
                raise ValueError(f"{u!r} is not a URL: use http://host:port, a list of them, or 'embedded'")
        if isinstance(v, list) and "embedded" in v and len(v) > 1:
            raise ValueError("'embedded' cannot be mixed with other URLs")
        return v

    @property
    def urls(self) -> list[str]:
        return [self.vllm_url] if isinstance(self.vllm_url, str) else list(self.vllm_url)

    def data_config(self) -> dict:
        """The data-affecting settings, as stored in run_config.json."""
        values = {k: getattr(self, k) for k in DATA_KEYS}
        values["thinking_kwarg"] = self.target_family.thinking_kwarg(self.thinking_kwarg)  # auto, resolved
        if self.multi_turn != "last":  # recorded only when set, so earlier runs' configs stay equal
            values["multi_turn"] = self.multi_turn
        return values

    def check_paths(self) -> None:
        src = self.params_file or "the notebook's parameters cell"
        if self.model_path.startswith("toy:") and self.model_path[4:] not in SIZES:
            raise ParamsError(f"parameter 'model_path' in {src}: unknown toy model {self.model_path!r}; use "
                              f"{' or '.join('toy:' + k for k in SIZES)}, or a Hugging Face model folder")
        if self.prompts.startswith("toy:") and self.prompts not in ("toy:train", "toy:heldout"):
            raise ParamsError(f"parameter 'prompts' in {src}: unknown toy prompt set {self.prompts!r}; use "
                              f"toy:train or toy:heldout, or a JSONL / parquet file")
        if not self.model_path.startswith("toy:") and not resolve(self.model_path).is_dir():
            raise ParamsError(f"parameter 'model_path' in {src}: folder {resolve(self.model_path)} does not exist; "
                              f"point it at the target's Hugging Face folder (tokenizer + chat template) or use "
                              f"toy:demo")
        if not self.prompts.strip():
            raise ParamsError(f"parameter 'prompts' in {src} is empty; set it to a JSONL / JSON / parquet file, a "
                              f"datasets folder, or toy:train")
        if self.prompts in NAMED_SETS:
            try:
                named_set(self.prompts)
            except PromptsError as e:
                raise ParamsError(f"parameter 'prompts' in {src}: {e}") from None
        elif not self.prompts.startswith("toy:") and not resolve(self.prompts).exists():
            raise ParamsError(f"parameter 'prompts' in {src}: {resolve(self.prompts)} does not exist; point it at a "
                              f"JSONL / parquet file or a datasets folder, or use toy:train")
        if self.vllm_url == "embedded" and not self.model_path.startswith("toy:") \
                and not (resolve(self.model_path) / "config.json").exists():
            raise ParamsError(f"parameter 'vllm_url' in {src} is 'embedded' but {resolve(self.model_path)} has no "
                              f"config.json to serve; give the URL of your vLLM/SGLang server instead")
