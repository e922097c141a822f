"""The training token stream of one sample: prompt ids + the assistant's ids, and the loss mask over them.

Best source: the ids the server returns (``return_token_ids``): exactly what the model read and sampled.
Fallback: the chat template rendered over the conversation with the assistant turn (``reasoning_content``
+ ``content``), split at the generation prompt. When both exist they are compared; a mismatch means the
text round trip is lossy (template drops reasoning, non-canonical tokenization, stripped special tokens).
The story's bug was the third option: ``reasoning + content`` joined as plain text, think wrappers lost.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eagle3nb.data.turns import answer_message, template_messages
from eagle3nb.families import AUTO, Family, detect, specials
from eagle3nb.hf import RemoteCodeRequired, from_pretrained
from eagle3nb.params import StageError


class StreamError(StageError):
    """The token stream cannot be built faithfully; the message says what to change."""


class Template:
    """The target's tokenizer and chat template, with the run's template kwargs; the folder's own tokenizer
    code runs only with ``trust_remote_code``. The reasoning markers and the end-of-turn token are the target's
    family's (``family``: the run's ``P.target_family``; None = told from the folder); ``thinking_kwarg`` auto
    asks through the family's switch, any other name as ``{thinking_kwarg: thinking}``."""

    def __init__(self, model_dir: str | Path, thinking: bool, thinking_kwarg: str = AUTO,
                 trust_remote_code: bool = False, family: Family | None = None):
        from transformers import AutoTokenizer

        try:
            self.tokenizer = from_pretrained(AutoTokenizer, model_dir, trust_remote_code=trust_remote_code)
        except RemoteCodeRequired as e:
            raise StreamError(str(e)) from None
        except Exception as e:  # noqa: BLE001 - any loader failure means the same fix
            raise StreamError(f"cannot load the tokenizer from {model_dir} ({type(e).__name__}: {e}); point "
                              "model_path at the target's Hugging Face folder (tokenizer files + chat template)",
                              ) from None
        if not self.tokenizer.chat_template:
            raise StreamError(f"{model_dir} has no chat template (tokenizer_config.json 'chat_template' or "
                              f"chat_template.jinja); the training stream must use the target's own template")
        self.family = family or detect(model_dir)
        self.kwargs = self.family.template_kwargs(thinking, thinking_kwarg)
        self.thinking_kwarg = self.family.thinking_kwarg(thinking_kwarg)  # the resolved name, None: no switch
        sp = specials(self.family, self.tokenizer)
        self.specials = sp
        self.end_text, self.end_id = sp.end, sp.end_id
        self.think_ids = sp.think_ids

    def render(self, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None = None) -> str:
        """The conversation as the engine renders it (tool-call arguments as objects, ``template_messages``)."""
        more = {"tools": tools} if tools else {}
        return self.tokenizer.apply_chat_template(template_messages(messages), tokenize=False,
                                                  add_generation_prompt=add_generation_prompt, **self.kwargs, **more)

    def encode(self, text: str) -> list[int]:
        """Ids of already-rendered text, as an OpenAI server tokenizes a chat prompt (no extra BOS)."""
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        """Text with every special token visible (the think wrappers and turn markers)."""
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def prompt_ids(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        return self.encode(self.render(messages, add_generation_prompt=True, tools=tools))

    def completion_text(self, messages: list[dict], reasoning: str | None, content: str | None,
                        truncated: bool, tools: list[dict] | None = None, tool_calls: list[dict] | None = None) -> str:
        """The assistant's part of the rendered conversation: what follows the generation prompt, up to and
        including the end-of-turn token (dropped when the answer was truncated: it was never generated)."""
        prompt = self.render(messages, add_generation_prompt=True, tools=tools)
        turn = answer_message(reasoning, content, tool_calls)
        full = self.render([*messages, turn], add_generation_prompt=False, tools=tools)
        if not full.startswith(prompt):
            raise StreamError("the chat template renders the conversation differently from its generation prompt, "
                              "so the assistant's tokens cannot be located; the server must return token ids "
                              "(vLLM/SGLang `return_token_ids`)")
        text = full[len(prompt):]
        if reasoning and reasoning.strip() not in text:  # a template may strip it (GLM-4.5's, Qwen3's)
            raise StreamError("the chat template drops the assistant turn's reasoning_content, so re-rendering "
                              "would lose the reasoning (the story's bug); use a server that returns token ids "
                              "(vLLM `return_token_ids`) or a template that keeps reasoning_content")
        cut = text.rfind(self.end_text)
        if cut >= 0:
            text = text[: cut + (0 if truncated else len(self.end_text))]
        elif not truncated:
            # GLM-4.5: a turn ends at the next role token (<|user|>), which a conversation that ends on the
            # assistant never renders; the model sampled it all the same (build() keeps it in the server's ids)
            text += self.end_text
        return text


def build(tpl: Template | None, messages: list[dict], reasoning: str | None, content: str | None,
          finish_reason: str | None, prompt_ids: list[int] | None, completion_ids: list[int] | None,
          tools: list[dict] | None = None, tool_calls: list[dict] | None = None) -> dict[str, Any]:
    """``input_ids``, ``loss_mask``, ``token_source`` (server | template) and ``ids_match`` (bool, or None when
    only one source exists) for one answered prompt."""
    truncated = finish_reason == "length"
    server = None
    if prompt_ids is not None and completion_ids is not None:
        completion = list(completion_ids)
        # A stop at end-of-turn was sampled (after calls too): keep it in the stream even if a server left it out.
        if (finish_reason in ("stop", "tool_calls") and tpl is not None and tpl.end_id is not None
                and (not completion or completion[-1] != tpl.end_id)):
            completion.append(tpl.end_id)
        server = (list(prompt_ids), completion)
    template = None
    if tpl is not None:
        try:
            template = (tpl.prompt_ids(messages, tools),
                        tpl.encode(tpl.completion_text(messages, reasoning, content, truncated, tools, tool_calls)))
        except StreamError:
            if server is None:
                raise
    if server is None and template is None:
        raise StreamError("the server returned no token ids and no tokenizer is loaded; set model_path to the "
                          "target's folder so the conversation can be rendered through its chat template")
    prompt, completion = server or template
    return {
        "input_ids": prompt + completion,
        "loss_mask": [0] * len(prompt) + [1] * len(completion),
        "token_source": "server" if server else "template",
        "ids_match": (server == template) if server and template else None,
    }


def naive_text(reasoning: str | None, content: str | None) -> str:
    """The story's broken training text: reasoning and answer glued together without the think wrappers."""
    return (reasoning or "") + (content or "")
