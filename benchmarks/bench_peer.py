"""03_train side by side with a peer trainer: speculators' trainer (0.9.0, its own environment) and ours, for any
registered method speculators ships (``--method``: EAGLE-3 or a block drafter), on the same hidden states, from the same
initial weights, with the same draft shape, token budget, lr schedule, fp32 and thread count (EAGLE-3: the same TTT
depth; block drafters: the same block size, decay gamma and every anchor); both drafts judged by the same
independent judge (04's offline acceptance, greedy, k = 3 or the block's drafts, on 03's held-out split of the data,
which neither trainer sees; block drafters also by their simulated greedy decoding).

    python -m benchmarks.bench_peer [--method M] [--data DIR] [--model toy:smoke] [--epochs 3] [--repeats 3]

1. Fairness first: the shared initial weights, saved in both layouts, loaded by each side; the draft logits on a
   held-out sample must agree (every TTT step; every block of every anchor), max |difference| printed, and so
   must the loss targets (speculators computes them from the converted files, we from our shards).
2. Each repeat (seed r) trains both (ours: 03's stage function; theirs: speculators' ``Trainer.train_epoch`` over
   its own sampler and collate) and judges both. tokens/s = sample tokens of the training split x epochs /
   training time; median of the repeats, spread = min..max.

Block drafters: speculators keeps the whole embedding table frozen, so its mask slots read the table's
``mask_token_id`` row, set here to our initial ``mask_embedding``; ours trains that vector. ``--mask frozen``
(the default) freezes ours too, so both train the same parameters; ``--mask trained`` runs ours as 03 ships it.
Speculators draws anchors among all loss-masked positions of its packed sequence (``--max-anchors`` per packed
sequence, default every one), ours among those whose next token is generated too (every one, per sample).

Data: ``--data`` (02's output, e.g. outputs/demo/02_hidden_states), else the target's own greedy answers to
toy prompts through 02 (cached in $EAGLE3NB_CACHE/bench-peer-*). Our shards are converted to speculators' per-sample
files (vLLM ``extract_hidden_states`` layout: ``hidden_states [T, 4, H]``, the last being the *pre-norm* final
state; ours is stored normed, so final / norm.weight is written, which the target's RMSNorm maps back exactly).

The peer lives in ``.venv-speculators/`` (created on first use, see ``setup_peer``); nothing is added to our
pyproject. Its source is read from that installed package; ``_peer_speculators.py`` drives it. Which methods get a
peer: the registered ones (``eagle3nb.drafts.PACKAGES``) whose name, the ``speculators_model_type`` our speculators
layout writes, is a model type the installed speculators ships (its own registry, read by ``_peer_speculators.py``:
0.9.0 ships dflash, dflash2, dspark, eagle3, mtp, peagle and xpress). Any other registered method trains on our
side alone, with the reason printed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any
from unittest import mock

from benchmarks.harness import (
    ROOT,
    THREADS,
    command_line,
    draft_module,
    greedy_data,
    median_span,
    parse,
    project_env,
    refuse,
)
from eagle3nb.drafts import DEFAULT, PACKAGES, get, rules

PEER_VENV = ROOT / ".venv-speculators"
PEER_PY = PEER_VENV / "bin" / "python"
PEER_SPEC = "speculators==0.9.0"
PEER_DRIVER = Path(__file__).with_name("_peer_speculators.py")  # run by the peer's interpreter, as a file
DECAY = 0.8  # EAGLE-3: the TTT steps' loss decay (both trainers)
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
    """One plan run by ``_peer_speculators.py`` in the peer's environment: its JSON answer."""
    path = work / f"plan-{plan['mode']}-{time.monotonic_ns()}.json"
    plan = {**plan, "out": str(path.with_suffix(".out.json"))}
    path.write_text(json.dumps(plan))
    env = {**os.environ, "OMP_NUM_THREADS": str(plan["threads"]), "PYTHONWARNINGS": "ignore"}
    r = subprocess.run([str(PEER_PY), str(PEER_DRIVER), str(path)], capture_output=True, text=True, env=env,
                       cwd=str(work))
    if r.returncode:
        raise RuntimeError(f"speculators ({plan['mode']}) failed:\n{r.stderr[-3000:]}")
    return json.loads(Path(plan["out"]).read_text())


def peer_methods(shipped: Sequence[str]) -> list[str]:
    """The registered methods with a peer: those whose name (the ``speculators_model_type`` our speculators layout
    writes) is a model type speculators ships (``shipped``, its registry)."""
    return [m for m in PACKAGES if m in shipped and "speculators" in get(m).layouts]


def peer_missing(method: str, work: Path) -> str | None:
    """Why ``method`` has no peer here (the peer cannot be installed, or speculators ships no such model), or None."""
    why_not = setup_peer()
    if why_not:
        return why_not
    shipped = run_peer({"mode": "ships", "threads": 1}, work)
    if method not in peer_methods(shipped["types"]):
        return (f"speculators {shipped['speculators']} ships no {method} model (its types: "
                f"{', '.join(shipped['types'])}; with a peer here: {', '.join(peer_methods(shipped['types']))})")
    return None


def data_dir(args: argparse.Namespace, model_dir: Path) -> Path:
    """02's folder: ``--data``, the demo run's on toy:demo, else the target's greedy answers to toy prompts, built
    once and cached."""
    from eagle3nb.paths import cache_dir

    if args.data:
        return Path(args.data)
    demo = ROOT / "outputs" / "demo" / "02_hidden_states"
    if (demo / "index.json").exists() and args.model == "toy:demo":
        return demo
    cache = cache_dir() / f"bench-peer-{model_dir.name}-{args.samples}x{args.max_new_tokens}-v{args.draft_vocab}"
    if not (cache / "02" / "index.json").exists():
        print(f"[bench_peer] building data: the target's greedy answers to {args.samples} toy prompts -> 02 "
              f"({cache})", flush=True)
    return greedy_data(model_dir, "toy:train", args.samples, cache, draft_vocab=args.draft_vocab,
                       max_new_tokens=args.max_new_tokens)


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


@contextlib.contextmanager
def mask_frozen(draft_class: type, frozen: bool) -> Iterator[None]:
    """Drafts of ``draft_class`` built meanwhile (03's) with their ``mask_embedding`` frozen (speculators trains
    no mask input): the value they load or start from stays theirs."""
    if not frozen:
        yield
        return
    real = draft_class.__init__

    def init(self, *args, **kwargs) -> None:
        real(self, *args, **kwargs)
        if getattr(self, "mask_embedding", None) is not None:
            self.mask_embedding.requires_grad_(False)

    with mock.patch.object(draft_class, "__init__", init):
        yield


def chain_fairness(args, data, held: int, work: Path, probe: Path) -> tuple[float, float, str]:
    """A chain draft (EAGLE-3): every TTT step's logits and the targets, ours vs speculators', on one held-out
    sample."""
    import torch
    from safetensors.torch import load_file

    from eagle3nb.drafts import load_draft

    run_peer({"mode": "logits", "method": args.method, "block": False, "draft": str(work / "init-speculators"),
              "threads": args.threads, "sample": str(probe), "ttt_steps": args.ttt, "decay": DECAY,
              "logits_file": str(work / "peer-logits.safetensors")}, work)
    theirs = load_file(str(work / "peer-logits.safetensors"))
    item = data[held]
    with torch.no_grad():
        ours = list(draft_module(args.method, "offline").chain_logits(
            load_draft(work / "init-ours", embed_tokens=data.embed_tokens()), item["aux"], item["input_ids"],
            args.ttt))
    diff = max(float((o - theirs[f"step{j}"]).abs().max()) for j, o in enumerate(ours))
    target = float((torch.softmax(theirs["targets"], -1) - data.target_probs(item)[1:]).abs().max())
    return diff, target, f"{args.ttt} TTT steps, logits up to {max(float(o.abs().max()) for o in ours):.1f}"


def block_fairness(args, data, held: int, work: Path, probe: Path) -> tuple[float, float, str]:
    """Block drafters: every anchor's block logits (where speculators' loss takes them), the targets of the slots
    its loss counts, and which slots both count, on one held-out sample."""
    import torch
    from safetensors.torch import load_file

    from eagle3nb.drafts import load_draft

    item = data[held]
    T, B = item["input_ids"].shape[0], args.block
    free = item["loss_mask"].bool().clone()
    free[T - B:] = False  # speculators' select_anchors, asked for all: the loss-masked positions before the last block
    pos = free.nonzero().squeeze(-1)  # shape: [A]
    run_peer({"mode": "logits", "method": args.method, "block": True, "draft": str(work / "init-speculators"),
              "threads": args.threads, "sample": str(probe), "max_anchors": pos.numel(),
              "logits_file": str(work / "peer-logits.safetensors")}, work)
    theirs = load_file(str(work / "peer-logits.safetensors"))
    m = load_draft(work / "init-ours", embed_tokens=data.embed_tokens(), lm_head=data.lm_head())
    ids = item["input_ids"]
    with torch.no_grad():
        ctx = m.context(item["aux"][None].float())  # shape: [1, T, H]
        # theirs: a selector's loss takes the unary logits (DFlash2), a Markov head's the biased ones (slot_logits)
        unary = getattr(m.config, "selector_rank", 0) > 0
        ours = m.logits(m(ctx, ids[pos][None], pos[None])[0]) if unary else m.slot_logits(ctx, ids, pos)  # [A, B, V]
    at, drafts = draft_module(args.method, "objective").slot_targets(m, pos[None], T)  # shape: [1, A, B] each
    counted = (drafts & item["loss_mask"].bool()[(at + 1).clamp_max(T - 1)])[0]  # shape: [A, B], ours
    their_counted = theirs["mask"].view(pos.numel(), B).bool()
    p_theirs = torch.softmax(theirs["targets"].view(pos.numel(), B, -1), -1)
    diff = float((ours - theirs["logits"].view_as(ours)).abs().max())
    target = float((p_theirs - data.target_probs(item)[at[0]])[counted & their_counted].abs().max())
    return diff, target, (f"{pos.numel()} anchors x {B} slots, logits up to {float(ours.abs().max()):.1f}; slots "
                          f"counted by the loss: ours {int(counted.sum())}, theirs {int(their_counted.sum())}, "
                          f"both {int((counted & their_counted).sum())}")


def parser() -> argparse.ArgumentParser:
    ap = command_line(__doc__)
    ap.add_argument("--method", default=DEFAULT, choices=list(PACKAGES),
                    help="a registered method (a peer where speculators ships it)")
    ap.add_argument("--data", default=None, help="02's output folder (default: built from the toy target)")
    ap.add_argument("--model", default="toy:smoke", help="the target the data came from")
    ap.add_argument("--samples", type=int, default=96)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--draft-vocab", type=int, default=None, help="02's draft vocabulary (default: 128 for a chain "
                                                                  "draft, the target's vocabulary for a block drafter)")
    ap.add_argument("--epochs", type=int, default=3, help="token budget: epochs over the training split")
    ap.add_argument("--repeats", type=int, default=3, help="seeds 0..repeats-1, the same seed on both sides")
    ap.add_argument("--ttt", type=int, default=4, help="EAGLE-3: TTT depth (both trainers); the judge drafts k = 3")
    ap.add_argument("--block", type=int, default=4, help="block drafters: block size (both trainers)")
    ap.add_argument("--gamma", type=float, default=4.0, help="block drafters: the position weights' decay gamma")
    ap.add_argument("--max-anchors", type=int, default=None, help="block drafters: speculators' anchors per packed "
                                                                  "sequence (default: enough for every one)")
    ap.add_argument("--mask", default="frozen", choices=("frozen", "trained"),
                    help="block drafters: ours with its mask_embedding frozen (as speculators) or trained (03's)")
    ap.add_argument("--seq", type=int, default=1024, help="tokens per micro-batch (ours: batch_tokens; theirs: "
                                                         "total_seq_len)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--threads", **THREADS)
    return ap


class Runs:
    """Both sides' runs: tokens/s, held-out tau, a block drafter's decoding tau and seconds, per seed."""

    def __init__(self, args: argparse.Namespace, data: Any, held_idx: list[int], k: int, max_k: int):
        self.args, self.data, self.held_idx, self.k, self.max_k = args, data, held_idx, k, max_k
        self.block = rules(args.method).block
        self.rows: dict[str, dict[str, list]] = {name: {"tok_s": [], "tau": [], "decode": [], "s": []}
                                                 for name in ("eagle3nb", "speculators")}
        # a block drafter's greedy decoding simulated block by block: its package's own offline rounds, where its
        # package has them (DFlash's ``offline_acceptance``); else that column stays empty
        self.decoding = getattr(draft_module(args.method, "offline"), "offline_acceptance", None) \
            if self.block else None
        self.held_items = [{**data[i], "target_argmax": data.target_argmax(data[i])} for i in held_idx] \
            if self.decoding else []

    def judge(self, draft_dir: Path, x: dict) -> None:
        """04's offline acceptance of the draft on the held-out split (and a block drafter's decoding)."""
        from eagle3nb.accept.offline import offline_acceptance
        from eagle3nb.drafts import load_draft

        heads = {"lm_head": self.data.lm_head()} if self.block else {}
        d = load_draft(draft_dir, embed_tokens=self.data.embed_tokens(), **heads)
        x["tau"].append(offline_acceptance(d, self.data, self.k, self.max_k,
                                           indices=self.held_idx)["greedy"]["acceptance_length"])
        if self.decoding:
            x["decode"].append(self.decoding(d, self.held_items)["decoding_acceptance_length"])


def main(argv: Sequence[str] | None = None) -> None:
    args = parse(parser(), argv)
    project_env()
    import torch

    from eagle3nb.data.head import read_head_tensors
    from eagle3nb.data.reader import HiddenStates
    from eagle3nb.data.split import split_holdout
    from eagle3nb.params import from_dict
    from eagle3nb.toy import resolve_model_path
    from eagle3nb.train.build import build_draft
    from eagle3nb.train.stage import run as train_run

    block = rules(args.method).block
    model_dir = resolve_model_path(args.model)
    if args.draft_vocab is None:
        args.draft_vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"] if block else 128
    data_path = data_dir(args, model_dir)
    data = HiddenStates(data_path)
    if data.storage not in ("fp32", "bf16", "fp8"):
        refuse(f"{data_path} has storage {data.storage!r}: the peer needs the final state (bf16/fp8/fp32)")
    holdout = 0.2
    train_idx, held_idx = split_holdout([s["id"] for s in data.meta["samples"]], holdout)
    samples = data.meta["samples"]
    epoch_tokens = sum(int(samples[i]["length"]) for i in train_idx)
    work = Path(tempfile.mkdtemp(prefix="bench-peer-"))
    why_not = peer_missing(args.method, work)
    k = rules(args.method).drafts_per_block(args.block) if block else 3
    max_k = k if block else args.ttt
    shape_kw = {"block_size": args.block, "num_speculative_tokens": k} if block else {}
    # what 03 reads beside the shared settings: the method's own (EAGLE-3's TTT; the block's shape and loss)
    ours_kw = ({**shape_kw, "anchors_per_seq": 512, "block_loss": "kl", "block_weighting": "decay",
                "block_gamma": args.gamma} if block else {"ttt_steps": args.ttt, "step_decay": DECAY})

    # The shared initial weights: 03's own fresh draft (target embedding and lm_head rows), in both layouts.
    P0 = from_dict("03_train", {"run_name": "bench-peer", "data_dir": str(data_path), "method": args.method,
                                **shape_kw})
    init, _ = build_draft(P0, data)
    method = get(args.method)
    method.save(init, work / "init-ours", method.layouts[0])  # vLLM's layout, as 03's draft/
    if not why_not:
        method.save(init, work / "init-speculators", "speculators", verifier=str(model_dir))
    cfg = init.config
    print(f"data {data_path}: {len(train_idx)} training / {len(held_idx)} held-out samples, {epoch_tokens:,} "
          f"training tokens per epoch")
    shape = (f"block {args.block} ({k} drafts), {cfg.num_layers} layer(s), gamma {args.gamma}, KL, mask input "
             f"{args.mask} in ours" if block else f"TTT {args.ttt}, decay {DECAY}, draft vocab {cfg.draft_vocab_size}")
    print(f"{args.method} draft: hidden {cfg.hidden_size}, {cfg.num_attention_heads}x{cfg.head_dim} heads, MLP "
          f"{cfg.intermediate_size}; {shape}; {args.epochs} epochs, {args.seq} tokens/micro-batch, lr {args.lr} "
          f"cosine (5% warm-up), AdamW wd 0.01, clip 1.0, fp32, {args.threads} thread(s)")
    if why_not:
        print(f"\nthe peer cannot run here: {why_not}")

    norm_w = read_head_tensors(model_dir)["norm.weight"]
    peer_train = to_per_sample(data, train_idx, norm_w, work / "peer-train")
    probe = next(to_per_sample(data, held_idx[:1], norm_w, work / "peer-probe").glob("*.safetensors"))
    if block and args.max_anchors is None:  # no packed sequence holds more generated tokens than this
        args.max_anchors = math.ceil(args.seq * max(int(torch.as_tensor(data[i]["loss_mask"]).sum()) /
                                                    int(samples[i]["length"]) for i in train_idx))

    # 1. fairness: the same weights give the same logits and the same loss targets.
    max_diff = target_diff = float("nan")
    if not why_not:
        check = block_fairness if block else chain_fairness
        max_diff, target_diff, what = check(args, data, held_idx[0], work, probe)
        print(f"\nfairness: same initial weights, a {data[held_idx[0]]['input_ids'].shape[0]}-token held-out sample, "
              f"{what}: max |logit difference| {max_diff:.2e}; loss targets max |probability difference| "
              f"{target_diff:.2e}")

    # 2. train both, judge both, repeat.
    sides = Runs(args, data, held_idx, k, max_k)
    rows = sides.rows
    peer_info: dict = {}
    for r in range(args.repeats):
        out = work / f"ours-{r}"
        t = time.perf_counter()
        with open(work / f"ours-{r}.log", "w") as log, contextlib.redirect_stdout(log), \
                contextlib.redirect_stderr(log), mask_frozen(type(init), block and args.mask == "frozen"):
            m = train_run(from_dict("03_train", {
                "run_name": "bench-peer", "data_dir": str(data_path), "output_dir": str(out), "method": args.method,
                "init_from": str(work / "init-ours"), **ours_kw, "lr": args.lr, "warmup_ratio": 0.05,
                "weight_decay": 0.01, "epochs": args.epochs, "max_length": args.seq, "batch_tokens": args.seq,
                "grad_clip": 1.0, "eval_every": 0, "save_every": 10**6, "holdout_fraction": holdout,
                "device": "cpu", "seed": r, "resume": False}))
        rows["eagle3nb"]["s"].append(time.perf_counter() - t)
        rows["eagle3nb"]["tok_s"].append(m["tokens_per_s"])
        peer_info["our_steps"] = m["steps"]
        sides.judge(out / "draft", rows["eagle3nb"])
        if why_not:
            continue
        t = time.perf_counter()
        peer_info |= run_peer({
            "mode": "train", "method": args.method, "block": block, "draft": str(work / "init-speculators"),
            "data": str(peer_train), "threads": args.threads, "ttt_steps": args.ttt, "decay": DECAY,
            "gamma": args.gamma, "max_anchors": args.max_anchors, "lr": args.lr, "warmup_ratio": 0.05,
            "weight_decay": 0.01, "epochs": args.epochs, "total_seq_len": args.seq, "seed": r,
            "save_path": str(work / f"peer-ckpt-{r}"), "out_draft": str(work / f"peer-{r}")}, work)
        rows["speculators"]["s"].append(time.perf_counter() - t)
        rows["speculators"]["tok_s"].append(peer_info["tokens_per_s"])
        sides.judge(work / f"peer-{r}", rows["speculators"])
        print(f"  seed {r}: ours {rows['eagle3nb']['tok_s'][-1]:,.0f} tok/s tau {rows['eagle3nb']['tau'][-1]:.3f} "
              f"| speculators {peer_info['tokens_per_s']:,.0f} tok/s tau {rows['speculators']['tau'][-1]:.3f}",
              flush=True)

    untrained = {"tau": [], "decode": []}
    sides.judge(work / "init-ours", untrained)
    report(args, rows, untrained, max_diff, peer_info, init, k)
    print(f"(files in {work})")


def report(args, rows: dict, untrained: dict, max_diff: float, peer_info: dict, init, k: int) -> None:
    """The table: tokens/s and held-out tau (median, min..max over the seeds), and the ratios."""
    import statistics

    block = rules(args.method).block
    extra = f" {'decoding tau':>24}" if block else ""
    print(f"\n{'trainer':22} {'tokens/s (median, min..max)':>30} {f'held-out tau (k={k})':>26}{extra} "
          f"{'max |logit diff|':>17}")
    for name, label in (("eagle3nb", "eagle3nb (03)"), ("speculators", f"speculators {PEER_SPEC.split('==')[1]}")):
        x = rows[name]
        if not x["tok_s"]:
            print(f"{label:22} {'cannot run here':>30}")
            continue
        diff = "reference" if name == "eagle3nb" else f"{max_diff:.1e}"
        dec = f" {median_span(x['decode']) if x['decode'] else '—':>24}" if block else ""
        print(f"{label:22} {median_span(x['tok_s'], ',.0f'):>30} {median_span(x['tau']):>26}{dec} {diff:>17}")
    decoded = f"{untrained['decode'][0]:.3f}" if untrained["decode"] else "—"
    dec = f" {decoded:>24}" if block else ""
    print(f"{'untrained (init)':22} {'':>30} {untrained['tau'][0]:26.3f}{dec}")
    if not rows["speculators"]["tok_s"]:
        return
    ratio = statistics.median(rows["eagle3nb"]["tok_s"]) / statistics.median(rows["speculators"]["tok_s"])
    dtau = statistics.median(rows["eagle3nb"]["tau"]) - statistics.median(rows["speculators"]["tau"])
    print(f"\nratio tokens/s ours / speculators: {ratio:.2f}  (goal >= 1.0)")
    print(f"held-out tau ours - speculators: {dtau:+.3f}  (goal >= 0: not behind; their seed spread "
          f"{max(rows['speculators']['tau']) - min(rows['speculators']['tau']):.3f})")
    frozen = {"embed_tokens.weight", "lm_head.weight"} | ({"mask_embedding"} if args.mask == "frozen" else set())
    ours_n = sum(p.numel() for n, p in init.named_parameters() if p.requires_grad and not (block and n in frozen))
    packing = (f"{peer_info['steps_per_epoch'] * args.epochs} steps ({peer_info['steps_per_epoch']}/epoch) of one "
               f"packed [1, {args.seq}] sequence, padded to {args.seq}"
               + (f", {args.max_anchors} anchor blocks each" if block else "") + f"; ours {peer_info['our_steps']} "
               f"steps of up to {args.seq} tokens")
    print(f"trainable parameters: speculators {peer_info['trainable_params']:,} (frozen: "
          f"{', '.join(peer_info['frozen'])}); ours {ours_n:,}; speculators {packing}")


if __name__ == "__main__":
    main()
