"""The silent misconfigurations of a served draft, refused in one line before any server starts: by ``start_vllm``
(its vLLM Python is a stand-in that leaves a mark when run, so a refusal provably started nothing), by ``eagle3nb
serve`` and by the doctor's ``serving`` check; each names the flag or field that fixes it, and a correct
configuration passes all three. The drafts are untrained one-layer drafts of the shipped ``toy:smoke`` target,
written in each layout and then edited the way a wrong export or a hand-edited config.json is."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest
import torch

from eagle3nb.cli import main
from eagle3nb.doctor import FAIL, PASS, run_checks
from eagle3nb.drafts import ServingError
from eagle3nb.launch import free_port

from mask_files import MASK_FILES, MaskFile
from worlds import write_run

BLOCK = 4  # the block drafters' block: DFlash drafts 3 a round, DSpark 4


@pytest.fixture(scope="module")
def target_config(toy_smoke) -> dict:
    return json.loads((toy_smoke / "config.json").read_text())


@pytest.fixture(scope="module")
def rows(toy_smoke) -> dict[str, int]:
    """Two tokens of the toy: ``dead``, one whose embedding row was never trained (norm under half the median: the
    toy's pad row 0, a fresh block drafter's default mask token), and ``live``, one at the median norm."""
    from eagle3nb.data.head import embedding_row_norms

    norms = embedding_row_norms(toy_smoke)
    dead = (norms < 0.5 * norms.median()).nonzero().flatten().tolist()
    assert dead, "the toy has no dead embedding row to plant"
    return {"dead": dead[0], "live": int((norms - norms.median()).abs().argmin())}


def edit_config(folder: Path, edit: Callable[[dict], None] | None) -> Path:
    if edit is not None:
        cfg = json.loads((folder / "config.json").read_text())
        edit(cfg)
        (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def block_draft(folder: Path, target_config: dict, rows: dict[str, int], method: str, layout: str = "vllm",
                edit: Callable[[dict], None] | None = None, mask: str = "live") -> Path:
    """An untrained one-layer DFlash / DSpark draft of the toy whose mask token is the ``mask`` row, saved in
    ``layout`` with no trained mask embedding, its config edited."""
    from eagle3nb.drafts.dflash.layouts import save_draft
    from eagle3nb.drafts.dflash.model import DFlashDraft, from_target

    torch.manual_seed(0)
    heads = {"dspark": {"markov_rank": 8},  # DFlash2's additions at a shape the toy fits
             "dflash2": {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 4, "selector_top_k": 2}}
    m = DFlashDraft(from_target(target_config, num_layers=1, block_size=BLOCK, mask_token_id=rows[mask],
                                **heads.get(method, {})))
    folder = save_draft(m, folder, layout)
    (folder / "mask_embedding.pt").unlink(missing_ok=True)
    return edit_config(folder, edit)


def eagle3_draft(folder: Path, target_config: dict, edit: Callable[[dict], None] | None = None,
                 d2t_shift: int = 0) -> Path:
    """An untrained EAGLE-3 draft of the toy over a 64-token draft vocabulary (so its file holds d2t); its last
    d2t entry shifted by ``d2t_shift``."""
    from safetensors.torch import load_file, save_file

    from eagle3nb.drafts.eagle3.layouts import save_draft
    from eagle3nb.drafts.eagle3.model import Eagle3Config, Eagle3Draft

    torch.manual_seed(0)
    V, VD, H = target_config["vocab_size"], 64, target_config["hidden_size"]
    m = Eagle3Draft(Eagle3Config(hidden_size=H, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
                                 head_dim=16, vocab_size=V, draft_vocab_size=VD, aux_layer_ids=[2, 4, 5]))
    ids = torch.randperm(V)[:VD].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    m.set_vocab(ids - torch.arange(VD), t2d)
    folder = save_draft(m, folder)
    if d2t_shift:
        tensors = load_file(folder / "model.safetensors")
        tensors["d2t"][-1] += d2t_shift
        save_file(tensors, folder / "model.safetensors")
    return edit_config(folder, edit)


def aux_ids(ids: list[int]) -> Callable[[dict], None]:
    def edit(cfg: dict) -> None:
        cfg["eagle_aux_hidden_state_layer_ids"] = ids
        cfg.setdefault("eagle_config", {})["eagle_aux_hidden_state_layer_ids"] = ids
    return edit


@dataclass
class Case:
    """A draft served as ``method`` with ``k``; ``names``: what the refusal must say ("{method}" / "{k}": the
    surface's own flag for the method / k). ``names`` empty: a correct configuration."""

    draft: Callable[[Path, dict, dict], Path]  # (folder, the target's config, rows) -> the draft's folder
    method: str
    k: int
    names: tuple[str, ...] = ()
    trained: dict = field(default_factory=dict)  # 03_train's values when they differ from the served ones
    ours: bool = True  # eagle3nb serve takes it too: its decoder drafts a block drafter's whole block, never fewer


REFUSED = {
    "DSpark with k other than its block": Case(
        lambda f, tc, r: block_draft(f, tc, r, "dspark"), "dspark", BLOCK - 1, ("{k} 3", "set {k} to 4")),
    "DFlash with k past its block": Case(
        lambda f, tc, r: block_draft(f, tc, r, "dflash"), "dflash", BLOCK, ("{k} 4", "set {k} to 3")),
    "DSpark (vLLM layout) with sample_from_anchor false": Case(
        lambda f, tc, r: block_draft(f, tc, r, "dspark", edit=lambda c: c.update(sample_from_anchor=False)),
        "dspark", BLOCK, ("sample_from_anchor is false", "set sample_from_anchor: true")),
    "DSpark (speculators layout) without sample_from_anchor": Case(
        lambda f, tc, r: block_draft(f, tc, r, "dspark", "speculators", edit=lambda c: c.pop("sample_from_anchor")),
        "dspark", BLOCK, ("sample_from_anchor is false (unset", "set sample_from_anchor: true")),
    "DFlash with dflash_config.sample_from_anchor true": Case(
        lambda f, tc, r: block_draft(f, tc, r, "dflash", edit=lambda c: c["dflash_config"].update(
            sample_from_anchor=True)), "dflash", BLOCK - 1, ("set dflash_config.sample_from_anchor: false",)),
    "DFlash2 heads in DFlash's layout": Case(
        lambda f, tc, r: block_draft(f, tc, r, "dflash2", edit=lambda c: c.update(architectures=["DFlashDraftModel"])),
        "dflash", BLOCK - 1, ("selector_rank 4", "make it dflash2", "write architectures ['DFlash2DraftModel']"),
        trained={"method": "dflash"}),
    "DSpark heads in DFlash's layout": Case(
        lambda f, tc, r: block_draft(f, tc, r, "dspark", edit=lambda c: c.update(architectures=["DFlashDraftModel"])),
        "dflash", BLOCK - 1, ("markov_rank 8", "architectures ['Qwen3DSparkModel']", "{method} dspark"),
        trained={"method": "dflash"}),
    "DFlash target_layer_ids past the target": Case(
        lambda f, tc, r: block_draft(f, tc, r, "dflash", edit=lambda c: c["dflash_config"].update(
            target_layer_ids=[1, 8])), "dflash", BLOCK - 1, ("dflash_config.target_layer_ids [1, 8]", "runs -1..6")),
    "EAGLE-3 aux layer ids past the target": Case(
        lambda f, tc, _: eagle3_draft(f, tc, aux_ids([2, 4, 8])), "eagle3", 3,
        ("eagle_aux_hidden_state_layer_ids [2, 4, 8]", "[8]")),
    "EAGLE-3 d2t past the target's vocabulary": Case(
        lambda f, tc, _: eagle3_draft(f, tc, d2t_shift=10_000), "eagle3", 3, ("d2t maps 1 draft ids outside",)),
    "EAGLE-3 draft of another vocabulary": Case(
        lambda f, tc, _: eagle3_draft(f, tc, lambda c: c.update(vocab_size=tc["vocab_size"] + 10)), "eagle3", 3,
        (f"vocab_size {546 + 10} is not the target's vocab_size 546",)),
    "DFlash served as eagle3": Case(
        lambda f, tc, r: block_draft(f, tc, r, "dflash"), "eagle3", 3, ("method dflash", "set {method} to dflash")),
    "DSpark served as eagle3": Case(
        lambda f, tc, r: block_draft(f, tc, r, "dspark", "speculators"), "eagle3", 3,
        ("method dspark", "set {method} to dspark")),
    "EAGLE-3 served as dspark": Case(
        lambda f, tc, _: eagle3_draft(f, tc), "dspark", BLOCK, ("method eagle3", "set {method} to eagle3")),
    "DSpark served as dflash": Case(
        lambda f, tc, r: block_draft(f, tc, r, "dspark"), "dflash", BLOCK - 1,
        ("method dspark", "set {method} to dspark")),
    "a dead mask row and no mask_embedding.pt": Case(
        lambda f, tc, r: block_draft(f, tc, r, "dflash", mask="dead"), "dflash", BLOCK - 1,
        ("embedding row is dead", "mask_embedding.pt")),
}


def with_mask_embedding(folder: Path) -> Path:
    """vLLM's format of a trained mask embedding: the draft's mask id and its [H] vector."""
    cfg = json.loads((folder / "config.json").read_text())
    torch.save({"mask_token_id": cfg["dflash_config"]["mask_token_id"], "embedding": torch.randn(cfg["hidden_size"])},
               folder / "mask_embedding.pt")
    return folder


def fresh_mask(mask_token_id: int, H: int) -> dict:
    """A fresh export's mask input: the smoke toy's live rows' mean (``mask.live_mean``, where 03 starts it), whose
    norm is a fraction of a row's, under the dead-row rule's half of the median: a vector is not held to it."""
    from safetensors.torch import load_file

    from eagle3nb.drafts.dflash.mask import live_mean
    from eagle3nb.toy import shipped

    rows = load_file(shipped("smoke") / "model.safetensors")["model.embed_tokens.weight"]
    mean = live_mean(rows)
    assert float(mean.norm()) < 0.5 * float(rows.norm(dim=-1).median()), "the case no longer tests a short vector"
    return {"mask_token_id": mask_token_id, "embedding": mean}


# The mask input files a new user's export may hold (tests/mask_files.py), each a DFlash draft served at its k.
REFUSED.update({name: Case(lambda f, tc, r, m=m: m.write(block_draft(f, tc, r, "dflash", mask=m.row)), "dflash",
                           BLOCK - 1, m.names) for name, m in MASK_FILES.items()})


SERVED_RIGHT = {
    "DFlash (vLLM layout)": Case(lambda f, tc, r: block_draft(f, tc, r, "dflash"), "dflash", BLOCK - 1),
    "DFlash (speculators layout) with fewer drafts than its block": Case(
        lambda f, tc, r: block_draft(f, tc, r, "dflash", "speculators"), "dflash", BLOCK - 2, ours=False),
    "DSpark (vLLM layout)": Case(lambda f, tc, r: block_draft(f, tc, r, "dspark"), "dspark", BLOCK),
    "DSpark (speculators layout)": Case(
        lambda f, tc, r: block_draft(f, tc, r, "dspark", "speculators"), "dspark", BLOCK),
    "EAGLE-3": Case(lambda f, tc, _: eagle3_draft(f, tc), "eagle3", 3),
    # vLLM serves DFlash2 as dflash, its model picked by the architecture; the check once compared the heads' method
    # with the served one and refused every DFlash2 draft before vLLM started
    "DFlash2 (vLLM layout) served as dflash": Case(
        lambda f, tc, r: block_draft(f, tc, r, "dflash2"), "dflash", BLOCK - 1, trained={"method": "dflash2"}),
    "a dead mask row with a trained mask_embedding.pt": Case(
        lambda f, tc, r: with_mask_embedding(block_draft(f, tc, r, "dflash", mask="dead")), "dflash", BLOCK - 1),
    "a dead mask row with a fresh export's mask_embedding.pt (the live rows' mean)": Case(
        lambda f, tc, r: MaskFile(fresh_mask, ()).write(block_draft(f, tc, r, "dflash", mask="dead")), "dflash",
        BLOCK - 1),
}

SURFACES = {  # each surface's own flag for the method and for k
    "start_vllm": ("the mode (vLLM's --speculative-config method)", "num_speculative_tokens"),
    "serve": ("--method", "--num-speculative-tokens"),
    "doctor": ("03_train method", "04_acceptance k"),
}


def expected(case: Case, surface: str) -> list[str]:
    method, k = SURFACES[surface]
    return [n.replace("{method}", method).replace("{k}", k) for n in case.names]


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch) -> Path:
    """vLLM's environment replaced by a Python that writes the returned file when run and exits 3."""
    import eagle3nb.serve.vllm as serve

    mark = tmp_path / "vllm-started"
    python = tmp_path / "fake-venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f"#!/bin/sh\necho \"$@\" > {mark}\nexit 3\n")
    python.chmod(0o755)
    monkeypatch.setenv("EAGLE3NB_VLLM_VENV", str(python.parent.parent))
    monkeypatch.setattr(serve, "unavailable_reason", lambda: None)  # the platform rule, not under test here
    return mark


def start(toy_smoke: Path, case: Case, draft: Path) -> None:
    from eagle3nb.serve.vllm import start_vllm

    start_vllm(toy_smoke, case.method, draft_dir=draft, num_speculative_tokens=case.k, timeout=60)


def serve_args(toy_smoke: Path, case: Case, draft: Path) -> list[str]:
    return ["serve", "--model", str(toy_smoke), "--draft", str(draft), "--method", case.method,
            "--num-speculative-tokens", str(case.k), "--port", str(free_port("127.0.0.1"))]


def doctor_run(folder: Path, toy_smoke: Path, case: Case, draft: Path) -> Path:
    """A run on the toy: 03 trained ``case.method`` (its valid k), 04 serves ``draft`` with ``case.k``."""
    method = case.trained.get("method", case.method)
    own_k = {"eagle3": 3, "dflash": BLOCK - 1, "dspark": BLOCK, "dflash2": BLOCK - 1}[method]
    return write_run(folder, {
        "01_synth": {"model_path": str(toy_smoke)}, "02_hidden_states": {"model_path": str(toy_smoke)},
        "03_train": {"method": method, "block_size": BLOCK, "num_speculative_tokens": own_k},
        "04_acceptance": {"model_path": str(toy_smoke), "draft_dir": str(draft), "k": case.k, "max_k": 8}})


def serving_result(folder: Path, toy_smoke: Path, case: Case, draft: Path):
    report = run_checks(doctor_run(folder, toy_smoke, case, draft), "04")
    return {r.name: r for r in report}["serving"]


@pytest.mark.parametrize("name", list(REFUSED))
def test_each_misconfiguration_is_refused_in_one_line_naming_its_fix(name, tmp_path, toy_smoke, target_config,
                                                                    rows, fake_vllm, capsys):
    case = REFUSED[name]
    draft = case.draft(tmp_path / "draft", target_config, rows)

    with pytest.raises(ServingError) as refused:
        start(toy_smoke, case, draft)
    msg = str(refused.value)
    assert "\n" not in msg and all(n in msg for n in expected(case, "start_vllm")), msg
    assert not fake_vllm.exists(), "start_vllm started vLLM before refusing"

    assert main(serve_args(toy_smoke, case, draft)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("eagle3nb serve: error: ") and "\n" not in err, err
    assert all(n in err for n in expected(case, "serve")), err

    r = serving_result(tmp_path / "run", toy_smoke, case, draft)
    assert r.status == FAIL, r
    said = f"{r.measured}: {r.fix}"
    assert "\n" not in said and all(n in said for n in expected(case, "doctor")), said


@pytest.mark.parametrize("name", list(SERVED_RIGHT))
def test_a_correct_configuration_passes_all_three(name, tmp_path, toy_smoke, target_config, rows, fake_vllm):
    from eagle3nb.cli import build_parser
    from eagle3nb.errors import InputError
    from eagle3nb.serve.cli import check_options

    case = SERVED_RIGHT[name]
    draft = case.draft(tmp_path / "draft", target_config, rows)

    with pytest.raises(InputError, match="exited with code 3"):  # the stand-in vLLM ran: nothing refused it
        start(toy_smoke, case, draft)
    spec = json.loads(fake_vllm.read_text().split("--speculative-config ", 1)[1].split(" --")[0])
    assert (spec["method"], spec["model"], spec["num_speculative_tokens"]) == (case.method, str(draft), case.k)

    args = build_parser().parse_args(serve_args(toy_smoke, case, draft))
    if case.ours:
        model_dir, _ = check_options(args)
        assert model_dir == toy_smoke
    else:  # vLLM runs fewer masks than the block; our decoder would fail after loading the target, so it refuses now
        with pytest.raises(ServingError) as refused:
            check_options(args)
        msg = str(refused.value)
        assert f"--num-speculative-tokens {case.k}, but this dflash draft's block of {BLOCK} drafts {BLOCK - 1}" in msg
        assert f"set --num-speculative-tokens to {BLOCK - 1}, or export the draft for k = {case.k}" in msg, msg

    r = serving_result(tmp_path / "run", toy_smoke, case, draft)
    assert r.status == PASS, r


@pytest.mark.parametrize("name", list(MASK_FILES))
def test_a_broken_mask_file_is_refused_where_the_draft_loads(name, tmp_path, toy_smoke, target_config, rows):
    """Where the draft itself loads (04, the doctor's draft_sanity, ``eagle3nb serve``'s decoder, 03's init_from):
    ``load_draft`` refuses a file vLLM would not load and ``check_usable`` a dead one, in the serving check's
    words, one line naming the file; never torch's error or a traceback."""
    from safetensors.torch import load_file

    from eagle3nb.drafts import DraftMismatchError, load_draft, of

    mask = MASK_FILES[name]
    draft = mask.write(block_draft(tmp_path / "draft", target_config, rows, "dflash", mask=mask.row))
    weights = load_file(toy_smoke / "model.safetensors")
    with pytest.raises(DraftMismatchError) as refused:
        model = load_draft(draft, embed_tokens=weights["model.embed_tokens.weight"], lm_head=weights["lm_head.weight"])
        of(model).check_usable(model, str(draft))
    msg = str(refused.value)
    assert "\n" not in msg and str(draft / "mask_embedding.pt") in msg and all(n in msg for n in mask.names), msg


def test_the_doctor_cli_fails_on_a_misconfiguration(tmp_path, toy_smoke, target_config, rows, capsys):
    """``eagle3nb doctor`` exits 1 and prints the serving check's failure with its fix."""
    case = REFUSED["DSpark with k other than its block"]
    draft = case.draft(tmp_path / "draft", target_config, rows)
    run = doctor_run(tmp_path / "run", toy_smoke, case, draft)
    assert main(["doctor", str(run), "--stage", "04"]) == 1
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith("FAIL") and "serving" in ln)
    assert "04_acceptance k 3" in line, out
    assert "set 04_acceptance k to 4" in out, out
    assert os.path.isdir(run)
