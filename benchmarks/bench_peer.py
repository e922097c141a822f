"""03_train side by side with a peer trainer: speculators' EAGLE-3 trainer (0.9.0, its own environment) and ours,
on the same hidden states, from the same initial weights, with the same draft shape, token budget, TTT depth,
lr schedule, fp32 and thread count; both drafts judged by the same independent judge (04's offline acceptance,
greedy, k = 3, on 03's held-out split of the data, which neither trainer sees).

    python benchmarks/bench_peer.py [--data DIR] [--model toy:smoke] [--epochs 3] [--repeats 3] [--ttt 4]

1. Fairness first: the shared initial weights, saved in both layouts, loaded by each side; every TTT step's
   draft logits on a held-out sample must agree (max |difference| printed), and so must the loss targets
   (speculators computes them from the converted files, we from our shards).
2. Each repeat trains both (ours: 03's stage function; theirs: speculators' ``Trainer.train_epoch`` over its
   own sampler and collate) and judges both. tokens/s = sample tokens of the training split x epochs / training
   time; median of the repeats, spread = min..max.

Data: ``--data`` (02's output, e.g. outputs/demo/02_hidden_states), else the target's own greedy answers to
toy prompts through 02 (cached in .cache/bench-peer-*). Our shards are converted to speculators' per-sample
files (vLLM ``extract_hidden_states`` layout: ``hidden_states [T, 4, H]``, the last being the *pre-norm* final
state; ours is stored normed, so final / norm.weight is written, which the target's RMSNorm maps back exactly).

The peer lives in ``.venv-speculators/`` (created on first use, see ``setup_peer``); nothing is added to our
pyproject. Its source is read from that installed package; ``_peer_speculators.py`` drives it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))  # _peer_speculators
sys.path.insert(0, str(ROOT))  # testkit
PEER_VENV = ROOT / ".venv-speculators"
PEER_PY = PEER_VENV / "bin" / "python"
PEER_SPEC = "speculators==0.9.0"
# speculators' own pins want transformers<=5.19 and CUDA-only extras; the model, losses and trainer need only
# these (installed with their dependencies), the package itself goes in with --no-deps.
PEER_DEPS = ["torch==2.13.0", "transformers==5.24.0", "safetensors", "openai", "datasets<=5.1.0", "loguru", "psutil",
             "pydantic-settings", "aiohttp", "httpx"]


def setup_peer() -> str | None:
    """Create .venv-speculators/ when missing; return None, or why the peer cannot run here."""
    if PEER_PY.exists():
        ok = subprocess.run([str(PEER_PY), "-c", "import speculators.train.trainer"], capture_output=True, text=True)
        if ok.returncode == 0:
            return None
    print(f"[bench_peer] installing {PEER_SPEC} into {PEER_VENV} (first use, ~2 min)", flush=True)
    steps = [[sys.executable, "-m", "venv", str(PEER_VENV)],
             [str(PEER_PY), "-m", "pip", "install", "-q", *PEER_DEPS],
             [str(PEER_PY), "-m", "pip", "install", "-q", "--no-deps", PEER_SPEC, "hs-connectors==0.9.0"],
             [str(PEER_PY), "-c", "import speculators.train.trainer"]]
    for cmd in steps:
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            return f"`{' '.join(cmd)}` failed: {(r.stderr or r.stdout).strip().splitlines()[-1:]}"
    return None


def run_peer(plan: dict, work: Path) -> dict:
    path = work / f"plan-{plan['mode']}-{time.monotonic_ns()}.json"
    plan = {**plan, "out": str(path.with_suffix(".out.json"))}
    path.write_text(json.dumps(plan))
    env = {**os.environ, "OMP_NUM_THREADS": str(plan["threads"]), "PYTHONWARNINGS": "ignore"}
    r = subprocess.run([str(PEER_PY), str(Path(__file__).parent / "_peer_speculators.py"), str(path)],
                       capture_output=True, text=True, env=env, cwd=str(work))
    if r.returncode:
        raise RuntimeError(f"speculators ({plan['mode']}) failed:\n{r.stderr[-3000:]}")
    return json.loads(Path(plan["out"]).read_text())


def data_dir(args, model_dir: Path) -> Path:
    if args.data:
        return Path(args.data)
    demo = ROOT / "outputs" / "demo" / "02_hidden_states"
    if (demo / "index.json").exists() and args.model == "toy:demo":
        return demo
    from testkit.heldout import greedy_hidden_states

    cache = ROOT / ".cache" / f"bench-peer-{model_dir.name}-{args.samples}x{args.max_new_tokens}"
    if not (cache / "02" / "index.json").exists():
        print(f"[bench_peer] building data: the target's greedy answers to {args.samples} toy prompts -> 02 "
              f"({cache})", flush=True)
        greedy_hidden_states(model_dir, "toy:train", args.samples, args.max_new_tokens, cache,
                             draft_vocab_size=args.draft_vocab)
    return cache / "02"


def to_per_sample(data, idx: list[int], norm_w, out: Path) -> Path:
    """Our samples -> vLLM/speculators per-sample files (token_ids, hidden_states [T, 4, H], loss_mask)."""
    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    for i in idx:
        it = data[i]
        T = it["input_ids"].shape[0]
        aux = it["aux"].float().view(T, 3, -1)
        prenorm = it["final"].float() / norm_w.float()  # RMSNorm(final / w) * w == final (RMSNorm is scale-free)
        save_file({"token_ids": it["input_ids"].contiguous(), "loss_mask": it["loss_mask"].to(torch.uint8),
                   "hidden_states": torch.cat([aux, prenorm[:, None]], 1).contiguous()},
                  str(out / f"{i:06d}.safetensors"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default=None, help="02's output folder (default: built from the toy target)")
    ap.add_argument("--model", default="toy:smoke", help="the target the data came from")
    ap.add_argument("--samples", type=int, default=96)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--draft-vocab", type=int, default=128)
    ap.add_argument("--epochs", type=int, default=3, help="token budget: epochs over the training split")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ttt", type=int, default=4, help="TTT depth (both trainers); the judge drafts k = 3")
    ap.add_argument("--seq", type=int, default=1024, help="tokens per micro-batch (ours: batch_tokens; theirs: "
                                                         "total_seq_len)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from eagle3nb.accept.offline import offline_acceptance
    from eagle3nb.data.head import read_head_tensors
    from eagle3nb.data.reader import HiddenStates
    from eagle3nb.data.split import split_holdout
    from eagle3nb.drafts import load_draft
    from eagle3nb.drafts.eagle3.layouts import save_draft
    from eagle3nb.drafts.eagle3.offline import chain_logits
    from eagle3nb.params import from_dict
    from eagle3nb.toy import resolve_model_path
    from eagle3nb.train.stage import run as train_run

    why_not = setup_peer()
    model_dir = resolve_model_path(args.model)
    data_path = data_dir(args, model_dir)
    data = HiddenStates(data_path)
    if data.storage not in ("fp32", "bf16", "fp8"):
        raise SystemExit(f"{data_path} has storage {data.storage!r}: the peer needs the final state (bf16/fp8/fp32)")
    holdout = 0.2
    train_idx, held_idx = split_holdout([s["id"] for s in data.meta["samples"]], holdout)
    lengths = [int(s["length"]) for s in data.meta["samples"]]
    epoch_tokens = sum(lengths[i] for i in train_idx)
    work = Path(tempfile.mkdtemp(prefix="bench-peer-"))
    k, max_k, decay = 3, args.ttt, 0.8

    # The shared initial weights: 03's own fresh draft (target embedding and lm_head rows), in both layouts.
    from eagle3nb.train.build import build_draft

    P0 = from_dict("03_train", {"run_name": "bench-peer", "data_dir": str(data_path)})
    init, _ = build_draft(P0, data)
    save_draft(init, work / "init-eagle3")
    save_draft(init, work / "init-speculators", format="speculators", verifier=str(model_dir),
               num_speculative_tokens=k)
    cfg = init.config
    print(f"data {data_path}: {len(train_idx)} training / {len(held_idx)} held-out samples, {epoch_tokens:,} "
          f"training tokens per epoch; target hidden {cfg.target_hidden_size}, vocab {cfg.vocab_size}")
    print(f"draft: hidden {cfg.hidden_size}, {cfg.num_attention_heads}x{cfg.head_dim} heads, MLP "
          f"{cfg.intermediate_size}, draft vocab {cfg.draft_vocab_size}; TTT {args.ttt}, decay {decay}, {args.epochs} "
          f"epochs, {args.seq} tokens/micro-batch, lr {args.lr} cosine (5% warm-up), AdamW wd 0.01, clip 1.0, fp32, "
          f"{args.threads} thread(s)")
    if why_not:
        print(f"\nthe peer cannot run here: {why_not}")

    norm_w = read_head_tensors(model_dir)["norm.weight"]
    peer_train = to_per_sample(data, train_idx, norm_w, work / "peer-train")
    probe = to_per_sample(data, held_idx[:1], norm_w, work / "peer-probe")

    # 1. fairness: the same weights give the same logits (every TTT step) and the same loss targets.
    max_diff = target_diff = float("nan")
    if not why_not:
        from safetensors.torch import load_file

        run_peer({"mode": "logits", "draft": str(work / "init-speculators"), "threads": args.threads,
                  "sample": str(next(probe.glob("*.safetensors"))), "ttt_steps": max_k, "decay": decay,
                  "logits_file": str(work / "peer-logits.safetensors")}, work)
        theirs = load_file(str(work / "peer-logits.safetensors"))
        item = data[held_idx[0]]
        ours_init = load_draft(work / "init-eagle3", embed_tokens=data.embed_tokens())
        with torch.no_grad():
            ours = list(chain_logits(ours_init, item["aux"], item["input_ids"], max_k))
        max_diff = max(float((o - theirs[f"step{j}"]).abs().max()) for j, o in enumerate(ours))
        scale = max(float(o.abs().max()) for o in ours)
        p_theirs = torch.softmax(theirs["targets"], -1)
        target_diff = float((p_theirs - data.target_probs(item)[1:]).abs().max())
        print(f"\nfairness: same initial weights, {max_k} TTT steps on a {item['input_ids'].shape[0]}-token held-out "
              f"sample: max |logit difference| {max_diff:.2e} (logits up to {scale:.1f}); loss targets max "
              f"|probability difference| {target_diff:.2e}")

    # 2. train both, judge both, repeat.
    rows: dict[str, dict[str, list]] = {"eagle3nb": {"tok_s": [], "tau": [], "s": []},
                                        "speculators": {"tok_s": [], "tau": [], "s": []}}
    peer_info: dict = {}

    def judge(draft_dir: Path) -> float:
        d = load_draft(draft_dir, embed_tokens=data.embed_tokens())
        return offline_acceptance(d, data, k, max_k, indices=held_idx)["greedy"]["acceptance_length"]

    for r in range(args.repeats):
        out = work / f"ours-{r}"
        t = time.perf_counter()
        with open(work / f"ours-{r}.log", "w") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            m = train_run(from_dict("03_train", {
                "run_name": "bench-peer", "data_dir": str(data_path), "output_dir": str(out),
                "init_from": str(work / "init-eagle3"), "ttt_steps": args.ttt, "step_decay": decay, "lr": args.lr,
                "warmup_ratio": 0.05, "weight_decay": 0.01, "epochs": args.epochs, "max_length": args.seq,
                "batch_tokens": args.seq, "grad_clip": 1.0, "eval_every": 0, "save_every": 10**6,
                "holdout_fraction": holdout, "device": "cpu", "seed": 0, "resume": False}))
        rows["eagle3nb"]["s"].append(time.perf_counter() - t)
        rows["eagle3nb"]["tok_s"].append(m["tokens_per_s"])
        rows["eagle3nb"]["tau"].append(judge(out / "draft"))
        if why_not:
            continue
        t = time.perf_counter()
        peer_info = run_peer({
            "mode": "train", "draft": str(work / "init-speculators"), "data": str(peer_train), "threads": args.threads,
            "ttt_steps": args.ttt, "decay": decay, "lr": args.lr, "warmup_ratio": 0.05, "weight_decay": 0.01,
            "epochs": args.epochs, "total_seq_len": args.seq, "seed": 0, "save_path": str(work / f"peer-ckpt-{r}"),
            "out_draft": str(work / f"peer-{r}")}, work)
        rows["speculators"]["s"].append(time.perf_counter() - t)
        rows["speculators"]["tok_s"].append(peer_info["tokens_per_s"])
        rows["speculators"]["tau"].append(judge(work / f"peer-{r}"))
        print(f"  repeat {r + 1}: ours {rows['eagle3nb']['tok_s'][-1]:,.0f} tok/s tau "
              f"{rows['eagle3nb']['tau'][-1]:.3f} | speculators {peer_info['tokens_per_s']:,.0f} tok/s tau "
              f"{rows['speculators']['tau'][-1]:.3f}", flush=True)

    untrained = judge(work / "init-eagle3")
    print(f"\n{'trainer':22} {'tokens/s (median, min..max)':>30} {'held-out tau (k=3)':>19} {'max |logit diff|':>17}")
    for name, label in (("eagle3nb", "eagle3nb (03)"), ("speculators", f"speculators {PEER_SPEC.split('==')[1]}")):
        x = rows[name]
        if not x["tok_s"]:
            print(f"{label:22} {'cannot run here':>30}")
            continue
        spread = f"{statistics.median(x['tok_s']):,.0f} ({min(x['tok_s']):,.0f}..{max(x['tok_s']):,.0f})"
        diff = "reference" if name == "eagle3nb" else f"{max_diff:.1e}"
        print(f"{label:22} {spread:>30} {statistics.median(x['tau']):19.3f} {diff:>17}")
    print(f"{'untrained (init)':22} {'':>30} {untrained:19.3f}")
    if rows["speculators"]["tok_s"]:
        ratio = statistics.median(rows["eagle3nb"]["tok_s"]) / statistics.median(rows["speculators"]["tok_s"])
        dtau = statistics.median(rows["eagle3nb"]["tau"]) - statistics.median(rows["speculators"]["tau"])
        print(f"\nratio tokens/s ours / speculators: {ratio:.2f}  (goal >= 1.0)")
        print(f"held-out tau ours - speculators: {dtau:+.3f}  (goal >= 0: not behind)")
        print(f"trainable parameters: speculators {peer_info['trainable_params']:,} (frozen: "
              f"{', '.join(peer_info['frozen'])}); ours "
              f"{sum(p.numel() for p in init.parameters() if p.requires_grad):,} (frozen: embed_tokens.weight); "
              f"speculators {peer_info['steps_per_epoch']} steps/epoch of one packed [1, {args.seq}] sequence, padded "
              f"to {args.seq}")
    print(f"(files in {work})")


if __name__ == "__main__":
    main()
