"""One question asked with the run's settings, before a long run: where everything landed (the raw reasoning
and content fields, whether token ids came back, the training stream decoded with special tokens visible).
``landed`` reads one answer the way the doctor's server probes read theirs."""

from __future__ import annotations

from typing import Any

from eagle3nb.data.reasoning import REASONING_FIELDS, extract, field, no_reasoning_fix
from eagle3nb.data.stream import Template, build, naive_text
from eagle3nb.synth.client import Endpoint, FatalServerError, GaveUp, chat, connect, retried, run_sync
from eagle3nb.synth.params import SynthParams
from eagle3nb.synth.session import SynthError, server_urls


def landed(resp: Any, think_tags: Any) -> dict[str, Any]:
    """Where one chat answer landed: the reasoning and content as 01 stores them (``extract``, with ``source`` the
    field or think tags the reasoning came from), each raw reasoning field and the raw content, the finish reason
    and the token ids the server returned (None when it returned none)."""
    choice = resp.choices[0]
    reasoning, content, source = extract(choice.message, think_tags)
    return {"reasoning": reasoning, "content": content, "source": source,
            "fields": {f: field(choice.message, f) for f in REASONING_FIELDS},
            "raw_content": field(choice.message, "content"), "finish_reason": choice.finish_reason,
            "prompt_token_ids": field(resp, "prompt_token_ids"), "token_ids": field(choice, "token_ids")}


def ask(P: SynthParams, question: str = "What is 2+2?") -> dict[str, Any]:
    """Ask one question with the run's settings and show where everything landed: the raw reasoning and
    content fields, whether token ids came back, and the training stream decoded with special tokens
    visible. Catches a missing reasoning parser or a wrong template kwarg before a long run."""
    model_dir = P.model_dir
    tpl = Template(model_dir, P.thinking, P.thinking_kwarg, P.trust_remote_code, P.target_family)
    messages = [{"role": "user", "content": question}]

    async def request(urls: list[str]) -> tuple[Endpoint, Any]:
        retry = {"max_retries": P.max_retries, "backoff_s": P.retry_backoff_s}
        eps = await connect(urls, P.api_key(), P.request_timeout_s, P.served_model_name, 1, family=tpl.family, **retry)
        try:
            resp = await retried(lambda ep: chat(ep, messages, max_completion_tokens=P.max_completion_tokens,
                                                 temperature=P.temperature, top_p=P.top_p, seed=P.seed,
                                                 template_kwargs=tpl.kwargs,
                                                 return_token_ids=P.return_token_ids,
                                                 vocab_size=len(tpl.tokenizer)), eps[0], **retry)
        except (GaveUp, FatalServerError) as e:
            raise SynthError(f"the probe request failed: {e}") from None
        finally:
            await eps[0].client.close()
        return eps[0], resp

    with server_urls(P, model_dir) as urls:
        ep, resp = run_sync(lambda: request(urls))
    got = landed(resp, tpl.family.think_tags)
    reasoning, content = got["reasoning"], got["content"]
    stream = build(tpl, messages, reasoning, content, got["finish_reason"], got["prompt_token_ids"], got["token_ids"])
    n_prompt = stream["loss_mask"].count(0)
    problems = []
    if P.thinking and reasoning is None:
        problems.append(no_reasoning_fix(1, tpl.family, tpl.thinking_kwarg))
    if stream["token_source"] == "template":
        problems.append("the server returned no token ids (return_token_ids): the stream is re-rendered through "
                        "the chat template, which is exact only if the template keeps reasoning_content")
    if stream["ids_match"] is False:
        problems.append("the server's token ids differ from the template rendering of the same text: the server ids "
                        "are used (they are what the model produced)")
    return {
        "url": ep.url, "model": ep.model, "finish_reason": got["finish_reason"],
        "raw": {**got["fields"], "content": got["raw_content"]},
        "reasoning_from": got["source"], "token_source": stream["token_source"], "ids_match": stream["ids_match"],
        "prompt": tpl.decode(stream["input_ids"][:n_prompt]), "completion": tpl.decode(stream["input_ids"][n_prompt:]),
        "naive_concatenation": naive_text(reasoning, content), "problems": problems,
    }
