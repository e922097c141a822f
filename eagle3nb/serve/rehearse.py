"""The production recipe rehearsed with the real vLLM on this machine: ``python -m eagle3nb.serve.rehearse
params/vllm-cpu/`` (``make rehearse``).

The README's recipe, step by step, with each vLLM server started (CPU build, :mod:`eagle3nb.serve.vllm`)
on the port its stage's params name and stopped when the stage is done:

1. vLLM with ``--reasoning-parser kimi_k2``; ``eagle3nb doctor --stage 01`` must pass; ``eagle3nb run --stages 01``.
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
from contextlib import ExitStack
from pathlib import Path
from urllib.parse import urlparse

from eagle3nb.drafts import served_method
from eagle3nb.errors import InputError
from eagle3nb.hidden.prepare import aux_layer_ids
from eagle3nb.params import from_dict
from eagle3nb.params_yaml import run_params
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
    """Run the four stages of ``run_dir`` against the real vLLM servers each one needs."""
    P1, P2, P4 = (from_dict(s, run_params(run_dir, s), check_paths=False)
                  for s in ("01_synth", "02_hidden_states", "04_acceptance"))
    urls = P1.vllm_url if isinstance(P1.vllm_url, list) else [P1.vllm_url]
    if len(urls) != 1 or P2.backend != "vllm" or P4.endpoints == "embedded" or len(P4.endpoints) != 2:
        raise SystemExit("a rehearsal needs one vllm_url in 01, backend: vllm in 02 and two endpoints in 04 "
                         "(the target plainly, then with the draft): see params/vllm-cpu/")
    again = ["--force"] if force else []
    model = P1.model_path
    num_layers = json.loads((resolve_model_path(model) / "config.json").read_text())["num_hidden_layers"]

    print("== 1. the target with its reasoning parser; the doctor first", flush=True)
    with start_vllm(model, "plain", port=_port(urls[0])):
        _eagle3nb("doctor", str(run_dir), "--stage", "01")
        _eagle3nb("run", str(run_dir), "--stages", "01", *again)

    print("== 2. hidden states through vLLM's extract_hidden_states", flush=True)
    layer_ids = [*aux_layer_ids(P2, num_layers), num_layers]
    with tempfile.TemporaryDirectory(prefix="eagle3nb-hidden-") as storage, \
            start_vllm(model, "extract", port=_port(P2.vllm_url), layer_ids=layer_ids, storage_dir=storage):
        _eagle3nb("run", str(run_dir), "--stages", "02", *again)

    print("== 3. training (no server)", flush=True)
    _eagle3nb("run", str(run_dir), "--stages", "03", *again)

    print("== 4. vLLM plainly and vLLM serving the draft", flush=True)
    plain, spec = P4.endpoints
    method = served_method(P4.draft_path)
    with ExitStack() as stack:
        stack.enter_context(start_vllm(model, "plain", port=_port(plain.url), rounds=plain.rounds))
        stack.enter_context(start_vllm(model, method, port=_port(spec.url), draft_dir=P4.draft_path,
                                       num_speculative_tokens=spec.k or P4.k, rounds=spec.rounds))
        _eagle3nb("run", str(run_dir), "--stages", "04", *again)
    print(f"rehearsal done: {P4.stage_dir.parent}/04_acceptance.html has vLLM's acceptance beside the offline and "
          "local figures", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m eagle3nb.serve.rehearse", description=__doc__.split("\n")[0])
    p.add_argument("run_dir", type=Path, help="params/<run>/ (e.g. params/vllm-cpu/)")
    p.add_argument("--force", action="store_true", help="redo stages that are done")
    args = p.parse_args(argv)
    rehearse(args.run_dir, args.force)
    return 0


if __name__ == "__main__":
    sys.exit(main())
