"""Where block drafters overtake EAGLE-3.1: acceptance against the amount of training data (issue 43, item 4).

Every point trains through 03 itself (``eagle3nb.train.stage.run``, the harness' ``TRAIN`` settings) on the first
``n`` of the toy's own greedy answers to ``toy:train`` prompts (through 02: ``testkit.heldout``; the prompt sets are
nested, so the 48 answers are the first 48 of the 500), and is judged by 04's offline acceptance (the draft
package's offline simulation) at T=0 and T=1 on one fixed held-out set for every point: the toy's greedy answers
to the first ``--heldout`` ``toy:heldout`` prompts, questions no training answer asks. Every method trains on the
same data at the whole vocabulary (a block drafter has no reduced one, so the EAGLE drafts get it too) for the same
steps: ``max(--min-steps, --epochs passes over the set's tokens at TRAIN's batch_tokens a step)``; 03 holds out a
tenth of the set by id hash for its own end-of-run check, so a point trains on about 0.9 n answers. The methods:
EAGLE-3.1 at k=3 (3 TTT steps) and k=7 (7 TTT steps), and every registered block drafter (DFlash, DSpark,
DFlash2) at each ``--blocks`` size, judged at its block's k (DFlash, DFlash2: block - 1; DSpark: block). Served
speedup is not measured here (``bench_recipes.py`` serves a trained draft on the real vLLM; its CPU build serves
EAGLE-3 and DFlash only).

The crossover, per toy, depth, block and temperature: the smallest data size at which a block drafter's mean beats
an EAGLE-3.1 row's by more than both half ranges over the seeds together; with none, each curve's slope per decade
of data and where the fitted lines would cross. Writes ``results.json`` and, per toy and depth,
``crossover-<toy>-<depth>L.png`` (tau against training answers, one line per method, T=0 and T=1 panels) under
``--out``.

    python -m benchmarks.bench_crossover          # the reduced grid docs/recipes.md reports (~30 min here)
    python -m benchmarks.bench_crossover --full   # the full grid (~34 h here: the projection in docs/recipes.md)
    python -m benchmarks.bench_crossover --sizes 500 --depths 2 --methods dflash,dspark --out /tmp/xo
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks.harness import (
    THREADS,
    TOYS,
    TRAIN,
    Results,
    beats,
    choose,
    command_line,
    greedy_data,
    half_range,
    ints,
    judge,
    mean_half,
    parse,
    refuse,
    serve_drafts,
    table,
    train,
)
from eagle3nb.data.prompts import load_prompts
from eagle3nb.data.reader import HiddenStates
from eagle3nb.drafts import block_methods, rules
from eagle3nb.toy import shipped

EAGLE = {"eagle3.1/k3": 3, "eagle3.1/k7": 7}  # EAGLE-3.1 rows: k drafts a round, trained with k TTT steps


def methods() -> tuple[str, ...]:
    """The candidates: the EAGLE-3.1 rows, then every block drafter the registry holds, in its order."""
    return (*EAGLE, *block_methods())


# The full grid (issue 43): 10,000 answers are out of it because the toy generator has only 2,213 distinct
# toy:train prompts (eagle3nb/toy/dialogues.py refuses more).
FULL = {"toys": "smoke,demo,kimi", "sizes": "48,500,2000", "depths": "1,2,3,5", "blocks": "4,8,16:8", "seeds": 3,
        "heldout": 227, "epochs": 8, "min_steps": 200}
# The reduced grid docs/recipes.md reports: the data-size axis at one depth, both blocks, two seeds.
QUICK = {"toys": "smoke", "sizes": "48,500,2000", "depths": "1", "blocks": "4,8", "seeds": 2, "heldout": 227,
         "epochs": 3, "min_steps": 100}
TEMPS = ("t0", "t1")


def recipe(method: str, depth: int, block: int, served: int | None = None, causal: bool = False) -> dict:
    """03's settings for ``method`` beyond the harness' TRAIN, at ``depth`` draft layers (and ``block``, served
    as a block of ``served`` slots: the papers' train at 16, serve at 8; ``causal``: ``block_causal``)."""
    if method in EAGLE:
        k = EAGLE[method]
        return {"fc_norm": True, "norm_output": True, "ttt_steps": k, "num_speculative_tokens": k,
                "num_layers": depth}
    return {"method": method, "block_size": block, "block_causal": causal,
            "num_speculative_tokens": rules(method).drafts_per_block(served or block), "num_layers": depth}


def steps_for(tokens: int, epochs: int, min_steps: int, batch_tokens: int) -> int:
    """Optimizer steps for a data set of ``tokens``: ``epochs`` passes at ``batch_tokens`` a step, at least
    ``min_steps`` (small sets need many passes before held-out acceptance stops moving)."""
    return max(min_steps, math.ceil(epochs * tokens / batch_tokens))


def curves(points: list[dict], temp: str) -> dict[str, dict[int, list[float]]]:
    """Per label (method, or method/block), per data size, the seeds' acceptance at ``temp``."""
    out: dict[str, dict[int, list[float]]] = {}
    for p in points:
        if temp in p:
            out.setdefault(p["label"], {}).setdefault(p["n"], []).append(p[temp])
    return out


def overtakes(block: dict[int, list[float]], eagle: dict[int, list[float]]) -> int | None:
    """The smallest data size at which ``block``'s mean is above ``eagle``'s by more than both half ranges together
    (None: at no size both measured); one seed has no spread, so it needs only a higher mean."""
    return next((n for n in sorted(set(block) & set(eagle)) if beats(block[n], eagle[n])), None)


def fit(curve: dict[int, list[float]]) -> tuple[float, float]:
    """Least squares of the seeds' mean acceptance on log10(answers): (intercept, slope per decade)."""
    xs = [math.log10(n) for n in sorted(curve)]
    ys = [statistics.mean(curve[n]) for n in sorted(curve)]
    if len(xs) < 2:
        return ys[0], 0.0
    mx, my = statistics.mean(xs), statistics.mean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, slope


def crossing(block: dict[int, list[float]], eagle: dict[int, list[float]]) -> float | None:
    """Where ``block``'s fitted line would pass ``eagle``'s (answers), when it starts below and climbs faster; None
    when the lines never meet ahead (it is above already, or climbs no faster)."""
    (a_b, s_b), (a_e, s_e) = fit(block), fit(eagle)
    if s_b <= s_e:
        return None
    x = (a_e - a_b) / (s_b - s_e)
    return 10 ** min(x, 300) if x > math.log10(max(block)) else None  # near-parallel lines meet absurdly far


def verdicts(points: list[dict]) -> list[str]:
    """One line per (block drafter, EAGLE row, temperature) of one toy and depth: where it overtakes, or its slope
    and fitted crossing."""
    lines = []
    for temp in TEMPS:
        cs = curves(points, temp)
        for e in EAGLE:
            for label in (lb for lb in cs if lb.split("/")[0] in block_methods()):
                if e not in cs:
                    continue
                n = overtakes(cs[label], cs[e])
                if n is not None:
                    lines.append(f"{temp}: {label} overtakes {e} at {n} answers")
                    continue
                (_, s_b), (_, s_e) = fit(cs[label]), fit(cs[e])
                x = crossing(cs[label], cs[e])
                lines.append(f"{temp}: {label} does not overtake {e} up to {max(cs[label])} answers; slopes per decade "
                             f"{s_b:+.3f} against {s_e:+.3f}; fitted lines " +
                             (f"cross at ~{x:.2g} answers" if x else "do not cross ahead"))
    return lines


def points_table(points: list[dict]) -> str:
    """The markdown table docs/recipes.md carries: one row per (label, size), mean ± half range over the seeds."""
    groups: dict[tuple[int, int, str, int, int], list[dict]] = {}
    order = methods()
    for p in points:
        groups.setdefault((p["depth"], order.index(p["method"]), p["label"], p["n"], p["steps"]), []).append(p)
    rows = []
    for (depth, _, label, n, _), ps in sorted(groups.items()):
        if "error" in ps[0]:
            rows.append([label, depth, ps[0]["k"], n, "—", f"03 refuses it: {ps[0]['error']}", "—", "—", "—"])
            continue
        rows.append([label, depth, ps[0]["k"], n, ps[0]["steps"], mean_half([p["t0"] for p in ps]),
                     mean_half([p["t1"] for p in ps]), f"{statistics.mean(p['tps'] for p in ps):.0f}", len(ps)])
    return table(["method", "layers", "k", "answers", "steps", "offline T=0", "offline T=1", "train tok/s", "seeds"],
                 rows)


def plot(points: list[dict], path: Path, title: str) -> None:
    """tau against training answers (log axis), one line per label with the seeds' range, T=0 and T=1 panels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, temp, name in zip(axes, TEMPS, ("T=0", "T=1")):
        for label, curve in curves(points, temp).items():
            ns = sorted(curve)
            means = [statistics.mean(curve[n]) for n in ns]
            ax.errorbar(ns, means, yerr=[half_range(curve[n]) for n in ns], marker="o", capsize=3, label=label,
                        linestyle="--" if label in EAGLE else "-")
        ax.set_xscale("log")
        ax.set_xlabel("training answers (the toy's greedy answers)")
        ax.set_title(f"{title}, {name}")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("offline acceptance length tau (held-out)")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def data_for(model_dir: Path, prompts: str, n: int, out: Path, longer: Path | None = None) -> Path:
    """The toy's greedy answers to the first ``n`` of ``prompts`` through 02 at the whole vocabulary, kept under
    ``out`` and reused; ``longer``: the folder of a longer run of the same prompts, whose first ``n`` answers
    these are."""
    return greedy_data(model_dir, prompts, n, out, longer=longer)


KEY = ("toy", "n", "depth", "label", "seed", "steps")  # what makes two points the same run


def bench_toy(toy: str, args: argparse.Namespace, root: Path, results: Results) -> None:
    """Every (size, depth, block, method, seed) point on ``toy``, added to ``results`` and saved as it lands; a
    point an earlier run in the same ``--out`` landed is taken from there."""
    model_dir = shipped(toy)
    t0 = time.perf_counter()
    held = HiddenStates(data_for(model_dir, "toy:heldout", args.heldout, root / "data" / toy / "heldout"))
    made = [n for n in args.sizes if n not in args.data]
    top = max(made, default=0)  # answered once: the smaller sets are its first answers
    datas = {top: data_for(model_dir, "toy:train", top, root / "data" / toy / str(top))} if made else {}
    datas |= {n: data_for(model_dir, "toy:train", n, root / "data" / toy / str(n), datas[top].parent)
              for n in made if n != top}
    datas |= {n: Path(folder) for n, folder in args.data.items()}
    print(f"{toy}: {len(held)} held-out answers, training sets {args.sizes}, {time.perf_counter() - t0:.0f} s",
          flush=True)
    for seed in range(args.seeds):  # seeds outside: a machine's load drifts over the whole grid
        for n in args.sizes:
            data = HiddenStates(datas[n])
            tokens = sum(int(data[i]["input_ids"].shape[0]) for i in range(len(data)))
            steps = steps_for(tokens, args.epochs, args.min_steps, TRAIN["batch_tokens"])
            for depth in args.depths:
                for block, served in args.blocks:
                    for method in args.methods:
                        if method in EAGLE and (block, served) != args.blocks[0]:
                            continue  # EAGLE has no block: once per depth
                        label = method if method in EAGLE else \
                            f"{method}/{block}" + (f"->{served}" if served else "") + ("c" if args.causal else "")
                        point = {"toy": toy, "n": n, "tokens": tokens, "depth": depth, "block": block,
                                 "served": served, "method": method, "label": label, "seed": seed, "steps": steps,
                                 "causal": args.causal and method not in EAGLE, "eval_every": args.eval_every,
                                 "k": recipe(method, depth, block, served)["num_speculative_tokens"]}
                        earlier = results.reused(point)
                        if not earlier:
                            train_point(point, toy, datas[n], held, root)
                        results.add(earlier or point)


def train_point(point: dict, toy: str, data_dir: Path, held: HiddenStates, root: Path) -> None:
    """Train one point through 03 and judge it on the fixed held-out answers (or record 03's one-line refusal)."""
    out = root / "runs" / toy / str(point["n"]) / f"{point['depth']}L-{point['steps']}steps" / point["label"] / \
        str(point["seed"])
    point["run"] = str(out)
    t0 = time.perf_counter()
    extra = TOYS[toy] if point["method"] in EAGLE else {}
    metrics = train({"holdout_fraction": 0.1, "eval_every": point["eval_every"], **extra,
                     **recipe(point["method"], point["depth"], point["block"], point["served"], point["causal"])},
                    data_dir, out, point["seed"], point["steps"])
    if isinstance(metrics, str):
        point["error"] = metrics
        print(f"{toy} {point['label']}: 03 refuses it: {point['error']}", flush=True)
        return
    point["t0"], point["t1"] = judge(out / "draft", held, list(range(len(held))), point["k"])
    point["evals"] = [(r["step"], r["loss"]) for r in map(json.loads, (out / "metrics.jsonl").open())
                      if r.get("kind") == "eval"]  # 03's held-out loss: where the curve flattens
    point["tps"], point["seconds"] = metrics["tokens_per_s"], time.perf_counter() - t0
    diagnostics = metrics.get("best", {}).get("diagnostics")  # what the method's objective reports (LiLiCorr: prefixes)
    if diagnostics:
        point["diagnostics"] = diagnostics
    print(f"{toy} n={point['n']} {point['label']} seed {point['seed']} ({point['steps']} steps, "
          f"{point['seconds']:.0f} s): tau T=0 {point['t0']:.3f}, T=1 {point['t1']:.3f}" +
          (f"; 03's best evaluation: {json.dumps(diagnostics)}" if diagnostics else ""), flush=True)


def serve_points(toy: str, results: Results, n: int, depth: int, prompts: int) -> str:
    """Seed 0's ``depth``-layer draft of every label trained on ``n`` answers (its longest run), served by the
    real vLLM beside the plain target (``harness.serve_drafts``: T=0 speedup at c=1 and c=4, the counters' tau) on
    ``prompts`` held-out prompts; the markdown table docs/recipes.md carries."""
    mine = sorted((p for p in results.points if (p["toy"], p["n"], p["depth"], p["seed"]) == (toy, n, depth, 0)
                   and "error" not in p), key=lambda p: p["steps"])
    mine = list({p["label"]: p for p in mine}.values())
    served = serve_drafts(toy, {p["label"]: (Path(p["run"]) / "draft", p["k"]) for p in mine},
                          load_prompts("toy:heldout", prompts), 64, levels=(1, 4))
    rows = []
    for p in mine:
        v = served[p["label"]]
        cells = ([f"not served: {v}", "—", "—", "—"] if isinstance(v, str) else
                 [f"{v['v0']:.3f}", f"{v['v1']:.3f}", f"{v['speedup'][1]:.2f}x", f"{v['speedup'][4]:.2f}x"])
        rows.append([p["label"], p["depth"], p["k"], f"{p['t0']:.3f}", *cells])
        p["vllm"] = v
    results.save()
    return table(["method", "layers", "k", "offline T=0", "vLLM T=0", "vLLM T=1", "speedup c=1", "speedup c=4"], rows)


def parser() -> argparse.ArgumentParser:
    ap = command_line(__doc__)
    ap.add_argument("--full", action="store_true", help="the full grid (FULL, ~34 h here) instead of the reduced one "
                                                        "(QUICK, the default)")
    ap.add_argument("--toys", help="comma-separated shipped toys (default: the grid's): " + ", ".join(TOYS))
    ap.add_argument("--sizes", help="comma-separated training answers (default: the grid's)")
    ap.add_argument("--depths", help="comma-separated draft layers (default: the grid's)")
    ap.add_argument("--blocks", help="comma-separated block sizes of the block drafters, TRAINED:SERVED for a block "
                                     "trained long and served shorter, e.g. 8,16:8 (default: the grid's)")
    ap.add_argument("--eval-every", type=int, default=0, help="03's held-out evaluation every N steps (0: at the "
                                                                  "start and end), kept per point as evals")
    ap.add_argument("--causal", action="store_true", help="train the block drafters with block_causal (those whose "
                                                          "rules read it; labels end in c)")
    ap.add_argument("--methods", default=",".join(methods()), help="comma-separated: " + ", ".join(methods()))
    ap.add_argument("--seeds", type=int, help="seeds per point (0..N-1; default: the grid's)")
    ap.add_argument("--heldout", type=int, help="toy:heldout prompts answered for judging (at most 227)")
    ap.add_argument("--epochs", type=int, help="passes over a training set's tokens (default: the grid's)")
    ap.add_argument("--min-steps", type=int, help="the fewest optimizer steps a point trains (default: the grid's)")
    ap.add_argument("--out", type=Path, help="where results.json, crossover.png, data and runs go (default: a "
                                             "temporary folder; data and points already there are reused, so a "
                                             "stopped run resumes)")
    ap.add_argument("--data", action="append", default=[], metavar="N=DIR",
                    help="a training set made elsewhere: 02's output DIR holding N answers of the toy, e.g. "
                         "10000=outputs/smoke-10k/02_hidden_states (params/smoke-10k, by papermill); N joins --sizes")
    ap.add_argument("--serve", type=int, metavar="N", help="then serve seed 0's drafts trained on N answers on the "
                                                           "real vLLM: T=0 speedup at c=1 and c=4 (time it alone)")
    ap.add_argument("--serve-prompts", type=int, default=32, help="toy:heldout prompts sent to vLLM per level")
    ap.add_argument("--threads", **THREADS)
    return ap


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """The grid's values where a flag is not given, the lists parsed and checked, before any work: a one-line
    refusal naming the flag otherwise."""
    grid = FULL if args.full else QUICK
    for key in ("toys", "sizes", "depths", "blocks", "seeds", "heldout", "epochs", "min_steps"):
        if getattr(args, key) is None:
            setattr(args, key, grid[key])
    args.toys, args.methods = choose("--toys", args.toys, list(TOYS)), choose("--methods", args.methods, methods())
    args.sizes, args.depths = ints("--sizes", args.sizes), ints("--depths", args.depths)
    try:
        args.data = {int(n): Path(d) for n, d in (item.split("=", 1) for item in args.data)}
    except ValueError:
        refuse(f"--data takes N=DIR (answers=02's folder), e.g. 10000=outputs/smoke-10k/02_hidden_states; got "
               f"{args.data}")
    args.sizes = sorted(set(args.sizes) | set(args.data))
    args.blocks = [(ints("--blocks", b.split(":")[0])[0], ints("--blocks", b.split(":")[1])[0] if ":" in b else None)
                   for b in str(args.blocks).split(",")]
    if missing := [str(d) for d in args.data.values() if not (d / "index.json").exists()]:
        refuse(f"--data: no 02 output (index.json) in {', '.join(missing)}; run 02_hidden_states there first")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = resolve(parse(parser(), argv))
    with tempfile.TemporaryDirectory() as tmp:
        root = args.out or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        results = Results(root, KEY, landed=lambda p: "t0" in p)  # the points that landed (a refusal runs again)
        for toy in args.toys:
            bench_toy(toy, args, root, results)
        done = [p for p in results.points if "error" not in p]
        for toy in args.toys:
            print(f"\n{toy}:\n{points_table([p for p in results.points if p['toy'] == toy])}")
            for depth in args.depths:
                mine = [p for p in done if p["toy"] == toy and p["depth"] == depth]
                print(f"\n{toy}, {depth} layer(s):\n" + "\n".join(verdicts(mine)))
                plot(mine, root / f"crossover-{toy}-{depth}L.png", f"toy:{toy}, {depth} layer(s)")
            if args.serve:
                print(f"\n{toy}, served (seed 0, {args.serve} answers, {args.depths[0]} layer(s)):\n"
                      f"{serve_points(toy, results, args.serve, args.depths[0], args.serve_prompts)}")
        print(f"\nresults and figures in {root}" + ("" if args.out else " (a temporary folder, now removed)"))


if __name__ == "__main__":
    main()
