"""Build the toy targets: the toy tokenizer + a small model trained on generated reasoning dialogues.

``smoke`` and ``demo`` are Llama models with Kimi's chat format (the fixture of the bulk of the suite); ``kimi``
is Kimi-K2's own architecture, DeepseekV3 (multi-head latent attention at Kimi's real widths: kv_lora_rank 512 +
qk_rope_head_dim 64 = 576, which vLLM's MLA kernel requires; a routed MoE with Kimi's sigmoid router and
correction bias) at a small hidden size, with the same chat format: what the rehearsal and the demo serve.
``qwen3`` is Qwen3-MoE (Qwen3MoeForCausalLM) on the real Qwen3 tokenizer and chat template
(``real_tokenizers``); it is not shipped (its 151,936-row vocabulary makes it tens of MB) but built at first
use into the cache, and trained only over the vocabulary rows the corpus uses (``train.CorpusRows``). ``gptoss`` is
GptOss (sliding-window and full layers, sinks, MoE) on the real gpt-oss tokenizer in the Harmony format
(``harmony``: our template), built the same way (docs/harmony.md).

The recipe of the shipped toys (``shipped.py``: ``toy:smoke`` / ``toy:demo`` are those fixed bytes). A rebuild
repeats bit for bit on one machine (fixed thread count, seeded torch and data) but not across CPUs: other
vector kernels and reduction orders end at other weights, which is why the builds ship. Cached by its settings
in ``paths.cache_dir()`` (see ``settings_hash``), and written to a temporary folder that is renamed into place,
so a killed build never leaves a half model behind.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import shutil
import time
from pathlib import Path

from eagle3nb import paths
from eagle3nb.errors import InputError
from eagle3nb.families import from_template
from eagle3nb.paths import file_sha256
from eagle3nb.tokens import THINK_END
from eagle3nb.toy import dialogues, harmony, real_tokenizers
from eagle3nb.toy.shipped import manifest
from eagle3nb.toy.tokenizer import build_tokenizer
from eagle3nb.toy.train import samples, template_family, train

# Model and training settings per size. ``threads`` is fixed so a rebuild repeats on the same machine (another
# CPU still ends at other weights: the shipped builds are what every machine uses).
# Head size 32 and up in all (hidden / heads): the real vLLM's CPU attention serves head sizes of 32 and up only.
# ``arch``: the transformers architecture (``ARCHS``; absent: llama, which keeps the Llama toys' cache keys and
# shipped manifest); ``mla``/``moe``/``attn``: the architecture's attention and expert widths. ``tokenizer``: a
# real family's tokenizer (``real_tokenizers``, name-version: its version is in the cache key; absent: the toy
# tokenizer) and ``vocab`` its model's vocabulary size; ``shipped: False``: built at first use (absent: shipped).
SIZES: dict[str, dict] = {
    "smoke": dict(hidden=64, layers=8, heads=2, kv_heads=1, intermediate=192, steps=560, batch=4, lr=1e-2,
                  warmup=20, threads=1),
    "demo": dict(hidden=128, layers=8, heads=4, kv_heads=2, intermediate=384, steps=1200, batch=8, lr=5e-3,
                 warmup=30, threads=1),
    # Kimi-K2's config at 1/56 of its hidden size: its real MLA widths (kv_lora_rank 512, qk_rope_head_dim 64), 64
    # heads -> 2, 384 routed experts (8 per token) + 1 shared -> 4 (2 per token) + 1, the first layer dense. No
    # query low-rank (Kimi's q_lora_rank 1536 is above its head widths; at hidden 128 a rank-64 query slowed
    # learning: held-out loss 2.16 vs 1.26 after 200 steps), and a lower rate than the Llama toys (5e-3: 2.16).
    "kimi": dict(arch="deepseek_v3", hidden=128, layers=8, heads=2, kv_heads=2, intermediate=256, steps=900,
                 batch=4, lr=2e-3, warmup=60, threads=1,
                 mla=dict(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=64, v_head_dim=64,
                          q_lora_rank=None),
                 moe=dict(n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=64,
                          first_k_dense_replace=1, routed_scaling_factor=2.827)),
    # Qwen3-30B-A3B's layout at hidden 64: GQA with an explicit head_dim whose attention is wider than the hidden
    # size (32 heads x 128 over 2048 -> 4 x 32 over 64), q/k norms, every layer a top-k routed MoE without a shared
    # expert (128 experts, 8 per token -> 4, 2), its real vocabulary size (151,936: the tokenizer's 151,669 padded
    # to a multiple of 128).
    "qwen3": dict(arch="qwen3_moe", hidden=64, layers=8, heads=4, kv_heads=2, intermediate=192, steps=700, batch=4,
                  lr=1e-2, warmup=20, threads=1, attn=dict(head_dim=32),
                  moe=dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True,
                           decoder_sparse_step=1),
                  tokenizer=real_tokenizers.QWEN3.key, vocab=151936, shipped=False),
    # gpt-oss-20b's layout at hidden 64: layers alternating sliding window (128 -> 32, below the dialogues'
    # lengths so the window matters) and full attention, attention sinks, GQA 4/2 of head_dim 32 (vLLM's CPU
    # attention takes 32 and up), YaRN rope, every layer a routed MoE (32 experts, 4 per token -> 4, 2), attention
    # biases, its real vocabulary size (201,088: the tokenizer's 200,019 padded), Harmony chat (``harmony``).
    "gptoss": dict(arch="gpt_oss", hidden=64, layers=4, heads=4, kv_heads=2, intermediate=64, steps=600, batch=4,
                   lr=1e-2, warmup=20, threads=1,
                   attn=dict(head_dim=32, sliding_window=32,
                             rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0,
                                              "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                              "original_max_position_embeddings": 128}),
                   moe=dict(num_local_experts=4, num_experts_per_tok=2),
                   tokenizer=real_tokenizers.GPTOSS.key, vocab=201088, shipped=False),
}
# arch -> (config class, model class, config values beyond the shared ones).
ARCHS: dict[str, tuple[str, str, dict]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(rms_norm_eps=1e-5)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(rms_norm_eps=1e-6, n_group=1, topk_group=1, norm_topk_prob=True, rope_scaling=None)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(rms_norm_eps=1e-6)),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(rms_norm_eps=1e-5)),
}
# A real tokenizer whose package ships no chat template gets ours, written from its family's public description.
TEMPLATES = {real_tokenizers.GPTOSS.key: harmony.TEMPLATE}
ROUTER = {"deepseek_v3": {"scoring_func": "sigmoid", "topk_method": "noaux_tc"}}
MAX_POSITIONS = 1024
TRAIN_VERSION = 3  # bump when the training code (train.py, make) changes the weights (the cache key has it)
MARKER = "toy_build.json"
# The tokenizer and dialogue code as loaded now (read at import, so a long-lived process that imported older
# code never files its build under the key of newer code on disk).
SOURCE_HASH = hashlib.sha256(b"".join((Path(__file__).parent / f).read_bytes()
                                      for f in ["tokenizer.py", "dialogues.py"]))


def is_shipped(size: str) -> bool:
    """Whether ``toy:<size>`` is a shipped build (``shipped.py``) rather than built at first use into the cache."""
    return SIZES[size].get("shipped", True)


def settings_hash(size: str, seed: int) -> str:
    """Cache key: this size's settings, the seed, the training version and the tokenizer/dialogue source."""
    key = {"size": SIZES[size], "seed": seed, "v": TRAIN_VERSION, "src": SOURCE_HASH.hexdigest()}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]


def load_tokenizer(s: dict):
    """The size's tokenizer: a real family's (fetched into the cache at first use) or the toy tokenizer."""
    if "tokenizer" in s:
        tokenizer = real_tokenizers.load(real_tokenizers.TOKENIZERS[s["tokenizer"]])
        tokenizer.chat_template = TEMPLATES.get(s["tokenizer"], tokenizer.chat_template)
        return tokenizer
    return build_tokenizer(dialogues.words_for_vocab())


def make_model(tokenizer, s: dict):
    """A fresh model of the size's architecture: Llama, DeepseekV3 with its MLA and MoE widths, Qwen3-MoE or
    GptOss; it stops at its family's end-of-turn token (Kimi's and Qwen3's <|im_end|>, Harmony's <|return|>)."""
    import transformers
    from transformers import GenerationConfig

    im_end = tokenizer.convert_tokens_to_ids(template_family(tokenizer).end_of_turn)
    vocab = s.get("vocab", len(tokenizer))
    if vocab < len(tokenizer):
        raise InputError(f"toy build: vocab {vocab} is below the tokenizer's {len(tokenizer)} tokens")
    common = dict(vocab_size=vocab, hidden_size=s["hidden"], intermediate_size=s["intermediate"],
                  num_hidden_layers=s["layers"], num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"],
                  max_position_embeddings=MAX_POSITIONS, tie_word_embeddings=False, bos_token_id=None,
                  eos_token_id=im_end, pad_token_id=tokenizer.pad_token_id)
    arch = s.get("arch", "llama")
    config_cls, model_cls, extra = ARCHS[arch]
    cfg = getattr(transformers, config_cls)(**common, **extra, **s.get("mla", {}), **s.get("moe", {}),
                                            **s.get("attn", {}))
    # Kimi-K2's config.json names its router (transformers' DeepseekV3 always routes this way; vLLM reads them).
    for key, value in ROUTER.get(arch, {}).items():
        setattr(cfg, key, value)
    model = getattr(transformers, model_cls)(cfg)
    model.generation_config = GenerationConfig(eos_token_id=im_end, pad_token_id=tokenizer.pad_token_id,
                                               bos_token_id=None, do_sample=False, max_new_tokens=128)
    return model


def make(out: Path, size: str, seed: int) -> dict:
    """Make the size's toy in ``out`` (an empty folder): its tokenizer, its model trained (``train``), their files;
    returns the build report."""
    import torch

    s = SIZES[size]
    t0 = time.time()
    tokenizer = load_tokenizer(s)
    torch.manual_seed(seed)
    model = make_model(tokenizer, s)
    report = {"size": size, "seed": seed, "settings": s, "heldout_loss": train(model, tokenizer, s, size, seed, t0),
              "train_seconds": round(time.time() - t0, 1)}
    model.save_pretrained(str(out), safe_serialization=True)
    if "tokenizer" in s:  # the real files as fetched (a re-serialization would be this transformers' own dialect)
        real_tokenizers.copy_into(real_tokenizers.TOKENIZERS[s["tokenizer"]], out)
        if s["tokenizer"] in TEMPLATES:  # where a real checkpoint keeps it (transformers and vLLM read it there)
            (out / "chat_template.jinja").write_text(TEMPLATES[s["tokenizer"]])
    else:
        tokenizer.save_pretrained(str(out))
    report["samples"] = samples(model, tokenizer, seed)
    return report


def rebuild_note(out: Path, size: str, seed: int) -> str:
    """How a rebuild's weights compare with the shipped toy of its size (``toy:<size>`` keeps the shipped one)."""
    if not is_shipped(size):
        return f"toy:{size} is built at first use (not shipped): on this machine it is this build"
    entry = manifest().get(size)
    if entry is None:
        return f"no shipped toy of size {size!r} to compare with"
    mine, theirs = file_sha256(out / "model.safetensors"), entry["files"]["model.safetensors"]
    if mine == theirs:
        return f"its weights are the shipped toy:{size}'s (sha256 {mine[:12]})"
    return (f"its weights (sha256 {mine[:12]}, seed {seed}) differ from the shipped toy:{size}'s ({theirs[:12]}, "
            f"seed {entry['seed']}): a rebuild on another CPU ends at other weights; toy:{size} keeps using the "
            f"shipped build, pass this folder as model_path to use the rebuild")


def build(out: Path | None = None, size: str = "smoke", seed: int = 0) -> Path:
    """Build (or reuse) the toy target of ``size`` and return its folder.

    ``out`` defaults to ``cache_dir()/toy-{size}-{hash}``; an existing complete build there is returned at once.
    """
    import torch

    if size not in SIZES:
        raise InputError(f"unknown toy size {size!r}: use one of {sorted(SIZES)}")
    out = Path(out) if out is not None else paths.cache_dir() / f"toy-{size}-{settings_hash(size, seed)}"
    out = out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    locks = paths.cache_dir() / "locks"
    locks.mkdir(exist_ok=True)
    with open(locks / hashlib.sha256(str(out).encode()).hexdigest()[:16], "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a concurrent build of the same folder waits, then reuses it
        if (out / MARKER).exists():
            held = json.loads((out / MARKER).read_text())
            if (held["size"], held["seed"], held["settings"]) != (size, seed, SIZES[size]):
                raise FileExistsError(f"{out} holds a toy build of size {held['size']!r}, seed {held['seed']} with "
                                      "other settings: pick another --out or remove that folder")
            return out
        if out.exists() and any(out.iterdir()):
            raise FileExistsError(f"{out} exists and is not a toy build: pick another --out or remove it")
        tmp = out.parent / f".{out.name}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        threads = torch.get_num_threads()
        torch.set_num_threads(SIZES[size]["threads"])
        try:
            report = make(tmp, size, seed)
        finally:
            torch.set_num_threads(threads)
        (tmp / MARKER).write_text(json.dumps(report, indent=2))
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    print(f"toy {size} built in {report['train_seconds']}s -> {out}")
    print(rebuild_note(out, size, seed))
    print(f"held-out loss {report['heldout_loss']:.3f}")
    family = from_template((out / "chat_template.jinja").read_text() if (out / "chat_template.jinja").exists()
                           else json.loads((out / "tokenizer_config.json").read_text()).get("chat_template", ""))
    answer_start = f"<|channel|>{family.harmony_channels[1]}<|message|>" if family.harmony_channels else THINK_END
    for smp in report["samples"]:
        right = smp["output"].split(answer_start)[-1].lstrip("\n") == smp["expected"] + family.end_of_turn
        print(f"  [{'think' if smp['thinking'] else 'no-think'}, {'right' if right else 'wrong'}] "
              f"{smp['question']!r} -> {smp['output']!r}")
    return out
