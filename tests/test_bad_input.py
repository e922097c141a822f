"""Bad input, the way users bring it: every case runs a real command's ``main()`` in-process (the stage commands,
``eagle3nb ...``) and must end with the right exit code, a message of at most two lines that names the thing
and the fix, no traceback, no secret, and nothing already written lost or changed.

Cases are grouped: parameters, files, servers that lie, concurrency and faults, secrets. A case is
``(setup, expect)``: ``setup(tmp) -> (command, argv)`` prepares its inputs in the test's folder.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml

from eagle3nb.families import names

from mask_files import MASK_FILES

ROOT = Path(__file__).resolve().parents[1]
SECRET = "sk-bad-input-5e3f9a-never-printed"
KEY_ENV = "EAGLE3NB_BAD_INPUT_KEY"
FAMILY_NAMES = names()
STAGE = {"01": "01_synth", "02": "02_hidden_states", "03": "03_train", "04": "04_acceptance"}


@dataclass
class Case:
    name: str
    setup: Callable[[Path], tuple[str, list[str]]]
    must: tuple[str, ...]  # substrings of the message
    rc: int = 2


# --- helpers ------------------------------------------------------------------------------------------------------

def run_dir(tmp: Path, **stages: dict) -> Path:
    """A copy of params/smoke with some stages' values changed (None deletes a key) and output in ``tmp``."""
    folder = tmp / "params" / "smoke"
    if not folder.exists():
        shutil.copytree(ROOT / "params" / "smoke", folder)
    for stage, changes in stages.items():
        path = folder / f"{STAGE[stage]}.yaml"
        values = yaml.safe_load(path.read_text()) or {}
        for k, v in changes.items():
            if v is None:
                values.pop(k, None)
            else:
                values[k] = str(v) if isinstance(v, Path) else v
        path.write_text(yaml.safe_dump(values))
    return folder


def stage(code: str, tmp: Path, *extra: str, **changes: Any) -> tuple[str, list[str]]:
    return STAGE[code], [str(run_dir(tmp, **{code: changes})), *extra]


def cli(*argv: str) -> tuple[str, list[str]]:
    return "eagle3nb", list(argv)


def write(path: Path, data: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    (path.write_bytes if isinstance(data, bytes) else path.write_text)(data)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Lying:
    """An HTTP server that answers every request from ``answer(path, body) -> (status, content type, bytes)``."""

    def __init__(self, answer: Callable[[str, dict], tuple[int, str, bytes]]):
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def _reply(self) -> None:
                n = int(self.headers.get("content-length") or 0)
                body = json.loads(self.rfile.read(n) or b"{}") if n else {}
                status, ctype, data = answer(self.path, body)
                self.send_response(status)
                self.send_header("content-type", ctype)
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _reply

            def log_message(self, *args: Any) -> None:
                pass

        class Server(ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request: Any, client_address: Any) -> None:
                pass  # a client that hung up (the stage stopped early): nothing to report

        self.httpd = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()
        outer.requests = 0

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def models_json(name: str = "toy:smoke") -> bytes:
    return json.dumps({"object": "list", "data": [{"id": name, "object": "model", "owned_by": "vllm"}]}).encode()


def chat_answer(token_ids: Any = (0, 1, 2), prompt_ids: Any = (3, 4), content: Any = "The answer is 4.") -> bytes:
    return json.dumps({
        "id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "toy:smoke",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content, "reasoning": "2 plus 2"},
                     "finish_reason": "stop", "token_ids": list(token_ids)}],
        "prompt_token_ids": prompt_ids if isinstance(prompt_ids, str) else list(prompt_ids),
        "usage": {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}}).encode()


def lying(kind: str) -> Callable[[str, dict], tuple[int, str, bytes]]:
    """Answers of a server that lies in one way (the model list is honest unless the lie is about it)."""
    def answer(path: str, body: dict) -> tuple[int, str, bytes]:
        if kind == "html":
            return 200, "text/html", b"<html><body>Welcome to nginx!</body></html>"
        if kind == "hello":
            return 200, "application/json", b'{"hello": "world"}'
        if path.endswith("/models"):
            return 200, "application/json", models_json()
        if kind == "string-ids":
            return 200, "application/json", chat_answer(token_ids=["163584", "17"])
        if kind == "huge-ids":
            return 200, "application/json", chat_answer(token_ids=[10**9, 5])
        if kind == "number-content":
            return 200, "application/json", chat_answer(content=42)
        if kind == "ids-not-list":
            return 200, "application/json", chat_answer(prompt_ids="3 4")
        if kind == "401":
            return 401, "application/json", b'{"error": {"message": "bad key", "type": "auth"}}'
        raise AssertionError(kind)

    return answer


SERVERS: dict[str, Lying] = {}


def server(kind: str) -> str:
    if kind not in SERVERS:
        SERVERS[kind] = Lying(lying(kind))
    return SERVERS[kind].url


def synth_against(kind_or_url: str, tmp: Path, **changes: Any) -> tuple[str, list[str]]:
    url = kind_or_url if kind_or_url.startswith("http") else server(kind_or_url)
    return stage("01", tmp, vllm_url=url, max_samples=4, concurrency=2, max_retries=1, retry_backoff_s=0.01,
                 output_dir=tmp / "out01", **changes)


def toy_records(tmp: Path) -> Path:
    """A real 01 output folder (a few records answered by the embedded toy server): the input of 02's cases."""
    out = tmp / "synth"
    shutil.copytree(SYNTH_CACHE["dir"], out)
    return out


SYNTH_CACHE: dict[str, Path] = {}
BUSY: list[Any] = []  # a listening socket and its port


# --- the cases ----------------------------------------------------------------------------------------------------

PARAMETERS = [
    Case("malformed YAML", lambda t: (STAGE["01"], [str(write(t / "p" / "01_synth.yaml", "max_samples: [1, 2\n"))]),
         ("01_synth.yaml", "not valid YAML")),
    Case("a key given twice", lambda t: (STAGE["01"], [str(write(t / "p" / "01_synth.yaml",
                                                                 "max_samples: 3\nseed: 1\nmax_samples: 4\n"))]),
         ("'max_samples' is given twice", "lines 1 and 3", "keep one")),
    Case("an unknown key", lambda t: stage("01", t, max_sample=3), ("'max_sample'", "did you mean 'max_samples'")),
    Case("a wrong type", lambda t: stage("01", t, max_samples="many"), ("'max_samples'", "'many'")),
    Case("a bad value in common.yaml", lambda t: (STAGE["01"], [str(write(run_dir(t) / "common.yaml",
                                                                          "max_retries: many\n").parent)]),
         ("'max_retries'", "common.yaml")),
    Case("a missing params folder", lambda t: (STAGE["01"], [str(t / "nope")]), ("nope", "does not exist")),
    Case("--set without =", lambda t: stage("01", t, "--set", "seed"), ("--set 'seed'", "KEY=VALUE")),
    Case("--set with a bad value", lambda t: stage("01", t, "--set", "concurrency=-3"), ("'concurrency'",)),
    Case("a missing model folder", lambda t: stage("01", t, model_path=t / "no-model"),
         ("'model_path'", "no-model", "does not exist")),
    Case("an unknown toy", lambda t: stage("01", t, model_path="toy:huge"), ("'model_path'", "toy:huge")),
    Case("a missing prompts file", lambda t: stage("01", t, prompts=t / "missing.jsonl"),
         ("'prompts'", "missing.jsonl")),
    Case("an empty prompts path", lambda t: stage("01", t, prompts=""), ("'prompts'", "empty")),
    Case("a URL that is not one", lambda t: stage("02", t, backend="vllm", vllm_url="localhost:8000"),
         ("vllm_url", "http://")),
    Case("02 backend vllm without vllm_url", lambda t: stage("02", t, backend="vllm"),
         ("backend 'vllm' needs vllm_url",)),
    Case("03 batch_tokens below max_length", lambda t: stage("03", t, batch_tokens=256, max_length=1024),
         ("batch_tokens (256)", "max_length (1024)")),
    Case("04 k above max_k", lambda t: stage("04", t, k=6, max_k=4), ("k", "max_k")),
    Case("03 device cuda without a GPU", lambda t: stage("03", t, device="cuda"), ("'device'", "cuda", "cpu")),
    Case("03 init_from without a checkpoint", lambda t: stage("03", t, init_from=t),
         ("'init_from'", "config.json")),
    Case("a parameter file that is not text", lambda t: (STAGE["01"], [str(write(t / "p" / "01_synth.yaml",
                                                                                b"\xff\xfe\x00bin"))]),
         ("01_synth.yaml", "not UTF-8")),
    Case("a stage file of a list", lambda t: (STAGE["01"], [str(write(t / "p" / "01_synth.yaml", "- a\n- b\n"))]),
         ("01_synth.yaml", "expected a mapping")),
    Case("eagle3nb run on a missing folder", lambda t: cli("run", str(t / "nothing")), ("no such parameter folder",)),
    Case("eagle3nb run with a bad parameter", lambda t: cli("run", str(run_dir(t, **{"03": {"lr": "fast"}}))),
         ("'lr'", "03_train.yaml")),
    Case("eagle3nb status of a folder with no run", lambda t: cli("status", str(t)), ("status.json",)),
    Case("eagle3nb doctor on a missing folder", lambda t: cli("doctor", str(t / "nothing")), ("nothing",)),
]

FILES = [
    Case("a binary prompts file", lambda t: stage("01", t, prompts=write(t / "bin.jsonl", b"\x00\xff\xfe" * 40),
                                                  output_dir=t / "o"),
         ("bin.jsonl line 1", "not UTF-8")),
    Case("a prompts line that is not JSON", lambda t: stage("01", t, prompts=write(t / "p.jsonl", '{"prompt": "a"}\n'
                                                                                           '{"prompt": \n'),
                                                            output_dir=t / "o"),
         ("p.jsonl line 2", "not valid JSON")),
    Case("a prompts row without a prompt", lambda t: stage("01", t, prompts=write(t / "p.jsonl", '{"text": "a"}\n'),
                                                           output_dir=t / "o"),
         ("p.jsonl line 1", "no prompt found")),
    Case("a corrupt parquet", lambda t: stage("01", t, prompts=write(t / "p.parquet", b"PAR1garbagePAR1"),
                                              output_dir=t / "o"),
         ("p.parquet", "parquet")),
    Case("a broken JSON array", lambda t: stage("01", t, prompts=write(t / "p.json", '[{"prompt": "a"},'),
                                                output_dir=t / "o"),
         ("p.json", "JSON array")),
    Case("an output_dir that is a file", lambda t: stage("01", t, output_dir=write(t / "file", "x")),
         ("file",)),
    Case("02 on a missing 01 folder", lambda t: stage("02", t, synth_dir=t / "no-synth", output_dir=t / "o"),
         ("no-synth",)),
    Case("02 aux layer ids out of range", lambda t: stage("02", t, synth_dir=toy_records(t), output_dir=t / "o",
                                                          aux_layer_ids=[2, 4, 40]),
         ("40", "layer")),
    Case("02 draft vocabulary above the target's", lambda t: stage("02", t, synth_dir=toy_records(t),
                                                                   output_dir=t / "o", draft_vocab_size=10**6),
         ("draft_vocab_size",)),
    Case("02 on a corrupt line of 01's output", lambda t: stage("02", t, synth_dir=corrupt_line(toy_records(t)),
                                                                output_dir=t / "o"),
         ("samples-", "line")),
    Case("02 on a 01 that was stopped and not resumed", lambda t: stage("02", t, synth_dir=unfinished(toy_records(t)),
                                                                           output_dir=t / "o"),
         ("not finished", "'running'", "resume 01_synth", "allow_partial_synth")),
    Case("02 on a 01 output ending in a torn line", lambda t: stage("02", t, synth_dir=torn(toy_records(t)),
                                                                    output_dir=t / "o"),
         ("torn line", "samples-00000.jsonl line", "allow_partial_synth")),
    Case("two 02 runs on one folder", lambda t: stage("02", t, synth_dir=toy_records(t), output_dir=held(t / "o2")),
         ("another 02_hidden_states run", f"pid {os.getpid()}", "another output_dir")),
    Case("two 03 runs on one folder", lambda t: stage("03", t, output_dir=held(t / "o3")),
         ("another 03_train run", f"pid {os.getpid()}")),
    Case("03 on a 01 folder", lambda t: stage("03", t, data_dir=toy_records(t), output_dir=t / "o"),
         ("index.json",)),
    Case("eagle3nb serve with a missing model", lambda t: cli("serve", "--model", str(t / "none")), ("none",)),
    Case("eagle3nb serve with a missing draft", lambda t: cli("serve", "--model", "toy:smoke", "--draft",
                                                              str(t / "nodraft"), "--port", str(free_port())),
         ("--draft", "nodraft", "config.json")),
    Case("eagle3nb serve on a busy port", lambda t: cli("serve", "--model", "toy:smoke", "--port", str(BUSY[1])),
         ("cannot listen", "--port")),
    Case("eagle3nb serve with an unset key variable", lambda t: cli("serve", "--model", "toy:smoke", "--api-key-env",
                                                                    "EAGLE3NB_SURELY_UNSET"),
         ("EAGLE3NB_SURELY_UNSET", "unset")),
]

SERVERS_THAT_LIE = [
    Case("a dead server", lambda t: synth_against(f"http://127.0.0.1:{free_port()}", t),
         ("cannot reach", "vllm_url")),
    Case("an HTML page", lambda t: synth_against("html", t), ("not as an OpenAI-compatible API",)),
    Case("{'hello': 'world'} everywhere", lambda t: synth_against("hello", t),
         ("not as an OpenAI-compatible API", "models")),
    Case("token ids as strings", lambda t: synth_against("string-ids", t),
         ("all failed", "BadAnswer", "'163584'", "not an integer token id")),
    Case("token ids outside the vocabulary", lambda t: synth_against("huge-ids", t),
         ("all failed", "1000000000", "outside the tokenizer")),
    Case("content that is a number", lambda t: synth_against("number-content", t), ("all failed", "not text")),
    Case("prompt ids that are a string", lambda t: synth_against("ids-not-list", t),
         ("all failed", "prompt_token_ids", "not a list")),
    Case("a server refusing the key", lambda t: synth_against("401", t), ("refused the API key", "api_key_env")),
]

SECRETS = [
    Case("a credential inside vllm_url", lambda t: stage("01", t, vllm_url=f"http://user:{SECRET}@127.0.0.1:9"),
         ("'vllm_url'", "credential", "api_key_env")),
    Case("a credential inside 02's vllm_url", lambda t: stage("02", t, backend="vllm",
                                                               vllm_url=f"http://u:{SECRET}@127.0.0.1:9"),
         ("'vllm_url'", "credential")),
    Case("a key in the environment, a server that refuses it", lambda t: synth_against("401", t, api_key_env=KEY_ENV),
         ("refused the API key",)),
]

CASES = PARAMETERS + FILES + SERVERS_THAT_LIE + SECRETS


HELD: list[Any] = []  # the locks the "two runs" cases hold, as a first run would


def held(folder: Path) -> Path:
    from eagle3nb.progress import one_writer

    lock = one_writer(folder, "first")
    lock.__enter__()
    HELD.append(lock)
    return folder


def unfinished(folder: Path) -> Path:
    progress = json.loads((folder / "progress.json").read_text())
    (folder / "progress.json").write_text(json.dumps({**progress, "state": "running"}))
    return folder


def torn(folder: Path) -> Path:
    f = sorted(folder.glob("samples-*.jsonl"))[-1]
    f.write_bytes(f.read_bytes() + b'{"id": "cut-off", "status": "o')
    return folder


def corrupt_line(folder: Path) -> Path:
    f = sorted(folder.glob("samples-*.jsonl"))[0]
    lines = f.read_text().splitlines(keepends=True)
    lines.insert(1, "{not json\n")
    f.write_text("".join(lines))
    return folder


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@pytest.fixture(scope="module", autouse=True)
def world(toy_smoke, embedded, tmp_path_factory):
    """A real 01 output (for 02's cases), a busy port (for serve's), a key in the environment; servers closed after."""
    from eagle3nb.params import from_dict
    from eagle3nb.synth.stage import run as synth

    out = tmp_path_factory.mktemp("synth-input") / "synth"
    synth(from_dict("01_synth", {"model_path": str(toy_smoke), "vllm_url": embedded.url, "max_samples": 4,
                                 "max_completion_tokens": 64, "output_dir": str(out)}))
    SYNTH_CACHE["dir"] = out
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    BUSY[:] = [busy, busy.getsockname()[1]]
    os.environ[KEY_ENV] = SECRET
    yield
    busy.close()
    for s in SERVERS.values():
        s.close()
    SERVERS.clear()
    os.environ.pop(KEY_ENV, None)


def error_lines(err: str) -> list[str]:
    """A command's message: from its "error:" line to the end (progress bars a started stage drew come before it),
    one or two lines."""
    lines = [ln for ln in err.replace("\r", "\n").splitlines() if ln.strip()]
    start = next((i for i, ln in enumerate(lines) if ": error: " in ln), None)
    assert start is not None, f"no error line:\n{err}"
    assert len(lines) - start <= 2, f"expected one or two lines, got {len(lines) - start}:\n{err}"
    return lines[start:]


def run_command(command: str, argv: list[str]) -> int:
    from eagle3nb.cli import main as eagle3nb_main
    from eagle3nb.stage_cli import main as stage_main

    return eagle3nb_main(argv) if command == "eagle3nb" else stage_main(command, argv)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_gets_one_clear_line(case: Case, tmp_path, capsys):
    command, argv = case.setup(tmp_path)
    before = snapshot(tmp_path)
    capsys.readouterr()
    rc = run_command(command, argv)
    out, err = capsys.readouterr()
    assert rc == case.rc, f"exit {rc}, stderr:\n{err}"
    assert "Traceback" not in out + err and "internal error" not in err, err
    message = "\n".join(error_lines(err))
    if os.environ.get("EAGLE3NB_BAD_INPUT_LOG"):  # the list of cases with what each prints, for a reviewer
        with open(os.environ["EAGLE3NB_BAD_INPUT_LOG"], "a") as log:
            log.write(f"{case.name}\t{rc}\t{message}\n")
    for part in case.must:
        assert part in message, f"{part!r} not in the message:\n{message}"
    assert SECRET not in out + err
    after = snapshot(tmp_path)
    assert {k: v for k, v in after.items() if k in before} == before, "an input or earlier output was changed"
    while HELD:
        HELD.pop().__exit__(None, None, None)


def test_the_suite_covers_every_group():
    assert len(CASES) >= 50, len(CASES)
    assert len({c.name for c in CASES}) == len(CASES)


def test_disk_full_while_01_writes_is_one_line_and_resumes(tmp_path, embedded, capsys, monkeypatch):
    """ENOSPC at the writer after the first batch: one line naming the file and the fix, exit 2, and what was
    written stays and resumes to the full set."""
    import errno

    from eagle3nb.data.samples import SampleWriter, latest

    out = tmp_path / "o"
    _, argv = stage("01", tmp_path, vllm_url=embedded.url, max_samples=12, concurrency=2, output_dir=out)
    real = SampleWriter.write
    calls = {"n": 0}

    def full_after_one(self, records):
        calls["n"] += 1
        if calls["n"] > 1 and records:
            raise OSError(errno.ENOSPC, "No space left on device", str(self.path))
        real(self, records)

    monkeypatch.setattr(SampleWriter, "write", full_after_one)
    assert run_command(STAGE["01"], argv) == 2
    err = capsys.readouterr().err
    assert "no space left on the disk" in err and "samples-" in err and "Traceback" not in err, err
    kept = latest(out)
    assert 0 < len(kept) < 12
    monkeypatch.setattr(SampleWriter, "write", real)
    assert run_command(STAGE["01"], argv) == 0
    done = latest(out)
    assert len(done) == 12 and {k: done[k] for k in kept} == kept  # the first answers kept as written


def test_the_embedded_server_dies_with_its_stage_on_kill_9(tmp_path):
    """A stage that serves the toy itself (vllm_url: embedded) and is killed with SIGKILL leaves no server behind."""
    import signal
    import subprocess
    import sys
    import time

    import psutil

    _, argv = stage("01", tmp_path, max_samples=200, max_completion_tokens=128, output_dir=tmp_path / "o")
    proc = subprocess.Popen([sys.executable, "-m", "eagle3nb.synth", *argv], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        server = None
        while server is None and time.time() < deadline:
            server = next((c for c in psutil.Process(proc.pid).children() if "serve" in c.cmdline()), None)
            time.sleep(0.2)
        assert server is not None, "the stage never started its embedded server"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        gone, alive = psutil.wait_procs([server], timeout=15)
        assert not alive, f"the embedded server (pid {server.pid}) outlived its stage"
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_shard_whose_bytes_changed_stops_03_and_a_verified_one_is_not_hashed_again(trained, tmp_path, capsys,
                                                                                    monkeypatch):
    """64 bytes flipped inside a shard (same size): 03 refuses before training, naming the shard and the fix;
    whole shards are hashed once and recorded, so a resume does not hash them again."""
    import eagle3nb.train.sources as sources

    data = tmp_path / "02"
    shutil.copytree(trained["out"] / "02_hidden_states", data)
    _, argv = stage("03", tmp_path, data_dir=data, output_dir=tmp_path / "o", max_steps=2, eval_every=0)
    hashed: list[str] = []
    real = sources.file_sha256
    monkeypatch.setattr(sources, "file_sha256", lambda p: hashed.append(p.name) or real(p))
    assert run_command(STAGE["03"], argv) == 0
    shards = sorted(p.name for p in data.glob("shard-*.safetensors"))
    assert sorted(hashed) == shards
    hashed.clear()
    assert run_command(STAGE["03"], [*argv, "--set", "max_steps=3"]) == 2  # a changed setting: refused, not hashed
    assert hashed == []
    shard = data / shards[0]
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2: len(raw) // 2 + 64] = bytes(b ^ 0xFF for b in raw[len(raw) // 2: len(raw) // 2 + 64])
    shard.write_bytes(bytes(raw))
    capsys.readouterr()
    _, argv = stage("03", tmp_path, data_dir=data, output_dir=tmp_path / "fresh", max_steps=2, eval_every=0)
    assert run_command(STAGE["03"], argv) == 2
    err = capsys.readouterr().err
    assert f"{shard}: its bytes differ from the sha256 02 recorded" in err and "re-run 02_hidden_states" in err, err
    assert not (tmp_path / "fresh" / "metrics.jsonl").exists(), "03 trained before it checked its data"


def test_04_probes_its_endpoints_before_the_offline_work(trained, tmp_path, capsys):
    dead = f"http://127.0.0.1:{free_port()}/v1"
    out = trained["out"]
    _, argv = stage("04", tmp_path, draft_dir=out / "03_train" / "draft", data_dir=out / "02_hidden_states",
                    output_dir=tmp_path / "o", local_prompts=0, cost_ratio=0.05, overhead=0.1, ks=None,
                    endpoints=[{"label": "baseline", "url": dead}, {"label": "eagle3", "url": dead}])
    assert run_command(STAGE["04"], argv) == 2
    err = capsys.readouterr().err
    assert f"endpoint {dead} cannot be reached" in err and "Traceback" not in err, err
    assert not (tmp_path / "o" / "positions.jsonl").exists(), "the offline step ran before the endpoints were probed"


def test_a_failed_check_up_stops_with_the_first_fix_on_its_first_line(toy_smoke, tmp_path):
    """01's notebook stops on its strict check-up, and a terminal (papermill's, `eagle3nb run`'s log) may show the
    stop's first line only: that line carries the first failure and its fix. The case: the server started without
    its reasoning parser (the embedded one, as vLLM without --reasoning-parser)."""
    from eagle3nb.doctor import DoctorError, check_stage
    from eagle3nb.errors import user_message
    from eagle3nb.families import detect
    from eagle3nb.launch import start_server
    from eagle3nb.params import from_dict
    from eagle3nb.params_yaml import run_params

    with start_server(toy_smoke, reasoning_parser=False) as bare:
        folder = run_dir(tmp_path, **{"01": {"model_path": toy_smoke, "vllm_url": bare.url,
                                             "output_dir": tmp_path / "o"}})
        with pytest.raises(DoctorError) as stop:
            check_stage("01_synth", from_dict("01_synth", run_params(folder, "01_synth")), strict=True)
    flag = detect(toy_smoke).parser_flag("vllm")
    for shown in (str(stop.value).splitlines()[0], user_message(stop.value).splitlines()[0]):
        assert "server: " in shown and "message.reasoning empty" in shown and flag in shown, shown


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_a_dead_server_is_refused_at_once_naming_the_family_parser(name):
    """01's connect on a port nothing listens on, with 01's default retry policy: a refused connection is final
    before the work (seconds, not the minute of backoff), and the start hint names the target family's parser."""
    import asyncio
    import time

    from eagle3nb.families import get
    from eagle3nb.synth.client import FatalServerError, connect
    from eagle3nb.synth.params import SynthParams

    family, fields = get(name), SynthParams.model_fields
    t0 = time.monotonic()
    with pytest.raises(FatalServerError) as e:
        asyncio.run(connect([f"http://127.0.0.1:{free_port()}"], "k", 5.0, None, 1, family=family,
                            max_retries=fields["max_retries"].default, backoff_s=fields["retry_backoff_s"].default))
    assert time.monotonic() - t0 < min(5.0, fields["retry_backoff_s"].default * 2), "waited out the backoff"
    msg, hint = str(e.value), "" if family.reasoning == "none" else family.parser_flag()
    assert "cannot reach" in msg and "connection refused" in msg and hint in msg
    assert ("--reasoning-parser" in msg) == bool(hint), msg


def refresh_params(tmp: Path, **values: Any) -> list[str]:
    """05's command line on a copy of params/smoke with a ``05_refresh.yaml`` of ``values`` (the costs given, so 04
    need not have run)."""
    folder = run_dir(tmp)
    write(folder / "05_refresh.yaml", yaml.safe_dump({"model_path": "toy:smoke", "cost_ratio": 0.1, "overhead": 0.1,
                                                      "output_dir": str(tmp / "o"),
                                                      **{k: str(v) if isinstance(v, Path) else v
                                                         for k, v in values.items()}}))
    return [str(folder)]


def test_05_stops_at_its_first_step_on_traffic_with_no_usable_request(tmp_path, capsys):
    """41 lines of garbage: 05 stops before any work, naming the lines dropped by reason (it used to run on into
    the fine-tune and fail there with 03's held-out split)."""
    log = write(tmp_path / "traffic.jsonl", "".join(f"garbage {i} {{\n" for i in range(40)) + '["a list"]\n')
    draft = write(tmp_path / "draft" / "config.json", "{}").parent
    argv = refresh_params(tmp_path, traffic=log, draft_dir=draft)
    capsys.readouterr()
    assert run_command("05_refresh", argv) == 2
    err = capsys.readouterr().err
    assert "no usable chat request" in err and "40 not JSON" in err and "1 not a JSON object" in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) <= 2, err
    assert sorted(p.name for p in (tmp_path / "o").iterdir()) == [], "05 worked past reading the traffic"


def test_05_stops_naming_the_cause_when_every_on_policy_answer_is_truncated(trained, embedded, tmp_path, capsys):
    """20 readable requests answered with max_completion_tokens 8 (the toy reasons for ~20 tokens): every answer is
    cut, so there is nothing to train on; 05 stops after 01, naming the truncation and the fix, before 02 and 03."""
    log = write(tmp_path / "traffic.jsonl", "".join(
        json.dumps({"messages": [{"role": "user", "content": f"Tell me about the number {i} in a few sentences."}]})
        + "\n" for i in range(20)))
    out = trained["out"]
    argv = refresh_params(tmp_path, traffic=log, draft_dir=out / "03_train" / "draft", synth_dir=out / "01_synth",
                          vllm_url=embedded.url, max_completion_tokens=8, max_tokens=8, seeds=[0], budget=8)
    capsys.readouterr()
    assert run_command("05_refresh", argv) == 2
    err = capsys.readouterr().err
    assert "none of the 8 on-policy answers" in err and "8 truncated" in err, err
    assert "max_completion_tokens (8)" in err and "raise it" in err and "Traceback" not in err, err
    assert (tmp_path / "o" / "01_synth").is_dir() and not (tmp_path / "o" / "02_hidden_states").exists()


def test_a_server_is_not_started_on_a_port_another_holds(tmp_path):
    """A server launched on a port another process listens on is refused before it starts: else the new one fails
    to bind while the old one answers /health, and every request meant for the new server reaches the old."""
    import socket
    import sys

    from eagle3nb.errors import InputError
    from eagle3nb.launch import launch

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        marker = tmp_path / "started"
        with pytest.raises(InputError, match=f"port {port} on 127.0.0.1 is already in use"):
            launch([sys.executable, "-c", f"open({str(marker)!r}, 'w')"], "127.0.0.1", port, "probe", timeout=5)
    assert not marker.exists(), "the server process was started on a held port"


# --- block drafters 04 would serve wrong: refused before its work ---------------------------------------------------

BLOCK = 4  # the DFlash draft's block: it drafts 3 a round


def block_draft_of(trained: dict, folder: Path) -> Path:
    """A fresh one-layer DFlash draft of block 4 for the trained run's target and 02 layers, its mask token a live
    row, exported as 03 does (its ``mask_embedding.pt`` where a fresh draft starts: the live rows' mean)."""
    import torch
    from safetensors.torch import load_file

    from eagle3nb.drafts.dflash.layouts import save_draft
    from eagle3nb.drafts.dflash.model import DFlashDraft, from_target

    target = Path(trained["stages"]["04_acceptance"]["model_path"])
    weights = load_file(target / "model.safetensors")
    embed = weights["model.embed_tokens.weight"]
    norms = embed.norm(dim=-1)
    layers = json.loads((trained["out"] / "02_hidden_states" / "index.json").read_text())["layer_ids"]
    torch.manual_seed(0)
    draft = DFlashDraft(from_target(json.loads((target / "config.json").read_text()), num_layers=1, block_size=BLOCK,
                                    aux_layer_ids=layers, mask_token_id=int((norms - norms.median()).abs().argmin())))
    draft.set_target(embed, weights["lm_head.weight"])
    return save_draft(draft, folder)


def stage_04(trained: dict, tmp: Path, draft: Path, **changes: Any) -> list[str]:
    """04's command line judging ``draft`` on the trained run's held-out data (no public benchmark sets)."""
    return stage("04", tmp, draft_dir=draft, data_dir=trained["out"] / "02_hidden_states", output_dir=tmp / "o",
                 benchmarks=None, **changes)[1]


REFUSED_BY_04 = {  # what the one line must say
    **{name: MASK_FILES[name].names for name in ("an all-zero mask_embedding.pt", "a NaN mask_embedding.pt",
                                                 "a mask_embedding.pt that is not a torch file",
                                                 "a mask_embedding.pt of another mask id")},
    "ks [2] for a block of 4": ("ks 2, but this dflash draft's block of 4 drafts 3", "set ks to 3",
                                "export the draft for k = 2"),
}


@pytest.mark.parametrize("name", list(REFUSED_BY_04))
def test_04_refuses_a_block_drafter_it_would_serve_wrong_before_any_work(name, trained, tmp_path, capsys):
    """A block drafter's dead or unreadable ``mask_embedding.pt``, or an embedded sweep's k its decoder cannot
    serve (DFlash's block of 4 drafts 3; ks [2] used to run the offline, local and benchmark steps and then fail in
    the server's log): 04 stops at once, in one line naming the draft's file or the k, its block and what to use,
    and writes nothing of its work."""
    draft = block_draft_of(trained, tmp_path / "draft")
    changes: dict[str, Any] = {"ks": None}
    if name in MASK_FILES:
        MASK_FILES[name].write(draft)
    else:
        changes["ks"] = [2]
    capsys.readouterr()
    assert run_command(STAGE["04"], stage_04(trained, tmp_path, draft, **changes)) == 2
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err and "internal error" not in err, err
    lines = error_lines(err)
    assert len(lines) == 1 and str(draft) in lines[0] and all(n in lines[0] for n in REFUSED_BY_04[name]), lines
    assert not list((tmp_path / "o").rglob("*")), "04 worked before it checked its draft"


def test_04_names_its_embedded_servers_refusal_on_its_error_line(trained, tmp_path, capsys, monkeypatch):
    """A refusal of an embedded server 04's own checks did not foresee (here: its serving check switched off, so
    the block-4 DFlash draft's ks [2] reaches ``eagle3nb serve``) stops 04 with the server's own reason on its error
    line, the first (a terminal may show no other), not in its log only."""
    import eagle3nb.accept.stage as accept

    monkeypatch.setattr(accept, "check_serving", lambda P: None)
    draft = block_draft_of(trained, tmp_path / "draft")
    argv = stage_04(trained, tmp_path, draft, ks=[2], local_prompts=0, cost_ratio=0.05, overhead=0.1,
                    offline_samples=2, concurrency_levels=[1], num_prompts=1, max_tokens=4)
    capsys.readouterr()
    assert run_command(STAGE["04"], argv) == 2
    first = error_lines(capsys.readouterr().err)[0]
    assert "eagle3nb serve exited with code 2 before it was ready: --num-speculative-tokens 2, but this dflash " \
           "draft's block of 4 drafts 3" in first and "set --num-speculative-tokens to 3" in first, first
    assert (tmp_path / "o" / "online-baseline.json").exists(), "the refusal did not come from the k = 2 server"


def test_a_server_that_refuses_has_its_reason_on_the_first_line(tmp_path):
    """A server that exits before it is ready: its own refusal (our commands' ``<prog>: error:`` line) leads the
    error, wherever its output put it: after a model load's progress bars, before a print its stdout buffer flushed
    at exit. A user error shows two lines at most, so a reason left in the log's tail was cut off."""
    import sys

    from eagle3nb.errors import InputError, user_message
    from eagle3nb.launch import launch

    server = write(tmp_path / "server.py", "import sys\n"
                   "print('draft loaded')\n"  # block-buffered to the log: written at exit, after the error line
                   "for i in range(40):\n    sys.stderr.write(f'\\rLoading weights: {i + 1}/40')\n"
                   "sys.stderr.write('\\nstand-in serve: error: k = 2, but the block drafts 3: use k = 3\\n')\n"
                   "sys.exit(2)\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # a server's own default buffering
    with pytest.raises(InputError) as refused:
        launch([sys.executable, str(server), "--port", "0"], "127.0.0.1", 0, "stand-in serve", timeout=30, env=env)
    shown = user_message(refused.value).splitlines()
    assert shown[0].startswith("stand-in serve exited with code 2 before it was ready: k = 2, but the block drafts 3: "
                               "use k = 3; its output ("), shown
    assert str(refused.value).endswith("use k = 3\ndraft loaded"), "the stand-in's output came in another order"
