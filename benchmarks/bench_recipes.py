"""The 2026 draft recipes, one factor at a time against the EAGLE-3 baseline, on the smoke and the Kimi-shaped toy
(issue 24, item 2).

Every recipe trains through 03 itself (``eagle3nb.train.stage.run``) on the same data (the toy's own greedy
answers to ``toy:train`` prompts, through 02: ``testkit.heldout``), from the same seeds and for the same steps;
only its own parameter differs from the baseline's (which sets ``fc_norm: false, norm_output: false`` itself, so
it stays EAGLE-3.0 whatever 03's defaults are). Each draft is judged three ways, at greedy (T=0) and at
temperature 1 (sampled drafting):

- offline: 04's acceptance length at k=3 on the samples 03 held out (T=1: the expected acceptance of rejection
  sampling, sum min(p, q));
- local: our speculative decoder (``eagle3nb.decoder``, lossless: at T=0 every output is checked against the
  target's own greedy tokens) on held-out prompts (``toy:heldout``), acceptance length from its counters;
- vLLM (seed 0 only, one server per draft, ``draft_sample_method: probabilistic`` so T=1 drafts by sampling):
  the real vLLM's spec-decode counters on the same prompts, and the served speedup: output tokens/s with the draft
  over a plain vLLM server's on the same prompts at concurrency 1 and T=0, the two measured one after the other.
  vLLM runs with the project's fixes for its CPU build (the plugin ``eagle3nb_vllm_fixes``: without them its T=1
  acceptance is ~1.0 whatever the draft); ``--no-vllm-fixes`` serves the drafts without them, to show that.

with the spread over the seeds and 03's training tokens/s. The block drafters' rows (``dflash/4`` ... ``dspark/8``:
issue 35, item 6) train the same steps on a copy of the same answers that keeps the whole vocabulary (a block
drafter has no reduced one) and are judged at their block's k (DFlash: block - 1, DSpark: block); vLLM serves
DFlash here and refuses DSpark on a CPU (its V1 runner has no dspark, V2 needs Triton): that row's vLLM cells
carry vLLM's own error. A recipe "beats" the baseline only when its mean is
above the baseline's by more than both half ranges (over the seeds) together.

On ``toy:kimi`` (a DeepseekV3 MLA target) every EAGLE draft, the baseline's too, is an MLA draft (``draft_attention:
mla``, as params/vllm-cpu-kimi trains it); a block drafter keeps its Qwen3 attention, which vLLM's CPU build serves
beside an MLA target with the fixes plugin's block-size fix. A recipe 03 refuses is listed with 03's error.

    python benchmarks/bench_recipes.py               # every recipe on smoke, 3 seeds, vLLM (~25 min on 2 shared cores)
    python benchmarks/bench_recipes.py --no-vllm     # offline and local only (~17 min)
    python benchmarks/bench_recipes.py --seeds 1 --only baseline,muon
    python benchmarks/bench_recipes.py --toys kimi --only eagle3.1,num_layers=2,loss=lk_lambda --samples 32 --steps 40
    python benchmarks/bench_recipes.py --only eagle3.1,dflash/4,dflash/8,dspark/4,dspark/8   # the block drafters
    python benchmarks/bench_recipes.py --toys kimi \
        --only eagle3.1,dflash/4-2layers,dflash/8-2layers,dspark/4-2layers,dspark/8-2layers   # ... on the Kimi toy
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from eagle3nb.accept.offline import offline_acceptance  # noqa: E402
from eagle3nb.accept.online import bench_endpoint  # noqa: E402
from eagle3nb.data.prompts import load_prompts  # noqa: E402
from eagle3nb.data.reader import HiddenStates  # noqa: E402
from eagle3nb.data.split import split_holdout  # noqa: E402
from eagle3nb.data.stream import Template  # noqa: E402
from eagle3nb.decoder.batch import SpecDecoder  # noqa: E402
from eagle3nb.decoder.reference import plain_generate  # noqa: E402
from eagle3nb.drafts import DEFAULT, block_methods, load_draft, rules  # noqa: E402
from eagle3nb.errors import UserError  # noqa: E402
from eagle3nb.hf import DECODER, load_target  # noqa: E402
from eagle3nb.params import from_dict  # noqa: E402
from eagle3nb.serve.vllm import start_vllm, unavailable_reason  # noqa: E402
from eagle3nb.toy import shipped  # noqa: E402
from eagle3nb.train.stage import run  # noqa: E402
from eagle3nb.verification.verify import SpecCounters  # noqa: E402
from testkit.heldout import greedy_hidden_states  # noqa: E402

# One factor each, against the EAGLE-3.0 baseline (one Llama layer, no 3.1 norms, forward KL, AdamW).
BASELINE = {"fc_norm": False, "norm_output": False}
RECIPES: dict[str, dict] = {
    "baseline": BASELINE,
    "eagle3.1": {"fc_norm": True, "norm_output": True},
    "num_layers=2": {**BASELINE, "num_layers": 2},
    "loss=reverse_kl": {**BASELINE, "loss": "reverse_kl"},
    "loss=tv": {**BASELINE, "loss": "tv"},
    "loss=jsd": {**BASELINE, "loss": "jsd"},
    "loss=lk_alpha": {**BASELINE, "loss": "lk_alpha"},
    "loss=lk_lambda": {**BASELINE, "loss": "lk_lambda"},
    "muon": {**BASELINE, "optimizer": "muon"},
    "parallel_drafting": {**BASELINE, "parallel_drafting": True},  # P-EAGLE: all k drafts in one forward
    # Every registered block drafter (eagle3nb/drafts/dflash: DFlash, DSpark): a block of drafts in one forward,
    # k = the block's drafts (DFlash: the block less its anchor; DSpark: the block), one layer like EAGLE's, the
    # other settings 03's defaults ...
    **{f"{m}/{b}": {"method": m, "block_size": b, "num_speculative_tokens": rules(m).drafts_per_block(b),
                    "num_layers": 1}
       for m in block_methods() for b in (4, 8)},
    # ... and at the depth of the num_layers=2 row: a DFlash mask slot reads its anchor only through attention
    **{f"{m}/{b}-2layers": {"method": m, "block_size": b, "num_speculative_tokens": rules(m).drafts_per_block(b),
                            "num_layers": 2}
       for m in block_methods() for b in (4, 8)},
}
# The smoke run's 03 settings (params/smoke/03_train.yaml), a held-out quarter.
TRAIN = {"run_name": "bench", "ttt_steps": 3, "lr": 5e-3, "warmup_ratio": 0.05, "max_length": 1024,
         "batch_tokens": 1024, "eval_every": 0, "save_every": 1000, "holdout_fraction": 0.25}
# What every EAGLE run on a toy sets beyond TRAIN: an MLA target's EAGLE drafts are MLA drafts
# (params/vllm-cpu-kimi); a block drafter has its own (Qwen3) attention on every target.
TOYS: dict[str, dict] = {"smoke": {}, "demo": {}, "kimi": {"draft_attention": "mla"}}
K = 3  # the EAGLE recipes' k; a block drafter's is its block's drafts (``k_of``)
TEMPERATURES = (0.0, 1.0)
# Offline (t0, t1), local (l0, l1) acceptance lengths and train tokens/s per seed; vLLM's (v0, v1, speedup) at
# seed 0, or the one-line reason it did not serve the draft.
Row = dict[str, list[float] | str]


def k_of(name: str) -> int:
    """The drafts a round of recipe ``name`` proposes (vLLM's ``num_speculative_tokens``)."""
    return RECIPES[name].get("num_speculative_tokens", K)


def full_vocab(name: str) -> bool:
    """A block drafter drafts over the target's whole vocabulary (02 must store it: no reduced draft vocab)."""
    return rules(RECIPES[name].get("method", DEFAULT)).block


def spread(xs: list[float]) -> str:
    return f"{statistics.mean(xs):.3f} ± {(max(xs) - min(xs)) / 2:.3f}" if len(xs) > 1 else f"{xs[0]:.3f}"


def verdict(xs: list[float], base: list[float]) -> str:
    """The mean's gap to the baseline's, and whether it exceeds both half ranges together."""
    gap = statistics.mean(xs) - statistics.mean(base)
    if len(xs) < 2:  # one seed has no spread to beat
        return f"{gap:+.3f} (one seed: no spread)"
    noise = (max(xs) - min(xs)) / 2 + (max(base) - min(base)) / 2
    return f"{gap:+.3f} {'beats' if gap > noise else 'worse' if gap < -noise else 'within spread'}"


def judge(out: Path, data: HiddenStates, held: list[int], k: int) -> tuple[float, float]:
    """(greedy, sampled T=1) acceptance length at ``k`` of ``out/draft`` on the held-out samples."""
    draft = load_draft(out / "draft", embed_tokens=data.embed_tokens(), lm_head=data.lm_head())
    r = offline_acceptance(draft, data, k=k, max_k=k, temperature=1.0, indices=held)
    return r["greedy"]["acceptance_length"], r["sampled"]["acceptance_length"]


class Local:
    """Our speculative decoder on a toy's held-out prompts, with the target's own greedy tokens to check against."""

    def __init__(self, model_dir: Path, n: int, max_tokens: int):
        tpl = Template(model_dir, True)
        self.prompts = [tpl.prompt_ids(p["messages"]) for p in load_prompts("toy:heldout", n)]
        self.target = load_target(model_dir, trust_remote_code=False, use=DECODER)
        self.eos, self.max_tokens = [tpl.end_id], max_tokens
        self.plain = [plain_generate(self.target, p, max_tokens, eos_token_ids=self.eos) for p in self.prompts]

    def decoder(self, draft_dir: Path, k: int) -> SpecDecoder:
        """Our speculative decoder of the draft in ``draft_dir`` (on the target's embedding and head), ``k`` drafts
        a round."""
        draft = load_draft(draft_dir, embed_tokens=self.target.get_input_embeddings().weight.detach(),
                           lm_head=self.target.get_output_embeddings().weight.detach())
        return SpecDecoder(self.target, draft, k)

    @torch.inference_mode()
    def decode(self, draft_dir: Path, k: int) -> tuple[float, float, int]:
        """(acceptance length at T=0, at T=1, prompts whose T=0 output differs from the target's), ``k`` drafts a
        round."""
        dec = self.decoder(draft_dir, k)
        taus, mismatched = [], 0
        for t in TEMPERATURES:
            counters = SpecCounters(k)
            for i, (p, want) in enumerate(zip(self.prompts, self.plain)):
                res = dec.generate(p, self.max_tokens, t, self.eos, torch.Generator().manual_seed(i))
                counters.merge(res.counters)
                mismatched += t == 0.0 and res.tokens != want
            taus.append(counters.summary()["acceptance_length"])
        return taus[0], taus[1], mismatched


def bench_toy(toy: str, names: list[str], args: argparse.Namespace, root: Path) -> dict[str, Row | str]:
    """Each recipe on ``toy`` for every seed: offline and local acceptance and tokens/s, or 03's one-line
    refusal; then, with vLLM, seed 0's drafts served one at a time beside a plain server."""
    t0 = time.perf_counter()
    model_dir = shipped(toy)
    # The same answers for every recipe; the block drafters' copy keeps the whole vocabulary.
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    data_dirs = {full: greedy_hidden_states(model_dir, "toy:train", args.samples, 96, root / toy / f"data-{full}",
                                            draft_vocab_size=vocab if full else 128)
                 for full in sorted({full_vocab(n) for n in names})}
    datas = {full: HiddenStates(d) for full, d in data_dirs.items()}
    data = next(iter(datas.values()))
    _, held = split_holdout([s["id"] for s in data.meta["samples"]], TRAIN["holdout_fraction"])
    local = Local(model_dir, args.prompts, args.max_tokens)
    print(f"{toy} data: {len(data)} samples of the toy's greedy answers ({len(held)} held out), "
          f"{len(local.prompts)} held-out prompts for decoding, {time.perf_counter() - t0:.0f} s", flush=True)
    rows: dict[str, Row | str] = {name: {key: [] for key in ("t0", "t1", "l0", "l1", "lossy", "tps")}
                                  for name in names}
    for seed in range(args.seeds):  # seeds outside, recipes inside: a machine's load drifts over all recipes
        for name in names:
            row = rows[name]
            if isinstance(row, str):  # refused at an earlier seed: the same settings are refused again
                continue
            out, full = root / toy / "runs" / name / str(seed), full_vocab(name)
            try:
                metrics = run(from_dict("03_train", {**TRAIN, **({} if full else TOYS[toy]), **RECIPES[name],
                                                     "data_dir": str(data_dirs[full]),
                                                     "output_dir": str(out), "seed": seed,
                                                     "max_steps": args.steps}))
            except UserError as e:
                rows[name] = str(e).splitlines()[0]
                print(f"{toy} {name}: 03 refuses it: {rows[name]}", flush=True)
                continue
            t_greedy, t_sampled = judge(out, datas[full], held, k_of(name))
            l_greedy, l_sampled, lossy = local.decode(out / "draft", k_of(name))
            for key, value in zip(("t0", "t1", "l0", "l1", "lossy", "tps"),
                                  (t_greedy, t_sampled, l_greedy, l_sampled, lossy, metrics["tokens_per_s"])):
                row[key].append(value)
            print(f"{toy} {name} seed {seed}: offline tau T=0 {t_greedy:.3f}, T=1 {t_sampled:.3f}; local "
                  f"{l_greedy:.3f} / {l_sampled:.3f} ({lossy} not lossless); {metrics['tokens_per_s']:.0f} train tok/s",
                  flush=True)
    if args.vllm:
        serve_toy(toy, rows, root, load_prompts("toy:heldout", args.prompts), args.max_tokens, args.vllm_fixes)
    return rows


def root_cause(e: Exception) -> str:
    """The first error vLLM's log names (its engine's own, not the "initialization failed" that follows it; for a
    config vLLM's pydantic validation refuses, the refusal's own words on the line after), else the exception's last
    line: what a row says when vLLM did not start on its draft."""
    text = str(e).strip()
    log = re.search(r"its output \((\S+)\)", text)
    lines = Path(log.group(1)).read_text(errors="replace").splitlines() if log and Path(log.group(1)).exists() \
        else text.splitlines()
    causes = [m.group(1) for line in lines if (m := re.search(r"\bValue error, (.*?) \[type=", line))]
    causes += [m.group(0) for line in lines if (m := re.search(r"\b\w+Error: .*", line))
               and "WARNING" not in line and "initialization failed" not in line]
    return (causes[0] if causes else text.splitlines()[-1]).split(". ")[0][:200]  # its first sentence


def serve_drafts(toy: str, drafts: dict[str, tuple[Path, str, int]], prompts: list[dict], max_tokens: int,
                 fixes: bool = True, levels: tuple[int, ...] = (1,)) -> dict[str, dict | str]:
    """Each draft (name: folder, method, k) on the real vLLM, one server at a time beside one plain server: the
    counters' acceptance at T=0 (``v0``) and T=1 (``v1``, at c=4), and the speedup at T=0 per concurrency level
    (``speedup``: output tokens/s over the plain server's at that level, measured just before, so the machine's
    load drifts between pairs, not within one). A draft vLLM does not serve, or a level with failed requests, gets
    the one-line reason instead."""
    out: dict[str, dict | str] = {}
    t0 = time.perf_counter()
    with start_vllm(f"toy:{toy}", "plain") as plain:
        print(f"{toy} vLLM plain server up in {time.perf_counter() - t0:.0f} s", flush=True)
        for name, (draft_dir, method, k) in drafts.items():
            t0 = time.perf_counter()
            try:  # DSpark on a CPU: vLLM's own refusal (its V1 runner has no dspark, V2 needs Triton) goes in the row
                server = start_vllm(f"toy:{toy}", method, draft_dir=draft_dir, num_speculative_tokens=k,
                                    speculative={"draft_sample_method": "probabilistic"}, fixes=fixes)
            except (RuntimeError, UserError) as e:  # a draft vLLM does not start on: its reason goes in the row
                out[name] = root_cause(e)
                print(f"{toy} {name}: vLLM did not serve it: {out[name]}", flush=True)
                continue
            with server:
                up = time.perf_counter() - t0
                base = bench_endpoint("plain", plain.base_url, prompts, levels, max_tokens, 0.0, warmup=1)
                greedy = bench_endpoint(name, server.base_url, prompts, levels, max_tokens, 0.0, warmup=1, k=k)
                sampled = bench_endpoint(name, server.base_url, prompts, [4], max_tokens, 1.0, warmup=0, k=k)[0]
            errors = sum(r["errors"] for r in base + greedy) + sampled["errors"]
            if errors:
                first = next((r["first_error"] for r in greedy + [sampled] if r.get("first_error")), None)
                out[name] = f"{errors} request(s) failed: {first}"
                continue
            speedup = {c: g["output_tokens_per_s"] / b["output_tokens_per_s"] for c, b, g in zip(levels, base, greedy)}
            out[name] = {"v0": greedy[0]["acceptance_length"], "v1": sampled["acceptance_length"], "speedup": speedup}
            print(f"{toy} {name} on vLLM (up in {up:.0f} s): tau T=0 {out[name]['v0']:.3f}, T=1 {out[name]['v1']:.3f}; "
                  "speedup " + ", ".join(f"c={c} {x:.2f}x ({g['output_tokens_per_s']:.1f} vs plain "
                                         f"{b['output_tokens_per_s']:.1f} tok/s)"
                                         for (c, x), b, g in zip(speedup.items(), base, greedy)), flush=True)
    return out


def serve_toy(toy: str, rows: dict[str, Row | str], root: Path, prompts: list[dict], max_tokens: int,
              fixes: bool = True) -> None:
    """Seed 0's draft of every recipe on the real vLLM (:func:`serve_drafts`, c=1), its cells added to its row."""
    drafts = {name: (root / toy / "runs" / name / "0" / "draft", RECIPES[name].get("method", DEFAULT), k_of(name))
              for name, row in rows.items() if not isinstance(row, str)}
    for name, served in serve_drafts(toy, drafts, prompts, max_tokens, fixes).items():
        if isinstance(served, str):
            rows[name]["vllm"] = served
        else:
            rows[name]["v0"], rows[name]["v1"], rows[name]["speedup"] = [served["v0"]], [served["v1"]], \
                [served["speedup"][1]]


def print_table(toy: str, rows: dict[str, Row | str], args: argparse.Namespace) -> None:
    """The markdown table docs/recipes.md carries, then each recipe's training speed relative to the baseline's."""
    base = rows["baseline"]
    if isinstance(base, str):
        print(f"\n{toy}: the baseline itself is refused ({base}); nothing to compare")
        return
    lossy = sum(sum(r["lossy"]) for r in rows.values() if not isinstance(r, str))
    runs = sum(len(r["lossy"]) for r in rows.values() if not isinstance(r, str))
    print(f"\n{toy}{' (MLA drafts)' if TOYS[toy] else ''}: acceptance length at k={K} (a block drafter's: its "
          "block's drafts) "
          f"(mean ± half range over {args.seeds} seed(s)), {args.steps} steps, {args.samples} samples; offline on "
          f"03's held-out samples, local{' and vLLM' if args.vllm else ''} on {args.prompts} held-out prompts x "
          f"{args.max_tokens} tokens; "
          f"local decoding at T=0 gave the target's own tokens in {runs * args.prompts - lossy} of "
          f"{runs * args.prompts} prompt runs" +
          (f"; vLLM columns: seed 0{'' if args.vllm_fixes else ', WITHOUT the fixes'}" if args.vllm else ""))
    vllm_cols = " vLLM T=0 (seed 0) | vLLM T=1 (seed 0) | served speedup (seed 0) |" if args.vllm else ""
    print(f"| recipe | k | offline T=0 | offline T=1 | local T=0 | local T=1 |{vllm_cols} train tok/s | "
          "vs baseline (offline T=0 / T=1) |")
    print("| --- " * (8 + 3 * args.vllm) + "|")
    for name, row in rows.items():
        if isinstance(row, str):
            print(f"| {name} | {k_of(name)} |" + " — |" * (5 + 3 * args.vllm) + f" 03 refuses it: {row} |")
            continue
        verdicts = ["—"] if name == "baseline" else [verdict(row[key], base[key]) for key in ("t0", "t1")]
        served = ""
        if args.vllm:
            served = (f" not served: {row['vllm']} | — | — |" if "vllm" in row else
                      f" {row['v0'][0]:.3f} | {row['v1'][0]:.3f} | {row['speedup'][0]:.2f}x |")
        cells = " | ".join(spread(row[key]) for key in ("t0", "t1", "l0", "l1"))
        print(f"| {name} | {k_of(name)} | {cells} |{served} {statistics.mean(row['tps']):.0f} | "
              f"{' / '.join(verdicts)} |")
    tps = statistics.mean(base["tps"])
    print(f"\n{toy} training speed vs baseline: " + ", ".join(
        f"{n} {statistics.mean(r['tps']) / tps:.2f}x" for n, r in rows.items() if n != "baseline" and
        not isinstance(r, str)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--toys", default="smoke", help="comma-separated shipped toys: " + ", ".join(TOYS))
    ap.add_argument("--seeds", type=int, default=3, help="seeds per recipe (0..N-1)")
    ap.add_argument("--steps", type=int, default=60, help="optimizer steps per run (the same for every recipe)")
    ap.add_argument("--samples", type=int, default=48, help="toy:train prompts answered by the toy (train + held out)")
    ap.add_argument("--prompts", type=int, default=8, help="toy:heldout prompts decoded locally and sent to vLLM")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens per decoded prompt")
    ap.add_argument("--only", default="", help="comma-separated recipe names (default: all): " + ", ".join(RECIPES))
    ap.add_argument("--no-vllm", dest="vllm", action="store_false", help="skip the real vLLM's columns")
    ap.add_argument("--no-vllm-fixes", dest="vllm_fixes", action="store_false",
                    help="serve the drafts without the vLLM plugin eagle3nb_vllm_fixes (the CPU build's defects back)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    toys = [t for t in args.toys.split(",") if t]
    names = [n for n in (args.only.split(",") if args.only else RECIPES) if n]
    for flag, given, known in (("--toys", toys, TOYS), ("--only", names, RECIPES)):
        unknown = [n for n in given if n not in known]
        if unknown or not given:
            what = f"unknown {', '.join(unknown)}" if unknown else "nothing given"
            sys.exit(f"{flag}: {what}; choose from {', '.join(known)}")
    if args.vllm and unavailable_reason():
        sys.exit(f"the real vLLM cannot run here ({unavailable_reason()}); pass --no-vllm to skip its columns")
    if "baseline" not in names:
        names.insert(0, "baseline")
    with tempfile.TemporaryDirectory() as tmp:
        tables = {toy: bench_toy(toy, names, args, Path(tmp)) for toy in toys}
    for toy, rows in tables.items():
        print_table(toy, rows, args)


if __name__ == "__main__":
    main()
