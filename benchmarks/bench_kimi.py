"""Kimi-K2.5's shapes on this machine: a dry run of 02, 03 and 04 at its widths with synthetic tensors, module by
module, and a projection of the seed's 10K run (disk, memory per GPU, GPU-hours per stage).

    python -m benchmarks.bench_kimi [--tokens 128] [--threads 1]

Widths: target hidden H = 7168, vocabulary V = 163840, draft vocabulary Vd = 32000, aux ids [2, 30, 58] of 61
layers; the draft (AQ-MedAI's shape) has one layer: 64 heads x 128 (64 KV heads), MLP I = 18432, fc 3H -> H,
lm_head H -> Vd: 1.19 B trainable parameters + a 1.17 B frozen embedding. A whole fp32 draft with gradients and
AdamW state (~24 GB) does not fit beside other work in this machine's 24 GiB, so each part is measured alone on
short sequences, with eagle3nb's own code (``Eagle3Draft`` built on the meta device, each sub-module then
materialised, run forward + backward and dropped; 02's ``shards.encode``/``decode``/``write_shard`` and the
reader's ``safe_open`` path; 03's ``DeviceTargets`` and ``TTTObjective``; ``TTTCache`` attention). Everything
longer than the measured sequences, and every GPU figure, is a projection from FLOP counts (formulas below),
labelled as such.

FLOPs (multiply-add = 2), per token, N = tokens:
- linear in -> out: forward 2*in*out; backward 2x forward (weight and input gradients); fc: no input gradient.
- draft, per TTT step: q/k/v 2H*(3*64*128) + o 64*128*H + MLP 3*H*I + lm_head H*Vd (as above);
  attention core: step 0 causal, 4*64*128*T/2; step i >= 1 scores against all step-0 keys, 4*64*128*T
  (CPU path) or, fused on GPUs (mask [causal | diagonal ...]), 4*64*128*(i+1)*T.
- loss targets (03 ``DeviceTargets``; 02 ``topk``): 2*H*V (full-vocabulary argmax) + 2*H*Vd (draft-vocab softmax).
- 02's extraction: the target's forward, 2 x 32 B active parameters (Kimi-K2.5 is a 1T MoE with 32B active).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks.harness import THREADS, command_line, parse

H, V, VD, I_, NH, HD, L, AUX = 7168, 163840, 32000, 18432, 64, 128, 61, [2, 30, 58]
TTT, K = 7, 3
ACTIVE = 32e9  # Kimi-K2.5 active parameters per token
# Seed's figures (the story's 10K run on 8 x RTX PRO 6000 Blackwell)
SEED_DISK, SEED_EXTRACT_TOK_S, SEED_FT_H = 828e9, 3165.0, 2.6
# Dense bf16 tensor peak per GPU (vendor datasheets), and the utilisation the projection assumes.
GPUS = {"RTX PRO 6000 Blackwell": 503.8e12, "H200": 989e12}
UTIL = 0.35
N_GPU = 8


def timed(fn, repeats: int = 2) -> float:
    """Median seconds of ``fn()`` after one warm-up."""
    fn()
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def kimi_config(hidden: int = H):
    from eagle3nb.drafts.eagle3.model import Eagle3Config

    return Eagle3Config(hidden_size=hidden, intermediate_size=I_ if hidden == H else 3 * hidden,
                        num_attention_heads=NH if hidden == H else hidden // 128, num_key_value_heads=NH if hidden == H
                        else hidden // 128, head_dim=HD, vocab_size=V, draft_vocab_size=VD, aux_layer_ids=AUX,
                        rope_theta=1e6, max_position_embeddings=16384)


def materialise(module):
    import torch

    module.to_empty(device="cpu")
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.02) if p.dim() > 1 else p.fill_(1.0)
    return module


def linear_flops(i: int, o: int, grad_in: bool = True) -> float:
    return 2 * i * o * (3 if grad_in else 2)


def core_flops_per_token(T: int, step: int, fused: bool) -> float:
    """Attention score + value FLOPs per query token, forward, at TTT step ``step``."""
    if step == 0:
        return 4 * NH * HD * T / 2
    return 4 * NH * HD * T * ((step + 1) if fused else 1)


def draft_flops_per_token(T: int, fused: bool = True, steps: int = TTT, backward: bool = True) -> float:
    m = 3 if backward else 1
    per_step = (2 * 2 * H * 3 * NH * HD + 2 * NH * HD * H + 2 * 3 * H * I_ + 2 * H * VD) * m
    fc = 2 * 3 * H * H * (2 if backward else 1)
    return fc + steps * per_step + m * sum(core_flops_per_token(T, i, fused) for i in range(steps))


def matmul_flops_per_s() -> float:
    import torch

    a, b = torch.randn(256, H), torch.randn(H, 4096)
    return 2 * 256 * H * 4096 / timed(lambda: a @ b, 3)


def measure_storage(T: int, head, work: Path) -> dict:
    """02's writer (encode + write_shard) and reader (safe_open + decode) per storage, per token."""
    import torch
    from safetensors import safe_open

    from eagle3nb.data.shards import decode, encode, write_shard

    aux, final = torch.randn(T, 3, H), torch.randn(T, H)
    out = {}
    for storage in ("bf16", "fp8", "topk"):
        path = work / f"shard-{storage}.safetensors"

        def write():
            enc = encode(aux, final, storage, head if storage == "topk" else None, 32)
            tensors = {f"0.{k}": v for k, v in enc.items()}
            tensors["0.input_ids"] = torch.zeros(T, dtype=torch.int32)
            tensors["0.loss_mask"] = torch.ones(T, dtype=torch.uint8)
            return write_shard(path, tensors)

        w = timed(write, 1)
        info = write()

        def read():
            with safe_open(str(path), "pt") as f:
                raw = {k.split(".", 1)[1]: f.get_tensor(k) for k in f.keys()}
            return decode(raw, storage)

        r = timed(read, 2)
        out[storage] = {"write_s_per_tok": w / T, "read_s_per_tok": r / T, "bytes_per_tok": info["bytes"] / T}
    return out


def measure_targets(T: int, head_w, rows_ids) -> float:
    """03's DeviceTargets (draft-vocab softmax + full-vocabulary argmax, chunked 1024 tokens) per token."""
    import torch

    from eagle3nb.train.data import DeviceTargets

    class Data:  # the two things DeviceTargets reads from a HiddenStates
        d2t = rows_ids - torch.arange(VD)

        def lm_head(self):
            return head_w

    targets = DeviceTargets(Data(), torch.device("cpu"))
    item = {"final": torch.randn(T, H)}
    return timed(lambda: targets(item), 1) / T


def measure_modules(T: int) -> dict:
    """Forward (+ backward) seconds per token of each draft part at Kimi width, one part in memory at a time."""
    import torch
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from eagle3nb.drafts.eagle3.cache import TTTCache
    from eagle3nb.drafts.eagle3.model import Eagle3Draft

    cfg = kimi_config()
    with torch.device("meta"):
        draft = Eagle3Draft(cfg)
    rotary = LlamaRotaryEmbedding(LlamaConfig(**{k: v for k, v in cfg.llama_dict().items() if k != "model_type"}))
    pos = torch.arange(T)[None]
    x2 = torch.randn(1, T, 2 * H)
    cos, sin = rotary(x2, pos)
    res = {}

    def run(name, module, make_input, flops_fb, flops_f, fwd_bwd):
        materialise(module)
        x = make_input()
        with torch.no_grad():
            f = timed(lambda: fwd_bwd(module, x, False), 1)
        fb = timed(lambda: fwd_bwd(module, x, True), 1)
        module.zero_grad(set_to_none=True)
        module.to("meta")
        gc.collect()
        res[name] = {"fwd_s_per_tok": f / T, "fb_s_per_tok": fb / T, "fb_flops_per_tok": flops_fb,
                     "fwd_flops_per_tok": flops_f}

    def plain(module, x, grad):
        y = module(x.requires_grad_(grad and x.dtype.is_floating_point and x.shape[-1] != 3 * H))
        if grad:
            y.float().sum().backward()

    run("fc (3H -> H)", draft.fc, lambda: torch.randn(1, T, 3 * H), linear_flops(3 * H, H, False), 2 * 3 * H * H,
        plain)

    def attn(module, x, grad):  # two TTT steps through the real TTTCache: step 0 causal, step 1 step-0 + diagonal
        x = x.detach().requires_grad_(grad)
        cache = TTTCache(dense=False)
        y = module(x, cos, sin, cache, None) + module(x, cos, sin, cache, None)
        if grad:
            y.sum().backward()

    proj = linear_flops(2 * H, 3 * NH * HD) + linear_flops(NH * HD, H)
    core = core_flops_per_token(T, 0, False) + core_flops_per_token(T, 1, False)
    run("attention, 2 TTT steps", draft.midlayer.self_attn, lambda: torch.randn(1, T, 2 * H),
        2 * proj + 3 * core, proj * 2 / 3 + core, attn)
    run("MLP (SwiGLU)", draft.midlayer.mlp, lambda: torch.randn(1, T, H), 3 * linear_flops(H, I_),
        3 * 2 * H * I_, plain)
    run("lm_head (H -> Vd)", draft.lm_head, lambda: torch.randn(1, T, H), linear_flops(H, VD), 2 * H * VD, plain)
    return res


def measure_ttt_overhead(T: int) -> float:
    """03's real TTTObjective with Kimi's vocabularies (Vd 32000 loss, V 163840 maps) at a narrow hidden width
    (256): seconds per token per TTT step of everything but the wide matmuls (loss, norms, rotary, lookups)."""
    import torch

    from eagle3nb.drafts.eagle3.model import Eagle3Draft
    from eagle3nb.drafts.eagle3.objective import TTTObjective

    draft = Eagle3Draft(kimi_config(256))
    draft.set_vocab(torch.arange(VD) * 5 - torch.arange(VD), torch.arange(V) % 5 == 0)
    obj = TTTObjective(draft, TTT, 0.8)
    g = torch.Generator().manual_seed(0)
    batch = {"aux": torch.randn(1, T, 3 * 256, generator=g), "input_ids": torch.randint(0, V, (1, T), generator=g),
             "loss_mask": torch.ones(1, T, dtype=torch.int64),
             "target_argmax": torch.randint(0, V, (1, T), generator=g),
             "target_probs": torch.softmax(torch.randn(1, T, VD, generator=g), -1)}

    def step():
        loss, _ = obj(batch)
        loss.backward()
        draft.zero_grad(set_to_none=True)

    s = timed(step, 1)
    gc.collect()
    return s / T / TTT


def gb(x: float) -> str:
    return f"{x / 1e9:,.1f} GB"


def parser() -> argparse.ArgumentParser:
    ap = command_line(__doc__)
    ap.add_argument("--tokens", type=int, default=128, help="tokens per measured sequence (short: module by module)")
    ap.add_argument("--threads", **THREADS)
    return ap


def main(argv: Sequence[str] | None = None) -> None:
    args = parse(parser(), argv)
    import torch

    T = args.tokens
    work = Path(tempfile.mkdtemp(prefix="bench-kimi-"))
    ref = matmul_flops_per_s()
    print(f"Kimi-K2.5 widths: H {H}, V {V}, Vd {VD}, draft 1 layer {NH}x{HD} heads, MLP {I_}; measured on {T}-token "
          f"sequences, fp32, {args.threads} thread(s); this CPU's fp32 matmul: {ref / 1e9:.1f} GFLOP/s")

    # 02 + 03's loss targets: the 163840-row head is needed by both (topk storage, DeviceTargets); 4.7 GB fp32.
    head_w = torch.empty(V, H).normal_(0, 0.02)
    rows_ids = torch.arange(VD) * 5
    from eagle3nb.data.head import TargetHead

    head = TargetHead(head_w, rows_ids, device="cpu")
    storage = measure_storage(T, head, work)
    targets_s = measure_targets(T, head_w, rows_ids)
    del head, head_w
    gc.collect()
    modules = measure_modules(T)
    ttt_over = measure_ttt_overhead(T)

    print(f"\n{'measured (per token)':34} {'fwd ms':>8} {'fwd+bwd ms':>11} {'GFLOP fwd+bwd':>14} "
          f"{'achieved GFLOP/s':>17}")
    for name, m in modules.items():
        print(f"{name:34} {m['fwd_s_per_tok'] * 1e3:8.2f} {m['fb_s_per_tok'] * 1e3:11.2f} "
              f"{m['fb_flops_per_tok'] / 1e9:14.3f} {m['fb_flops_per_tok'] / m['fb_s_per_tok'] / 1e9:17.1f}")
    tflops = 2 * H * V + 2 * H * VD
    print(f"{'loss targets (V 163840 head)':34} {targets_s * 1e3:8.2f} {'':>11} {tflops / 1e9:14.3f} "
          f"{tflops / targets_s / 1e9:17.1f}")
    print(f"{'TTT objective rest, per step':34} {'':>8} {ttt_over * 1e3:11.2f}   (loss over Vd, norms, rotary; "
          f"TTTObjective at hidden 256)")
    for s, m in storage.items():
        print(f"02 storage {s:5} writer {m['write_s_per_tok'] * 1e6:7.1f} us/token ({1 / m['write_s_per_tok']:8,.0f} "
              f"tok/s on one process), reader {m['read_s_per_tok'] * 1e6:6.1f} us/token, {m['bytes_per_tok']:,.0f} "
              "bytes/token")

    # ---- per-token costs of each stage on this CPU (measured parts, composed) --------------------------
    attn2 = modules["attention, 2 TTT steps"]
    per_step_fb = attn2["fb_s_per_tok"] / 2 + modules["MLP (SwiGLU)"]["fb_s_per_tok"] + \
        modules["lm_head (H -> Vd)"]["fb_s_per_tok"] + ttt_over
    train_cpu = modules["fc (3H -> H)"]["fb_s_per_tok"] + TTT * per_step_fb + targets_s
    fwd_step = attn2["fwd_s_per_tok"] / 2 + modules["MLP (SwiGLU)"]["fwd_s_per_tok"] + \
        modules["lm_head (H -> Vd)"]["fwd_s_per_tok"]
    accept_cpu = modules["fc (3H -> H)"]["fwd_s_per_tok"] + (K + 1) * fwd_step + targets_s
    print(f"\nthis CPU, composed from the rows above at T={T}: 03 training {train_cpu:.2f} s/token "
          f"({draft_flops_per_token(T) / 1e9:.1f} GFLOP/token with TTT {TTT}), 04 offline acceptance "
          f"(k+1 = {K + 1} steps) {accept_cpu:.2f} s/token")

    # ---- projection of the seed's 10K run --------------------------------------------------------------
    from eagle3nb.data.shards import bytes_per_token

    N = SEED_DISK / bytes_per_token("bf16", H)  # tokens of the seed's run (828 GB of bf16 states)
    avg_T = N / 10000
    print(f"\nPROJECTION (not measured): the seed's run = {N / 1e6:.1f} M tokens ({SEED_DISK / 1e9:.0f} GB of bf16 "
          f"at {bytes_per_token('bf16', H):,} B/token), {avg_T:,.0f} tokens/sample on average; 03 = 2 epochs, TTT "
          f"{TTT}; 8 GPUs at {UTIL:.0%} of dense bf16 peak "
          f"({', '.join(f'{g} {p / 1e12:.0f} TFLOP/s' for g, p in GPUS.items())})")
    print(f"{'figure':44} {'projection':>24} {'seed':>12} {'from':>32}")

    def row(name, value, seed, source):
        print(f"{name:44} {value:>24} {seed:>12} {source:>32}")

    for s in ("bf16", "fp8", "topk"):
        row(f"02 disk, storage {s}", gb(N * storage[s]["bytes_per_tok"]), "828 GB" if s == "bf16" else "",
            f"measured {storage[s]['bytes_per_tok']:,.0f} B/token")
    for s in ("bf16", "fp8", "topk"):
        # topk's head (2*H*(V+Vd) FLOP/token) runs on the GPU in 02 (TargetHead on the device): CPU part = the rest
        cpu = storage[s]["write_s_per_tok"] - (targets_s if s == "topk" else 0.0)
        need = SEED_EXTRACT_TOK_S / N_GPU * max(cpu, 0.0)
        row(f"02 writer CPU cores/GPU at 3,165 tok/s ({s})", f"{need:.2f}", "",
            "measured writer us/token" + (" - head" if s == "topk" else ""))
    extract_flops = 2 * ACTIVE * N
    seed_h = N / SEED_EXTRACT_TOK_S / 3600
    seed_util = 2 * ACTIVE * SEED_EXTRACT_TOK_S / (N_GPU * GPUS["RTX PRO 6000 Blackwell"])
    row("02 extraction at the seed's rate, RTX PRO 6000", f"{seed_h:.2f} h wall, {seed_h * N_GPU:.1f} GPU-h",
        "3,165 tok/s", f"seed's rate = {seed_util:.1%} of peak")
    h200 = seed_h * GPUS["RTX PRO 6000 Blackwell"] / GPUS["H200"]
    row("02 extraction, H200 at the same utilisation", f"{h200:.2f} h wall, {h200 * N_GPU:.1f} GPU-h", "",
        "seed's rate x peak ratio")
    for g, peak in GPUS.items():
        h = extract_flops / (N_GPU * peak * UTIL) / 3600
        row(f"02 extraction bound at {UTIL:.0%}, {g}", f"{h:.2f} h wall, {h * N_GPU:.1f} GPU-h", "",
            "2 x 32B FLOP/token")
    for Tm in (2048, 8192, 16384):
        f = draft_flops_per_token(Tm)
        row(f"03 GFLOP/token at T={Tm} (GPU fused attention)", f"{f / 1e9:.1f}", "",
            f"formula; CPU path {draft_flops_per_token(Tm, fused=False) / 1e9:.1f}")
    train_flops = 2 * N * (draft_flops_per_token(int(avg_T)) + tflops)
    for g, peak in GPUS.items():
        h = train_flops / (N_GPU * peak * UTIL) / 3600
        row(f"03 fine-tune, 2 epochs, {g}", f"{h:.2f} h wall, {h * N_GPU:.1f} GPU-h", "2.6 h" if "RTX" in g else "",
            f"{train_flops / 2 / N / 1e9:.1f} GFLOP/token x 2N")
    seed_ft_util = train_flops / (N_GPU * GPUS["RTX PRO 6000 Blackwell"] * SEED_FT_H * 3600)
    row("03: utilisation the seed's 2.6 h implies", f"{seed_ft_util:.1%}", "2.6 h", "same FLOPs / seed's time")
    acc_flops_tok = draft_flops_per_token(int(avg_T), steps=K + 1, backward=False) + tflops
    held = 0.02 * N
    for g, peak in GPUS.items():
        h = held * acc_flops_tok / (N_GPU * peak * UTIL) / 3600
        row(f"04 offline acceptance (2% held out), {g}", f"{h * 3600:.0f} s wall", "",
            f"{acc_flops_tok / 1e9:.1f} GFLOP/token fwd")
    trainable = 3 * H * H + 2 * H * 3 * NH * HD + NH * HD * H + 3 * H * I_ + H * VD + 4 * H
    state = trainable * 4 * 4  # fp32 weights + grads + AdamW m, v
    embed = V * H * 4
    heads = V * H * 4 + VD * H * 4  # DeviceTargets: the target head in fp32 + the draft-vocab rows
    row("03 memory/GPU: draft fp32 + grads + AdamW", gb(state), "", f"{trainable / 1e9:.2f} B trainable x 16 B")
    row("03 memory/GPU: frozen embedding + target head", gb(embed + heads), "", "V x H fp32 (x2) + Vd x H")
    for Tm in (8192, 16384):
        act = Tm * TTT * 4 * (2 * H + 4 * NH * HD + 4 * H + 3 * I_ + 2 * VD) / 2  # bf16 autocast halves most
        row(f"03 memory/GPU: activations, T={Tm} (bf16)", gb(act), "", "saved tensors per step x TTT")
        row(f"03 memory/GPU: total, T={Tm}", gb(state + embed + heads + act), "", "the three rows above")
    print("\nGPU hours = FLOPs / (8 x peak x utilisation); extraction also rated by the seed's 3,165 tok/s. "
          f"CPU-measured per-token costs above are the same FLOPs at this machine's achieved GFLOP/s (files in {work})")


if __name__ == "__main__":
    main()
