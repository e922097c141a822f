"""The package's shape, kept by tests: layers that only import downward (core < data < stages < top), stages that
import no other stage (the exceptions named below, each with its reason), no import cycle (imports inside
functions count), the same roles in every stage package, and docs that name only paths that exist."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "eagle3nb"
STAGES = ("synth", "hidden", "train", "accept")
CORE = ("paths", "params", "progress", "formulas", "tokens", "families", "layers", "verification", "drafts", "decoder",
        "vllm_config", "hf", "launch", "stage_cli", "toy", "tokenview", "figures", "errors",
        "sizing", "track", "params_yaml", "params_notebook")
DATA = ("data",)  # the contracts between the stages (docs/ARCHITECTURE.md "The data layer")
# 05 refresh has a stage's roles (params, run(P), report) but runs 01-04's stages on its own data: it sits on top of
# them, as the runner does.
TOP = ("serve", "doctor", "run", "render", "cli", "__main__", "refresh", "select", "rehearse")
# A stage reads what an earlier stage wrote through eagle3nb.data, never through that stage's package. The only
# stage-to-stage imports, (importer, imported) -> why; at most three.
STAGE_IMPORTS = {
    ("eagle3nb.train.sources", "eagle3nb.hidden.online"):
        "03's online and hybrid data sources are 02's extraction run per micro-batch (OnlineStates), not a copy of it",
    ("eagle3nb.hidden.vllm_backend", "eagle3nb.synth.client"):
        "02's extraction requests go through 01's endpoints and retry policy (with_retries, classify), not a second "
        "retry loop",
}
# Every draft algorithm's package has these files (eagle3nb/drafts/__init__.py says what each holds).
DRAFT_ROLES = ("__init__.py", "method.py", "model.py", "objective.py", "layouts.py", "drafting.py", "offline.py")
# Modules outside eagle3nb/drafts/ that import one algorithm's package instead of the registry -> why.
METHOD_IMPORTS = {
    ("eagle3nb.train.build", "eagle3nb.drafts.eagle3.layouts"):
        "03's EAGLE-3.1 params (EAGLE31_KEYS) default on for a fresh draft and must match a fine-tuned one",
    ("eagle3nb.train.checkpoint", "eagle3nb.drafts.eagle3.layouts"):
        "a resumed run's settings leave EAGLE-3.1's keys out when off, as every run before them",
    ("eagle3nb.train.export", "eagle3nb.drafts.eagle3.layouts"):
        "the SGLang serve command warns about an EAGLE-3.1 draft's keys",
}
# Third-party packages a module may import inside a function: heavy ones, kept off the CLI's start-up path.
HEAVY = {"torch", "transformers", "safetensors", "fastapi", "uvicorn", "matplotlib", "pandas", "numpy", "openai",
         "httpx", "papermill", "nbformat", "nbconvert", "pyarrow", "datasets", "IPython", "ipywidgets", "tqdm",
         "accelerate", "scipy", "jinja2", "tokenizers", "psutil", "mlflow"}
LIGHT_AT_START = {"tqdm", "psutil"}  # the runner's progress bars and process checks: milliseconds to import


# Package data, not modules of eagle3nb: the folder vLLM's PYTHONPATH gets (eagle3nb.serve.vllm.VLLM_EXT), its code
# run by vLLM in vLLM's environment, where eagle3nb is not installed. Outside the import graph, both ways
# (test_the_vllm_loaded_folder_is_self_contained).
VLLM_LOADED = PKG / "serve" / "vllm_ext"


def modules() -> dict[str, Path]:
    out = {}
    for f in PKG.rglob("*.py"):
        if f.is_relative_to(VLLM_LOADED):
            continue
        parts = f.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = f
    return out


MODULES = modules()


def _target(name: str) -> str:
    """The deepest module of ours an import names (``eagle3nb.x.y.func`` -> ``eagle3nb.x.y``)."""
    while name not in MODULES and "." in name:
        name = name.rsplit(".", 1)[0]
    return name if name in MODULES else ""


def imports(name: str) -> list[tuple[str, bool]]:
    """(imported module of ours or third-party top name, inside a function?) for every import in a module."""
    tree = ast.parse(MODULES[name].read_text())
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, in_func: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = in_func or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.Import):
                found.extend((a.name, in_func) for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                for a in child.names:
                    full = f"{child.module}.{a.name}"
                    found.append((full if full in MODULES else child.module, in_func))
            visit(child, inner)

    visit(tree, False)
    return found


def layer(name: str) -> str:
    first = name.split(".")[1] if "." in name else ""
    if first in CORE:
        return "core"
    if first in DATA:
        return "data"
    if first in STAGES:
        return "stage"
    if first in TOP:
        return "top"
    return "unplaced"


def graph() -> dict[str, set[str]]:
    return {m: {t for imp, _ in imports(m) if imp.startswith("eagle3nb") and (t := _target(imp)) and t != m}
            for m in MODULES}


def test_the_vllm_loaded_folder_is_self_contained():
    """What vLLM loads from the package imports nothing of eagle3nb (vLLM's environment lacks it), and no module of
    eagle3nb imports it (its files are vLLM's, run only there); it is a folder of package data, no package."""
    assert not (VLLM_LOADED / "__init__.py").exists() and sorted(VLLM_LOADED.rglob("*.py"))
    bad = []
    for f in sorted(VLLM_LOADED.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            bad += [f"{f.relative_to(ROOT)}: {n}" for n in names if n == "eagle3nb" or n.startswith("eagle3nb.")]
    local = {p.stem for p in VLLM_LOADED.iterdir()} | {"vllm_ext"}
    bad += [f"{m} imports {imp}" for m in MODULES for imp, _ in imports(m) if imp.split(".")[-1] in local
            or imp.split(".")[0] in local]
    assert bad == []


def test_every_module_has_a_layer():
    assert [m for m in MODULES if m != "eagle3nb" and layer(m) == "unplaced"] == []


def test_nothing_imports_upward():
    order = {"core": 0, "data": 1, "stage": 2, "top": 3}
    bad = []
    for m, deps in graph().items():
        if m == "eagle3nb":
            continue
        for d in deps:
            if d != "eagle3nb" and order[layer(d)] > order[layer(m)]:
                bad.append(f"{m} ({layer(m)}) imports {d} ({layer(d)})")
    assert bad == []


def package(name: str) -> str:
    """The first-level package (or module) of ours a module belongs to: ``eagle3nb.drafts.eagle3.model`` -> drafts."""
    return name.split(".")[1] if "." in name else name


def test_no_package_both_imports_and_is_imported_by_the_drafts():
    """The decoding core (verification, padding) sits below the draft algorithms and the batched decoder above them:
    a package the drafts import imports no draft, so a new verification method lands below every draft."""
    edges = {(package(m), package(d)) for m, deps in graph().items() for d in deps if package(m) != package(d)}
    below = {d for m, d in edges if m == "drafts"}
    above = {m for m, d in edges if d == "drafts"}
    assert sorted(below & above) == []
    assert "verification" in below and "decoder" in above


def test_no_folder_of_the_package_is_named_like_a_test_folder():
    """Structure tools skip folders named as test suites are (spec/, specs/, test/, tests/, testing/), and with them
    every line inside."""
    testlike = {"spec", "specs", "test", "tests", "testing"}
    assert sorted(str(p.relative_to(ROOT)) for p in PKG.rglob("*") if p.is_dir() and p.name in testlike) == []


def stage_imports() -> set[tuple[str, str]]:
    """(importer, imported) for every import of one stage's module by another stage's."""
    return {(m, d) for m, deps in graph().items() for d in deps
            if layer(m) == layer(d) == "stage" and m.split(".")[1] != d.split(".")[1]}


def test_a_stage_imports_no_other_stage():
    """What one stage hands the next lives in eagle3nb/data/; the exceptions are named, with their reasons, and
    still needed (a stale exception fails too)."""
    assert len(STAGE_IMPORTS) <= 3 and all(why.strip() for why in STAGE_IMPORTS.values())
    found = stage_imports()
    assert sorted(found - STAGE_IMPORTS.keys()) == [], "read the earlier stage's output through eagle3nb.data"
    assert sorted(STAGE_IMPORTS.keys() - found) == [], "an exception no import needs any more: remove it"
    for m, d in found:
        assert STAGES.index(d.split(".")[1]) < STAGES.index(m.split(".")[1]), f"{m} imports a later stage: {d}"


# Stage modules that read parameter files (eagle3nb.params_yaml) -> why. A stage never reads another stage's file:
# what one stage's settings decide for another the run's plan hands over (params_yaml.HANDOFFS).
READS_PARAMS_FILES = {
    "eagle3nb.train.sources": "03's online and hybrid sources run 02's extraction with the 02 parameters the user "
                              "points hidden_params at (a folder or file the user names, as data_dir names 02's data)",
}


def test_no_stage_reads_another_stages_parameter_file():
    found = {m for m, deps in graph().items() if m.count(".") > 1 and m.split(".")[1] in STAGES
             and "eagle3nb.params_yaml" in deps}
    assert sorted(found - READS_PARAMS_FILES.keys()) == [], "hand the value over in the run's plan (HANDOFFS)"
    assert sorted(READS_PARAMS_FILES.keys() - found) == [], "an exception no import needs any more: remove it"


def stage_modules() -> set[str]:
    """Every stage's orchestrator: 01-04's, 05's and 06's (``refresh``, ``select``, on top of them)."""
    return {f"eagle3nb.{stage}.stage" for stage in (*STAGES, "refresh", "select")}


def test_no_module_imports_a_stage_orchestrator():
    """A ``stage.py`` orchestrates its package's modules and is imported by no module of the package, its own
    package's included (the command line reaches each by name, ``stage_cli``): what another module needs from a
    stage (03's online source from 02, the doctor from 02's plan) is a public function of a named module."""
    bad = sorted(f"{m} imports {d}" for m, deps in graph().items() for d in deps if d in stage_modules())
    assert bad == []


def test_a_stage_is_run_by_name_only_through_the_stage_entry():
    """Running a stage's ``run(P)`` from inside the package (05 runs 01-03) goes through one public entry,
    ``eagle3nb.stage_cli.run_stage(P)``: no other module builds a ``stage`` module's name for importlib, so the
    rule above cannot be sidestepped."""
    bad = []
    for m, f in MODULES.items():
        for node in ast.walk(ast.parse(f.read_text())):
            if (isinstance(node, ast.Call) and ast.unparse(node.func).endswith("import_module") and node.args
                    and re.search(r"\.stage['\"]", ast.unparse(node.args[0]))):
                bad.append(f"{m}: {ast.unparse(node)}")
    assert [b for b in bad if not b.startswith("eagle3nb.stage_cli:")] == []
    assert len(bad) == 1, "stage_cli.run_stage is the entry: it reaches each stage.py by name"


def test_tools_benchmarks_and_testkit_take_only_run_from_a_stage():
    """Outside the package, a stage's ``stage.py`` gives only ``run`` (what the notebook calls); every other
    piece comes from the module that holds it."""
    bad = []
    for folder in ("testkit", "benchmarks", "tools"):
        for f in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(f.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module in stage_modules():
                    bad += [f"{f.relative_to(ROOT)}: {node.module}.{a.name}" for a in node.names if a.name != "run"]
    assert bad == []


def sys_path_edits(tree: ast.AST) -> list[int]:
    """The lines of a module that change the import path: ``sys.path`` assigned or mutated, ``site.addsitedir``,
    pytest's ``syspath_prepend``."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            name = ast.unparse(node.func)
            if re.fullmatch(r"sys\.path\.(insert|append|extend|remove|pop|clear)|.*\.(addsitedir|syspath_prepend)",
                            name):
                lines.append(node.lineno)
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, ast.AugAssign) else []
        lines += [node.lineno for t in targets if ast.unparse(t).startswith("sys.path")]
    return sorted(lines)


def test_benchmarks_and_tests_import_without_editing_sys_path():
    """The benchmarks are a package run as ``python -m benchmarks.<name>`` from the repository root, and the tests
    reach them and testkit/ through pytest's ``pythonpath`` (pyproject.toml): no module of either edits the import
    path, which would make an import work from one folder only."""
    probe = "import sys, site\nsys.path.insert(0, 'x')\nsys.path += ['y']\nsys.path[:0] = ['z']\nsite.addsitedir('w')\n"
    assert sys_path_edits(ast.parse(probe)) == [2, 3, 4, 5]  # the forms it knows
    found = [f"{f.relative_to(ROOT)}:{line}" for folder in ("benchmarks", "tests")
             for f in sorted((ROOT / folder).rglob("*.py")) for line in sys_path_edits(ast.parse(f.read_text()))]
    assert found == []


def test_no_import_cycles():
    g = graph()
    index, low, stack, on, cycles = {}, {}, [], set(), []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in g:
        if v not in index:
            strong(v)
    assert cycles == []


def heavy_modules() -> set[str]:
    """Our modules whose import loads a heavy package (directly or through our modules they import at the top)."""
    top = {m: {i for i, in_func in imports(m) if not in_func} for m in MODULES}
    heavy = {m for m, deps in top.items() if any(d.split(".")[0] in HEAVY for d in deps)}
    while True:
        more = {m for m, deps in top.items() if m not in heavy and any(_target(d) in heavy for d in deps)}
        if not more:
            return heavy
        heavy |= more


def test_imports_inside_functions_are_heavy_only():
    """A function-level import defers a heavy package (torch, transformers, ...) or one of our modules that
    loads one, so the command line starts fast; anything else belongs at the top, where a reader looks."""
    heavy = heavy_modules()
    bad = [f"{m}: {imp}" for m in MODULES for imp, in_func in imports(m)
           if in_func and imp.split(".")[0] not in HEAVY and _target(imp) not in heavy]
    assert bad == []


def test_the_command_line_starts_without_heavy_packages():
    """`eagle3nb status` and `--help` stay instant: building the parser loads no torch, transformers, ..."""
    code = ("import sys; from eagle3nb.cli import build_parser; build_parser(); "
            f"print(sorted(m for m in {sorted(HEAVY - LIGHT_AT_START)!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("stage", STAGES)
def test_stage_packages_share_one_shape(stage):
    folder = PKG / stage
    for role in ("__init__.py", "__main__.py", "params.py", "stage.py", "report.py"):
        assert (folder / role).exists(), f"eagle3nb/{stage}/{role}"
    tree = ast.parse((folder / "stage.py").read_text())
    assert any(isinstance(n, ast.FunctionDef) and n.name == "run" for n in tree.body), f"{stage}/stage.py: run(P)"
    assert len((folder / "stage.py").read_text().splitlines()) <= 250, f"{stage}/stage.py: orchestrate, move work out"
    main = (folder / "__main__.py").read_text()
    assert "from eagle3nb.stage_cli import main" in main
    assert len((folder / "__init__.py").read_text().splitlines()) <= 15


def test_draft_packages_share_one_shape_and_are_registered():
    """One package per draft algorithm, the same files in each, every package in the registry under its own name
    (a package may serve variants engines name apart, DSpark in DFlash's, each one registry line naming it), the
    registry's a real import of each package (a reader, or a tool, follows it: no module named by a string), and
    the registry the only way in from outside eagle3nb/drafts/ (the named exceptions, still needed)."""
    import importlib

    from eagle3nb.drafts import PACKAGES, get

    packages = sorted(p.name for p in (PKG / "drafts").iterdir() if (p / "__init__.py").exists())
    served = {name: module.__name__.removeprefix("eagle3nb.drafts.") for name, module in PACKAGES.items()}
    assert packages == sorted(set(served.values())) and set(packages) <= PACKAGES.keys()
    for name in packages:
        missing = [role for role in DRAFT_ROLES if not (PKG / "drafts" / name / role).exists()]
        assert missing == [], f"eagle3nb/drafts/{name}/ lacks {missing}"
    for name, package in served.items():
        assert get(name).name == name
        methods = importlib.import_module(f"{PACKAGES[name].__name__}.method").METHODS
        assert sorted(methods) == sorted(n for n, p in served.items() if p == package), \
            f"{package} serves other methods than the registry says"
        assert PACKAGES[name].method_named(name) is methods[name]
    assert {f"eagle3nb.drafts.{p}" for p in packages} <= graph()["eagle3nb.drafts"], "import each package for real"
    found = {(m, d) for m, deps in graph().items() for d in deps if not m.startswith("eagle3nb.drafts")
             and d.startswith("eagle3nb.drafts.") and d.split(".")[2] in packages}
    assert sorted(found - METHOD_IMPORTS.keys()) == [], "call the algorithm through eagle3nb.drafts: get, of, ..."
    assert sorted(METHOD_IMPORTS.keys() - found) == [], "an exception no import needs any more: remove it"


def test_architecture_doc_names_only_paths_that_exist():
    doc = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    named = set(re.findall(r"`((?:eagle3nb|notebooks|params|tests|benchmarks|tools|docs)/[\w./-]*)`", doc))
    assert named, "ARCHITECTURE.md names no paths"
    missing = sorted(p for p in named if not (ROOT / p.rstrip("/")).exists())
    assert missing == []


def imported_modules(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module) of every import in a module, at any depth: import statements and ``importlib.import_module``
    of a literal name."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Call) and ast.unparse(node.func).endswith("import_module") and node.args \
                and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            found.append((node.lineno, node.args[0].value))
    return found


def test_tests_share_helpers_through_helper_modules_not_test_modules():
    """A helper, constant or fixture two test modules share lives in a helper module under tests/ (worlds.py,
    served_drafts.py, tiny_targets.py ...; fixtures through a plugin tests/conftest.py loads), never in a test
    module another one imports: that ties one test file's edits to another's tests, and a fixture imported by name
    is a second copy of it. (No module there edits ``sys.path`` either:
    test_benchmarks_and_tests_import_without_editing_sys_path.)"""
    probe = "import test_a, os\ndef f():\n    from test_b import x\n    importlib.import_module('tests.test_c')\n"
    assert imported_modules(ast.parse(probe)) == [(1, "test_a"), (1, "os"), (3, "test_b"), (4, "tests.test_c")]
    tests = ROOT / "tests"
    test_modules = {f.stem for f in tests.rglob("test_*.py")}
    found = [f"{f.relative_to(ROOT)}:{line}: {name}" for f in sorted(tests.rglob("*.py"))
             for line, name in imported_modules(ast.parse(f.read_text()))
             if name.removeprefix("tests.").split(".")[0] in test_modules]
    assert found == [], "move what they share into a helper module under tests/ (docs/testing.md)"
