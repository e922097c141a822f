"""The toy tokenizer: a few hundred word/digit pieces, Kimi's special tokens, and a chat template of Kimi's shape.

Built with the ``tokenizers`` library and saved in the standard Hugging Face layout, so
``AutoTokenizer.from_pretrained(dir)`` loads it without remote code. Pieces: every word the dialogue generator
uses (bare and with a leading space), single letters, single digits, punctuation, whitespace, and 256 byte
tokens so that any text round-trips. Digits are always single tokens (as in Llama/Kimi) so arithmetic is
learnable column by column.
"""

from __future__ import annotations

import re

from eagle3nb.tokens import IM_END, SPECIAL_TOKENS

PAD = "[PAD]"
UNK = "[UNK]"
DEFAULT_SYSTEM = "You are Kimi, an AI assistant created by Moonshot AI."

# One pre-token per word (with its leading space), per digit, per punctuation mark, per whitespace char.
PRETOKEN_PATTERN = r" ?[A-Za-z]+| ?[0-9]| ?[^\sA-Za-z0-9]|\s"

PUNCTUATION = list("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~")

# Kimi-K2.5's shape: default system prompt, role headers, <think>reasoning</think>content<|im_end|>.
# History turns (assistant messages before the last user message) get an empty <think></think>; the
# turns after the last user message keep their reasoning, so that the generation prompt + the generated
# ids re-render to exactly the same tokens. (Kimi's own template also blanks the final assistant turn,
# which is why a training stream must be built from the prompt rendering + the completion ids.)
# ``thinking=false`` renders an empty think block in the generation prompt.
CHAT_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- "
    "endfor -%}"
    "{%- if messages|length == 0 or messages[0]['role'] != 'system' -%}"
    "<|im_system|>system<|im_middle|>" + DEFAULT_SYSTEM + "<|im_end|>"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- set content = m['content'] if m['content'] is string else '' -%}"
    "{%- if m['role'] == 'system' -%}<|im_system|>{{ m.get('name') or 'system' }}<|im_middle|>{{ content }}"
    "{%- elif m['role'] == 'user' -%}<|im_user|>{{ m.get('name') or 'user' }}<|im_middle|>{{ content }}"
    "{%- elif m['role'] == 'tool' -%}<|im_system|>tool<|im_middle|>{{ content }}"
    "{%- elif m['role'] == 'assistant' -%}<|im_assistant|>{{ m.get('name') or 'assistant' }}<|im_middle|>"
    "{%- if loop.index0 < ns.last_user -%}<think></think>"
    "{%- else -%}<think>{{ m.get('reasoning_content') or m.get('reasoning') or '' }}</think>"
    "{%- endif -%}{{ content }}"
    "{%- else -%}{{ raise_exception('unknown role ' ~ m['role'] ~ ': use system, user, assistant or tool') }}"
    "{%- endif -%}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- if thinking is defined and thinking is false -%}<think></think>{%- endif -%}"
    "{%- endif -%}"
)


def vocabulary(words: list[str]) -> list[str]:
    """The ordinary (non-special) pieces, in a fixed order: bytes, whitespace, letters, digits, punctuation,
    then the generator's words. Deterministic for a given word list."""
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)] + [chr(c) for c in range(ord("A"), ord("Z") + 1)]
    digits = [str(d) for d in range(10)]
    singles = letters + digits + PUNCTUATION
    pieces = [" ", "\n", "\t"] + singles + [" " + s for s in singles]
    for w in sorted(set(words) | set(re.findall(r"[A-Za-z]+", DEFAULT_SYSTEM))):
        if len(w) > 1:
            pieces += [w, " " + w]
    seen: set[str] = set()
    return [p for p in pieces if not (p in seen or seen.add(p))]


def build_tokenizer(words: list[str]):
    """A PreTrainedTokenizerFast over ``words``; eos = <|im_end|>, pad = [PAD], no BOS, Kimi chat template."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = [PAD, UNK] + SPECIAL_TOKENS
    byte_pieces = [f"<0x{b:02X}>" for b in range(256)]
    # Unigram scores: whole pieces are cheap, so Viterbi picks the fewest pieces (whole words when known).
    vocab = [(s, 0.0) for s in specials] + [(b, -100.0) for b in byte_pieces]
    vocab += [(p, -1.0 if len(p.strip()) > 1 else -1.5) for p in vocabulary(words)]
    tok = Tokenizer(models.Unigram(vocab, unk_id=1, byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(PRETOKEN_PATTERN), behavior="isolated")
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        unk_token=UNK,
        eos_token=IM_END,
        additional_special_tokens=SPECIAL_TOKENS,
        clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE,
        model_max_length=1024,
    )
