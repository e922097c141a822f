"""What the benchmarks share, written once: their command lines' conventions, measuring side by side, the toy world
they train and judge drafts on, serving drafts beside a plain server, tables, a results file a stopped run resumes
from; and which of them ``make bench`` runs (``QUICK``) and which it only names, with their run times and commands
(``LONG``).

A benchmark is a module ``benchmarks/bench_<name>.py``, run from the repository root as ``python -m
benchmarks.bench_<name>``: its docstring says what it compares and the target ratio, ``parser()`` builds its command
line and ``main(argv)`` runs it. Timings on a shared machine are noisy, so each measures the thing and its reference
in the same run (:func:`alternate`) and reports the ratio. No benchmark names a draft method: the registry
(``eagle3nb.drafts``) says which are registered, which draft in blocks and what each is served as.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, TypeVar

ROOT = Path(__file__).resolve().parents[1]
T = TypeVar("T")


# ----------------------------------------------------------------------------------- which ones `make bench` runs


@dataclass(frozen=True)
class Bench:
    """One benchmark's entry in the run list: its module, the flags ``make bench`` (or its command) gives it, and
    its run time on this project's 2 shared cores (measured, or where a doc measured it, that doc)."""

    name: str
    args: tuple[str, ...] = ()
    minutes: float = 0.0
    note: str = ""

    @property
    def command(self) -> str:
        return " ".join(("python -m benchmarks." + self.name, *self.args))


# What `make bench` (`python -m benchmarks`) runs, in turn, each in its own process: 4.0 minutes in all (3.0 of
# CPU), measured here one after the other on 2 cores shared with other work (load average ~2.5).
QUICK = (
    Bench("bench_train", ("--repeats", "3"), 0.9),
    Bench("bench_hidden", ("--tokens", "4000", "--repeats", "1"), 0.5),
    Bench("bench_online", ("--model", "toy:smoke", "--samples", "32", "--steps", "6", "--repeats", "1"), 0.2),
    Bench("bench_spec", (), 0.3),
    Bench("bench_serve", (), 0.2),
    Bench("bench_spec_serve", (), 0.3, "0.8 min on first use: it trains its draft and caches it in .cache/"),
    Bench("bench_synth", (), 0.9),
    Bench("bench_gate_power", (), 0.4),
    Bench("bench_redact", (), 0.4),
)
# What it names instead, with their run times (measured here, or where a doc measured them) and commands.
LONG = (
    Bench("bench_scale", (), 5, "10K, 100K and 1M samples, 0.76 GB of disk at 1M; --quick stops at 100K (1.3 min); "
                                "docs/benchmarks.md"),
    Bench("bench_kimi", ("--tokens", "128", "--threads", "1"), 2,
          "Kimi-K2.5 widths one module at a time: the 163840-row head alone is 4.7 GB in fp32; docs/benchmarks.md"),
    Bench("bench_peer", (), 3, "~1 min after installing speculators 0.9.0 into .venv-speculators/ on first use "
                               "(~2 min); --method M, any registered method it ships; docs/benchmarks.md"),
    Bench("bench_t1_spread", (), 8, "needs the real vLLM (make vllm), else --no-vllm; docs/recipes.md"),
    Bench("bench_mask_input", (), 10, "docs/block-drafters.md"),
    Bench("bench_recipes", (), 25, "needs the real vLLM (make vllm), else --no-vllm (~17 min); docs/recipes.md"),
    Bench("bench_crossover", ("--out", "/tmp/crossover"), 30,
          "the reduced grid, resumable from its --out; --full ~34 h; docs/recipes.md"),
    Bench("bench_select", (), 6, "06's selection on the smoke toy, three candidates; needs the real vLLM (make vllm), "
                                 "else --engine embedded (docs/select.md)"),
)


# ----------------------------------------------------------------------------------- command lines


def command_line(doc: str | None) -> argparse.ArgumentParser:
    """A benchmark's command line, described by its docstring's first line."""
    return argparse.ArgumentParser(description=(doc or "").split("\n")[0])


# The flags several benchmarks take, with one meaning each: ``ap.add_argument("--threads", **THREADS)``.
THREADS = {"type": int, "default": 1, "help": "torch threads (on two shared cores a second thread mostly waits "
                                              "for the first)"}
SEEDS = {"type": int, "default": 3, "help": "seeds per point (0..N-1)"}
STEPS = {"type": int, "default": 60, "help": "03's optimizer steps per run (the same for every variant)"}
SAMPLES = {"type": int, "default": 48, "help": "toy:train prompts the toy answers (03's training and held-out data)"}
MAX_TOKENS = {"type": int, "default": 64, "help": "tokens per decoded prompt"}
REPEATS = {"type": int, "default": 2, "help": "alternating runs of each side, the best kept"}


def parse(ap: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """A benchmark's arguments, its ``--threads`` (:data:`THREADS`) set as torch's intra-op threads before any work
    (torch imported here: a command line that takes no threads stays light)."""
    args = ap.parse_args(argv)
    if getattr(args, "threads", None):
        import torch

        torch.set_num_threads(args.threads)
    return args


def refuse(message: str) -> NoReturn:
    """Stop before any work with one line naming what is wrong and what to do."""
    sys.exit(message)


def choose(flag: str, text: str, known: Sequence[str]) -> list[str]:
    """The comma-separated names of ``flag``, each one of ``known``; else the one-line refusal listing them."""
    given = [x for x in text.split(",") if x]
    unknown = [x for x in given if x not in known]
    if unknown or not given:
        what = f"unknown {', '.join(unknown)}" if unknown else "nothing given"
        refuse(f"{flag}: {what}; choose from {', '.join(known)}")
    return given


def ints(flag: str, text: str | int) -> list[int]:
    """The comma-separated integers of ``flag``; else the one-line refusal."""
    try:
        return [int(x) for x in str(text).split(",")]
    except ValueError:
        refuse(f"{flag} takes comma-separated integers, e.g. 48,500; got {text!r}")


def project_env() -> None:
    """The project's folders for what a benchmark starts (servers, the toy cache) when it runs from the repository:
    ``EAGLE3NB_ROOT`` and ``EAGLE3NB_CACHE`` where not set."""
    os.environ.setdefault("EAGLE3NB_ROOT", str(ROOT))
    os.environ.setdefault("EAGLE3NB_CACHE", str(ROOT / ".cache"))


# ----------------------------------------------------------------------------------- side by side


def alternate(sides: dict[str, Callable[[], T]], repeats: int) -> dict[str, list[T]]:
    """Each side's measurement ``repeats`` times, the sides in turn (A B A B ...): a change of load on the shared
    machine hits every side alike, so the ratios of one run are what to read."""
    out: dict[str, list[T]] = {name: [] for name in sides}
    for _ in range(repeats):
        for name, measure in sides.items():
            out[name].append(measure())
    return out


def half_range(xs: Sequence[float]) -> float:
    return (max(xs) - min(xs)) / 2


def mean_half(xs: Sequence[float]) -> str:
    """``mean ± half range`` over the seeds (one value alone as it is)."""
    return f"{statistics.mean(xs):.3f} ± {half_range(xs):.3f}" if len(xs) > 1 else f"{xs[0]:.3f}"


def median_span(xs: Sequence[float], fmt: str = ".3f") -> str:
    """``median (min..max)`` over the repeats."""
    return f"{statistics.median(xs):{fmt}} ({min(xs):{fmt}}..{max(xs):{fmt}})"


def beats(xs: Sequence[float], base: Sequence[float]) -> bool:
    """Whether ``xs``' mean is above ``base``'s by more than both half ranges together (one seed has no spread:
    a higher mean is enough)."""
    return statistics.mean(xs) - statistics.mean(base) > half_range(xs) + half_range(base)


def verdict(xs: Sequence[float], base: Sequence[float]) -> str:
    """The mean's gap to the baseline's, and whether it exceeds both half ranges together."""
    gap = statistics.mean(xs) - statistics.mean(base)
    if len(xs) < 2:  # one seed has no spread to beat
        return f"{gap:+.3f} (one seed: no spread)"
    return f"{gap:+.3f} {'beats' if beats(xs, base) else 'worse' if beats(base, xs) else 'within spread'}"


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A markdown table (what the docs carry)."""
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


class Results:
    """A benchmark's ``results.json`` under its ``--out``: saved as each point lands, so a stopped run resumes; the
    points an earlier run there landed are reused where every field of ``key`` matches."""

    def __init__(self, root: Path, key: Sequence[str], landed: Callable[[dict], bool]):
        self.path, self.key = Path(root) / "results.json", tuple(key)
        self.points: list[dict] = []
        self.earlier = [p for p in json.loads(self.path.read_text()) if landed(p)] if self.path.exists() else []

    def reused(self, point: dict) -> dict | None:
        """An earlier run's point for the same run as ``point``, or None."""
        return next((p for p in self.earlier if all(p.get(k) == point[k] for k in self.key)), None)

    def add(self, point: dict) -> None:
        self.points.append(point)
        self.save()

    def save(self) -> None:
        self.path.write_text(json.dumps(self.points, indent=1))


def draft_module(method: str, module: str) -> Any:
    """A module of ``method``'s draft package (``eagle3nb.drafts.PACKAGES``: its ``model``, ``objective``,
    ``offline``), for what a benchmark measures inside one method's own code."""
    import importlib

    from eagle3nb.drafts import PACKAGES

    package = PACKAGES[method]
    return importlib.import_module(f"{getattr(package, '__name__', package)}.{module}")


# ----------------------------------------------------------------------------------- the toy world

# The smoke run's 03 settings (params/smoke/03_train.yaml), a held-out quarter: every trained benchmark's base.
TRAIN = {"run_name": "bench", "ttt_steps": 3, "lr": 5e-3, "warmup_ratio": 0.05, "max_length": 1024,
         "batch_tokens": 1024, "eval_every": 0, "save_every": 1000, "holdout_fraction": 0.25}
# What every EAGLE run on a shipped toy sets beyond TRAIN: an MLA target's EAGLE drafts are MLA drafts
# (params/vllm-cpu-kimi); a block drafter has its own (Qwen3) attention on every target.
TOYS: dict[str, dict] = {"smoke": {}, "demo": {}, "kimi": {"draft_attention": "mla"}}


def vocab_size(model_dir: Path) -> int:
    """The target's vocabulary (a block drafter drafts over all of it: 02 keeps it whole for one)."""
    return json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]


def greedy_data(model_dir: Path, prompts: str, n: int, out: Path, draft_vocab: int | None = None,
                max_new_tokens: int = 96, longer: Path | None = None) -> Path:
    """02's folder of the toy's own greedy answers to the first ``n`` of ``prompts`` (``testkit.heldout``), kept
    under ``out`` and reused when there; ``draft_vocab`` None keeps the whole vocabulary; ``longer``: the folder of
    a longer run of the same prompts, whose first ``n`` answers these are."""
    from testkit.heldout import greedy_hidden_states

    if (Path(out) / "02" / "index.json").exists():
        return Path(out) / "02"
    return greedy_hidden_states(model_dir, prompts, n, max_new_tokens, out, answers_from=longer,
                                draft_vocab_size=draft_vocab or vocab_size(model_dir))


def held_out(data: Any, fraction: float = TRAIN["holdout_fraction"]) -> list[int]:
    """The samples 03 holds out of ``data`` (a ``HiddenStates``) at ``fraction``: what a trained draft is judged on."""
    from eagle3nb.data.split import split_holdout

    return split_holdout([s["id"] for s in data.meta["samples"]], fraction)[1]


def train(settings: dict, data_dir: Path, out: Path, seed: int, steps: int, base: dict = TRAIN) -> dict | str:
    """03 itself (``eagle3nb.train.stage.run``) on ``data_dir`` with ``base`` and ``settings``: its metrics, or its
    one-line refusal of the settings."""
    from eagle3nb.errors import UserError
    from eagle3nb.params import from_dict
    from eagle3nb.train.stage import run

    try:
        return run(from_dict("03_train", {**base, **settings, "data_dir": str(data_dir), "output_dir": str(out),
                                          "seed": seed, "max_steps": steps}))
    except UserError as e:
        return str(e).splitlines()[0]


def small_draft(model_dir: Path, work: Path) -> Path:
    """A small EAGLE-3 draft trained on the target's greedy answers to 48 toy prompts (a minute or so): ``work/03``."""
    data = greedy_data(model_dir, "toy:train", 48, work, draft_vocab=128, max_new_tokens=64)
    metrics = train({"ttt_steps": 4, "max_length": 256, "batch_tokens": 512, "lr": 3e-3, "holdout_fraction": 0.05},
                    data, work / "03", 0, 120)
    if isinstance(metrics, str):
        refuse(f"03 refused the small draft's settings: {metrics}")
    return work / "03" / "draft"


def judged_draft(draft_dir: Path, data: Any) -> Any:
    """The draft in ``draft_dir`` on ``data``'s target embedding and head (a ``HiddenStates``)."""
    from eagle3nb.drafts import load_draft

    return load_draft(draft_dir, embed_tokens=data.embed_tokens(), lm_head=data.lm_head())


def offline(draft_dir: Path, data: Any, held: list[int], k: int, temperature: float = 1.0) -> dict:
    """04's offline acceptance of the draft at ``k`` on the held-out samples: ``greedy`` and ``sampled`` (at
    ``temperature``: the expected acceptance of rejection sampling, sum min(p, q))."""
    from eagle3nb.accept.offline import offline_acceptance

    return offline_acceptance(judged_draft(draft_dir, data), data, k=k, max_k=k, temperature=temperature,
                              indices=held)


def judge(draft_dir: Path, data: Any, held: list[int], k: int) -> tuple[float, float]:
    """(greedy, sampled T=1) offline acceptance length at ``k`` on the held-out samples."""
    r = offline(draft_dir, data, held, k)
    return r["greedy"]["acceptance_length"], r["sampled"]["acceptance_length"]


class Local:
    """Our speculative decoder on a toy's held-out prompts, with the target's own greedy tokens to check against."""

    def __init__(self, model_dir: Path, n: int, max_tokens: int):
        from eagle3nb.data.prompts import load_prompts
        from eagle3nb.data.stream import Template
        from eagle3nb.decoder.reference import plain_generate
        from eagle3nb.hf import DECODER, load_target

        tpl = Template(model_dir, True)
        self.prompts = [tpl.prompt_ids(p["messages"]) for p in load_prompts("toy:heldout", n)]
        self.target = load_target(model_dir, trust_remote_code=False, use=DECODER)
        self.eos, self.max_tokens = [tpl.end_id], max_tokens
        self.plain = [plain_generate(self.target, p, max_tokens, eos_token_ids=self.eos) for p in self.prompts]

    def decoder(self, draft_dir: Path, k: int) -> Any:
        """Our speculative decoder of the draft in ``draft_dir`` (on the target's embedding and head), ``k`` drafts
        a round."""
        from eagle3nb.decoder.batch import SpecDecoder
        from eagle3nb.drafts import load_draft

        draft = load_draft(draft_dir, embed_tokens=self.target.get_input_embeddings().weight.detach(),
                           lm_head=self.target.get_output_embeddings().weight.detach())
        return SpecDecoder(self.target, draft, k)

    def decode(self, draft_dir: Path, k: int, temperatures: Sequence[float] = (0.0, 1.0)) -> tuple[list[float], int]:
        """(acceptance length at each temperature, prompts whose T=0 output differs from the target's), ``k`` drafts
        a round, prompt i seeded i."""
        import torch

        from eagle3nb.verification.verify import SpecCounters

        dec = self.decoder(draft_dir, k)
        taus, mismatched = [], 0
        with torch.inference_mode():
            for t in temperatures:
                counters = SpecCounters(k)
                for i, (p, want) in enumerate(zip(self.prompts, self.plain)):
                    res = dec.generate(p, self.max_tokens, t, self.eos, torch.Generator().manual_seed(i))
                    counters.merge(res.counters)
                    mismatched += t == 0.0 and res.tokens != want
                taus.append(counters.summary()["acceptance_length"])
        return taus, mismatched


# ----------------------------------------------------------------------------------- servers


def questions(n: int) -> list[str]:
    """``n`` toy held-out questions (the same on every run: seed 0)."""
    from eagle3nb.toy.dialogues import problem

    rng = random.Random(0)
    return [problem(rng, "heldout")["question"] for _ in range(n)]


async def chat(client: Any, model: str, asked: list[str], concurrency: int, max_tokens: int
               ) -> tuple[list[list[int]], float]:
    """(token ids per request, seconds) of greedy chat requests, at most ``concurrency`` in flight."""
    import asyncio

    gate = asyncio.Semaphore(concurrency)

    async def one(q: str) -> list[int]:
        async with gate:
            r = await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": q}], temperature=0, max_tokens=max_tokens,
                extra_body={"return_token_ids": True})
            return r.choices[0].token_ids

    t0 = time.perf_counter()
    out = await asyncio.gather(*(one(q) for q in asked))
    return list(out), time.perf_counter() - t0


def serve_drafts(toy: str, drafts: dict[str, tuple[Path, int]], prompts: list[dict], max_tokens: int,
                 fixes: bool = True, levels: tuple[int, ...] = (1,)) -> dict[str, dict | str]:
    """Each draft (name: folder, k) on the real vLLM, served as the method its config.json declares
    (``served_method``), one server at a time beside one plain server: the counters' acceptance at T=0 (``v0``) and
    T=1 (``v1``, at c=4, sampled drafting), and the speedup at T=0 per concurrency level (``speedup``: output
    tokens/s over the plain server's at that level, measured just before, so the machine's load drifts between
    pairs, not within one). A draft vLLM does not serve, or a level with failed requests, gets the one-line reason
    instead."""
    from eagle3nb.accept.online import bench_endpoint
    from eagle3nb.drafts import served_method
    from eagle3nb.errors import UserError
    from eagle3nb.select.engines import refusal
    from eagle3nb.serve.vllm import start_vllm

    out: dict[str, dict | str] = {}
    t0 = time.perf_counter()
    with start_vllm(f"toy:{toy}", "plain") as plain:
        print(f"{toy} vLLM plain server up in {time.perf_counter() - t0:.0f} s", flush=True)
        for name, (draft_dir, k) in drafts.items():
            t0 = time.perf_counter()
            try:  # a draft vLLM does not start on (its CPU build has no runner for it): its reason goes in the row
                server = start_vllm(f"toy:{toy}", served_method(draft_dir), draft_dir=draft_dir,
                                    num_speculative_tokens=k, speculative={"draft_sample_method": "probabilistic"},
                                    fixes=fixes)
            except (RuntimeError, UserError) as e:
                out[name] = refusal(e)
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


# ----------------------------------------------------------------------------------- synthetic data


def write_samples(out: Path, vocab: int, lengths: Iterable[int], rng: random.Random) -> Path:
    """01-format rows of random token ids (what a cost depends on is the tokens' count, not what they say), one per
    length, loss on all but the first quarter: ``out/samples-00000.jsonl``."""
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for i, n in enumerate(lengths):
        rows.append({"id": f"b{i:05d}", "status": "ok", "input_ids": [rng.randrange(vocab) for _ in range(n)],
                     "loss_mask": [0] * (n // 4) + [1] * (n - n // 4), "category": "bench"})
    (out / "samples-00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out
