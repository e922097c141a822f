"""A method is its package plus one registry line: outside ``eagle3nb/drafts/`` no code names a draft method
(``served_as``, ``served_method`` and the rules say what a draft is served as), and 05's served A/B serves each draft
as the method it was trained with, and the doctor reads its tensors through its method."""

from __future__ import annotations

import ast
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
# file -> why it may still write a method's name (each a reason, not a method's fact)
ALLOWED = {
    "eagle3nb/train/params.py": "export_format eagle3 is EAGLE-3's checkpoint layout's name, not a method",
    "eagle3nb/train/export.py": "export_format eagle3 is EAGLE-3's checkpoint layout's name, not a method",
    "eagle3nb/doctor/checks/server.py": "whether a family's vLLM model class has the EAGLE-3 interface",
}


def method_literals() -> dict[str, list[tuple[int, str]]]:
    """Every string constant outside eagle3nb/drafts/ (in the package and the benchmarks, which read the registry)
    equal to a registered method or a name one is served as."""
    from eagle3nb.drafts import PACKAGES, served_as

    names = set(PACKAGES) | {served_as(m) for m in PACKAGES}
    found: dict[str, list[tuple[int, str]]] = {}
    for f in sorted([*(ROOT / "eagle3nb").rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py")]):
        rel = f.relative_to(ROOT).as_posix()
        if rel.startswith("eagle3nb/drafts/"):
            continue
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Constant) and node.value in names:
                found.setdefault(rel, []).append((node.lineno, node.value))
    return found


def test_no_method_is_named_outside_its_package_but_the_allowed():
    found = method_literals()
    assert set(found) <= set(ALLOWED), {f: hits for f, hits in found.items() if f not in ALLOWED}
    assert set(ALLOWED) <= set(found), f"allowed but clean now, drop them: {set(ALLOWED) - set(found)}"


def write_config(folder: Path, method: str, target_config: dict) -> Path:
    """A ``method`` draft's vLLM config.json (what the served method is read from) in ``folder``."""
    from eagle3nb.drafts.dflash.layouts import layout_config
    from eagle3nb.drafts.dflash.model import from_target

    heads = {"dspark": {"markov_rank": 4},
             "dflash2": {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 4, "selector_top_k": 2}}
    folder.mkdir()
    cfg = from_target(target_config, block_size=4, **heads.get(method, {}))
    (folder / "config.json").write_text(json.dumps(layout_config(cfg, "vllm")))
    return folder


@pytest.mark.parametrize("method", ["dspark", "dflash2"])
def test_served_ab_serves_each_draft_as_its_method(method, toy_smoke, tmp_path, monkeypatch):
    """05's served A/B starts vLLM with the method each draft was trained with (DFlash2's served as dflash), not
    EAGLE-3's."""
    import eagle3nb.accept.online as online
    import eagle3nb.refresh.served as served
    from eagle3nb.drafts import served_as

    started = []

    def fake_start(model, mode, draft_dir, **kw):
        started.append(mode)
        return SimpleNamespace(base_url=f"http://{draft_dir.name}", stop=lambda: None)

    monkeypatch.setattr(served, "start_vllm", fake_start)
    monkeypatch.setattr(online, "bench_endpoint",
                        lambda name, *a, **kw: [{k: 0 for k in served.KEPT}])
    target = json.loads((toy_smoke / "config.json").read_text())
    drafts = {n: write_config(tmp_path / n, method, target) for n in ("current", "refreshed")}
    P = SimpleNamespace(model_path=str(toy_smoke), k=3, family=None, max_tokens=8)
    out = served._measure(P, [{"id": 0}], drafts)
    assert set(out) == set(drafts) and started == [served_as(method)] * 2


def test_shapes_vocab_reads_a_block_drafter_through_its_method(trained, toy_smoke, tmp_path):
    """A DFlash export (no head, no vocab map, fc over its own aux layers) passes shapes_vocab, its tensors read
    through its method's ``tensor_problems``; its config naming one aux layer fewer than its fc takes fails, naming
    the fc and the layers."""
    from safetensors.torch import load_file

    from eagle3nb.doctor import FAIL, PASS
    from eagle3nb.doctor.checks.draft import check_shapes_vocab
    from eagle3nb.doctor.context import Context
    from eagle3nb.drafts.dflash.layouts import save_draft
    from eagle3nb.drafts.dflash.model import DFlashDraft, from_target

    from worlds import write_run

    ids = [2, 6]  # not EAGLE-3's three: an fc of 2 x H, which the EAGLE-3 reading refused
    draft = DFlashDraft(from_target(json.loads((toy_smoke / "config.json").read_text()), block_size=4,
                                    aux_layer_ids=ids))
    target = load_file(toy_smoke / "model.safetensors")
    draft.set_target(target["model.embed_tokens.weight"], target["lm_head.weight"])
    folder = save_draft(draft, tmp_path / "dflash")
    stages = {s: {**v, **({"draft_dir": folder} if s == "04_acceptance" else {})} for s, v in trained["stages"].items()}
    run = write_run(tmp_path / "run", stages)
    r = check_shapes_vocab(Context.from_run_dir(run))
    assert r.status == PASS, r
    config = json.loads((folder / "config.json").read_text())
    config["dflash_config"]["target_layer_ids"] = [ids[0] - 1]
    (folder / "config.json").write_text(json.dumps(config))
    r = check_shapes_vocab(Context.from_run_dir(run))
    H = draft.config.target_hidden_size
    assert r.status == FAIL and f"does not take 1 x {H} = {H} inputs" in r.measured, r


def test_the_embedded_sweep_serves_every_k_of_a_chain_draft_and_the_block_of_a_block_drafter(trained, toy_smoke,
                                                                                              tmp_path):
    """04's default ``ks``: a chain draft (the suite's EAGLE-3) is served at k = 1..max_k, so the best k per
    concurrency has a choice; a block drafter (DFlash, read from its config.json) only at its block's k."""
    from eagle3nb.params import from_dict
    from eagle3nb.params_yaml import run_params

    from worlds import write_run

    block = write_config(tmp_path / "dflash", "dflash", json.loads((toy_smoke / "config.json").read_text()))
    for draft, want in ((trained["stages"]["04_acceptance"]["draft_dir"], [1, 2, 3, 4, 5]), (block, [3])):
        stages = {"04_acceptance": {**trained["stages"]["04_acceptance"], "draft_dir": draft, "k": 3, "max_k": 5}}
        P = from_dict("04_acceptance", run_params(write_run(tmp_path / draft.name / "run", stages), "04_acceptance"))
        assert P.sweep_ks == want
        assert P.model_copy(update={"ks": [2]}).sweep_ks == [2]  # a listed ks is served as listed
