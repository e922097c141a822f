"""The request bodies of the OpenAI-compatible routes (``eagle3nb.serve.app``): what a chat or a text completion
request may carry, validated by pydantic before the engine sees it (a malformed body is a 400 there)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class Body(BaseModel):
    """What a chat and a text completion request share: the model, sampling, streaming, token ids."""

    model_config = ConfigDict(extra="allow")  # unknown fields are ignored, as vLLM does
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = None
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    return_token_ids: bool = False


class ChatBody(Body):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None


class CompletionBody(Body):
    prompt: str | list[int] | list[str] | list[list[int]]
