"""The toy's trainer: generated dialogues rendered in the tokenizer's chat format as padded batches, the training
loop (AdamW, warm-up then cosine; a real vocabulary trained over the rows the corpus uses), the held-out loss and
the greedy samples a build records. ``build.py`` holds the recipe it runs (sizes, architectures) and the build.

Light to import: torch loads only when a function runs.
"""

from __future__ import annotations

import math
import random
import time

from eagle3nb.errors import InputError
from eagle3nb.families import from_template
from eagle3nb.toy import dialogues

SAMPLE_TOKENS = 128  # length cap of the sample generations printed after a build


def template_family(tokenizer):
    """The tokenizer's family, told from its chat template's markers as the stages tell them."""
    family = from_template(tokenizer.chat_template or "")
    if family is None:
        raise InputError("toy build: the tokenizer's chat template carries no known family's markers")
    return family


def template_kwargs(tokenizer, thinking: bool) -> dict:
    """The chat-template kwargs asking for ``thinking`` in the tokenizer's family (the toy template's and Kimi's
    ``thinking``, Qwen3's ``enable_thinking``, gpt-oss's ``reasoning_effort``)."""
    return template_family(tokenizer).template_kwargs(thinking)


def render(tokenizer, d: dict) -> tuple[str, str]:
    """A finished dialogue's generation prompt and full text (the loss covers what the full text adds). A family
    whose reasoning cannot be switched off (gpt-oss: every effort reasons) reasons in every dialogue."""
    sw = template_family(tokenizer).switch
    thinking = d["thinking"] or (sw is not None and sw.off is None)
    kw = template_kwargs(tokenizer, thinking)
    prompt = tokenizer.apply_chat_template(d["messages"], tokenize=False, add_generation_prompt=True, **kw)
    reply = {"role": "assistant", "content": d["answer"], "reasoning_content": d["reasoning"] if thinking else ""}
    full = tokenizer.apply_chat_template(d["messages"] + [reply], tokenize=False, **kw)
    assert full.startswith(prompt), "toy chat template: the finished dialogue must extend its generation prompt"
    return prompt, full


def batches(tokenizer, rng: random.Random, n: int, batch: int, split: str) -> list:
    """``n`` padded batches (input_ids, labels with -100 outside the assistant reply) of fresh dialogues,
    grouped by length so little compute goes to padding, in a seeded random order."""
    import torch

    prompts, fulls = zip(*(render(tokenizer, dialogues.dialogue(rng, split)) for _ in range(n * batch)))
    enc = lambda texts: tokenizer(list(texts), add_special_tokens=False)["input_ids"]  # noqa: E731
    rows = [(ids, len(p)) for ids, p in zip(enc(fulls), enc(prompts))]
    window = 8 * batch  # sort within windows: batches stay mixed across categories
    rows = [r for w in range(0, len(rows), window) for r in sorted(rows[w : w + window], key=lambda r: len(r[0]))]
    out = []
    for b in range(n):
        chunk = rows[b * batch : (b + 1) * batch]
        T = max(len(ids) for ids, _ in chunk)
        x = torch.full((batch, T), tokenizer.pad_token_id, dtype=torch.long)
        y = torch.full((batch, T), -100, dtype=torch.long)
        for i, (ids, p) in enumerate(chunk):
            x[i, : len(ids)] = torch.tensor(ids)
            y[i, p - 1 : len(ids) - 1] = torch.tensor(ids[p:])
        out.append((x, y))
    rng.shuffle(out)
    return out


class CorpusRows:
    """Training over the vocabulary rows the corpus uses, for a real vocabulary (Qwen3's 151,936 rows): the lm_head
    over every row would cost most of each step. The embedding and lm_head rows of the ids the training batches
    hold are trained as their own parameters; every other lm_head row is zero (their logits 0), so the softmax
    over the used rows plus one logit log(#rest) for the rest is the full-vocabulary cross-entropy exactly,
    and greedy decoding never picks an untrained token. The other embedding rows stay at their init."""

    def __init__(self, model, data: list):
        import torch

        self.model = model
        self.ids = torch.unique(torch.cat([x.flatten() for x, _ in data]))
        self.local = torch.full((model.config.vocab_size,), -100, dtype=torch.long)
        self.local[self.ids] = torch.arange(len(self.ids))
        self.full_embed = model.get_input_embeddings().weight
        self.full_head = model.get_output_embeddings().weight
        self.embed = torch.nn.Parameter(self.full_embed.detach()[self.ids].clone())
        self.head = torch.nn.Parameter(self.full_head.detach()[self.ids].clone())
        self.rest = math.log(model.config.vocab_size - len(self.ids))
        self.full_embed.requires_grad_(False)
        self.full_head.requires_grad_(False)

    def parameters(self) -> list:
        return [self.embed, self.head] + [p for p in self.model.parameters() if p.requires_grad]

    def loss(self, x, y):
        import torch
        import torch.nn.functional as F

        h = self.model.get_decoder()(inputs_embeds=self.embed[self.local[x]]).last_hidden_state
        z = h @ self.head.T
        z = torch.cat([z, z.new_full((*z.shape[:-1], 1), self.rest)], -1)
        return F.cross_entropy(z.flatten(0, 1), self.local[y.clamp(min=0)].masked_fill(y == -100, -100).flatten())

    def write_back(self) -> None:
        """The trained rows into the model's full embedding and lm_head (the rest of lm_head zero)."""
        import torch

        with torch.no_grad():
            self.full_embed[self.ids] = self.embed
            self.full_head.zero_()
            self.full_head[self.ids] = self.head
        self.full_embed.requires_grad_(True)
        self.full_head.requires_grad_(True)


def heldout_loss(model, tokenizer, seed: int, n_batches: int = 4, per_sequence: bool = False) -> float:
    """Mean cross-entropy on held-out assistant tokens; ``per_sequence``: one sequence's logits at a time (a real
    vocabulary's logits of a whole batch would take gigabytes)."""
    import torch
    import torch.nn.functional as F

    rng = random.Random(f"heldout-loss:{seed}")
    total, count = 0.0, 0
    with torch.no_grad():
        for x, y in batches(tokenizer, rng, n_batches, 32, "heldout"):
            if per_sequence:
                h = model.get_decoder()(input_ids=x).last_hidden_state
                for hi, yi in zip(h, y):
                    total += F.cross_entropy(model.get_output_embeddings()(hi), yi, reduction="sum").item()
            else:
                logits = model(input_ids=x).logits
                total += F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum").item()
            count += int((y != -100).sum())
    return total / count


def generate(model, tokenizer, messages: list[dict], thinking: bool = True, max_new_tokens: int = 128) -> str:
    """Greedy completion text (special tokens kept) of one conversation."""
    import torch

    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False,
                                        **template_kwargs(tokenizer, thinking))
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0, len(ids):], skip_special_tokens=False)


def train(model, tokenizer, s: dict, size: str, seed: int, t0: float) -> float:
    """Train ``model`` on ``s["steps"]`` batches of fresh dialogues (AdamW, warm-up then cosine; a real vocabulary
    over the rows the corpus uses, ``CorpusRows``) and return its held-out loss; ``t0``: when the build started, for
    the progress lines."""
    import torch
    import torch.nn.functional as F

    rng = random.Random(f"train:{seed}")
    data = batches(tokenizer, rng, s["steps"], s["batch"], "train")
    rows = CorpusRows(model, data) if "tokenizer" in s else None
    params = rows.parameters() if rows else list(model.parameters())
    opt = torch.optim.AdamW(params, lr=s["lr"], weight_decay=0.01, betas=(0.9, 0.98))
    model.train()
    last = t0
    for step, (x, y) in enumerate(data):
        lr = s["lr"] * min(1.0, (step + 1) / s["warmup"]) * 0.5 * (1 + math.cos(math.pi * step / s["steps"]))
        for g in opt.param_groups:
            g["lr"] = lr
        loss = rows.loss(x, y) if rows else F.cross_entropy(model(input_ids=x).logits.flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if time.time() - last > 15 or step == s["steps"] - 1:
            last = time.time()
            print(f"toy {size}: step {step + 1}/{s['steps']} loss {loss.item():.3f} ({time.time() - t0:.0f}s)",
                  flush=True)
    if rows:
        rows.write_back()
    model.eval()
    return heldout_loss(model, tokenizer, seed, per_sequence=rows is not None)


def samples(model, tokenizer, seed: int) -> list[dict]:
    """Greedy answers to one held-out question per category with thinking on, and the first again with it off:
    what a build prints and records, to see the toy answer."""
    out = []
    rng = random.Random(f"samples:{seed}")
    for category in dialogues.CATEGORIES:
        p = next(p for p in iter(lambda: dialogues.problem(rng, "heldout"), None) if p["category"] == category)
        msgs = [{"role": "user", "content": p["question"]}]
        out.append({"question": p["question"], "expected": p["answer"], "thinking": True,
                    "output": generate(model, tokenizer, msgs, max_new_tokens=SAMPLE_TOKENS)})
    out.append({**out[0], "thinking": False,
                "output": generate(model, tokenizer, [{"role": "user", "content": out[0]["question"]}], False,
                                   SAMPLE_TOKENS)})
    return out
