"""The fixes plugin vLLM loads (eagle3nb/serve/vllm_ext/): shipped in the wheel and found from the installed package
whatever the current directory, refused by the launcher where vLLM would not load it, and graceful inside vLLM:
each fix turns itself off on a vLLM without its defect, a fix whose private name is gone or whose signature changed
is skipped while the others install, and a patch its own probe still finds defective is undone (docs/vllm.md)."""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from worlds import requires_vllm

ROOT = Path(__file__).resolve().parents[1]


def test_the_launcher_refuses_a_vllm_that_would_not_load_the_fixes(monkeypatch, tmp_path):
    """vLLM's plugin allowlist (``VLLM_PLUGINS``) leaving the plugin out, or a package without the plugin: the CPU
    build is refused in one line naming the cause and ``fixes=False``, before any process starts; ``fixes=False``
    and a GPU start (``cpu=False``) are not refused."""
    import eagle3nb.serve.vllm as vllm
    from eagle3nb.errors import InputError

    started = []
    monkeypatch.setattr(vllm, "unavailable_reason", lambda: None)
    monkeypatch.setattr(vllm, "launch", lambda cmd, *a, env, **kw: started.append(env) or FakeHandle(""))
    assert vllm.missing_fixes({}) is None
    monkeypatch.setenv("VLLM_PLUGINS", "someone_elses")
    with pytest.raises(InputError, match=r"without the project's fixes.*VLLM_PLUGINS='someone_elses'.*leaves out "
                                         r"eagle3nb_cpu_fixes.*fixes=False") as refused:
        vllm.start_vllm("toy:smoke")
    assert "\n" not in str(refused.value) and started == []
    monkeypatch.setenv("VLLM_PLUGINS", "someone_elses,eagle3nb_cpu_fixes")
    vllm.start_vllm("toy:smoke")
    monkeypatch.setenv("VLLM_PLUGINS", "someone_elses")
    vllm.start_vllm("toy:smoke", fixes=False)
    vllm.start_vllm("toy:smoke", cpu=False)
    assert [e["PYTHONPATH"] for e in started] == [str(vllm.VLLM_EXT)] * 3 and started[1]["VLLM_PLUGINS"] == ""
    broken = shutil.copytree(vllm.VLLM_EXT, tmp_path / "ext")
    shutil.rmtree(broken / "eagle3nb_vllm_fixes")
    assert "eagle3nb_vllm_fixes is missing: reinstall eagle3nb" in vllm.missing_fixes({}, broken)
    shutil.rmtree(next(broken.glob("*.dist-info")))
    assert "no vllm.general_plugins entry point" in vllm.missing_fixes({}, broken)


class FakeHandle:
    """A started server's stand-in with a given log."""

    url = "http://127.0.0.1:1"

    def __init__(self, text: str):
        self.text = text

    def log(self) -> str:
        return self.text


def test_a_skipped_fix_is_repeated_as_a_warning():
    """The launcher repeats each fix the plugin skipped (once, though every vLLM process logs it), in the words
    of the plugin's guard."""
    from eagle3nb.serve.vllm import warn_skipped_fixes

    line = ("(EngineCore pid=7) WARNING [guard.py:28] eagle3nb_vllm_fixes.blocksize: skipped: ImportError: gone; "
            "vLLM runs without this fix: x\n")
    with pytest.warns(UserWarning, match=r"started without 1 of the project's fixes.*\n"
                                         r"eagle3nb_vllm_fixes.blocksize: skipped: ImportError: gone"):
        assert len(warn_skipped_fixes(FakeHandle(line * 2))) == 1


WATCHER = """
import importlib.machinery, importlib.util, sys, time
spec = importlib.machinery.PathFinder.find_spec("eagle3nb_vllm_fixes", [sys.argv[1]])
importlib.util.module_from_spec(spec)
parent = importlib.machinery.PathFinder.find_spec("parent", spec.submodule_search_locations)
module = importlib.util.module_from_spec(parent)
parent.loader.exec_module(module)
module.install()
print("watching", flush=True)
time.sleep(60)
"""


def test_a_vllm_process_stops_once_the_process_that_started_it_is_gone():
    """What every vLLM process the project starts runs (the plugin's parent.py, given start_vllm's pid in its
    environment): a stand-in started by a process that is then killed -9 stops within seconds, as a vLLM server of
    a killed stage would, instead of holding its memory and port until the machine restarts; without the variable
    (a vLLM started by hand) nothing is watched."""
    from eagle3nb.serve.vllm import PARENT_ENV, VLLM_EXT

    starter = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    env = {**os.environ, PARENT_ENV: str(starter.pid)}
    watched = subprocess.Popen([sys.executable, "-c", WATCHER, str(VLLM_EXT)], env=env, stdout=subprocess.PIPE,
                               text=True)
    alone = subprocess.Popen([sys.executable, "-c", WATCHER, str(VLLM_EXT)],
                             env={k: v for k, v in env.items() if k != PARENT_ENV}, stdout=subprocess.PIPE, text=True)
    try:
        assert watched.stdout.readline().strip() == "watching" and alone.stdout.readline().strip() == "watching"
        assert watched.poll() is None  # its starter lives
        starter.kill()
        starter.wait()
        assert watched.wait(timeout=10) == -15  # SIGTERM, vLLM's own shutdown
        assert alone.poll() is None
    finally:
        for p in (starter, watched, alone):
            p.kill()
            p.wait()


def test_the_wheel_ships_the_plugin_and_the_installed_package_finds_it(tmp_path):
    """A wheel built from the tracked files holds the plugin, its entry point and the connector; installed
    (not editable) into a folder and imported from another directory, the launcher's folder is the installed
    one and nothing is missing. ~15 s (a wheel build)."""
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    src = tmp_path / "src"
    for name in tracked.decode().split("\0"):
        if name and (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "wheel"), str(src)],
                   check=True, capture_output=True)
    wheel = next((tmp_path / "wheel").glob("eagle3nb-*.whl"))
    subprocess.run([*pip, "install", "--no-deps", "--target", str(tmp_path / "site"), str(wheel)], check=True,
                   capture_output=True)
    away = tmp_path / "elsewhere"
    away.mkdir()
    probe = ("import json\nfrom eagle3nb.serve.vllm import VLLM_EXT, missing_fixes\n"
             "print(json.dumps({'ext': str(VLLM_EXT), 'missing': missing_fixes({}),"
             " 'files': sorted(str(p.relative_to(VLLM_EXT)) for p in VLLM_EXT.rglob('*') if p.is_file()"
             " and '__pycache__' not in p.parts)}))")
    env = {k: v for k, v in os.environ.items() if k != "EAGLE3NB_ROOT"} | {"PYTHONPATH": str(tmp_path / "site")}
    got = json.loads(subprocess.run([sys.executable, "-c", probe], cwd=away, env=env, capture_output=True, text=True,
                                    check=True).stdout)
    shipped = sorted(str(p.relative_to(ROOT / "eagle3nb/serve/vllm_ext")) for p in
                     (ROOT / "eagle3nb/serve/vllm_ext").rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    assert got["ext"] == str(tmp_path / "site" / "eagle3nb" / "serve" / "vllm_ext") and got["missing"] is None, got
    assert got["files"] == shipped and "cpu_hidden_states_connector.py" in shipped, got


# Run in vLLM's own Python with the plugin's folder on its path: register() as vLLM calls it (then the sampling
# check its registration wrapper runs), on vLLM made to look fixed, then on the real (defective) vLLM lacking one
# private name, then with a changed signature, then with kernels no patch can mend. Prints one JSON line of what each
# fix left in place and which said "skipped".
PLUGIN_CHECK = r"""
import json, logging, torch
from vllm import _custom_ops as ops
from vllm.platforms import current_platform
from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
from vllm.v1.attention.backend import MultipleOf
from vllm.v1.attention.backends import cpu_attn
from vllm.v1.sample import rejection_sampler
import eagle3nb_vllm_fixes
from eagle3nb_vllm_fixes import sampling
from eagle3nb_vllm_fixes.guard import guarded

lines = []
class Keep(logging.Handler):
    def emit(self, record):
        lines.append(record.getMessage())
logging.getLogger("vllm.eagle3nb_vllm_fixes").addHandler(Keep())
Backend = cpu_attn.CPUAttentionBackend
real = {"rotary": ops.rotary_embedding, "norm": ops.rms_norm, "expand": rejection_sampler._expand,
        "sizes": Backend.__dict__["get_supported_kernel_block_sizes"], "isa": cpu_attn._get_attn_isa,
        "meta": ops.cpu_attn_get_scheduler_metadata}

current_platform.register_triton_kernel_overrides()  # the platform's kernels, once, as a worker registers them
def register():
    start = len(lines)
    eagle3nb_vllm_fixes.register()
    # what the sampling fix's wrapper of that registration runs after it (registering twice breaks vLLM's kernels)
    guarded("sampling", sampling.check_and_fix, sampling.WITHOUT)
    return [l for l in lines[start:] if "skipped:" in l]

def expand_impl():
    return getattr(rejection_sampler.expand_kernel, "func", None)

# 1. vLLM fixed upstream: each kernel exact, 16 declared
def rotary(positions, query, key, head_size, cache, is_neox):
    q, k = RotaryEmbedding.forward_static(positions, query, key, head_size, head_size, cache, is_neox)
    query.copy_(q.view(query.shape)), key.copy_(k.view(key.shape))
def norm(out, x, weight, eps):
    w = weight if weight.dim() == 1 else weight.reshape(weight.shape[0], *[1] * (x.dim() - 2), weight.shape[-1])
    out.copy_(x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w)
def expand(output, values, cu_num_tokens, replace_from, replace_to):
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
    out = torch.where(values == replace_from, torch.as_tensor(replace_to, dtype=values.dtype), values)
    output[:int(counts.sum())] = out.repeat_interleave(counts).to(output.dtype)
sizes = staticmethod(lambda kv_cache_spec=None: [16, MultipleOf(32)])
ops.rotary_embedding, ops.rms_norm, rejection_sampler._expand = rotary, norm, expand
Backend.get_supported_kernel_block_sizes = sizes
skipped = register()
fixed = {"cpu": current_platform.is_cpu(), "skipped": skipped, "rotary": ops.rotary_embedding is rotary,
         "norm": ops.rms_norm is norm, "expand": expand_impl() is not sampling.expand,
         "sizes": Backend.__dict__["get_supported_kernel_block_sizes"] is sizes}

# 2. the real vLLM 0.32, its _get_attn_isa renamed away
ops.rotary_embedding, ops.rms_norm, rejection_sampler._expand = real["rotary"], real["norm"], real["expand"]
Backend.get_supported_kernel_block_sizes = real["sizes"]
del cpu_attn._get_attn_isa
skipped = register()
missing = {"skipped": skipped, "rotary": hasattr(ops.rotary_embedding, "eagle3nb_wrapped"),
           "norm": hasattr(ops.rms_norm, "eagle3nb_wrapped"), "expand": expand_impl() is sampling.expand,
           "expand_broken": sampling.expand_is_broken(), "takes_16": Backend.supports_block_size(16)}

# 3. cpu_attn_get_scheduler_metadata without the enable_kv_split keyword
cpu_attn._get_attn_isa = real["isa"]
def meta(*, num_reqs, num_heads, num_kv_heads, head_dim, seq_lens, dtype, query_start_loc, causal,
         sliding_window_size, isa):
    return real["meta"](num_reqs=num_reqs, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                        seq_lens=seq_lens, dtype=dtype, query_start_loc=query_start_loc, causal=causal,
                        sliding_window_size=sliding_window_size, isa=isa)
ops.cpu_attn_get_scheduler_metadata = meta
changed = {"skipped": register(), "takes_16": Backend.supports_block_size(16)}
ops.cpu_attn_get_scheduler_metadata = real["meta"]

# 4. defects no patch mends: each fix applies, probes again, undoes itself and says skipped
from vllm.triton_utils.dispatcher import register_kernels
from vllm.utils import cpu_triton_utils
register_kernels({sampling.KERNEL: cpu_triton_utils._expand_kernel_impl})  # the platform's, as before the fix
def still(*args, **kwargs):
    return None  # rotates nothing, normalises nothing, expands nothing
ops.rotary_embedding, ops.rms_norm, rejection_sampler._expand = still, still, still
Backend.supports_block_size = classmethod(lambda cls, block_size: block_size != 16)
skipped = register()
undone = {"skipped": skipped, "rotary": ops.rotary_embedding is still, "norm": ops.rms_norm is still,
          "expand": expand_impl() is cpu_triton_utils._expand_kernel_impl,
          "sizes": Backend.__dict__["get_supported_kernel_block_sizes"] is real["sizes"]}
print(json.dumps({"fixed": fixed, "missing": missing, "changed": changed, "undone": undone}))
"""


@pytest.fixture(scope="module")
def plugin_check() -> dict:
    """PLUGIN_CHECK's findings (~20-40 s: one vLLM import)."""
    from eagle3nb.serve.vllm import VLLM_EXT, vllm_python

    env = {**os.environ, "PYTHONPATH": str(VLLM_EXT)}
    done = subprocess.run([str(vllm_python()), "-c", PLUGIN_CHECK], env=env, capture_output=True, text=True,
                          timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@requires_vllm()
def test_each_fix_turns_itself_off_on_a_fixed_vllm(plugin_check):
    """vLLM with exact kernels (its own PyTorch rotary, a grouped RMSNorm, a float-keeping ``_expand``) and blocks
    of 16 declared: every fix's probe finds no defect and leaves vLLM's function in place."""
    got = plugin_check["fixed"]
    assert got == {"cpu": True, "skipped": [], "rotary": True, "norm": True, "expand": True, "sizes": True}, got


@requires_vllm()
def test_a_missing_private_name_skips_that_fix_only(plugin_check):
    """The real vLLM with ``_get_attn_isa`` renamed away: register() returns (the server starts), the block-size
    fix says skipped with the name, and the other three apply and hold (the rotary and norm kernels wrapped,
    ``_expand`` keeping floats through the registered fix); the declaration stays vLLM's. The launcher repeats
    that line once as a warning."""
    from eagle3nb.serve.vllm import warn_skipped_fixes

    got = plugin_check["missing"]
    assert len(got["skipped"]) == 1 and "blocksize: skipped: ImportError" in got["skipped"][0], got
    assert "_get_attn_isa" in got["skipped"][0] and "vLLM runs without this fix" in got["skipped"][0], got
    assert got["rotary"] and got["norm"] and got["expand"] and not got["expand_broken"], got
    assert not got["takes_16"], got
    with pytest.warns(UserWarning, match="started without 1 of the project's fixes"):  # the launcher repeats it
        assert len(warn_skipped_fixes(FakeHandle("\n".join(got["skipped"] * 2)))) == 1


@requires_vllm()
def test_a_changed_signature_skips_that_fix_only(plugin_check):
    """``cpu_attn_get_scheduler_metadata`` without a keyword the probe passes: the block-size fix says skipped
    with the TypeError, the others (already in) are untouched, the declaration stays vLLM's."""
    got = plugin_check["changed"]
    assert len(got["skipped"]) == 1 and "blocksize: skipped: TypeError" in got["skipped"][0], got
    assert "enable_kv_split" in got["skipped"][0] and not got["takes_16"], got


@requires_vllm()
def test_a_patch_its_probe_still_finds_defective_is_undone(plugin_check):
    """Kernels no patch mends (a rotary and a norm that do nothing, an ``_expand`` that writes nothing, a check
    refusing 16 whatever is declared): each fix applies, runs its probe again, puts vLLM's own back and says
    skipped; all four say so, and register() still returns."""
    got = plugin_check["undone"]
    assert sorted(line.split(": skipped:")[0].rsplit(".", 1)[-1] for line in got["skipped"]) == \
        ["blocksize", "grouped_norm", "rotary", "sampling"], got
    assert got["rotary"] and got["norm"] and got["expand"] and got["sizes"], got


PATCHED = ("rotary_embedding", "rms_norm")  # the module attributes of vllm._custom_ops the fixes replace


def bindings_of(root: Path, names: tuple[str, ...]) -> tuple[int, list[str]]:
    """Every reference in vLLM's source ``root`` to ``vllm._custom_ops.<name>``: (calls inside a function, looked
    up at each call; every other reference, each a binding that would bypass a replaced attribute: a from-import, a
    module- or class-level reference, a reference not called)."""
    calls, bound = 0, []
    for f in sorted(root.rglob("*.py")):
        text = f.read_text(errors="replace")
        if "_custom_ops" not in text or not any(n in text for n in names):
            continue
        tree = ast.parse(text)
        aliases, parents = {"vllm._custom_ops"}, {}
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                parents[child] = node
            if isinstance(node, ast.ImportFrom) and node.module == "vllm._custom_ops":
                bound += [f"{f}:{node.lineno} from-import {a.name}" for a in node.names if a.name in (*names, "*")]
            elif isinstance(node, ast.ImportFrom) and node.module == "vllm":
                aliases |= {a.asname or a.name for a in node.names if a.name == "_custom_ops"}
            elif isinstance(node, ast.Import):
                aliases |= {a.asname or a.name for a in node.names if a.name == "vllm._custom_ops"}
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and node.attr in names and ast.unparse(node.value) in aliases):
                continue
            scope = parents[node]
            while scope is not None and not isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                scope = parents.get(scope)
            parent = parents[node]
            if isinstance(parent, ast.Call) and parent.func is node and scope is not None:
                calls += 1
            else:
                bound.append(f"{f}:{node.lineno} {ast.unparse(parent)[:80]}")
    return calls, bound


def test_the_binding_reader_sees_a_binding(tmp_path):
    """The reader below is not vacuous: a from-import, a module-level alias and a default argument count as
    bindings, a call inside a function as a look-up."""
    (tmp_path / "m.py").write_text("from vllm import _custom_ops as ops\nfrom vllm._custom_ops import rms_norm\n"
                                   "NORM = ops.rms_norm\ndef f(x, rope=ops.rotary_embedding):\n"
                                   "    ops.rms_norm(x)\n")
    calls, bound = bindings_of(tmp_path, PATCHED)
    assert calls == 1 and len(bound) == 3, bound


@requires_vllm()
def test_no_vllm_module_binds_a_patched_function():
    """Read in the installed vLLM's source: every reference to ``vllm._custom_ops.rotary_embedding`` or
    ``.rms_norm`` is a call looked up at each call, so replacing the attribute reaches every caller (docs/vllm.md
    "Callers that bound the patched function"; vLLM 0.32: 6 and 8 calls, no binding)."""
    from eagle3nb.serve.vllm import vllm_python

    where = subprocess.run([str(vllm_python()), "-c", "import importlib.util as u; "
                            "print(u.find_spec('vllm').submodule_search_locations[0])"],
                           capture_output=True, text=True, check=True).stdout.strip()
    calls, bound = bindings_of(Path(where), PATCHED)
    print(f"vLLM at {where}: {calls} calls of the patched functions, {len(bound)} bindings")
    assert calls > 0 and bound == [], bound
