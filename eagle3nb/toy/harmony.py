"""The Harmony chat format (gpt-oss's), as a chat template written from its public description, for the
``toy:gptoss`` folder (the gpt-oss tokenizer package ships none).

A turn is ``<|start|>{role}<|message|>{text}<|end|>``; the assistant's carry a channel,
``<|start|>assistant<|channel|>analysis<|message|>`` for the reasoning and ``...<|channel|>final<|message|>`` for
the answer, and the answer that closes a conversation ends ``<|return|>``. The system message is the one vLLM's
gpt-oss chat path renders through openai_harmony (``SystemContent.new()``: identity, knowledge cutoff, today's
date, ``Reasoning: {reasoning_effort}``, the valid channels), a leading system/developer message becomes the
developer message's instructions, and earlier assistant turns keep their final answer only (Harmony drops the
reasoning of answered turns). tests/test_family_gptoss.py holds the rendering equal, token for token, to vLLM's.
"""

from __future__ import annotations

SYSTEM = ("You are ChatGPT, a large language model trained by OpenAI.\nKnowledge cutoff: 2024-06\nCurrent date: ")
CHANNELS = "# Valid channels: analysis, commentary, final. Channel must be included for every message."

TEMPLATE = (
    "{%- set effort = reasoning_effort if reasoning_effort is defined and reasoning_effort else 'medium' -%}"
    "<|start|>system<|message|>" + SYSTEM.replace("\n", "{{ '\\n' }}") + "{{ strftime_now('%Y-%m-%d') }}"
    "{{ '\\n\\n' }}Reasoning: {{ effort }}{{ '\\n\\n' }}" + CHANNELS + "<|end|>"
    "{%- set rest = messages -%}"
    "{%- if messages and messages[0].role in ('system', 'developer') -%}"
    "<|start|>developer<|message|># Instructions{{ '\\n\\n' }}{{ messages[0].content }}<|end|>"
    "{%- set rest = messages[1:] -%}"
    "{%- endif -%}"
    "{%- for m in rest -%}"
    "{%- if m.role == 'user' -%}"
    "<|start|>user<|message|>{{ m.content }}<|end|>"
    "{%- elif m.role == 'assistant' -%}"
    "{%- if loop.last and not add_generation_prompt -%}"
    "{%- set r = m.reasoning_content or m.reasoning or m.thinking -%}"
    "{%- if r -%}<|start|>assistant<|channel|>analysis<|message|>{{ r }}<|end|>{%- endif -%}"
    "<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|return|>"
    "{%- else -%}"
    "<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>"
    "{%- endif -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}"
)
