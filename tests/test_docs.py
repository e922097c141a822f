"""Every command the docs show works, and every link in them leads somewhere.

Each shell command in a fenced ```bash / ```sh / ```console block of README.md and docs/*.md is checked against
the real thing: ``eagle3nb ...`` against the console script's argparse parser, ``python -m eagle3nb.<stage>``
(and ``torchrun ... -m eagle3nb.<stage>``) through the stage's own command line up to validated parameters,
``papermill`` against its click command, ``torchrun`` against torch's own parser, ``vllm serve`` / vLLM's
api_server against vLLM's parser (in its own environment, .venv-vllm/), ``make`` against the Makefile's targets
and variables, ``python <script>`` against the script's file and the flags it defines; repository paths the
commands name must exist. Abbreviated flags are refused (argparse would accept a prefix of a real flag, which a
misspelling can be). A command no check knows fails, unless it is in EXEMPTIONS with its reason.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest

from worlds import under_ci

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_LANGS = {"bash", "sh", "shell", "console"}
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
VLLM_INSTALLED = ROOT / ".venv-vllm" / ".installed"  # the Makefile's stamp: vLLM installed and importable
# Arguments that name files of this repository (inputs); outputs/ and absolute paths belong to a run or a machine.
REPO_PREFIXES = ("params/", "notebooks/", "tools/", "benchmarks/", "eagle3nb/", "tests/", "docs/")

# Commands shown in the docs that no check here parses, each with why.
EXEMPTIONS = {
    "tail": "a standard shell tool reading a run's log: nothing of ours to parse",
}
# vLLM's parser lives in its own environment; without it (no `make vllm` yet) these commands cannot be parsed.
VLLM_EXEMPTIONS = {
    "vllm": "vLLM's parser is only in .venv-vllm/ (`make vllm`), which is not installed here",
    "vllm.entrypoints.openai.api_server": "vLLM's parser is only in .venv-vllm/ (`make vllm`), which is not "
                                          "installed here",
}


@dataclass
class Command:
    doc: Path
    line: int
    text: str

    @property
    def where(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"


# ----------------------------------------------------------------------------------- reading the docs


def fenced_blocks(path: Path) -> list[tuple[str, int, list[str]]]:
    """(language, line number of the first body line, body lines with the fence's indent removed)."""
    out, lang, indent, start, body = [], None, "", 0, []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        m = re.match(r"^(\s*)```\s*([\w+-]*)\s*$", line)
        if lang is None and m:
            indent, lang, start, body = m.group(1), m.group(2).lower(), n + 1, []
        elif lang is not None and m and line.strip() == "```":
            out.append((lang, start, body))
            lang = None
        elif lang is not None:
            body.append(line[len(indent):] if line.startswith(indent) else line.lstrip())
    assert lang is None, f"{path}: a fenced block opened at line {start - 1} is never closed"
    return out


def shell_commands(path: Path) -> list[Command]:
    """The commands of a document's shell blocks; continuation lines joined, console output lines skipped."""
    out = []
    for lang, start, body in fenced_blocks(path):
        if lang not in SHELL_LANGS:
            continue
        pending, first = "", 0
        for n, line in enumerate(body, start):
            if lang == "console" and not pending:
                if not line.startswith("$ "):
                    continue  # output
                line = line[2:]
            if not pending:
                first = n
            if line.rstrip().endswith("\\"):
                pending += line.rstrip()[:-1] + " "
                continue
            text = (pending + line).strip()
            pending = ""
            if text and not text.startswith("#"):
                out.append(Command(path, first, text))
    return out


def all_commands() -> list[Command]:
    return [c for doc in DOCS for c in shell_commands(doc)]


def split_command(text: str) -> list[list[str]]:
    """Shell words of each simple command (``a && b; c`` -> three), comments dropped."""
    words = shlex.split(text, comments=True)
    parts, cur = [], []
    for w in words:
        if w in ("&&", "||", ";", "|"):
            parts.append(cur)
            cur = []
        else:
            cur.append(w)
    parts.append(cur)
    return [p for p in parts if p]


def strip_env(words: list[str]) -> list[str]:
    """Drop leading ``NAME=value`` environment assignments."""
    i = 0
    while i < len(words) and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[i]):
        i += 1
    return words[i:]


# ----------------------------------------------------------------------------------- the checkers


class Aliases:
    """Paths an earlier command of the same document creates (``cp -r SRC DST``): DST stands for SRC."""

    def __init__(self):
        self.map: dict[str, str] = {}

    def resolve(self, word: str) -> str:
        for dst, src in self.map.items():
            if word.rstrip("/") == dst or word.startswith(dst + "/"):
                return src + word[len(dst):]
        return word


def check_repo_paths(words: list[str], aliases: Aliases) -> None:
    for w in words:
        if w.startswith(REPO_PREFIXES):
            real = aliases.resolve(w)
            assert (ROOT / real).exists(), f"{w!r} does not exist in the repository"


def no_abbrev(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Refuse abbreviated flags in this parser and its sub-parsers (a misspelt prefix would pass otherwise)."""
    parser.allow_abbrev = False
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                no_abbrev(sub)
    return parser


def parse_or_fail(parser: argparse.ArgumentParser, argv: list[str], capsys) -> argparse.Namespace:
    try:
        return parser.parse_args(argv)
    except SystemExit as e:
        err = capsys.readouterr().err.strip().splitlines()
        raise AssertionError(f"{parser.prog} refuses {argv}: {err[-1] if err else e}") from None


def check_eagle3nb(argv: list[str], capsys) -> None:
    from eagle3nb.cli import build_parser

    parse_or_fail(no_abbrev(build_parser()), argv, capsys)


def check_stage(module: str, argv: list[str], monkeypatch, capsys, aliases: Aliases) -> None:
    """``python -m eagle3nb.<stage> ARGS``: the stage's own command line up to validated parameters (input paths
    made by earlier stages or on the production machine are not required); the stage itself is not run."""
    from eagle3nb import stage_cli
    from eagle3nb.params import STAGE_MODULES, from_dict

    stages = {m: s for s, m in STAGE_MODULES.items()}
    assert module in stages, f"{module} is not a stage module ({', '.join(sorted(stages))})"
    ran = []
    monkeypatch.setattr(stage_cli, "from_dict", lambda stage, values: from_dict(stage, values, check_paths=False))
    monkeypatch.setattr(stage_cli, "importlib", SimpleNamespace(import_module=lambda name: SimpleNamespace(
        run=ran.append)))
    monkeypatch.setattr(stage_cli, "argparse", SimpleNamespace(
        ArgumentParser=functools.partial(argparse.ArgumentParser, allow_abbrev=False)))
    monkeypatch.chdir(ROOT)
    try:
        rc = stage_cli.main(stages[module], [aliases.resolve(a) for a in argv])
    except SystemExit as e:
        err = capsys.readouterr().err.strip().splitlines()
        raise AssertionError(f"python -m {module} refuses {argv}: {err[-1] if err else e}") from None
    err = capsys.readouterr().err.strip()
    assert rc == 0 and len(ran) == 1, f"python -m {module} {' '.join(argv)}: exit {rc}: {err}"


def module_file(module: str) -> Path | None:
    base = ROOT.joinpath(*module.split("."))
    for f in (base.with_suffix(".py"), base / "__main__.py"):
        if f.exists():
            return f
    return None


def check_flags_in_source(source: Path, argv: list[str]) -> None:
    """A script's flags must be ones it defines (its argparse ``add_argument("--flag", ...)``)."""
    text = source.read_text()
    for a in argv:
        if a.startswith("--"):
            flag = a.split("=", 1)[0]
            assert f'"{flag}"' in text or f"'{flag}'" in text, f"{source.relative_to(ROOT)} defines no {flag}"


def check_python(argv: list[str], monkeypatch, capsys, aliases: Aliases) -> None:
    if argv[:1] == ["-m"]:
        module, rest = argv[1], argv[2:]
        if module.count(".") == 1 and module.startswith("eagle3nb."):
            check_stage(module, rest, monkeypatch, capsys, aliases)
            return
        source = module_file(module)
        assert source is not None, f"python -m {module}: no such module in the repository"
        text = source.read_text()
        assert source.name == "__main__.py" or '__name__ == "__main__"' in text, f"{module} cannot run with -m"
        check_flags_in_source(source, rest)
        return
    script = argv[0]
    assert script.endswith(".py") and (ROOT / script).exists(), f"python {script}: no such script"
    check_flags_in_source(ROOT / script, argv[1:])


def check_papermill(argv: list[str]) -> None:
    import click
    from papermill.cli import papermill

    try:
        ctx = papermill.make_context("papermill", list(argv))
    except click.ClickException as e:
        raise AssertionError(f"papermill refuses {argv}: {e.format_message()}") from None
    assert (ROOT / ctx.params["notebook_path"]).exists(), f"{ctx.params['notebook_path']} does not exist"
    for f in ctx.params["parameters_file"] or ():
        assert (ROOT / f).exists(), f"parameters file {f} does not exist"


def check_torchrun(argv: list[str], monkeypatch, capsys, aliases: Aliases) -> None:
    from torch.distributed.run import get_args_parser

    args = parse_or_fail(no_abbrev(get_args_parser()), argv, capsys)
    assert args.module, "torchrun: use -m eagle3nb.<stage> (the stage's module)"
    check_stage(args.training_script, args.training_script_args, monkeypatch, capsys, aliases)


def makefile() -> tuple[set[str], set[str]]:
    text = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([A-Za-z0-9_.-]+)\s*:(?!=)", text, re.M))
    variables = set(re.findall(r"^([A-Za-z_][A-Za-z0-9_]*)\s*[?:+]?=", text, re.M))
    return targets, variables


def check_make(argv: list[str]) -> None:
    targets, variables = makefile()
    for a in argv:
        if "=" in a:
            name = a.split("=", 1)[0]
            assert name in variables, f"make {a}: the Makefile has no variable {name}"
        elif not a.startswith("-"):
            assert a in targets, f"make {a}: the Makefile has no target {a!r}"


def check_cp(argv: list[str], aliases: Aliases) -> None:
    paths = [a for a in argv if not a.startswith("-")]
    assert len(paths) == 2, f"cp {' '.join(argv)}: expected a source and a destination"
    src, dst = paths
    assert (ROOT / aliases.resolve(src)).exists(), f"cp: {src} does not exist"
    aliases.map[dst.rstrip("/")] = aliases.resolve(src).rstrip("/")


# ----------------------------------------------------------------------------------- vLLM, in its environment

_VLLM_PARSE = r"""
import contextlib, io, json, sys
try:  # where vLLM keeps its server's parser: 0.32 (the tested release), then earlier releases
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
except ImportError:
    from vllm.entrypoints.openai.cli_args import make_arg_parser
try:
    from vllm.utils.argparse_utils import FlexibleArgumentParser
except ImportError:
    from vllm.utils import FlexibleArgumentParser
out = []
for argv in json.load(sys.stdin):
    parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
    parser.allow_abbrev = False
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            parser.parse_args(argv)
        out.append(None)
    except SystemExit:
        lines = err.getvalue().strip().splitlines()
        out.append(lines[-1] if lines else "refused")
print("RESULTS " + json.dumps(out))
"""


def vllm_available() -> bool:
    return VLLM_PYTHON.exists() and VLLM_INSTALLED.exists()


@functools.lru_cache(maxsize=1)
def vllm_results() -> dict[tuple[str, ...], str | None]:
    """Every vLLM command of the docs parsed by vLLM's own parser, in one subprocess (its import is slow)."""
    argvs = []
    for cmd in all_commands():
        for words in split_command(cmd.text):
            key = vllm_argv(strip_env(words))
            if key is not None:
                argvs.append(key)
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"}
    proc = subprocess.run([str(VLLM_PYTHON), "-c", _VLLM_PARSE], input=json.dumps(argvs), capture_output=True,
                          text=True, timeout=600, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")]
    assert lines, f"vLLM's parser did not run: {proc.stderr[-2000:]}"
    return dict(zip(map(tuple, argvs), json.loads(lines[-1][len("RESULTS "):])))


def vllm_argv(words: list[str]) -> list[str] | None:
    """The argv vLLM's parser sees for a command, or None when the command is not vLLM's."""
    if words[:2] == ["vllm", "serve"]:
        return words[2:]
    if len(words) > 2 and Path(words[0]).name.startswith("python") and words[1:3] == [
            "-m", "vllm.entrypoints.openai.api_server"]:
        return words[3:]
    return None


def vllm_key(words: list[str]) -> str | None:
    if words[:1] == ["vllm"]:
        return "vllm"
    if len(words) > 2 and Path(words[0]).name.startswith("python") and words[1] == "-m" and \
            words[2].startswith("vllm."):
        return words[2]
    return None


def check_vllm(words: list[str]) -> None:
    argv = vllm_argv(words)
    assert argv is not None, f"{' '.join(words[:3])}: not a vLLM server command this test knows (vllm serve, " \
                             "python -m vllm.entrypoints.openai.api_server)"
    error = vllm_results()[tuple(argv)]
    assert error is None, f"vLLM refuses {argv}: {error}"


# ----------------------------------------------------------------------------------- the tests

COMMANDS = all_commands()


def test_the_docs_show_commands():
    assert len(COMMANDS) >= 20, f"only {len(COMMANDS)} commands found in {', '.join(d.name for d in DOCS)}"


def exemption(words: list[str]) -> str | None:
    """Why this command is not checked, or None when it is."""
    key = vllm_key(words)
    if key is not None and not vllm_available():
        if under_ci():
            pytest.fail("CI must check vLLM commands against vLLM's parser, but .venv-vllm/ is not installed "
                        "(make vllm)")
        return VLLM_EXEMPTIONS.get(key, VLLM_EXEMPTIONS["vllm"])
    name = Path(words[0]).name
    return f"{name}: {EXEMPTIONS[name]}" if name in EXEMPTIONS else None


def check_words(words: list[str], monkeypatch, capsys, aliases: Aliases) -> None:
    prog, argv = words[0], words[1:]
    if prog == "cp":
        check_cp(argv, Aliases())
        return
    check_repo_paths(argv, aliases)
    checkers = {
        "eagle3nb": lambda: check_eagle3nb(argv, capsys),
        "papermill": lambda: check_papermill(argv),
        "torchrun": lambda: check_torchrun(argv, monkeypatch, capsys, aliases),
        "make": lambda: check_make(argv),
    }
    if vllm_key(words) is not None:
        check_vllm(words)
    elif Path(prog).name.startswith("python"):
        check_python(argv, monkeypatch, capsys, aliases)
    elif prog in checkers:
        checkers[prog]()
    else:
        pytest.fail(f"no check knows {prog!r}; add one to tests/test_docs.py or an exemption with its reason "
                    "to EXEMPTIONS")


def earlier_aliases(cmd: Command) -> Aliases:
    """The paths earlier commands of the same document create (cp -r params/x params/mine)."""
    aliases = Aliases()
    for earlier in shell_commands(cmd.doc):
        if earlier.line >= cmd.line:
            break
        for words in map(strip_env, split_command(earlier.text)):
            if words[0] == "cp":
                check_cp(words[1:], aliases)
    return aliases


def tiered(cmd: Command) -> Command | object:
    """A command vLLM's own parser checks is in the engine tier: parsing it imports vLLM in its environment (one
    import for all of them, ~12 s), which the inner loop (`make test-fast`) leaves to `make test`."""
    uses_vllm = any(vllm_key(strip_env(words)) for words in split_command(cmd.text))
    return pytest.param(cmd, marks=pytest.mark.engine) if uses_vllm else cmd


@pytest.mark.parametrize("cmd", [tiered(c) for c in COMMANDS], ids=lambda c: f"{c.where}:{c.text.split()[0]}")
def test_command_works(cmd: Command, monkeypatch, capsys):
    aliases = earlier_aliases(cmd)
    for words in map(strip_env, split_command(cmd.text)):
        reason = exemption(words)
        if reason:
            pytest.skip(f"{cmd.where}: {reason}")
        try:
            check_words(words, monkeypatch, capsys, aliases)
        except AssertionError as e:
            raise AssertionError(f"{cmd.where}: {cmd.text}\n  {e}") from None


# ----------------------------------------------------------------------------------- links


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)
    seen: dict[str, int] = {}
    out = set()
    for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*$", text, re.M):
        s = slug(m.group(1))
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


def links(path: Path) -> list[tuple[int, str]]:
    """(line, target) of every markdown link outside code."""
    out = []
    in_fence = False
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip().startswith("```"):
            in_fence = not in_fence
            continue
        if in_fence:
            continue
        for m in re.finditer(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", re.sub(r"`[^`]*`", "", line)):
            out.append((n, m.group(1)))
    return out


LINKS = [(doc, n, target) for doc in DOCS for n, target in links(doc)
         if not re.match(r"^[a-z][a-z0-9+.-]*:", target)]  # http:, https:, mailto: are not ours to check


@pytest.mark.parametrize("doc,line,target", LINKS, ids=lambda x: str(x.relative_to(ROOT)) if isinstance(x, Path)
                         else str(x))
def test_relative_link_resolves(doc: Path, line: int, target: str):
    path, _, anchor = target.partition("#")
    dest = (doc.parent / path).resolve() if path else doc
    where = f"{doc.relative_to(ROOT)}:{line}"
    assert dest.exists(), f"{where}: link to {target} points at nothing ({dest} does not exist)"
    assert ROOT in dest.parents or dest == ROOT, f"{where}: link to {target} leaves the repository"
    if anchor and dest.suffix == ".md":
        assert anchor in anchors(dest), f"{where}: {dest.name} has no heading with anchor #{anchor}"


def test_docs_have_links():
    assert len(LINKS) >= 10, f"only {len(LINKS)} relative links found"


# ----------------------------------------------------------------------------------- navigation

README_MAX_LINES = 160


def test_the_readme_stays_a_front_page():
    n = len((ROOT / "README.md").read_text().splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines (at most {README_MAX_LINES}): move detail to docs/"


def test_every_docs_page_and_folder_is_in_the_index():
    index = ROOT / "docs" / "README.md"
    linked = {(index.parent / target.partition("#")[0]).resolve() for _, target in links(index)}
    pages = [p for p in (ROOT / "docs").iterdir() if p != index and (p.is_dir() or p.suffix == ".md")]
    missing = [p.name for p in pages if p.resolve() not in linked]
    assert not missing, f"docs/README.md does not list {missing}"
    assert "docs/README.md" in {t.partition("#")[0] for _, t in links(ROOT / "README.md")}, \
        "README.md does not link the docs index"


def parsers(parser: argparse.ArgumentParser, path: str = "eagle3nb"):
    """(command path, parser) of the console script and every subcommand under it."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from parsers(sub, f"{path} {name}")


def test_every_command_help_is_written_for_users():
    """Each command's --help opens with whole sentences for a user: no docstring cut mid-sentence, no reST."""
    from eagle3nb.cli import build_parser

    seen = list(parsers(build_parser()))
    assert len(seen) >= 9, [p for p, _ in seen]  # eagle3nb, run, status, toy x4, serve, doctor, plan
    for path, parser in seen:
        text = (parser.description or "").strip()
        assert text and text[0].isupper() and text.endswith("."), f"{path} --help: {text!r}"
        assert "``" not in text, f"{path} --help shows reST markup: {text!r}"


def test_the_help_and_the_readme_name_every_stage_and_every_draft_method():
    """A user's first reads, eagle3nb --help and the README, count the stages the registry has and name every draft
    method (05 with its params folder, serve --draft included): they said four stages and EAGLE-3."""
    from eagle3nb.cli import build_parser
    from eagle3nb.drafts import PACKAGES, get
    from eagle3nb.params import STAGE_MODULES

    count = {4: "four", 5: "five", 6: "six"}[len(STAGE_MODULES)]
    helps = dict(parsers(build_parser()))
    top, readme = " ".join(helps["eagle3nb"].format_help().split()), (ROOT / "README.md").read_text()
    assert f"{count} stages" in top and f"The {count} stages" in readme
    assert "eagle3nb run params/mine/ --stages 05" in top
    draft_help = " ".join(helps["eagle3nb serve"].format_help().split())
    for name in PACKAGES:
        assert name in top and name in draft_help, name
        assert get(name).title in readme.split("## Why")[0], get(name).title


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
