"""Issue 24's training recipes: deeper drafts (``num_layers``), the losses, Muon, and the best checkpoint by held-out
acceptance. Each recipe is held to its definition (a formula computed here, vLLM's loader naming, decoding without
a cache) and to training (a short run lowers its own loss)."""

from __future__ import annotations

import itertools
import json
import math
import shutil
import subprocess

import pytest
import torch
from batching import assert_batched_rows_draft_as_alone
from safetensors.torch import load_file
from tiny_drafts import MLA, T, inputs, smoke_draft, tiny_draft

from eagle3nb.drafts import load_draft
from eagle3nb.drafts.eagle3.cache import DraftCache, TTTCache
from eagle3nb.drafts.eagle3.layouts import save_draft

from worlds import requires_vllm

pytestmark = pytest.mark.usefixtures("one_thread")

DEEP = {"llama": {"num_layers": 2}, "mla": {"num_layers": 3, "mla": MLA}}


# ---- num_layers: vLLM's num_hidden_layers draft layers ----------------------------------------------------


@pytest.mark.parametrize("variant", list(DEEP))
@torch.no_grad()
def test_deeper_draft_decodes_with_its_caches_as_one_pass_and_ttt_as_decoding(variant):
    """Every layer keeps its own K/V: cached decoding (and crop) equals one causal pass, and TTT step i at t
    equals decoding i tokens ahead of t, layer by layer; a later layer reads H (not 2H) and changes the output."""
    m = tiny_draft(**DEEP[variant])
    aux, ids, pos = inputs(B=1)
    g = m.fuse(aux)
    _, full = m(g, ids, pos)
    cache = DraftCache()
    _, first = m(g[:, :5], ids[:, :5], pos[:, :5], cache)
    steps = [m(g[:, t:t + 1], ids[:, t:t + 1], pos[:, t:t + 1], cache)[1] for t in range(5, T)]
    assert [c.length for c in cache.layers()] == [T] * m.config.num_layers
    torch.testing.assert_close(torch.cat([first, *steps], 1), full, rtol=1e-5, atol=1e-5)
    cache.crop(7)
    assert [c.length for c in cache.layers()] == [7] * m.config.num_layers
    torch.testing.assert_close(m(g[:, 7:8], ids[:, 7:8], pos[:, 7:8], cache)[1], full[:, 7:8], rtol=1e-5, atol=1e-5)
    ttt, hidden, out = TTTCache(), g, []
    for i in range(3):
        hidden, logits = m(hidden, torch.roll(ids, -i, 1), pos + i, ttt)
        out.append(logits)
    for t in (0, 4, T - 1):
        dc = DraftCache()
        h, logits = m(m.fuse(aux[:, :t + 1]), ids[:, :t + 1], pos[:, :t + 1], dc)
        h = h[:, -1:]
        for i in range(1, 3):
            h, logits = m(h, torch.roll(ids, -i, 1)[:, t:t + 1], torch.tensor([[t + i]]), dc)
            torch.testing.assert_close(logits, out[i][:, t:t + 1], rtol=1e-5, atol=1e-5)
    attn = m.deeper[0].self_attn
    first_proj = attn.q_proj if variant == "llama" else attn.kv_a_proj_with_mqa
    assert first_proj.in_features == m.config.hidden_size
    m.deeper[-1].mlp.down_proj.weight.zero_()
    m.deeper[-1].self_attn.o_proj.weight.zero_()  # the last layer made an identity: other logits
    assert not torch.allclose(m(g, ids, pos)[1], full, atol=1e-3)


VLLM_NAMES = """
import json, sys
from vllm.model_executor.models.llama_eagle3 import LlamaModel
out = {}
for name in json.loads(sys.argv[1]):  # Eagle3LlamaForCausalLM.load_weights: model. prefix, then LlamaModel's mapper
    if name == "t2d":
        continue  # vLLM skips it
    if name == "d2t" or name.startswith("lm_head"):
        out[name] = [name.replace("d2t", "draft_id_to_target_id"), None]
        continue
    mapped, shard = LlamaModel.hf_to_vllm_mapper._map_name_with_shard(name)
    out[name] = [mapped, shard]
print("NAMES" + json.dumps(out))
"""


def vllm_module_names(num_layers: int) -> set[str]:
    """The parameters vLLM 0.32's Eagle3LlamaForCausalLM registers (llama_eagle3.py): every layer fused q/k/v and
    gate/up, layer 0 alone reads embedding + feature (its hidden_norm is the only one a forward uses)."""
    names = {"fc.weight", "norm.weight", "embed_tokens.weight", "lm_head.weight", "draft_id_to_target_id"}
    for i in range(num_layers):
        names |= {f"layers.{i}.{p}.weight" for p in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj",
                                                       "mlp.down_proj", "input_layernorm", "post_attention_layernorm")}
    return names | {"layers.0.hidden_norm.weight"}


@requires_vllm()
def test_deeper_draft_export_maps_onto_vllms_layers_with_vllms_own_mapper(tmp_path):
    """The 2-layer export's tensor names, run through vLLM 0.32's own weight mapper (its environment), land on
    the parameters of vLLM's two draft layers, q/k/v and gate/up as the shards it stacks; 1-layer exports keep
    ``midlayer.*``. The export reads back bit for bit, its config carries num_hidden_layers."""
    from eagle3nb.serve.vllm import vllm_python

    m = tiny_draft(num_layers=2)
    save_draft(m, tmp_path / "deep")
    names = sorted(load_file(tmp_path / "deep" / "model.safetensors"))
    assert json.loads((tmp_path / "deep" / "config.json").read_text())["num_hidden_layers"] == 2
    assert not any(n.startswith("midlayer.") for n in names)
    done = subprocess.run([str(vllm_python()), "-c", VLLM_NAMES, json.dumps(names)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    mapped = json.loads(done.stdout.split("NAMES", 1)[1])
    assert {v[0] for v in mapped.values()} == vllm_module_names(2)
    shards = {n: v[1] for n, v in mapped.items() if v[1] is not None}
    assert shards == {f"layers.{i}.{mod}.{p}_proj.weight": s for i in range(2)
                      for mod, p, s in [("self_attn", "q", "q"), ("self_attn", "k", "k"), ("self_attn", "v", "v"),
                                        ("mlp", "gate", 0), ("mlp", "up", 1)]}
    aux, ids, pos = inputs()
    back = load_draft(tmp_path / "deep")
    with torch.no_grad():
        assert torch.equal(back(back.fuse(aux), ids, pos)[1], m(m.fuse(aux), ids, pos)[1])
    save_draft(tiny_draft(), tmp_path / "one")
    assert any(n.startswith("midlayer.") for n in load_file(tmp_path / "one" / "model.safetensors"))


@torch.inference_mode()
def test_deeper_draft_decodes_losslessly_and_batched_rows_draft_as_alone(toy_smoke, tmp_path):
    """Our decoder reads the 2-layer export back and decodes the target's own greedy tokens; rows that join a
    batch (padding, merges, holes in every layer's cache) draft exactly the tokens they draft alone."""
    from eagle3nb.data.prompts import load_prompts
    from eagle3nb.data.stream import Template
    from eagle3nb.decoder.batch import SpecDecoder
    from eagle3nb.decoder.reference import plain_generate
    from eagle3nb.hf import DECODER, load_target

    draft = load_draft(save_draft(smoke_draft(toy_smoke, 2), tmp_path / "draft"))
    assert draft.config.num_layers == 2
    tpl = Template(toy_smoke, True)
    prompts = [tpl.prompt_ids(p["messages"]) for p in load_prompts("toy:heldout", 3)]
    target = load_target(toy_smoke, trust_remote_code=False, use=DECODER)
    dec = SpecDecoder(target, draft, 3)
    runs = [dec.generate(p, 12) for p in prompts]
    assert [r.tokens for r in runs] == [plain_generate(target, p, 12) for p in prompts]
    assert_batched_rows_draft_as_alone(dec, prompts, runs)


# ---- the losses ----------------------------------------------------------------------------------------------


def by_definition(loss: str, z: torch.Tensor, p: torch.Tensor, eta: float) -> torch.Tensor:
    """Each loss from its formula, in float64, one position at a time (p the target's distribution, q the
    draft's), independent of the vectorised code under test."""
    out = torch.zeros(z.shape[:-1], dtype=torch.float64)
    for idx in itertools.product(*map(range, z.shape[:-1])):
        q, pp = torch.softmax(z[idx].double(), -1), p[idx].double()
        kl_pq = sum(float(a) * math.log(float(a) / float(b)) for a, b in zip(pp, q) if a > 0)
        alpha = sum(min(float(a), float(b)) for a, b in zip(pp, q))
        if loss == "forward_kl":
            v = kl_pq
        elif loss == "reverse_kl":
            v = sum(float(b) * math.log(float(b) / float(a)) for a, b in zip(pp, q))
        elif loss == "tv":
            v = 0.5 * sum(abs(float(a) - float(b)) for a, b in zip(pp, q))
        elif loss == "jsd":
            m = [(float(a) + float(b)) / 2 for a, b in zip(pp, q)]
            v = 0.5 * sum(float(a) * math.log(float(a) / mi) for a, mi in zip(pp, m) if a > 0) + \
                0.5 * sum(float(b) * math.log(float(b) / mi) for b, mi in zip(q, m))
        elif loss == "lk_alpha":
            v = -math.log(alpha)
        else:
            lam = math.exp(-eta * alpha)
            v = lam * kl_pq + (1 - lam) * (1 - alpha)
        out[idx] = v
    return out


@pytest.mark.parametrize("loss", ["forward_kl", "reverse_kl", "tv", "jsd", "lk_alpha", "lk_lambda"])
def test_each_loss_is_its_definition_zero_at_the_target_and_has_gradients(loss):
    from eagle3nb.drafts.eagle3.objective import divergence

    g = torch.Generator().manual_seed(3)
    z = (torch.randn(2, 3, 7, generator=g) * 2).requires_grad_()
    p = torch.softmax(torch.randn(2, 3, 7, generator=g) * 2, -1)
    got = divergence(loss, z, p, eta=1.7)
    torch.testing.assert_close(got.double(), by_definition(loss, z.detach(), p, 1.7), rtol=1e-4, atol=1e-5)
    assert bool((got > 0).all())
    got.sum().backward()
    assert z.grad.abs().sum() > 0 and torch.isfinite(z.grad).all()
    at_target = divergence(loss, p.log(), p, eta=1.7)  # q == p
    torch.testing.assert_close(at_target, torch.zeros_like(at_target), rtol=0, atol=2e-6)
    padding = divergence(loss, z.detach(), torch.zeros_like(p), eta=1.7)  # a padding row: finite
    assert torch.isfinite(padding).all()


def test_the_default_loss_trains_on_soft_cross_entropy_kl_plus_the_targets_entropy():
    """forward_kl, the default, keeps EAGLE-3's fused soft cross-entropy: KL(p||q) + H(p), the same gradient."""
    from eagle3nb.drafts.eagle3.objective import SoftCrossEntropy, divergence

    g = torch.Generator().manual_seed(4)
    z = torch.randn(2, 5, 9, generator=g).requires_grad_()
    p = torch.softmax(torch.randn(2, 5, 9, generator=g), -1)
    w = torch.rand(2, 5, generator=g)
    total, ce, _ = SoftCrossEntropy.apply(z, p, w, 5)
    entropy = -(p * p.log()).sum(-1)
    torch.testing.assert_close(ce, divergence("forward_kl", z.detach(), p) + entropy, rtol=1e-5, atol=1e-5)
    total.backward()
    z2 = z.detach().clone().requires_grad_()
    (divergence("forward_kl", z2, p) * w).sum().backward()
    torch.testing.assert_close(z.grad, z2.grad, rtol=1e-5, atol=1e-6)


def ttt_batch(m, seed: int = 5, B: int = 2) -> dict[str, torch.Tensor]:
    """A micro-batch as 03 collates it, from random aux states and a random target over the draft vocabulary."""
    g = torch.Generator().manual_seed(seed)
    aux, ids, _ = inputs(B=B, seed=seed)
    probs = torch.softmax(torch.randn(B, T, m.config.draft_vocab_size, generator=g) * 3, -1)
    return {"aux": aux, "input_ids": ids, "loss_mask": torch.ones(B, T, dtype=torch.long),
            "target_argmax": m.draft_to_target(probs.argmax(-1)), "target_probs": probs}


@pytest.mark.parametrize("loss", ["reverse_kl", "tv", "jsd", "lk_alpha", "lk_lambda"])
def test_a_short_ttt_run_lowers_each_loss(loss):
    """25 AdamW steps of the TTT unroll on one micro-batch lower the loss it trains on by a fifth or more (the
    draft fits one batch easily; measured: 53-80% lower), and the stats report that loss."""
    from eagle3nb.drafts.eagle3.objective import TTTObjective

    m = tiny_draft(num_layers=2 if loss == "lk_lambda" else 1).train()
    obj = TTTObjective(m, steps=3, decay=0.8, loss=loss, eta=3.0)
    batch = ttt_batch(m)
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)
    first, stats = obj(batch)
    first = float(first.detach())
    assert first == pytest.approx(sum(0.8 ** i * float(stats[0, i] / stats[1, i]) for i in range(3)), rel=1e-5)
    for _ in range(25):
        opt.zero_grad()
        obj(batch)[0].backward()
        opt.step()
    last = float(obj(batch)[0].detach())
    assert last < 0.8 * first, (first, last)


def test_opd_takes_reverse_kl_where_the_target_rejected_and_forward_kl_where_it_accepted():
    """loss opd over a batch whose loss mask flags drafted tokens accepted (1) or rejected (REJECTED), at every TTT
    step: the per-step loss sum is the reverse-KL sum over the rejected positions (reverse_kl's own objective with
    only those scored) plus the forward-KL sum over the accepted ones (the fused soft cross-entropy with only those
    scored, less the target's entropy H(p) there), so a flag lost on the way would change it."""
    from eagle3nb.drafts.base import REJECTED
    from eagle3nb.drafts.eagle3.objective import TTTObjective

    m, steps = tiny_draft(num_layers=1).eval(), 3
    batch = ttt_batch(m, seed=9)
    flags = torch.randint(0, 3, batch["loss_mask"].shape, generator=torch.Generator().manual_seed(9))
    assert bool((flags == REJECTED).any() and (flags == 1).any())
    only = {v: {**batch, "loss_mask": (flags == v).long()} for v in (1, REJECTED)}
    opd = TTTObjective(m, steps, 0.8, loss="opd")({**batch, "loss_mask": flags})[1]
    rev = TTTObjective(m, steps, 0.8, loss="reverse_kl")(only[REJECTED])[1]
    fwd = TTTObjective(m, steps, 0.8, loss="forward_kl")(only[1])[1]
    p = batch["target_probs"]
    entropy = -(torch.xlogy(p, p)).sum(-1)  # shape: [B, T]
    for i in range(steps):
        # step i's position t scores token t+2+i against the target's distribution at u = t+1+i
        h = (entropy[:, 1 + i:T - 1] * only[1]["loss_mask"][:, 2 + i:]).sum().double()
        assert float(opd[0, i]) == pytest.approx(float(rev[0, i] + fwd[0, i] - h), rel=1e-4)
        assert opd[1, i] == rev[1, i] + fwd[1, i]  # every flagged position counted once


# ---- the optimizer -------------------------------------------------------------------------------------------


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest():
    from eagle3nb.params import from_dict
    from eagle3nb.train.optim import build_optimizer

    m = tiny_draft(num_layers=2).train()
    opt, sched, params = build_optimizer(m, from_dict("03_train", {"optimizer": "muon"}), lambda step: 1.0)
    muon = {id(p) for g in opt.parts["muon"].param_groups for p in g["params"]}
    adamw = {id(p) for g in opt.parts["adamw"].param_groups for p in g["params"]}
    names = {id(p): n for n, p in m.named_parameters()}
    assert {names[i] for i in muon} == {n for n, p in m.named_parameters() if p.ndim == 2 and p.requires_grad
                                        and n != "lm_head.weight"}
    assert "fc.weight" in {names[i] for i in muon} and "deeper.0.self_attn.q_proj.weight" in {names[i] for i in muon}
    assert {names[i] for i in adamw} == {"lm_head.weight"} | {n for n, p in m.named_parameters() if p.ndim == 1}
    assert muon | adamw == {id(p) for p in params} and not muon & adamw
    assert "embed_tokens.weight" not in {names[i] for i in muon | adamw}  # the target's, frozen
    assert sched.get_last_lr() == [from_dict("03_train", {}).lr]


def test_muon_on_a_torch_without_it_is_one_line_naming_the_fix(monkeypatch):
    from eagle3nb.params import ParamsError, from_dict

    monkeypatch.delattr(torch.optim, "Muon", raising=False)  # what an older torch is
    with pytest.raises(ParamsError, match=r"^parameter 'optimizer' .*torch\.optim\.Muon.*optimizer: adamw") as e:
        from_dict("03_train", {"optimizer": "muon"})
    assert "\n" not in str(e.value)
    from_dict("03_train", {"optimizer": "adamw"})


# ---- the best checkpoint by held-out acceptance -----------------------------------------------------------------


@pytest.fixture(scope="module")
def hidden(tmp_path_factory, toy_smoke):
    from train_data import make_hidden_states
    from worlds import SEED

    return make_hidden_states(tmp_path_factory.mktemp("hidden"), toy_smoke, n=24, draft_vocab_size=96, seed=SEED)


def train_params(data_dir, out, **over):
    from eagle3nb.params import from_dict

    from worlds import SEED

    return from_dict("03_train", {
        "run_name": "test", "data_dir": str(data_dir), "output_dir": str(out), "ttt_steps": 3, "max_length": 256,
        "batch_tokens": 400, "holdout_fraction": 0.25, "seed": SEED, "max_steps": 12, "lr": 5e-3, "eval_every": 3,
        "save_every": 3, "keep_checkpoints": 10, **over})


def test_draft_is_the_best_heldout_evaluation_kept_through_a_resume_and_its_positions_plotted(hidden, tmp_path):
    """A 2-layer lk_lambda draft under Muon (the recipes through 03 itself): draft/ holds the weights of the
    evaluation with the highest held-out acceptance length (the later on a tie), metrics.json names its step; a
    run resumed from a checkpoint before the end picks the same one and exports the same bytes; 04 reads the
    deeper draft back; fine-tuning it with a destructive lr leaves draft/ at the start's weights (the best);
    acceptance_by_position.png draws every draft position over the evaluations."""
    from eagle3nb.accept.offline import offline_acceptance
    from eagle3nb.data.reader import HiddenStates
    from eagle3nb.train.checkpoint import checkpoints
    from eagle3nb.train.report import POSITIONS_FIGURE, plot_positions, read_metrics
    from eagle3nb.train.stage import run

    out = tmp_path / "out"
    P = train_params(hidden, out, num_layers=2, loss="lk_lambda", optimizer="muon")
    result = run(P)
    evals = [r for r in read_metrics(out) if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [0, 3, 6, 9, 12]
    top = max(r["acceptance_length"] for r in evals)
    want = [r for r in evals if r["acceptance_length"] == top][-1]
    best = json.loads((out / "metrics.json").read_text())["best"]
    assert best == {"step": want["step"], "acceptance_length": top, "acc": want["acc"], "last_step": 12}
    assert result["best"] == best and best["step"] > 0 and evals[0]["acceptance_length"] < top
    at = torch.load(out / "checkpoints" / f"step-{best['step']:07d}.pt", weights_only=False)["model"]
    exported = load_draft(out / "draft").state_dict()
    assert all(torch.equal(exported[k], v) for k, v in at.items())
    assert torch.equal(load_file(out / "draft" / "model.safetensors")["layers.1.mlp.down_proj.weight"],
                       at["deeper.0.mlp.down_proj.weight"])
    # resumed from the checkpoint at 6: the evaluations after it are redone, the same best is exported
    again = tmp_path / "again"
    shutil.copytree(out, again)
    for c in checkpoints(again / "checkpoints"):
        if int(c.stem.split("-")[1]) > 6:
            c.unlink()
    run(train_params(hidden, again, num_layers=2, loss="lk_lambda", optimizer="muon"))
    assert json.loads((again / "metrics.json").read_text())["best"] == best
    assert (again / "draft" / "model.safetensors").read_bytes() == (out / "draft" / "model.safetensors").read_bytes()
    # 04 reads the deeper draft back
    data = HiddenStates(hidden)
    draft = load_draft(out / "draft", embed_tokens=data.embed_tokens())
    assert draft.config.num_layers == 2
    assert offline_acceptance(draft, data, k=3, max_k=3, indices=[0])["acceptance_length"] >= 1.0
    # fine-tuned with a destructive lr: the start (the checkpoint's quality) stays the best, and draft/ is it
    ruined = tmp_path / "ruined"
    ft = run(train_params(hidden, ruined, init_from=str(out / "draft"), lr=1.0, max_steps=3, eval_every=1))
    taus = [r["acceptance_length"] for r in read_metrics(ruined) if r["kind"] == "eval"]
    assert ft["best"]["step"] == 0 and max(taus[1:]) < taus[0] - 0.1, taus
    back = load_draft(ruined / "draft").state_dict()
    assert all(torch.equal(back[k], v) for k, v in exported.items())
    last = torch.load(checkpoints(ruined / "checkpoints")[-1], weights_only=False)["model"]
    assert not torch.equal(last["fc.weight"], exported["fc.weight"])
    assert (out / POSITIONS_FIGURE).stat().st_size > 0
    ax = plot_positions(out, best["step"]).axes[0]
    assert len(ax.lines) == 3 + 1 and list(ax.lines[-1].get_xdata()) == [best["step"]] * 2
    assert [list(line.get_ydata()) for line in ax.lines[:3]] == [[r["acc"][i] for r in evals] for i in range(3)]
