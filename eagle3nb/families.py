"""Model families: what is true of one family of target models lives here, in its entry, and nowhere else.

A family's entry says how its reasoning is marked (``think_tags`` with a start and end marker, ``harmony``
channels, or ``none``), the chat-template switch that turns thinking on and off, the end-of-turn token, the
reasoning parser vLLM and SGLang run for it, and whether vLLM 0.32 serves an EAGLE-3 draft for it. The stages,
the doctor, the embedded server and the vLLM launcher read the target's entry (``detect(model_dir)``, or the
``family`` parameter of 01 / 02 / 04) instead of assuming one family's markers. The table for readers:
docs/families.md; the sources of each fact: the comments below and docs/DESIGN-FACTS.md "Model families".
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3nb import tokens as kimi
from eagle3nb.errors import InputError

AUTO = "auto"
VLLM_EAGLE3_RELEASE = "0.32"  # the vLLM release the entries' vllm_eagle3 and dtype facts were read from
REASONING_FORMATS = ("think_tags", "harmony", "none")
# config.json architectures of an MLA EAGLE-3 draft (vLLM's model_executor/models/deepseek_eagle3.py registers
# both; the first is what eagle3nb writes): the draft stock vLLM's CPU build serves beside an MLA target.
MLA_ARCHS = ("Eagle3DeepseekV2ForCausalLM", "Eagle3DeepseekV3ForCausalLM")
# gpt-oss's Harmony format (docs/harmony.md): a message is <|start|>{role}<|channel|>{channel}<|message|>{text}<|end|>
# (<|return|> ends the last answer)
HARMONY_START = "<|start|>"
HARMONY_CHANNEL = "<|channel|>"
HARMONY_MESSAGE = "<|message|>"
HARMONY_END = "<|end|>"
HARMONY_MARKERS = (HARMONY_START, HARMONY_CHANNEL, HARMONY_MESSAGE, HARMONY_END)


class FamilyError(InputError):
    """The target's family cannot be told, or a family name is unknown; the message names the ``family``
    parameter."""


@dataclass(frozen=True)
class Switch:
    """The chat-template kwarg that turns thinking on and off, and its two values (``off`` None: thinking
    cannot be switched off, the template's default is kept)."""

    kwarg: str
    on: Any = True
    off: Any = False


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]  # config.json model_type values it covers (text_config's too)
    reasoning: str  # one of REASONING_FORMATS
    think_start: str | None  # think_tags: the markers around the reasoning (single special tokens)
    think_end: str | None
    switch: Switch | None  # None: the template has no thinking switch
    end_of_turn: str | None  # the token that ends an assistant turn; None: the tokenizer's eos token
    vllm_parser: str | None  # vLLM --reasoning-parser (vllm/reasoning/__init__.py's registry)
    sglang_parser: str | None  # SGLang --reasoning-parser (python/sglang/srt/parser/reasoning_parser.py)
    vllm_eagle3: bool  # vLLM 0.32's model class implements SupportsEagle3 (serves an EAGLE-3 draft)
    sglang_eagle3: bool  # SGLang serves an EAGLE-3 draft for it
    mla: bool  # multi-head latent attention (config.json has kv_lora_rank)
    markers: tuple[str, ...] = ()  # chat-template strings that identify the family (all must be present)
    harmony_channels: tuple[str, str] | None = None  # harmony: (reasoning channel, answer channel)
    vllm_tool_parser: str | None = None  # vLLM --tool-call-parser (vllm/tool_parsers/__init__.py's registry)

    @property
    def think_tags(self) -> tuple[str, str] | None:
        """(start, end) around the reasoning when it is marked by single tokens, else None."""
        return (self.think_start, self.think_end) if self.think_start and self.think_end else None

    @property
    def text_markers(self) -> tuple[str, ...]:
        """The special tokens a generated text must keep for its reasoning to be split from its answer: the think
        tags, or Harmony's message markers."""
        return HARMONY_MARKERS if self.harmony_channels else self.think_tags or ()

    def template_kwargs(self, thinking: bool, kwarg: str = AUTO) -> dict[str, Any]:
        """The chat_template_kwargs asking for ``thinking``: an explicit ``kwarg`` (``thinking_kwarg`` parameter)
        as ``{kwarg: thinking}``; ``auto`` the family's switch ({} when it has none, or cannot turn it off)."""
        if kwarg != AUTO:
            return {kwarg: thinking}
        if self.switch is None:
            return {}
        value = self.switch.on if thinking else self.switch.off
        return {} if value is None else {self.switch.kwarg: value}

    def thinking_kwarg(self, kwarg: str = AUTO) -> str | None:
        """The template kwarg that switches thinking (an explicit one wins), None when there is none."""
        if kwarg != AUTO:
            return kwarg
        return self.switch.kwarg if self.switch else None

    def serves_eagle3(self, engine: str) -> bool:
        return {"vllm": self.vllm_eagle3, "sglang": self.sglang_eagle3}[engine]

    def parser_flag(self, engine: str = "vllm") -> str:
        """The server flag that splits this family's reasoning out, as a reader would type it."""
        parser = self.vllm_parser if engine == "vllm" else self.sglang_parser
        if self.reasoning == "none":
            return "no reasoning parser (the family does not reason)"
        return f"`--reasoning-parser {parser}`" if parser else "a reasoning parser for it (none is known)"


FAMILIES: dict[str, Family] = {f.name: f for f in (
    # Kimi-K2 / K2.5 (moonshotai/Kimi-K2.5 tokenizer_config.json and chat template; vLLM
    # vllm/reasoning/kimi_k2_reasoning_parser.py; its text model is DeepseekV3, vLLM's DeepseekV2ForCausalLM
    # implements SupportsEagle3). The toy targets copy its template on a Llama model, so markers decide.
    Family("kimi", ("kimi_k2", "kimi_k25", "deepseek_v3"), "think_tags", kimi.THINK_START, kimi.THINK_END,
           Switch("thinking"), kimi.IM_END, "kimi_k2", "kimi_k2", True, True, True,
           markers=(kimi.IM_ASSISTANT, kimi.IM_END), vllm_tool_parser="kimi_k2"),
    # DeepSeek-R1 (deepseek-ai/DeepSeek-R1 chat template: <｜Assistant｜>, always thinks, the generation
    # prompt opens <think>; vLLM deepseek_r1_reasoning_parser.py; SGLang deepseek-r1).
    Family("deepseek_r1", ("deepseek_v3",), "think_tags", "<think>", "</think>", None, "<｜end▁of▁sentence｜>",
           "deepseek_r1", "deepseek-r1", True, True, True, markers=("<｜Assistant｜>",),
           vllm_tool_parser="deepseek_v3"),
    # DeepSeek-V3.1 / V3.2 hybrid (its chat template reads `thinking`; vLLM deepseek_v3_reasoning_parser.py
    # delegates to the R1 parser when chat_template_kwargs thinking is true; SGLang deepseek-v3).
    Family("deepseek_v3", ("deepseek_v3",), "think_tags", "<think>", "</think>", Switch("thinking"),
           "<｜end▁of▁sentence｜>", "deepseek_v3", "deepseek-v3", True, True, True,
           markers=("<｜Assistant｜>", "thinking"), vllm_tool_parser="deepseek_v31"),
    # Qwen3 (Qwen/Qwen3-8B tokenizer_config.json: <|im_start|>/<|im_end|>, `enable_thinking`; vLLM
    # qwen3_engine_reasoning_parser.py; Qwen3ForCausalLM and Qwen3MoeForCausalLM implement SupportsEagle3).
    Family("qwen3", ("qwen3", "qwen3_moe"), "think_tags", "<think>", "</think>", Switch("enable_thinking"),
           "<|im_end|>", "qwen3", "qwen3", True, True, False, markers=("<|im_start|>", "<think>"),
           vllm_tool_parser="hermes"),
    # GLM-4.5 (zai-org/GLM-4.5 chat template: [gMASK]<sop>, <|assistant|>, `enable_thinking`, turns end at the
    # next role token, eos <|user|>; vLLM registers glm45 -> glm47_moe_reasoning_parser.py; vLLM 0.32's
    # Glm4MoeForCausalLM (glm4_moe.py) lacks SupportsEagle3, SGLang serves GLM drafts).
    Family("glm45", ("glm4_moe",), "think_tags", "<think>", "</think>", Switch("enable_thinking"), "<|user|>",
           "glm45", "glm45", False, True, False, markers=("[gMASK]",), vllm_tool_parser="glm45"),
    # gpt-oss (openai/gpt-oss-20b chat template, the Harmony format: <|channel|>analysis for the reasoning,
    # <|channel|>final for the answer, `reasoning_effort` low|medium|high, never off, turns end <|return|>;
    # vLLM gptoss_reasoning_parser.py; GptOssForCausalLM implements SupportsEagle3).
    Family("gpt_oss", ("gpt_oss",), "harmony", None, None, Switch("reasoning_effort", "medium", None),
           "<|return|>", "openai_gptoss", "gpt-oss", True, True, False, markers=("<|channel|>",),
           harmony_channels=("analysis", "final"), vllm_tool_parser="openai"),
    # Llama 3 (meta-llama/Llama-3.1-8B-Instruct chat template: <|start_header_id|>, <|eot_id|>): no reasoning.
    Family("llama", ("llama",), "none", None, None, None, "<|eot_id|>", None, None, True, True, False,
           markers=("<|start_header_id|>",), vllm_tool_parser="llama3_json"),
)}

# Template markers are tried in this order: the more specific first (DeepSeek-V3.1 before R1).
DETECT_ORDER = ("kimi", "deepseek_v3", "deepseek_r1", "gpt_oss", "glm45", "qwen3", "llama")


def names() -> list[str]:
    return list(FAMILIES)


def get(name: str) -> Family:
    if name not in FAMILIES:
        raise FamilyError(f"unknown model family {name!r}: set the family parameter to auto or one of "
                          f"{', '.join(FAMILIES)} (docs/families.md)")
    return FAMILIES[name]


def think_tag_pairs() -> list[tuple[str, str]]:
    """Every registered family's (start, end) think markers, once each."""
    return list(dict.fromkeys(f.think_tags for f in FAMILIES.values() if f.think_tags))


def read_config(model_dir: str | Path) -> dict:
    path = Path(model_dir) / "config.json"
    return json.loads(path.read_text()) if path.exists() else {}


def model_types(config: dict) -> list[str]:
    """config.json's model_type and its text_config's (a multimodal wrapper names the text model there)."""
    text = config.get("text_config") or {}
    return [t for t in (config.get("model_type"), text.get("model_type")) if t]


def is_mla(config: dict) -> bool:
    """Multi-head latent attention: the config (or its text_config) has ``kv_lora_rank``."""
    return bool(config.get("kv_lora_rank") or (config.get("text_config") or {}).get("kv_lora_rank"))


def chat_template(model_dir: str | Path) -> str:
    """The folder's chat template text: tokenizer_config.json's ``chat_template`` (a string or a list of named
    templates), chat_template.jinja, chat_template.json; "" when none."""
    d = Path(model_dir)
    parts: list[str] = []
    cfg_path = d / "tokenizer_config.json"
    if cfg_path.exists():
        tpl = json.loads(cfg_path.read_text()).get("chat_template")
        if isinstance(tpl, str):
            parts.append(tpl)
        elif isinstance(tpl, list):
            parts += [t.get("template", "") for t in tpl if isinstance(t, dict)]
    if (d / "chat_template.jinja").exists():
        parts.append((d / "chat_template.jinja").read_text())
    if (d / "chat_template.json").exists():
        parts.append(str(json.loads((d / "chat_template.json").read_text()).get("chat_template", "")))
    return "\n".join(parts)


def from_template(template: str) -> Family | None:
    """The family whose markers the chat template carries (None when no family's do)."""
    for name in DETECT_ORDER:
        f = FAMILIES[name]
        if f.markers and all(m in template for m in f.markers):
            return f
    return None


def detect(model_dir: str | Path, family: str = AUTO) -> Family:
    """The target's family: ``family`` when it names one; with ``auto``, the chat template's markers decide (the
    template is what the model reads: Kimi and DeepSeek share model_type deepseek_v3, the toys are Llama models
    with Kimi's template), else config.json's ``model_type`` (or text_config's) when one family alone covers it."""
    if family != AUTO:
        return get(family)
    found = from_template(chat_template(model_dir))
    if found is not None:
        return found
    types = model_types(read_config(model_dir))
    for t in types:
        covering = [f for f in FAMILIES.values() if t in f.model_types]
        if len(covering) == 1:
            return covering[0]
    said = f"model_type {'/'.join(types)}" if types else "no config.json model_type"
    raise FamilyError(f"{model_dir}: cannot tell the model family ({said}, and the chat template carries no known "
                      f"family's markers); set the family parameter to one of {', '.join(FAMILIES)} "
                      f"(docs/families.md)")


@dataclass(frozen=True)
class Specials:
    """A family's markers as one tokenizer has them: their texts and ids (None where the vocabulary lacks one)."""

    think_start: str | None
    think_end: str | None
    end: str | None
    think_ids: tuple[int | None, int | None]
    end_id: int | None
    # Harmony: the ids of <|start|>, <|channel|>, <|message|>, and of the reasoning channel's name; None otherwise
    harmony: tuple[int, int, int, tuple[int, ...]] | None = None

    def segments(self, input_ids: list[int], loss_mask: list[int]) -> list[int]:
        """Per-token segment (0 prompt, 1 reasoning, 2 answer) in the family's format: between the think tags, or
        by Harmony channel; all answer when the vocabulary lacks the markers."""
        if self.harmony:
            return harmony_segment_ids(input_ids, loss_mask, *self.harmony)
        start, stop = self.think_ids
        if start is None or stop is None:
            return [2 if m else 0 for m in loss_mask]
        return segment_ids(input_ids, loss_mask, start, stop)


def specials(family: Family, tokenizer: Any) -> Specials:
    """The think markers and end-of-turn token of ``family`` in ``tokenizer``'s vocabulary; the end of turn falls
    back to the tokenizer's eos token when the vocabulary lacks the family's."""
    vocab = tokenizer.get_vocab()
    start, stop = family.think_tags or (None, None)
    end = family.end_of_turn if family.end_of_turn in vocab else tokenizer.eos_token
    harmony = None
    if family.harmony_channels and all(m in vocab for m in HARMONY_MARKERS):
        channel = tuple(tokenizer.encode(family.harmony_channels[0], add_special_tokens=False))
        harmony = (vocab[HARMONY_START], vocab[HARMONY_CHANNEL], vocab[HARMONY_MESSAGE], channel)
    return Specials(start, stop, end, (vocab.get(start), vocab.get(stop)), vocab.get(end), harmony)


def of_tokenizer(tokenizer: Any) -> Family:
    """The family of a loaded tokenizer: from the folder it was loaded from, else from its chat template."""
    where = Path(str(getattr(tokenizer, "name_or_path", "") or ""))
    if where.is_dir():
        return detect(where)
    found = from_template(getattr(tokenizer, "chat_template", None) or "")
    if found is None:
        raise FamilyError(f"cannot tell the model family of the tokenizer {where}; pass the family "
                          f"({', '.join(FAMILIES)})")
    return found


def segment_ids(input_ids: list[int], loss_mask: list[int], think_start: int, think_end: int) -> list[int]:
    """Per-token segment of an assistant turn: 0 prompt (loss_mask 0), 1 reasoning (inside the family's think
    markers, the markers included), 2 answer (after the end marker). For reasoning-vs-answer breakdowns."""
    out: list[int] = []
    inside = False
    for tok, m in zip(input_ids, loss_mask):
        if not m:
            out.append(0)
            inside = False
            continue
        if tok == think_start:
            inside = True
            out.append(1)
        elif tok == think_end:
            inside = False
            out.append(1)
        else:
            out.append(1 if inside else 2)
    return out


def harmony_segment_ids(input_ids: list[int], loss_mask: list[int], start: int, channel: int, message: int,
                        reasoning: tuple[int, ...]) -> list[int]:
    """Per-token segment of a Harmony turn: 0 prompt (loss_mask 0), 1 the messages of the reasoning channel (their
    header and closing marker included), 2 the rest (the answer's). A message runs from one <|start|> (or the
    turn's first token) to the next; its channel is the ids between <|channel|> and <|message|>."""
    out = [0] * len(input_ids)
    i, n = 0, len(input_ids)
    while i < n:
        if not loss_mask[i]:
            i += 1
            continue
        j = i + 1  # the message: up to the next <|start|> or the end of the masked run
        while j < n and loss_mask[j] and input_ids[j] != start:
            j += 1
        head = input_ids[i:j]
        name = ()
        if channel in head:
            c = head.index(channel) + 1
            name = tuple(head[c:head.index(message)] if message in head[c:] else head[c:])
        seg = 1 if name == reasoning else 2
        out[i:j] = [seg] * (j - i)
        i = j
    return out


def harmony_split(text: str, channels: tuple[str, str]) -> tuple[str | None, str | None]:
    """(reasoning, content) of a Harmony turn's text (markers kept) as vLLM's openai_gptoss parser splits them:
    the reasoning channel's messages, and the answer channel's; None where there is none (yet)."""
    parts: dict[str, list[str]] = {channels[0]: [], channels[1]: []}
    for msg in text.split(HARMONY_START):
        head, sep, body = msg.partition(HARMONY_MESSAGE)
        name = head.partition(HARMONY_CHANNEL)[2].split(" ")[0] if sep else ""
        if name in parts:
            parts[name].append(body.split(HARMONY_END)[0])
    reasoning, content = ("".join(parts[c]) for c in channels)
    return reasoning or None, content or None


# -- serving on vLLM's CPU build ---------------------------------------------------------------------------------

def cpu_flags() -> set[str]:
    """The CPU's feature flags (``/proc/cpuinfo``'s flags line); empty where there is none."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def vllm_cpu_dtype(config: dict, flags: set[str] | None = None) -> str:
    """The ``--dtype`` vLLM's CPU build serves this target in, on this machine. Measured on vllm-cpu 0.32: an
    MLA model (``kv_lora_rank`` in config.json: DeepSeek-V3, Kimi-K2) runs on its CPU MLA kernel only in
    bfloat16 and only where the CPU has AMX (flags ``amx_bf16`` and ``amx_tile``); elsewhere it is served in
    float32. Every other model is served in float32 (the exact arithmetic the tests compare against)."""
    flags = cpu_flags() if flags is None else flags
    if is_mla(config) and {"amx_bf16", "amx_tile"} <= flags:
        return "bfloat16"
    return "float32"
