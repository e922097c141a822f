"""The model-family registry: each family told from its config.json and chat template (the toys as kimi), the
``family`` override, the vLLM CPU dtype rule and launcher flags per family, the doctor refusing a target vLLM
cannot serve a draft for, and a non-Kimi family's markers used end to end in 01's token stream."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from eagle3nb import families
from eagle3nb.families import FAMILIES, FamilyError, detect, vllm_cpu_dtype
from eagle3nb.params import ParamsError, from_dict

from worlds import requires_vllm

# Each family's identifying chat-template text (a fragment of the public template) and config.json.
TEMPLATES = {
    "kimi": ("kimi_k2", "<|im_user|>user<|im_middle|>{{ m }}<|im_end|><|im_assistant|>assistant<|im_middle|>"),
    "deepseek_r1": ("deepseek_v3", "{{ bos_token }}<｜User｜>{{ m }}<｜Assistant｜><think>\n"),
    "deepseek_v3": ("deepseek_v3",
                    "<｜User｜>{{ m }}<｜Assistant｜>{% if thinking %}<think>{% else %}</think>{% endif %}"),
    "qwen3": ("qwen3_moe", "<|im_start|>user\n{{ m }}<|im_end|>\n<|im_start|>assistant\n{% if enable_thinking is "
                           "defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"),
    "glm45": ("glm4_moe", "[gMASK]<sop><|user|>\n{{ m }}<|assistant|>{% if not enable_thinking %}/nothink{% endif %}"),
    "gpt_oss": ("gpt_oss", "<|start|>user<|message|>{{ m }}<|end|><|start|>assistant<|channel|>analysis<|message|>"),
    "llama": ("llama", "<|start_header_id|>user<|end_header_id|>\n\n{{ m }}<|eot_id|>"),
}


def model_folder(path: Path, model_type: str, template: str | None = None, where: str = "config",
                 **config) -> Path:
    """A tiny target folder: config.json and the chat template in tokenizer_config.json (or chat_template.jinja)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model_type": model_type, **config}))
    if template is not None and where == "config":
        (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    elif template is not None:
        (path / "chat_template.jinja").write_text(template)
    return path


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_each_family_is_told_from_its_config_and_template(tmp_path, name):
    model_type, template = TEMPLATES[name]
    assert detect(model_folder(tmp_path / "a", model_type, template)).name == name
    assert detect(model_folder(tmp_path / "b", model_type, template, where="jinja")).name == name


def test_model_type_alone_decides_when_one_family_covers_it(tmp_path):
    assert detect(model_folder(tmp_path / "q", "qwen3")).name == "qwen3"
    assert detect(model_folder(tmp_path / "g", "gpt_oss")).name == "gpt_oss"
    # a multimodal wrapper names its text model in text_config
    wrapped = model_folder(tmp_path / "w", "kimi_vl_wrapper", text_config={"model_type": "glm4_moe"})
    assert detect(wrapped).name == "glm45"
    # deepseek_v3 is Kimi's and DeepSeek's: without a template the folder cannot be told
    with pytest.raises(FamilyError, match="set the family parameter"):
        detect(model_folder(tmp_path / "d", "deepseek_v3"))
    # Kimi's template markers decide against DeepSeek's model_type
    kimi = model_folder(tmp_path / "k", "deepseek_v3", TEMPLATES["kimi"][1])
    assert detect(kimi).name == "kimi"


def test_the_toys_detect_as_kimi(toy_smoke):
    from eagle3nb.toy import resolve_model_path

    assert json.loads((toy_smoke / "config.json").read_text())["model_type"] == "llama"  # Llama with Kimi's format
    assert detect(toy_smoke).name == "kimi"
    assert detect(resolve_model_path("toy:demo")).name == "kimi"


def test_family_parameter_overrides_detection(toy_smoke, tmp_path):
    P = from_dict("01_synth", {"model_path": str(toy_smoke), "output_dir": str(tmp_path)})
    assert P.family == "auto" and P.target_family.name == "kimi"
    P = from_dict("01_synth", {"model_path": str(toy_smoke), "output_dir": str(tmp_path), "family": "qwen3"})
    assert P.target_family.name == "qwen3"
    assert P.data_config()["thinking_kwarg"] == "enable_thinking"  # auto, resolved through the chosen family
    for stage in ("02_hidden_states", "04_acceptance"):
        assert "family" in type(from_dict(stage, {}, check_paths=False)).model_fields
    with pytest.raises(ParamsError, match="unknown model family 'qwen4'"):
        from_dict("01_synth", {"model_path": str(toy_smoke), "family": "qwen4"})


def test_thinking_switch_auto_and_explicit():
    kimi, qwen, gpt, llama, r1 = (FAMILIES[n] for n in ("kimi", "qwen3", "gpt_oss", "llama", "deepseek_r1"))
    assert kimi.template_kwargs(True) == {"thinking": True} and kimi.template_kwargs(False) == {"thinking": False}
    assert qwen.template_kwargs(False) == {"enable_thinking": False}
    assert gpt.template_kwargs(True) == {"reasoning_effort": "medium"} and gpt.template_kwargs(False) == {}
    assert llama.template_kwargs(True) == {} == r1.template_kwargs(True)
    assert qwen.template_kwargs(True, "my_switch") == {"my_switch": True}  # an explicit kwarg still works
    assert qwen.thinking_kwarg() == "enable_thinking" and llama.thinking_kwarg() is None


def test_vllm_cpu_dtype_rule(monkeypatch):
    mla = {"model_type": "deepseek_v3", "kv_lora_rank": 512}
    assert vllm_cpu_dtype(mla, {"avx512f", "amx_bf16", "amx_tile"}) == "bfloat16"
    assert vllm_cpu_dtype(mla, {"avx512f"}) == "float32"
    assert vllm_cpu_dtype({"text_config": {"kv_lora_rank": 512}}, {"amx_bf16", "amx_tile"}) == "bfloat16"
    assert vllm_cpu_dtype({"model_type": "llama"}, {"amx_bf16", "amx_tile"}) == "float32"
    # without given flags it reads this machine's /proc/cpuinfo
    monkeypatch.setattr(families, "cpu_flags", lambda: {"amx_bf16", "amx_tile"})
    assert vllm_cpu_dtype(mla) == "bfloat16"
    monkeypatch.setattr(families, "cpu_flags", lambda: set())
    assert vllm_cpu_dtype(mla) == "float32"


@pytest.mark.parametrize("name,parser", [("kimi", "kimi_k2"), ("qwen3", "qwen3"), ("deepseek_r1", "deepseek_r1"),
                                         ("gpt_oss", "openai_gptoss"), ("glm45", "glm45"), ("llama", None)])
def test_vllm_args_take_the_family_parser_and_dtype(tmp_path, name, parser):
    from eagle3nb.errors import InputError
    from eagle3nb.serve.vllm import vllm_args

    model_type, template = TEMPLATES[name]
    mla = {"kv_lora_rank": 512} if FAMILIES[name].mla else {}
    d = model_folder(tmp_path, model_type, template, **mla)
    args = vllm_args(d, "plain", cpu_flags={"amx_bf16", "amx_tile"})
    flag = args[args.index("--reasoning-parser") + 1] if "--reasoning-parser" in args else None
    assert flag == parser
    assert args[args.index("--dtype") + 1] == ("bfloat16" if mla else "float32")
    assert vllm_args(d, "plain", cpu_flags=set())[args.index("--dtype") + 1] == "float32"
    assert "--reasoning-parser" not in vllm_args(d, "no_parser")
    tools = vllm_args(d, "plain", cpu_flags=set(), tools=True)
    assert tools[tools.index("--tool-call-parser") + 1] == FAMILIES[name].vllm_tool_parser
    assert "--enable-auto-tool-choice" in tools and "--tool-call-parser" not in args
    if name == "glm45":  # vLLM 0.32's Glm4Moe class has no EAGLE-3 interface
        with pytest.raises(InputError, match="SGLang"):
            vllm_args(d, "eagle3", draft_dir=tmp_path)


def test_doctor_refuses_glm_on_vllm_naming_sglang(tmp_path):
    from eagle3nb.doctor import FAIL, PASS
    from eagle3nb.doctor.checks.server import check_family
    from eagle3nb.doctor.context import Context

    glm = model_folder(tmp_path / "glm", *TEMPLATES["glm45"])
    P = from_dict("02_hidden_states", {"model_path": str(glm)}, check_paths=False)
    r = check_family(Context({"02_hidden_states": P}, {}, serving_engine="vllm"))
    assert r.status == FAIL and "vLLM cannot serve an EAGLE-3 draft for the glm45 family" in r.measured, r
    assert "SGLang" in r.fix and "--serving-engine sglang" in r.fix
    assert "vLLM does not serve its EAGLE-3 drafts" in r.measured and "vLLM serves" not in r.measured, r
    assert check_family(Context({"02_hidden_states": P}, {}, serving_engine="sglang")).status == PASS
    qwen = model_folder(tmp_path / "qwen", *TEMPLATES["qwen3"])
    P = from_dict("02_hidden_states", {"model_path": str(qwen)}, check_paths=False)
    r = check_family(Context({"02_hidden_states": P}, {}, serving_engine="vllm"))
    assert r.status == PASS and "family qwen3" in r.measured and "vLLM serves its EAGLE-3 drafts" in r.measured, r


QWEN_STYLE = ("{%- for m in messages -%}<|im_start|>{{ m['role'] }}\n"
              "{%- if m['role'] == 'assistant' -%}"
              "{%- if m.get('reasoning_content') -%}<think>{{ m['reasoning_content'] }}</think>{%- endif -%}"
              "{{ m['content'] }}<|im_end|>{%- else -%}{{ m['content'] }}<|im_end|>{%- endif -%}{%- endfor -%}"
              "{%- if add_generation_prompt -%}<|im_start|>assistant\n"
              "{%- if enable_thinking is defined and not enable_thinking -%}<think></think>{%- endif -%}"
              "{%- endif -%}")
LLAMA_STYLE = ("{%- for m in messages -%}<|start_header_id|>{{ m['role'] }}<|end_header_id|>{{ m['content'] }}"
               "<|im_end|>{%- endfor -%}{%- if add_generation_prompt -%}<|start_header_id|>assistant<|end_header_id|>"
               "{%- endif -%}")


def retemplated(toy: Path, dest: Path, model_type: str, template: str) -> Path:
    """The toy's tokenizer (it has <think>, </think>, <|im_end|> as single tokens) under another family's
    template and model_type."""
    dest.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(toy / f, dest / f)
    (dest / "chat_template.jinja").write_text(template)
    (dest / "config.json").write_text(json.dumps({"model_type": model_type}))
    return dest


def test_a_non_kimi_family_markers_and_switch_reach_the_stream(toy_smoke, tmp_path):
    from eagle3nb.data.stream import Template, build
    from eagle3nb.synth.session import token_counts

    qwen = Template(retemplated(toy_smoke, tmp_path / "qwen", "qwen3", QWEN_STYLE), thinking=True)
    assert qwen.family.name == "qwen3" and qwen.kwargs == {"enable_thinking": True}
    assert qwen.end_text == "<|im_end|>"
    messages = [{"role": "user", "content": "what is 2 + 2"}]
    s = build(qwen, messages, "two and two", "4", "stop", None, None)
    completion = [t for t, m in zip(s["input_ids"], s["loss_mask"]) if m]
    start, end = qwen.think_ids
    assert completion[0] == start and end in completion and completion[-1] == qwen.end_id
    counts = token_counts(qwen, s["input_ids"], s["loss_mask"])
    assert counts["reasoning"] >= 3 and counts["content"] >= 2
    off = Template(tmp_path / "qwen", thinking=False)
    assert off.kwargs == {"enable_thinking": False} and off.render(messages, True).endswith("<think></think>")

    # a family without reasoning: no think markers, so every generated token is answer
    llama = Template(retemplated(toy_smoke, tmp_path / "llama", "llama", LLAMA_STYLE), thinking=True)
    assert llama.family.name == "llama" and llama.kwargs == {} and llama.think_ids == (None, None)
    s = build(llama, messages, None, "4", "stop", None, None)
    counts = token_counts(llama, s["input_ids"], s["loss_mask"])
    assert counts["reasoning"] == 0 and counts["content"] == sum(s["loss_mask"])


def test_inline_reasoning_is_split_at_the_family_markers():
    from eagle3nb.data.reasoning import extract

    msg = {"content": "<think>two and two</think>4"}
    assert extract(msg, FAMILIES["qwen3"].think_tags) == ("two and two", "4", "inline")
    assert extract(msg) == ("two and two", "4", "inline")  # no family given: any registered family's tags
    assert extract(msg, ("<reason>", "</reason>")) == (None, msg["content"], "none")


@requires_vllm()
def test_every_family_parser_is_one_the_installed_vllm_registers():
    """The reasoning and tool-call parser names the registry hands vLLM are keys of vLLM's own registries (read
    from its source, so no vLLM import): a renamed parser fails here, not a minute into a server start."""
    import re

    from eagle3nb.serve.vllm import vllm_python

    site = next(Path(vllm_python()).parent.parent.glob("lib/python*/site-packages/vllm"))
    registered = {kind: set(re.findall(r'^\s*"([a-z0-9_]+)": \(', (site / kind / "__init__.py").read_text(), re.M))
                  for kind in ("reasoning", "tool_parsers")}
    for f in FAMILIES.values():
        assert f.vllm_parser is None or f.vllm_parser in registered["reasoning"], (f.name, f.vllm_parser)
        assert f.vllm_tool_parser in registered["tool_parsers"], (f.name, f.vllm_tool_parser)
