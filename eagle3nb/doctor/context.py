"""What the doctor knows about a run: each stage's params and the artifacts they point at, loaded once,
lazily, and shared by the checks. Every network call has a timeout and 01_synth's retry policy; embedded
servers it starts are stopped when the check-up ends."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from functools import cached_property
from pathlib import Path
from typing import Any, Awaitable, Callable

from eagle3nb.data.split import split_holdout
from eagle3nb.data.stream import Template
from eagle3nb.doctor.result import FAIL, CheckResult
from eagle3nb.errors import InputError
from eagle3nb.families import AUTO, detect
from eagle3nb.launch import start_server
from eagle3nb.params import STAGES, ParamsError, StageParams, TargetParams, from_dict
from eagle3nb.params_yaml import run_params
from eagle3nb.paths import project_root, resolve
from eagle3nb.synth.client import Endpoint, FatalServerError, GaveUp, base_url, chat, retried, run_sync
from eagle3nb.synth.probe import landed

PROBE_QUESTION = "What is 2+2?"
# Token-stream probes: short questions every chat model answers briefly (the toy's own kind included).
STREAM_PROBES = [PROBE_QUESTION, "How many letters are in the word apple?"]
# Enough for a reasoning model to answer 2+2 (never more than the run's own max_completion_tokens).
PROBE_MAX_TOKENS = 2048
# Prompt length assumed when projecting disk use before any sample exists.
PROMPT_TOKENS_GUESS = 512


class Unavailable(Exception):
    """An artifact a check needs is missing; the message says which and how to get it (the check skips)."""


class Context:
    def __init__(self, params: dict[str, StageParams], problems: dict[str, str], *, serving_engine: str = "vllm",
                 serving_thinking: bool | None = None, server_url: str | None = None, timeout_s: float = 60.0):
        if serving_engine not in ("vllm", "sglang"):
            raise InputError(f"serving_engine must be vllm or sglang, got {serving_engine!r}")
        self.params, self.problems = params, problems
        self.serving_engine, self.serving_thinking = serving_engine, serving_thinking
        self.server_url, self.timeout_s = server_url, timeout_s
        self.use_server = True  # False when the check-up leaves the server out (a later stage's cell)
        self._servers: list[Any] = []
        self._probes: dict[tuple, dict | Unavailable] = {}
        self._models: dict[str, tuple[str, list[str]] | Exception] = {}

    # -- construction -------------------------------------------------------------------------------------

    @classmethod
    def from_run_dir(cls, run_dir: Path, **kw) -> "Context":
        """Params of every stage of ``params/<run>/`` (types only: missing artifacts are the checks' business)."""
        if not Path(run_dir).is_dir():
            raise InputError(f"{run_dir}: no such parameter folder; pass params/<run>/")
        params, problems = {}, {}
        for stage in STAGES:
            try:
                params[stage] = from_dict(stage, run_params(Path(run_dir), stage), check_paths=False)
            except ParamsError as e:
                problems[stage] = str(e)
        return cls(params, problems, **kw)

    @classmethod
    def from_stage(cls, stage: str, P: StageParams, **kw) -> "Context":
        """A notebook's validated ``P`` for ``stage``, plus the other stages' params from P's run folder
        (the folder of ``params_file``, else ``params/<run_name>/``) when there is one."""
        folder = resolve(P.params_file).parent if P.params_file else project_root() / "params" / P.run_name
        ctx = cls.from_run_dir(folder, **kw) if folder.is_dir() else cls({}, {}, **kw)
        ctx.params[stage] = P
        ctx.problems.pop(stage, None)
        return ctx

    def params_problems(self) -> list:
        return [CheckResult("params", FAIL, f"{stage}: {msg.splitlines()[0]}", "fix the parameter file named above",
                            {"stage": stage, "error": msg}) for stage, msg in self.problems.items()]

    def __enter__(self) -> "Context":
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._servers:
            handle.stop()
        self._servers.clear()

    # -- params -------------------------------------------------------------------------------------------

    def p(self, stage: str) -> StageParams:
        if stage not in self.params:
            raise Unavailable(f"no valid {stage} params")
        return self.params[stage]

    def stage_dir(self, stage: str) -> Path:
        return self.p(stage).stage_dir

    # -- the target -----------------------------------------------------------------------------------------

    @cached_property
    def target_params(self) -> TargetParams:
        """The first of 01/02/04's params: their model_path and trust_remote_code name the target (they
        should all agree)."""
        for stage in ("01_synth", "02_hidden_states", "04_acceptance"):
            if stage in self.params:
                return self.params[stage]
        raise Unavailable("no valid 01/02/04 params, so no model_path")

    @cached_property
    def model_dir(self) -> Path:
        """The target's folder."""
        P = self.target_params
        try:
            return P.model_dir
        except (FileNotFoundError, ValueError) as e:
            raise Unavailable(f"model_path of {P.stage}: {e}") from None

    @cached_property
    def family(self):
        """The target's family (``eagle3nb.families``): the params' ``family``, or told from its folder. Raises
        FamilyError naming the parameter when it cannot be told."""
        return detect(self.model_dir, self.target_params.family)

    @cached_property
    def template(self):
        """The target's tokenizer + chat template with 01_synth's thinking kwarg (the one 01 renders with);
        the folder's own code runs only with the params' trust_remote_code."""
        P1 = self.params.get("01_synth")
        return Template(self.model_dir, P1.thinking if P1 else True, P1.thinking_kwarg if P1 else AUTO,
                        self.target_params.trust_remote_code, self.family)

    @cached_property
    def target_dims(self) -> dict:
        """num_layers, hidden_size, vocab_size of the target (02's reading of its config.json)."""
        from eagle3nb.data.head import target_info

        return target_info(self.model_dir)

    # -- 01 samples -----------------------------------------------------------------------------------------

    @cached_property
    def synth_dir(self) -> Path:
        if "02_hidden_states" in self.params:
            return self.params["02_hidden_states"].synth_path
        return self.stage_dir("01_synth")

    @cached_property
    def records(self) -> list[dict]:
        """Every sample record 01_synth wrote (all statuses, every attempt)."""
        from eagle3nb.data.samples import read_records, sample_files

        if not sample_files(self.synth_dir):
            raise Unavailable(f"no 01_synth samples in {self.synth_dir} (run 01_synth first)")
        return list(read_records(self.synth_dir))

    @cached_property
    def samples(self) -> list[dict]:
        """The latest record per id, every status."""
        latest: dict[str, dict] = {}
        for r in self.records:
            latest[r["id"]] = r
        return list(latest.values())

    def max_length(self) -> int:
        """Tokens per sample that reach training: the smaller of 02's and 03's max_length."""
        lengths = [self.params[s].max_length for s in ("02_hidden_states", "03_train") if s in self.params]
        if not lengths:
            raise Unavailable("no valid 02_hidden_states / 03_train params: max_length unknown")
        return min(lengths)

    def projected_tokens(self) -> tuple[int, str]:
        """Tokens 02 will store for the whole run and how that was estimated: 02's own sample plan over 01's
        output (scaled up to max_samples while 01 is unfinished), else an upper bound from 01's budget."""
        from eagle3nb.hidden.prepare import HiddenStatesError, prepare_samples

        P1, P2 = self.p("01_synth"), self.p("02_hidden_states")
        caps = [x for x in (P1.max_samples, P2.max_samples) if x]
        planned = min(caps) if caps else None
        try:
            used, _ = prepare_samples(P2)
        except HiddenStatesError:
            used = []
        if used:
            tokens = sum(len(s["input_ids"]) for s in used)
            done = len(self.samples)
            if planned and done < planned:
                return int(tokens * planned / done), f"{done}/{planned} samples answered, scaled up"
            return tokens, f"{len(used)} samples"
        if not planned:
            raise Unavailable("no samples yet and max_samples is null: nothing to project the disk use from")
        per = min(P2.max_length, P1.max_completion_tokens + PROMPT_TOKENS_GUESS)
        return planned * per, f"upper bound {planned} x min(max_length, max_completion_tokens + {PROMPT_TOKENS_GUESS})"

    # -- 02 hidden states -------------------------------------------------------------------------------------

    @cached_property
    def hidden_dir(self) -> Path:
        """The training data: 03's data_dir, else 02's output."""
        if "03_train" in self.params:
            return self.params["03_train"].data_path
        return self.stage_dir("02_hidden_states")

    @cached_property
    def eval_dir(self) -> Path:
        """Hidden states for acceptance: 04's data_dir, else the training data."""
        if "04_acceptance" in self.params:
            return self.params["04_acceptance"].data_path
        return self.hidden_dir

    def hidden(self, data_dir: Path | None = None):
        """The hidden-state reader for ``data_dir`` (default: the training data)."""
        from eagle3nb.data.reader import HiddenStates

        d = data_dir or self.hidden_dir
        if not (d / "index.json").exists():
            raise Unavailable(f"no hidden-state data in {d} (run 02_hidden_states first)")
        return HiddenStates(d)

    def heldout(self):
        """Held-out samples of the evaluation data: all of it when it is not the training data, else 03's
        held-out split of it (the samples the draft never trained on)."""
        hs = self.hidden(self.eval_dir)
        if self.eval_dir.resolve() != self.hidden_dir.resolve() or "03_train" not in self.params:
            return hs
        _, held = split_holdout([s["id"] for s in hs.samples], self.params["03_train"].holdout_fraction)
        return Subset(hs, held)

    # -- drafts ---------------------------------------------------------------------------------------------

    @cached_property
    def drafts(self) -> list[tuple[str, Path]]:
        """(label, dir) of each draft checkpoint the run uses that exists: 03's init_from, the trained draft
        (its ``-sglang`` export when judging for SGLang)."""
        out = []
        P3, P4 = self.params.get("03_train"), self.params.get("04_acceptance")
        if P3 is not None and P3.init_path:
            out.append(("init_from", P3.init_path))
        trained = P4.draft_path if P4 is not None else P3.stage_dir / "draft" if P3 is not None else None
        if trained is not None:
            sglang = trained.with_name(trained.name + "-sglang")  # 03 exports SGLang's ids beside vLLM's
            out.append(("draft", sglang if self.serving_engine == "sglang" and sglang.is_dir() else trained))
        return [(label, d) for label, d in out if (d / "config.json").exists()]

    # -- the server -------------------------------------------------------------------------------------------

    def server_urls(self) -> list[str]:
        """Base URLs (ending in /v1) of the server 01_synth talks to; 'embedded' starts one for the target."""
        if self.server_url:
            urls = [self.server_url]
        else:
            urls = self.p("01_synth").urls
        if urls == ["embedded"]:
            handle = start_server(self.model_dir, trust_remote_code=self.target_params.trust_remote_code)
            self._servers.append(handle)
            self.server_url = handle.base_url
            urls = [handle.base_url]
        return [base_url(u) for u in urls]

    def ask(self, base_url: str, call: Callable[[Endpoint], Awaitable[Any]], model: str = "") -> Any:
        """``call(endpoint)`` under 01_synth's retry policy (its max_retries and retry_backoff_s), so a server
        that fails now and then passes the check-up as it passes the run. Raises GaveUp when the failure
        outlasted the retries (or the server rejected the request), FatalServerError when no retry can help."""
        import openai

        P1 = self.p("01_synth")

        async def go() -> Any:
            client = openai.AsyncOpenAI(base_url=base_url, api_key=P1.api_key(), timeout=self.timeout_s,
                                        max_retries=0)
            try:
                return await retried(call, Endpoint(base_url, client, model), max_retries=P1.max_retries,
                                     backoff_s=P1.retry_backoff_s)
            finally:
                await client.close()

        return run_sync(go)

    def served_model(self, base_url: str) -> tuple[str, list[str]]:
        """(the model name to ask for, the names the server lists); raises GaveUp, FatalServerError or
        ParamsError when the server cannot be asked (remembered, so later checks do not wait out the retries
        again)."""
        if base_url not in self._models:
            try:
                names = [m.id for m in self.ask(base_url, lambda ep: ep.client.models.list()).data]
                wanted = self.p("01_synth").served_model_name
                self._models[base_url] = (wanted or (names[0] if names else "")), names
            except (GaveUp, FatalServerError, ParamsError) as e:
                self._models[base_url] = e
        got = self._models[base_url]
        if isinstance(got, Exception):
            raise got
        return got

    def engine(self, base_url: str) -> dict[str, str | None]:
        """Which engine serves ``base_url`` and its version: ``owned_by`` of /v1/models (vLLM: "vllm",
        the embedded server: "eagle3nb") and ``GET /version`` (vLLM's route), under 01_synth's retry policy.
        A server without /version gives version None."""
        model, _ = self.served_model(base_url)
        owners = {m.id: m.owned_by for m in self.ask(base_url, lambda ep: ep.client.models.list()).data}
        root = base_url.rstrip("/").removesuffix("/v1")
        try:
            answer = self.ask(base_url, lambda ep: ep.client.get(root + "/version", cast_to=object))
        except (GaveUp, FatalServerError):  # 404: an engine without the route, not a failure of the server
            answer = None
        version = answer.get("version") if isinstance(answer, dict) else None
        return {"engine": owners.get(model), "version": None if version is None else str(version)}

    def probe_all(self, base_url: str, thinking: bool) -> None:
        """Send every probe the check-up will read at once (the server batches them): the stream probes in
        the run's thinking mode, and the question in the server's default mode."""
        keys = [(q, thinking) for q in STREAM_PROBES] + [(PROBE_QUESTION, None)]
        with ThreadPoolExecutor(len(keys)) as pool:
            list(pool.map(lambda k: self.probe(base_url, *k), keys))

    def probe(self, base_url: str, question: str, thinking: bool | None) -> dict:
        """One chat completion at temperature 0 (``thinking`` None: the server's default mode), with
        ``return_token_ids``, under 01_synth's retry policy; cached, failures too. Returns the message fields,
        reasoning source and token ids. A server that does not answer after the retries raises Unavailable
        (the server check reports it)."""
        key = (base_url, question, thinking)
        if key not in self._probes:
            try:
                self._probes[key] = self._probe(base_url, question, thinking)
            except (GaveUp, FatalServerError, ParamsError) as e:
                self._probes[key] = Unavailable(f"the server at {base_url} did not answer a probe "
                                                f"({type(e).__name__}: {e}); see the server check")
        got = self._probes[key]
        if isinstance(got, Unavailable):
            raise got
        return got

    def _probe(self, base_url: str, question: str, thinking: bool | None) -> dict:
        P1 = self.p("01_synth")
        messages = [{"role": "user", "content": question}]
        max_tokens = min(PROBE_MAX_TOKENS, P1.max_completion_tokens)
        model, _ = self.served_model(base_url)
        resp = self.ask(base_url, lambda ep: chat(
            ep, messages, max_completion_tokens=max_tokens, temperature=0.0, top_p=1.0, seed=P1.seed,
            template_kwargs={} if thinking is None else self.family.template_kwargs(thinking, P1.thinking_kwarg)),
            model)
        return {"messages": messages, "thinking": thinking, "kwarg": self.family.thinking_kwarg(P1.thinking_kwarg),
                "model": model, "max_tokens": max_tokens, **landed(resp, self.family.think_tags)}


class Subset:
    """Some samples of a HiddenStates reader, with the reader's interface (len, [i], target_* and the rest)."""

    def __init__(self, data, indices: list[int]):
        self.data, self.indices = data, list(indices)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> dict:
        return self.data[self.indices[i]]

    def __getattr__(self, name: str):
        return getattr(self.data, name)
