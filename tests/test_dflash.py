"""The block drafters (eagle3nb/drafts/dflash/): DFlash and DSpark on the shipped ``toy:smoke`` target, whose states
come from transformers' ``output_hidden_states``. The model's attention reaches exactly the context before a
block's anchor and the block itself; the exports load back exactly and land on vLLM 0.32's own DFlash / DSpark
parameters through its loaders (in its environment, no server); a short training lowers the loss and lifts the
offline acceptance above the untrained draft's; block decoding gives the target's own greedy output, and the
offline simulation replays its rounds.

The data is the toy's own greedy continuations (one batched ``generate``) of toy prompts: the draft trains on
train prompts and is judged on held-out ones."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import vllm_drafts
from served_drafts import vllm_name

from engines import Servers
from worlds import requires_vllm

BLOCK = 4
NEW_TOKENS = 40
# DFlash2's additions at a shape the toy fits (hidden 64: groups of 16 channels; two taps; 8 of 546 candidates)
DFLASH2 = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 12, "selector_top_k": 8}
STEPS = 60  # measured: held-out tau DFlash (decay) 1.00 -> 2.02, DSpark (dpace) 1.09 -> 2.68; ~10 s each, 1 thread


@pytest.fixture(scope="module")
def target(toy_smoke):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(toy_smoke, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def target_config(toy_smoke) -> dict:
    return json.loads((toy_smoke / "config.json").read_text())


def continuations(target, toy, split: str, n: int, folder: Path) -> list[dict]:
    """``n`` toy prompts of ``split`` followed by the target's greedy continuation (batched, left-padded), each
    with the target's hidden states (every layer) and logits of its own unpadded forward; loss on the answer."""
    from transformers import AutoTokenizer

    from eagle3nb.toy import write_prompts

    tok = AutoTokenizer.from_pretrained(toy)
    rows = [json.loads(line)["messages"] for line in write_prompts(folder / f"{split}.jsonl", n, split).read_text()
            .splitlines()]
    prompts = [tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
               for m in rows]
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    att = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        gen = target.generate(input_ids=ids, attention_mask=att, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                              do_sample=False, pad_token_id=0)[:, width:]
    out = []
    for p, g in zip(prompts, gen):
        full = torch.tensor(p + g.tolist())
        with torch.no_grad():
            o = target(input_ids=full[None], output_hidden_states=True)
        mask = torch.zeros(len(full), dtype=torch.long)
        mask[len(p):] = 1
        out.append({"input_ids": full, "loss_mask": mask, "states": [h[0] for h in o.hidden_states],
                    "logits": o.logits[0]})
    return out


@pytest.fixture(scope="module")
def data(target, toy_smoke, tmp_path_factory) -> dict[str, list[dict]]:
    folder = tmp_path_factory.mktemp("dflash-prompts")
    return {"train": continuations(target, toy_smoke, "train", 16, folder),
            "heldout": continuations(target, toy_smoke, "heldout", 6, folder)}


def items(rows: list[dict], layer_ids: list[int]) -> list[dict]:
    """Rows as the offline simulation reads them: the aux states at ``layer_ids`` and the target's argmax."""
    return [{"aux": torch.cat([r["states"][i] for i in layer_ids], -1), "input_ids": r["input_ids"],
             "loss_mask": r["loss_mask"], "target_argmax": r["logits"].argmax(-1)} for r in rows]


def drafter(target, target_config, markov_rank: int = 0, seed: int = 0, **over):
    from eagle3nb.drafts.dflash.model import DFlashDraft, from_target

    torch.manual_seed(seed)
    m = DFlashDraft(from_target(target_config, num_layers=2, block_size=BLOCK, markov_rank=markov_rank, **over))
    m.set_target(target.model.embed_tokens.weight, target.lm_head.weight)
    return m


def test_layer_ids_are_the_peers_spread_and_vllms_convention():
    """The default ids spread 1..L-3 in DFlash's numbering (z-lab's Qwen3-8B drafts, 36 layers, 5 draft layers:
    [1, 9, 17, 25, 33]), are ours minus one in ``dflash_config.target_layer_ids``, and read back as ours."""
    from eagle3nb.drafts.dflash.layouts import config_from_json, layout_config
    from eagle3nb.drafts.dflash.model import DFlashConfig, spread_layer_ids

    ours = spread_layer_ids(36, 5)
    assert [i - 1 for i in ours] == [1, 9, 17, 25, 33]
    assert spread_layer_ids(8, 3) == [2, 4, 6] and spread_layer_ids(8, 1) == [5]
    cfg = DFlashConfig(64, 128, 2, 1, 32, 2, 100, 64, ours, mask_token_id=0)
    assert cfg.target_layer_ids == [i - 1 for i in ours]
    vllm = layout_config(cfg, "vllm")
    assert vllm["dflash_config"]["target_layer_ids"] == cfg.target_layer_ids
    assert layout_config(cfg, "speculators")["aux_hidden_state_layer_ids"] == ours
    for layout in ("vllm", "speculators"):
        assert config_from_json(layout_config(cfg, layout)) == cfg


def test_a_block_sees_the_context_before_its_anchor_and_its_own_block(target, target_config):
    """Context after the anchor or another block's tokens change nothing; context before it does; blocks drafted
    together equal blocks drafted alone; inside a block, a later slot reaches an earlier one only when not causal."""
    m = drafter(target, target_config)
    T, H = 12, m.config.hidden_size
    ctx = torch.randn(1, T, H)
    anchors, pos = torch.tensor([[5, 9, 7]]), torch.tensor([[4, 8, 10]])
    with torch.no_grad():
        base = m(ctx, anchors, pos)  # shape: [1, 3, S, H]
        for n in range(3):
            alone = m(ctx, anchors[:, n:n + 1], pos[:, n:n + 1])[:, 0]
            torch.testing.assert_close(alone, base[:, n], rtol=1e-5, atol=1e-5)
        later = ctx.clone()
        later[:, 4:] += 1.0  # after the first block's anchor (position 4)
        assert torch.equal(m(later, anchors, pos)[:, 0], base[:, 0])
        assert not torch.allclose(m(later, anchors, pos)[:, 1], base[:, 1])
        earlier = ctx.clone()
        earlier[:, 3] += 1.0
        assert not torch.allclose(m(earlier, anchors, pos)[:, 0], base[:, 0])
        one, mask_input = (anchors[:, :1], pos[:, :1]), m.mask_embedding.detach().clone()
        m.mask_embedding.add_(1.0)  # other inputs in the block's later slots
        assert not torch.allclose(m(ctx, *one)[0, 0, 0], base[0, 0, 0])  # bidirectional: the anchor slot sees them
        m.config.causal = True
        causal = m(ctx, *one)
        m.mask_embedding.copy_(mask_input)
        assert torch.equal(m(ctx, *one)[0, 0, 0], causal[0, 0, 0])
        assert not torch.allclose(m(ctx, *one)[0, 0, 1:], causal[0, 0, 1:])


def test_position_weights_decay_and_dpace():
    """``decay`` is exp(-i/gamma) on the drafted slots; D-PACE's weight of slot i is the sum over j >= i of the
    running product of the smoothed confidences up to j, zero off the mask."""
    from eagle3nb.drafts.dflash.objective import position_weights

    index = torch.tensor([-1, 0, 1, 2])
    mask = torch.tensor([[False, True, True, True], [False, True, True, False]])
    conf = torch.tensor([[0.9, 0.5, 0.2, 0.8], [0.1, 0.6, 0.4, 0.3]])
    got = position_weights("decay", index, mask, None, gamma=2.0, alpha=0.5)
    assert torch.allclose(got[0], torch.tensor([0.0, 1.0, torch.e ** -0.5, torch.e ** -1.0]))
    got = position_weights("dpace", index, mask, conf, gamma=2.0, alpha=0.5)
    for b in range(2):
        smooth = [0.5 * float(c) + 0.5 if bool(v) else 1.0 for c, v in zip(conf[b], mask[b])]
        run, prefix = 1.0, []
        for s, v in zip(smooth, mask[b]):
            run *= s
            prefix.append(run if bool(v) else 0.0)
        want = [sum(prefix[i:]) if bool(mask[b, i]) else 0.0 for i in range(4)]
        assert torch.allclose(got[b], torch.tensor(want))


@pytest.mark.parametrize("markov_rank", [0, 8], ids=["dflash", "dspark"])
def test_exports_load_back_exactly_in_both_layouts(tmp_path, target, target_config, markov_rank):
    """Both layouts hold the same tensors (the target's embedding and head left out), are claimed by this method
    alone among the registered ones (EAGLE-3's included), and load back to the same drafter: every parameter, and
    its blocks' logits."""
    from safetensors.torch import load_file

    from eagle3nb.drafts import PACKAGES, get
    from eagle3nb.drafts.dflash.layouts import MASK_FILE, TARGET_TENSORS, load_draft, save_draft

    m = drafter(target, target_config, markov_rank)
    with torch.no_grad():
        m.mask_embedding.normal_()  # a trained value, unlike any row of the target's
    ctx_aux = torch.randn(1, 10, m.fc.in_features)
    for layout in ("vllm", "speculators"):
        save_draft(m, tmp_path / layout, layout)
        tensors = load_file(tmp_path / layout / "model.safetensors")
        table = markov_rank > 0  # vLLM's DSpark reads the mask row of its own table
        assert set(tensors) == set(m.state_dict()) - {*TARGET_TENSORS, "mask_embedding"} | (
            {"embed_tokens.weight"} if table else set())
        if table:
            rows = target.model.embed_tokens.weight.detach().clone()
            rows[m.config.mask_token_id] = m.mask_embedding.detach()
            assert torch.equal(tensors["embed_tokens.weight"], rows)
        mask = torch.load(tmp_path / layout / MASK_FILE, weights_only=True)  # vLLM's format
        assert mask["mask_token_id"] == m.config.mask_token_id and torch.equal(mask["embedding"], m.mask_embedding)
        back = load_draft(tmp_path / layout, embed_tokens=target.model.embed_tokens.weight,
                          lm_head=target.lm_head.weight)
        assert back.config == m.config
        for k, v in m.state_dict().items():
            assert torch.equal(back.state_dict()[k], v), k
        with torch.no_grad():
            args = (torch.tensor([[5, 7]]), torch.tensor([[3, 8]]))
            assert torch.equal(back(back.context(ctx_aux), *args), m(m.context(ctx_aux), *args))
    for layout in ("vllm", "speculators"):  # exactly one registered method reads each config: this one
        config = json.loads((tmp_path / layout / "config.json").read_text())
        assert [name for name in PACKAGES if get(name).claims(config)] == [m.method]
    cfg = json.loads((tmp_path / "vllm" / "config.json").read_text())
    assert cfg["architectures"] == [{0: "DFlashDraftModel", 8: "Qwen3DSparkModel"}[markov_rank]]
    assert cfg["dflash_config"] == {"mask_token_id": m.config.mask_token_id, "block_size": BLOCK, "causal": False,
                                    "target_layer_ids": [i - 1 for i in m.config.aux_layer_ids]}


# appended to vllm_drafts.OPENING: per draft (label -> [vLLM's method for it, the folder]), its parameters as vLLM
# loaded them, what its V1 runner says, the aux layers it reads and its layers' attention
VLLM_LOAD = r"""
from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config

for label, (method, draft) in drafts.items():
    with built(method, draft, 3) as (cfg, model, params, v1):
        save_file({n: p.detach().contiguous() for n, p in params.items()}, f"{out}/{label}.safetensors")
        report[label] = {"class": type(model).__name__, "v1": v1,
                         "aux": list(get_eagle3_aux_layers_from_config(cfg.speculative_config)),
                         "causal": [layer.self_attn.causal for layer in model.model.layers],
                         "unset": sorted(n for n, p in params.items() if torch.isnan(p).any())}
print("REPORT" + json.dumps(report))
"""


@requires_vllm()
def test_vllm_loads_the_exports_onto_its_own_parameters(tmp_path, target, target_config, toy_smoke):
    """vLLM 0.32's ``DFlashQwen3ForCausalLM``, ``Qwen3DSparkForCausalLM`` and ``DFlash2Qwen3ForCausalLM`` (served as
    ``method: dflash``, its V1 runner refusing it as it refuses DSpark), built from the configs of both layouts
    (its speculators parser for ours) and loading our exports with their own ``load_weights`` (its environment, no
    server): every parameter holds our values (q/k/v, gate/up stacked; vocab-sized tables padded by vLLM), the
    trained mask input included: DFlash's ``mask_embedding`` read from our ``mask_embedding.pt`` by vLLM's own
    ``_read_mask_embedding``, DSpark's in the mask row of the table it keeps. The only ones left unset are the
    target's embedding and head (shared from the target at serve time) and DSpark's unused ``mask_embedding``; vLLM
    reads back our aux layer ids, and every layer attends bidirectionally."""
    from safetensors.torch import load_file

    from eagle3nb.drafts import served_as
    from eagle3nb.drafts.dflash.layouts import save_draft

    models = {"dflash": drafter(target, target_config), "dspark": drafter(target, target_config, markov_rank=8),
              "dflash2": drafter(target, target_config, **DFLASH2)}
    for m in models.values():
        with torch.no_grad():
            m.mask_embedding.normal_()  # a trained value, unlike any row of the target's
            if m.method == "dflash2":  # away from the identity convolutions, so each tensor's place shows
                for name, p in m.named_parameters():
                    if "conv" in name or "selector" in name:
                        p.normal_(0.0, 0.3)
    # label -> [vLLM's method for it (DFlash2 is served as dflash), the folder]
    drafts = {f"{method}-{layout}": [served_as(method), str(save_draft(m, tmp_path / f"{method}-{layout}", layout))]
              for method, m in models.items() for layout in ("vllm", "speculators")}
    report = vllm_drafts.run(VLLM_LOAD, toy_smoke, tmp_path, drafts)
    cls = {"dflash": "DFlashQwen3ForCausalLM", "dspark": "Qwen3DSparkForCausalLM", "dflash2": "DFlash2Qwen3ForCausalLM"}
    assert {k: v["class"] for k, v in report.items()} == {k: cls[k.split("-")[0]] for k in drafts}
    # the CPU build's V1 runner serves DFlash only: DSpark's speculator and DFlash2's candidate walk are V2's
    refused = {"dflash": None, "dspark": "dspark speculative decoding", "dflash2": "DFlash candidate-head drafts"}
    for label, r in report.items():
        want = refused[label.split("-")[0]]
        assert (r["v1"] is None) if want is None else (want in r["v1"]), (label, r["v1"])
    for label, (_, folder) in drafts.items():
        method = label.split("-")[0]
        m = models[method]
        assert report[label]["aux"] == m.config.aux_layer_ids
        assert report[label]["causal"] == [False] * m.config.num_layers
        unused = "model.mask_embedding" if method == "dspark" else "model.embed_tokens.weight"
        assert report[label]["unset"] == sorted(["lm_head.weight", unused]), label
        ours = load_file(Path(folder) / "model.safetensors")
        if method != "dspark":
            ours["mask_embedding"] = m.mask_embedding.detach()
        want: dict[str, list[torch.Tensor]] = {}
        for k in m.state_dict():  # module order: q, k, v and gate, up stack in vLLM's order
            if k in ours:
                want.setdefault(vllm_name(k), []).append(ours[k])
        theirs = load_file(tmp_path / f"{label}.safetensors")
        assert set(want) == set(theirs) - set(report[label]["unset"])
        for name, parts in want.items():
            full = torch.cat(parts)
            assert torch.equal(theirs[name][:full.shape[0]], full), name  # vocab-sized rows padded to 64
        mask_input = theirs["model.mask_embedding"] if method != "dspark" else \
            theirs["model.embed_tokens.weight"][m.config.mask_token_id]
        assert torch.equal(mask_input, m.mask_embedding.detach()), label


def test_start_vllm_runs_dspark_in_vllms_v2_runner_on_a_gpu(tmp_path, toy_smoke, monkeypatch, target,
                                                            target_config):
    """The command and environment ``start_vllm`` gives a block drafter's server on a GPU (``cpu=False``, what
    ``make gpu-check`` starts), with its launcher replaced (no server): the speculative config names the method, the
    draft and k, with the GPU flags (no ``--enforce-eager``, dtype auto); DSpark's server runs vLLM's V2 model runner
    (vLLM 0.32 drafts DSpark there only) even where the caller's environment picks V1, DFlash's keeps the caller's."""
    import eagle3nb.serve.vllm as serve
    from eagle3nb.drafts.dflash.layouts import save_draft

    launched = {}
    monkeypatch.setattr(serve, "unavailable_reason", lambda: None)  # vLLM's environment is not needed
    monkeypatch.setattr(serve, "check_draft", lambda *a: None)  # no draft here: tests/test_misconfig.py checks them
    monkeypatch.setattr(serve, "launch",
                        lambda cmd, host, port, name, timeout, env: launched.update({name: (cmd, env)}))
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    for mode, k in (("dspark", BLOCK), ("dflash", BLOCK - 1)):
        draft = save_draft(drafter(target, target_config, markov_rank=8 if mode == "dspark" else 0), tmp_path / mode,
                           "vllm")
        serve.start_vllm(toy_smoke, mode, draft_dir=draft, num_speculative_tokens=k, cpu=False)
    for mode, k, runner in (("dspark", BLOCK, "1"), ("dflash", BLOCK - 1, "0")):
        cmd, env = launched[f"vllm-{mode}"]
        spec = json.loads(cmd[cmd.index("--speculative-config") + 1])
        assert spec == {"method": mode, "model": str(tmp_path / mode), "num_speculative_tokens": k}, cmd
        assert "--enforce-eager" not in cmd and cmd[cmd.index("--dtype") + 1] == "auto", cmd
        assert env["VLLM_USE_V2_MODEL_RUNNER"] == runner, mode


def train(m, rows: list[dict], steps: int, weighting: str) -> list[float]:
    """``steps`` AdamW steps on micro-batches of 4 right-padded rows, 32 anchors per row."""
    from eagle3nb.drafts.dflash.objective import block_loss

    its = items(rows, m.config.aux_layer_ids)
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=3e-3)
    g = torch.Generator().manual_seed(0)
    losses = []
    for step in range(steps):
        batch = [(its[(step * 4 + i) % len(its)], rows[(step * 4 + i) % len(rows)]) for i in range(4)]
        T = max(len(it["input_ids"]) for it, _ in batch)

        def pad(x):
            return torch.cat([x, x.new_zeros((T - len(x), *x.shape[1:]))])

        out = block_loss(m, torch.stack([pad(it["aux"]) for it, _ in batch]),
                         torch.stack([pad(it["input_ids"]) for it, _ in batch]),
                         torch.stack([pad(it["loss_mask"]) for it, _ in batch]),
                         torch.stack([pad(r["logits"].softmax(-1)) for _, r in batch]),
                         torch.stack([pad(r["logits"].argmax(-1)) for _, r in batch]), anchors_per_seq=32, generator=g,
                         weighting=weighting)
        opt.zero_grad()
        out["loss"].backward()
        opt.step()
        losses.append(float(out["loss"].detach()))
    return losses


@pytest.fixture(scope="module")
def trained(one_thread, target, target_config, data):
    """``trained(markov_rank, weighting)``: a drafter after ``STEPS`` steps, its losses and its untrained held-out
    offline acceptance (each trained once per module)."""
    from eagle3nb.drafts.dflash.offline import offline_acceptance

    done: dict[tuple[int, str], tuple] = {}

    def get(markov_rank: int, weighting: str) -> tuple:
        if (markov_rank, weighting) not in done:
            m = drafter(target, target_config, markov_rank)
            before = offline_acceptance(m, items(data["heldout"], m.config.aux_layer_ids))
            done[markov_rank, weighting] = (m, train(m, data["train"], STEPS, weighting), before)
        return done[markov_rank, weighting]

    return get


def prompt_of(row: dict) -> list[int]:
    return row["input_ids"][row["loss_mask"] == 0].tolist()


@pytest.mark.parametrize(("markov_rank", "weighting"), [(0, "decay"), (8, "dpace")], ids=["dflash", "dspark-dpace"])
def test_training_lifts_offline_acceptance_and_decoding_stays_lossless(trained, target, data, markov_rank,
                                                                      weighting):
    """A few seconds of training on the toy's states: the loss falls, held-out offline acceptance (by block
    position, tau for the block) rises above the untrained draft's, greedy block decoding returns the target's own
    greedy tokens, and the offline simulation of that decode replays its rounds exactly."""
    from eagle3nb.decoder.reference import plain_generate
    from eagle3nb.drafts.dflash.drafting import generate
    from eagle3nb.drafts.dflash.offline import block_hits, offline_acceptance, rounds

    m, losses, before = trained(markov_rank, weighting)
    after = offline_acceptance(m, items(data["heldout"], m.config.aux_layer_ids))
    print(f"{m.config.method} {weighting}: loss {losses[0]:.3f} -> {sum(losses[-10:]) / 10:.3f}; held-out tau "
          f"{before['acceptance_length']:.3f} -> {after['acceptance_length']:.3f} "
          f"{[round(a, 3) for a in after['per_position']]}")
    assert sum(losses[-10:]) / 10 < 0.5 * sum(losses[:3]) / 3
    assert len(after["per_position"]) == m.config.drafts_per_block
    assert after["acceptance_length"] > before["acceptance_length"] + 0.3
    assert after["per_position"][0] > before["per_position"][0] + 0.25
    prompt = prompt_of(data["heldout"][0])
    decoded = generate(target, m, prompt, NEW_TOKENS)
    assert decoded.tokens == plain_generate(target, prompt, NEW_TOKENS)
    assert decoded.acceptance_length > 1.0
    seq = torch.tensor(prompt + decoded.tokens)
    with torch.no_grad():
        o = target(input_ids=seq[None], output_hidden_states=True)
    mask = torch.zeros(len(seq), dtype=torch.long)
    mask[len(prompt):] = 1
    it = items([{"input_ids": seq, "loss_mask": mask, "states": [h[0] for h in o.hidden_states],
                 "logits": o.logits[0]}], m.config.aux_layer_ids)[0]
    simulated = rounds(*block_hits(m, it["aux"], seq, mask, it["target_argmax"]))
    assert simulated and simulated == decoded.accepted[:len(simulated)]


def test_the_mask_input_starts_at_the_live_rows_mean_and_is_trained(trained, target, target_config, data):
    """A fresh drafter's mask slots enter as ``mask_embedding``, the mean of the target's rows that are not zero (the
    toy's pad row, its mask id, is); the loss reaches it, training moves it, and a block's mask slots read it (and
    not the target's row), while the anchor slot reads the anchor's row."""
    from eagle3nb.drafts.dflash.objective import block_loss

    rows = target.model.embed_tokens.weight.detach()
    fresh = drafter(target, target_config)
    mask = fresh.config.mask_token_id
    assert float(rows[mask].norm()) == 0.0  # the smoke toy's pad row: the dead input this replaces
    torch.testing.assert_close(fresh.mask_embedding.detach(), rows[rows.norm(dim=-1) > 0].mean(0))
    it = items(data["train"][:1], fresh.config.aux_layer_ids)[0]
    r = data["train"][0]
    out = block_loss(fresh, it["aux"][None], it["input_ids"][None], it["loss_mask"][None],
                     r["logits"].softmax(-1)[None], r["logits"].argmax(-1)[None], anchors_per_seq=8)
    out["loss"].backward()
    assert fresh.mask_embedding.grad is not None and float(fresh.mask_embedding.grad.abs().max()) > 0
    m = trained(0, "decay")[0]
    moved = float((m.mask_embedding.detach() - fresh.mask_embedding.detach()).norm())
    assert moved > 0.5 * float(fresh.mask_embedding.detach().norm()), moved
    ids = torch.tensor([[5, mask, mask]])
    embedded = m.embed(ids)[0]
    assert torch.equal(embedded[0], rows[5]) and torch.equal(embedded[1], m.mask_embedding.detach())


@pytest.fixture(scope="module")
def served(trained, engines, toy_smoke, tmp_path_factory):
    """The trained DFlash draft (decay) on two real vLLM servers of the session's registry, submitted together as
    soon as the first serving test asks, so their start-ups overlap each other and that test's local decoding:
    ``whole``, the export at its whole block, drafting by sampling at T > 0; ``causal``, the same weights as a causal
    block exported one draft shorter. ``{"drafts": {name: folder}, "k": {name: k}, "servers": Servers}``;
    ``servers[name]`` waits for its server."""
    import dataclasses

    from eagle3nb.drafts.dflash.layouts import save_draft
    from eagle3nb.drafts.dflash.model import DFlashDraft

    m = trained(0, "decay")[0]
    causal = DFlashDraft(dataclasses.replace(m.config, causal=True)).eval()
    causal.load_state_dict(m.state_dict())
    folder = tmp_path_factory.mktemp("dflash-served")
    k = {"whole": m.config.drafts_per_block, "causal": m.config.drafts_per_block - 1}
    drafts = {"whole": save_draft(m, folder / "whole"),
              "causal": save_draft(causal, folder / "causal", num_speculative_tokens=k["causal"])}
    servers = Servers(engines, toy_smoke)
    try:
        servers.submit(whole={"mode": "dflash", "draft_dir": drafts["whole"], "num_speculative_tokens": k["whole"],
                              "speculative": {"draft_sample_method": "probabilistic"}},
                       causal={"mode": "dflash", "draft_dir": drafts["causal"], "num_speculative_tokens": k["causal"]})
        yield {"drafts": drafts, "k": k, "servers": servers}
    finally:
        servers.stop()


@requires_vllm()
def test_vllm_serves_the_trained_dflash_draft(trained, target, data, toy_smoke, served):
    """vLLM 0.32's CPU build serves the trained DFlash export (``method: dflash``, block - 1 speculative tokens):
    its log says it loaded our trained ``mask_embedding.pt``; its greedy completions are the target's own; greedy,
    its spec-decode counters count exactly the drafts and
    accepted tokens of local block decoding on the same prompts (the grouped-norm fix of the plugin in place:
    stock vLLM's CPU build normalises every layer's context keys with layer 0's ``k_norm``, so a 2-layer draft
    proposed other blocks, 143 drafts / 98 accepted against our 141 / 100), and at T=1 the same acceptance length
    within 10%. At T=1 both draft the same way:
    vLLM with ``draft_sample_method: probabilistic`` samples each of the block's slots from its own softmax at the
    request's temperature in one pass (``_sample_from_logits``, the temperature repeated per slot) and verifies by
    rejection sampling against those probabilities, as our ``BlockDrafting`` does (vLLM's default, ``greedy``,
    would draft the block's argmaxes and verify them as one-hot draws); the sampling fix of
    eagle3nb/serve/vllm_ext/eagle3nb_vllm_fixes is in place (without it vLLM accepts ~1.04 a step at T=1 whatever
    the draft, and the grouped-norm fix's absence moves the greedy acceptance: both are asserted, never its log)."""
    import httpx
    from served_drafts import held_out

    from eagle3nb.accept.local import compare_with_plain
    from eagle3nb.accept.online import bench_endpoint, metrics_url, scrape
    from eagle3nb.data.stream import Template
    from eagle3nb.decoder.reference import plain_generate
    from eagle3nb.drafts.dflash.drafting import generate
    from eagle3nb.formulas import spec_counters, spec_delta

    m = trained(0, "decay")[0]
    k = served["k"]["whole"]
    assert k == m.config.drafts_per_block
    prompts = [prompt_of(r) for r in data["heldout"]]
    local = [generate(target, m, p, NEW_TOKENS) for p in prompts]
    local_accepted = [n for d in local for n in d.accepted]
    local_tau = 1 + sum(local_accepted) / len(local_accepted)
    sampled, tpl = held_out(48), Template(toy_smoke, True)  # T=1: ~1000 rounds, sampling noise well inside 10%
    local_t1 = compare_with_plain(target, m, [tpl.prompt_ids(p["messages"]) for p in sampled], k, NEW_TOKENS, 1.0,
                                  [tpl.end_id])
    handle = served["servers"]["whole"]
    model = httpx.get(handle.base_url + "/models", timeout=30).json()["data"][0]["id"]
    murl = metrics_url(handle.base_url)
    before = spec_counters(scrape(murl))
    completions = []
    for ids in prompts:
        reply = httpx.post(handle.base_url + "/completions", timeout=300, json={
            "model": model, "prompt": ids, "max_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True}).json()
        completions.append(reply["choices"][0]["token_ids"])
    acc = spec_delta(before, spec_counters(scrape(murl)))
    log = handle.log()  # vLLM's own lines (its mask-embedding loader's), not the fixes plugin's
    row_t1 = bench_endpoint("dflash", handle.base_url, sampled, [4], max_tokens=NEW_TOKENS, temperature=1.0,
                            warmup=0, k=k)[0]
    print(f"vLLM dflash: acceptance length {acc['acceptance_length']:.3f} ({acc['accepted']:.0f} of "
          f"{acc['draft_tokens']:.0f} drafted, {acc['drafts']:.0f} drafts), local {local_tau:.3f}; at T=1 vLLM "
          f"{row_t1['acceptance_length']:.3f}, local {local_t1['acceptance_length']:.3f}")
    assert f"Loaded DFlash mask embedding for mask_token_id {m.config.mask_token_id}" in log, log[-2000:]
    assert completions == [plain_generate(target, p, NEW_TOKENS) for p in prompts]
    assert [d.tokens for d in local] == completions
    assert acc["engine"] == "vllm" and acc["drafts"] > 0, acc
    assert (acc["drafts"], acc["accepted"]) == (len(local_accepted), sum(local_accepted)), (acc, local_tau)
    assert row_t1["errors"] == 0 and local_t1["acceptance_length"] > 1.3, (row_t1, local_t1)
    # Both sample (different random streams) from the same draft and target: the same expected acceptance.
    assert abs(row_t1["acceptance_length"] - local_t1["acceptance_length"]) <= 0.1 * local_t1["acceptance_length"], \
        (row_t1["acceptance_length"], local_t1["acceptance_length"])


@requires_vllm()
def test_vllm_serves_a_causal_block_shorter_than_trained_as_local_decoding_does(trained, data, target, served):
    """block_causal's path through the real vLLM: the trained block-of-4 weights as a causal draft, exported at
    k = 2 (a served block of 3, shorter than trained): vLLM reads ``dflash_config.causal`` and picks causal
    attention for the draft, and greedy its counters count exactly the drafts and accepted tokens of our local block
    decoding of the same export on the same prompts (a whole-block attention in either engine would propose other
    blocks), its completions the target's own."""
    import httpx

    from eagle3nb.accept.online import metrics_url, scrape
    from eagle3nb.drafts import load_draft
    from eagle3nb.drafts.dflash.drafting import generate
    from eagle3nb.formulas import spec_counters, spec_delta

    m = trained(0, "decay")[0]
    folder, k = served["drafts"]["causal"], served["k"]["causal"]
    served_draft = load_draft(folder, embed_tokens=m.embed_tokens.weight, lm_head=m.lm_head.weight)
    assert served_draft.config.causal and served_draft.config.drafts_per_block == k == m.config.drafts_per_block - 1
    prompts = [prompt_of(r) for r in data["heldout"]]
    local = [generate(target, served_draft, p, NEW_TOKENS) for p in prompts]
    local_accepted = [n for d in local for n in d.accepted]
    handle = served["servers"]["causal"]
    model = httpx.get(handle.base_url + "/models", timeout=30).json()["data"][0]["id"]
    murl = metrics_url(handle.base_url)
    before = spec_counters(scrape(murl))
    completions = [httpx.post(handle.base_url + "/completions", timeout=300, json={
        "model": model, "prompt": ids, "max_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True,
        "return_token_ids": True}).json()["choices"][0]["token_ids"] for ids in prompts]
    acc = spec_delta(before, spec_counters(scrape(murl)))
    assert [d.tokens for d in local] == completions
    assert acc["drafts"] > 0 and (acc["drafts"], acc["accepted"]) == (len(local_accepted), sum(local_accepted)), acc


# ---- through the registry: 03 trains and exports a block drafter, 04 and the batched decoder judge it -------------

# num_layers left out: the block drafters' own depth (2), which test_03_trains_a_block_drafter checks reached the draft
STAGE = dict(run_name="test", block_size=BLOCK, anchors_per_seq=64, max_length=256, batch_tokens=400,
             lr=5e-3, warmup_ratio=0.05, max_steps=100, eval_every=50, save_every=50, holdout_fraction=0.2, seed=0,
             export_format="both")


def stage_method(method: str) -> dict:
    """03's method and the vLLM k its block drafts (DFlash, DFlash2: the block less its anchor; DSpark: the block)."""
    from eagle3nb.drafts import rules

    return {"method": method, "num_speculative_tokens": rules(method).drafts_per_block(BLOCK)}


@pytest.fixture(scope="module")
def stage_data(tmp_path_factory, toy_smoke) -> Path:
    """02's output over 32 toy dialogues with the whole vocabulary as the draft's (a block drafter's)."""
    from train_data import make_hidden_states

    return make_hidden_states(tmp_path_factory.mktemp("hidden"), toy_smoke, n=32, draft_vocab_size=546)


@pytest.fixture(scope="module")
def staged(one_thread, stage_data, tmp_path_factory):
    """``staged(method)``: (03's output folder, its metrics.json, its draft/ loaded through the registry with the
    target's embedding and head) after ``STAGE``'s 100 steps of 03 with ``method`` (each run once per module:
    measured ~6 s each on one thread)."""
    from eagle3nb.data.reader import HiddenStates
    from eagle3nb.drafts import load_draft
    from eagle3nb.params import from_dict
    from eagle3nb.train.stage import run

    data, done = HiddenStates(stage_data), {}

    def get(method: str):
        if method not in done:
            out = tmp_path_factory.mktemp(method)
            metrics = run(from_dict("03_train", {**STAGE, **stage_method(method), "data_dir": str(stage_data),
                                                 "output_dir": str(out)}))
            draft = load_draft(out / "draft", embed_tokens=data.embed_tokens(), lm_head=data.lm_head())
            done[method] = out, metrics, draft
        return done[method]

    return get


def best_weights(out: Path) -> dict[str, torch.Tensor]:
    """The weights of 03's best evaluation, from its last checkpoint (``best.model``; None: that step's own)."""
    from eagle3nb.train.checkpoint import checkpoints

    blob = torch.load(checkpoints(out / "checkpoints")[-1], weights_only=False)
    return blob["best"]["model"] or blob["model"]


def heldout(stage_data: Path) -> tuple[object, list[int]]:
    from eagle3nb.data.reader import HiddenStates
    from eagle3nb.data.split import split_holdout

    data = HiddenStates(stage_data)
    return data, split_holdout([s["id"] for s in data.meta["samples"]], STAGE["holdout_fraction"])[1]


@pytest.mark.parametrize("method", ["dflash", "dspark", "dflash2"])
def test_03_trains_a_block_drafter_and_exports_what_load_draft_reads(staged, stage_data, toy_smoke, method):
    """03 with ``method: dflash | dspark | dflash2``: the held-out accuracy is per block position
    (``drafts_per_block`` of them, the report's label says so) and rises over training; the draft's rotary base is
    the target's; ``draft/`` (vLLM's layout) and ``draft-speculators/`` are claimed by the method and load back
    (with the target's embedding and head, and the trained mask input) to the best evaluation's weights, giving its
    logits; the printed vLLM flags name the method vLLM serves it as."""
    from eagle3nb.drafts import fresh_num_layers, load_draft, method_of, served_as
    from eagle3nb.drafts.dflash.model import DFlashDraft
    from eagle3nb.train.report import acc_unit, read_metrics

    out, metrics, draft = staged(method)
    assert draft.config.num_layers == fresh_num_layers(method) == 2  # num_layers left out: the method's own depth
    rope = json.loads((toy_smoke / "config.json").read_text())["rope_parameters"]
    assert draft.config.rope_theta == rope["rope_theta"] and draft.mask_embedding is not None
    k = draft.config.drafts_per_block
    evals = [r for r in read_metrics(out) if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [0, 50, 100] and acc_unit(evals) == "block position"
    assert all(len(r["acc"]) == k for r in evals) and k == stage_method(method)["num_speculative_tokens"]
    first, best = metrics["initial_heldout"], metrics["best"]
    assert best["acc"][0] > first["acc"][0] + 0.2, (first["acc"], best["acc"])
    assert f'"method": "{served_as(method)}"' in metrics["serve"]["vllm"] and "sglang_draft_dir" not in metrics
    data, held = heldout(stage_data)
    ref = DFlashDraft(draft.config)
    ref.load_state_dict({**best_weights(out), "embed_tokens.weight": data.embed_tokens()})
    item = data[held[0]]
    ctx = (draft.context(item["aux"][None].float()), ref.context(item["aux"][None].float()))
    anchors = torch.arange(1, len(item["input_ids"]) - 1)
    with torch.no_grad():
        torch.testing.assert_close(draft.slot_logits(ctx[0], item["input_ids"], anchors),
                                   ref.slot_logits(ctx[1], item["input_ids"], anchors), rtol=0, atol=0)
    for folder in ("draft", "draft-speculators"):
        config = json.loads((out / folder / "config.json").read_text())
        assert method_of(config).name == method
    again = load_draft(out / "draft-speculators", embed_tokens=data.embed_tokens(), lm_head=data.lm_head())
    assert all(torch.equal(v, again.state_dict()[n]) for n, v in draft.state_dict().items())


def dead_row_draft(staged, folder: Path, mask_token_id: int | None = None) -> Path:
    """03's trained DFlash export without its ``mask_embedding.pt`` (a draft from before it, or a peer's), its
    ``mask_token_id`` changed when given."""
    import shutil

    shutil.copytree(staged("dflash")[0] / "draft", folder)
    (folder / "mask_embedding.pt").unlink()
    if mask_token_id is not None:
        cfg = json.loads((folder / "config.json").read_text())
        cfg["dflash_config"]["mask_token_id"] = mask_token_id
        (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def test_a_dead_mask_row_is_refused_by_03_in_one_line(staged, stage_data, tmp_path):
    """A block drafter without a trained mask input whose mask id reads a dead row (the toy's pad row, all zeros)
    is refused by 03 before it trains, in one line naming the row and the fix; the same draft on a live mask row
    (one of median norm) is not, and neither is one with its ``mask_embedding.pt``."""
    from eagle3nb.data.reader import HiddenStates
    from eagle3nb.drafts import DraftMismatchError, load_draft, of
    from eagle3nb.params import from_dict
    from eagle3nb.train.stage import run

    data = HiddenStates(stage_data)
    norms = data.embed_tokens().float().norm(dim=-1)
    dead = dead_row_draft(staged, tmp_path / "dead")
    assert float(norms[staged("dflash")[2].config.mask_token_id]) < 0.5 * float(norms.median())
    values = {**STAGE, **stage_method("dflash"), "data_dir": str(stage_data), "init_from": str(dead)}
    with pytest.raises(DraftMismatchError) as refused:
        run(from_dict("03_train", {**values, "output_dir": str(tmp_path / "out")}))
    assert "\n" not in str(refused.value) and "mask_token_id" in str(refused.value), refused.value
    assert "init_from: null" in str(refused.value) and not list((tmp_path / "out").rglob("step-*.pt"))
    live = int((norms - norms.median()).abs().argmin())
    for ok in (dead_row_draft(staged, tmp_path / "live", live), staged("dflash")[0] / "draft"):
        draft = load_draft(ok, embed_tokens=data.embed_tokens(), lm_head=data.lm_head())
        of(draft).check_usable(draft, str(ok))


def test_a_killed_block_drafter_run_resumes_exactly(staged, stage_data, tmp_path):
    """The last checkpoint (step 100) removed, 03 resumes from step 50 and repeats the curve and the weights bit
    for bit: the anchors' draws come back with torch's generator state (~3 s)."""
    import shutil

    from eagle3nb.params import from_dict
    from eagle3nb.train.checkpoint import checkpoints
    from eagle3nb.train.report import read_metrics
    from eagle3nb.train.stage import run

    out = staged("dflash")[0]
    again = tmp_path / "again"
    shutil.copytree(out, again)
    checkpoints(again / "checkpoints")[-1].unlink()
    run(from_dict("03_train", {**STAGE, **stage_method("dflash"), "data_dir": str(stage_data),
                               "output_dir": str(again)}))

    def curve(folder: Path) -> list[float]:
        return [r["loss"] for r in read_metrics(folder) if r["kind"] == "train"]

    assert len(curve(again)) == STAGE["max_steps"] and curve(again) == curve(out)
    want = torch.load(checkpoints(out / "checkpoints")[-1], weights_only=False)["model"]
    got = torch.load(checkpoints(again / "checkpoints")[-1], weights_only=False)["model"]
    assert all(torch.equal(want[n], got[n]) for n in want)


@pytest.mark.parametrize("method", ["dflash", "dspark", "dflash2"])
def test_the_batched_decoder_decodes_a_block_drafter_losslessly_and_04_replays_its_rounds(staged, stage_data,
                                                                                        target, method):
    """``SpecDecoder`` with the trained block drafter (k = its block's drafts): greedy output equal to the target's
    own, some drafts accepted; 04's offline simulation (the method's ``chain_acceptance`` on the target's states of
    that output, then ``simulate_rounds``) replays the decode's accepted count round by round, and 04's offline
    acceptance reports one rate per block position, its first near 03's held-out accuracy there; its predicted
    speedup charges one draft forward per block."""
    from block_replay import decode_and_replay

    from eagle3nb.accept.local import measure_costs
    from eagle3nb.accept.offline import offline_acceptance
    from eagle3nb.accept.predict import predict
    from eagle3nb.decoder.batch import SpecDecoder
    from eagle3nb.decoder.reference import plain_generate
    from eagle3nb.drafts import one_forward_per_round

    draft = staged(method)[2]
    k = draft.config.drafts_per_block
    dec = SpecDecoder(target, draft, k)
    data, held = heldout(stage_data)
    replayed = 0
    for i in held[:4]:
        item = data[i]
        prompt = item["input_ids"][item["loss_mask"] == 0].tolist()
        out, _, rounds = decode_and_replay(dec, prompt, 24)
        assert out.tokens == plain_generate(target, prompt, 24)
        assert len(rounds) >= 3 and rounds == out.accepted_per_round[:len(rounds)]
        replayed += sum(rounds)
    assert replayed > 0, "the trained drafter had no draft accepted"
    offline = offline_acceptance(draft, data, k, k, indices=held)
    # 04's rate at the first block position over every held-out token, 03's over the (up to 64) anchors it samples:
    # measured 0.54 vs 0.57 (dflash), 0.77 vs 0.80 (dspark)
    assert len(offline["per_position"]) == k
    assert abs(offline["per_position"][0] - staged(method)[1]["best"]["acc"][0]) < 0.15
    # 04's prediction charges one draft forward (the block's, timed by the method's step_timer) per round
    costs = measure_costs(target, draft, k, context=64, repeats=3)
    pred = predict(offline["acceptance_length"], k, costs["cost_ratio"], costs["overhead"],
                   one_forward_per_round(draft))
    assert pred["speedup"] == offline["acceptance_length"] / (1 + costs["cost_ratio"] + costs["overhead"])


@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_the_embedded_server_serves_a_block_drafter_losslessly(staged, target, toy_smoke, method):
    """The embedded speculative server (``eagle3nb serve --draft``, 01's and 04's stand-in for vLLM) loads 03's
    block drafter export through the registry: its greedy chat answers are the target's own greedy tokens, its
    vLLM-style counters count the block's drafts per position, and drafts get accepted. ~3 s each."""
    from openai import OpenAI

    from eagle3nb.accept.online import metrics_url, scrape
    from eagle3nb.data.prompts import load_prompts
    from eagle3nb.decoder.reference import plain_generate
    from eagle3nb.formulas import spec_counters, spec_delta
    from eagle3nb.launch import start_server

    out, _, draft = staged(method)
    k = draft.config.drafts_per_block
    with start_server(toy_smoke, draft_dir=out / "draft", num_speculative_tokens=k) as h:
        client = OpenAI(base_url=h.base_url, api_key="EMPTY")
        model = client.models.list().data[0].id
        before = spec_counters(scrape(metrics_url(h.base_url)))
        for row in load_prompts("toy:heldout", 4):
            r = client.chat.completions.create(model=model, messages=row["messages"], max_tokens=24, temperature=0.0,
                                               extra_body={"return_token_ids": True})
            prompt, ids = r.model_extra["prompt_token_ids"], r.choices[0].model_extra["token_ids"]
            assert ids == plain_generate(target, prompt, len(ids))
        after = spec_counters(scrape(metrics_url(h.base_url)))
    d = spec_delta(before, after)
    assert after["engine"] == "vllm" and len(after["per_pos"]) == k
    assert d["drafts"] >= 4 and d["accepted"] > 0, d


@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_the_batched_decoder_samples_the_targets_distribution_with_a_block_drafter(staged, target, data, method):
    """At T=1 the second generated token (the first one a block drafts) of N seeded rows, decoded together, fits
    the target's own distribution of that token (tests/sampling.py's G-test), at a position where the first token
    is near-certain and the second spread; rows do draft it (~2 s each)."""
    from eagle3nb.decoder.batch import SpecBatch, SpecDecoder
    from eagle3nb.verification.verify import Sampling

    from sampling import ALPHA, N, SpreadPrompt, fits_target

    draft = staged(method)[2]
    sp = None
    for row in data["heldout"]:
        probs = row["logits"].softmax(-1)  # shape: [T, V]
        cut = next((c for c in range(int((row["loss_mask"] == 0).sum()), len(probs) - 1)
                    if probs[c - 1].max() > 0.99 and probs[c].max() < 0.5), None)
        if cut is not None:
            prefix = row["input_ids"][:cut]
            every = torch.cat([prefix.expand(probs.shape[1], -1), torch.arange(probs.shape[1])[:, None]], 1)
            with torch.no_grad():
                sp = SpreadPrompt(prefix.tolist(), probs[cut - 1] @ target(every).logits[:, -1].softmax(-1))
            break
    assert sp is not None, "no held-out position with a near-certain token followed by a spread one"
    batch = SpecBatch(SpecDecoder(target, draft, draft.config.drafts_per_block))
    with torch.inference_mode():
        batch.add([sp.ids] * N, [Sampling(1.0, 1.0, torch.Generator().manual_seed(s)) for s in range(N)])
        seconds = [new[0] for new in batch.round()]
    assert batch.counters.drafts == N
    assert fits_target(seconds, sp) > ALPHA, torch.bincount(torch.tensor(seconds)).nonzero().flatten()


def test_03_trains_a_block_drafter_online_as_from_stored_states(staged, stage_data, toy_smoke, tmp_path):
    """``data_source: online`` (the target computes each micro-batch's states from 01's records, nothing stored)
    feeds the block drafter the batch 02's shards do: the same curve and held-out accuracy by block position as the
    stored run, up to float noise that training amplifies (~15 s: the run and the target's passes)."""
    import yaml

    from eagle3nb.params import from_dict
    from eagle3nb.train.report import read_metrics
    from eagle3nb.train.stage import run

    folder = tmp_path / "params" / "test"
    folder.mkdir(parents=True)
    stored_layers = json.loads((stage_data / "index.json").read_text())["layer_ids"]  # the stored run's taps
    (folder / "02_hidden_states.yaml").write_text(yaml.safe_dump({
        "run_name": "test", "synth_dir": str(stage_data.parent / "01"), "model_path": str(toy_smoke),
        "draft_vocab_size": 546, "storage": "fp32", "aux_layer_ids": stored_layers}))
    values = {**STAGE, **stage_method("dflash"), "data_dir": str(tmp_path / "no-02"),
              "output_dir": str(tmp_path / "out"), "data_source": "online"}
    (folder / "03_train.yaml").write_text(yaml.safe_dump(values))
    run(from_dict("03_train", {**values, "params_file": str(folder / "03_train.yaml")}))
    rows = {name: read_metrics(out) for name, out in (("online", tmp_path / "out"), ("stored", staged("dflash")[0]))}
    curves = {name: [r["loss"] for r in rs if r["kind"] == "train"] for name, rs in rows.items()}
    assert len(curves["online"]) == STAGE["max_steps"]
    rel = [abs(a - b) / abs(b) for a, b in zip(curves["online"], curves["stored"])]
    # measured: <= 3.6e-7 over the first 20 steps (the target's states over other batch shapes than 02's differ by
    # ~1e-7), growing as training amplifies it to 3.5e-4 by step 78
    assert max(rel[:20]) < 1e-5 and max(rel) < 1e-2
    accs = {name: torch.tensor([r["acc"] for r in rs if r["kind"] == "eval"]) for name, rs in rows.items()}
    assert torch.equal(accs["online"][0], accs["stored"][0]) and torch.allclose(accs["online"], accs["stored"],
                                                                                  atol=0.05)


def test_04s_views_draw_a_block_drafters_rounds_as_blocks(staged, stage_data, target, toy_smoke, tmp_path):
    """04's token views of a trained DFlash draft's rounds (its records carry the method's unit, block position):
    local decoding's real rounds render exactly each round's accepted prefix as accepted and its first rejected
    block position as rejected (the record's ``outcomes``), the target's token after a full block apart; the
    offline record of the same output (the method's chains on the target's states) draws the same blocks where it
    simulates rounds; the key and the static excerpt say block position."""
    import re

    from transformers import AutoTokenizer

    from eagle3nb import drafts
    from eagle3nb.accept import misses, views
    from eagle3nb.accept.offline import position_record
    from eagle3nb.decoder.batch import SpecDecoder
    from eagle3nb.families import detect

    draft = staged("dflash")[2]
    k, unit = draft.config.drafts_per_block, drafts.of(draft).unit
    tok, family = AutoTokenizer.from_pretrained(toy_smoke), detect(toy_smoke)
    dec = SpecDecoder(target, draft, k)
    data, held = heldout(stage_data)
    prompts, local, offline = [], {"outputs": [], "accepted_per_round": [], "drafted_per_round": []}, []
    for i in held[:3]:
        item = data[i]
        prompt = item["input_ids"][item["loss_mask"] == 0].tolist()
        out = dec.generate(prompt, 24)
        prompts.append(prompt)
        for key, value in zip(local, (out.tokens, out.accepted_per_round, out.drafted_per_round)):
            local[key].append(value)
        ids = torch.tensor(prompt + out.tokens)
        with torch.no_grad():
            states = target(input_ids=ids[None], output_hidden_states=True)
        aux = torch.cat([states.hidden_states[j][0] for j in draft.config.aux_layer_ids], -1)
        own = {"id": f"prompt-{len(offline)}", "aux": aux, "input_ids": ids,
               "loss_mask": (torch.arange(len(ids)) >= len(prompt)).long()}
        chains = drafts.of(draft).chain_acceptance(draft, own, states.logits[0].argmax(-1), None, k, 0.0)
        offline.append(misses.with_pieces(position_record(own, chains, k, unit), tok, "offline", family))
    records = [misses.with_pieces(r, tok, "local", family) for r in misses.local_records(prompts, local, None, unit)]

    def marks(rec: dict) -> list[str | None]:
        spans = re.findall(r'<span class="tv-role-[^"]*?(?: tv-mark-(\w+))?" data-id', views.render_record(rec, k))
        assert len(spans) == len(rec["ids"])
        return [m or None for m in spans]

    partial = 0
    for rec, off in zip(records, offline):
        assert rec["unit"] == off["unit"] == "block position"
        want = [{1: "blk_ok", 0: "blk_miss"}.get(o) for o in misses.outcomes(rec)]
        for p, n, _ in rec["rounds"]:
            if n == k and p + n < len(want):
                want[p + n] = "blk_full"
            partial += 0 < n < k
        shown = marks(rec)
        assert shown == want
        # offline, on the target's own output: the same blocks wherever it simulates a round (whole blocks only)
        sim = marks(off)
        assert sum(m == "blk_ok" for m in sim) > 0
        assert [m for m in sim if m] == [m for m, s in zip(shown, sim) if s]
    assert partial > 0, "no round accepted part of its block: nothing shows an accepted prefix before a rejection"
    assert "block position" in views.key(k, unit) and "draft step" not in views.key(k, unit)
    misses.write_records(tmp_path / misses.ROUNDS, records)
    static = str(views.excerpts(tmp_path, k, "local"))
    assert "tv-mark-blk_ok" in static and "tv-mark-blk_miss" in static and "block position accepted" in static


# ---- DSpark's confidence head: calibrated after training (eagle3nb/drafts/dflash/calibration.py) ------------------

def test_temperature_scaling_recovers_a_known_overconfidence():
    """Acceptance probabilities sigmoid(z) estimated by sigmoid(c * z): the fitted scale is 1/c (the cross-entropy's
    minimum, exactly), and the scaled estimate's ECE is nil where the unscaled one's is not; ``calibrate`` folds
    that scale into the head's weight and bias (what vLLM reads)."""
    from eagle3nb.drafts.dflash.calibration import calibrate, ece, fit_scale

    z = torch.randn(4000, generator=torch.Generator().manual_seed(0)) * 2
    accept = torch.sigmoid(z)
    for c in (0.5, 3.0):
        s = fit_scale(c * z, accept)
        assert abs(s * c - 1) < 1e-6, (c, s)
        assert ece(torch.sigmoid(c * z), accept) > 0.03 and ece(torch.sigmoid(s * c * z), accept) < 1e-5

    class Overconfident(torch.nn.Module):  # 03's objective, as calibrate sees it: the draft and its slots' pairs
        def __init__(self):
            super().__init__()
            self.draft = torch.nn.Module()
            self.draft.confidence_head = torch.nn.Module()
            self.draft.confidence_head.proj = torch.nn.Linear(3, 1)

        def confidence(self, batch):
            return 3 * batch["z"], torch.sigmoid(batch["z"])

    obj = Overconfident()
    weight, bias = obj.draft.confidence_head.proj.weight.clone(), obj.draft.confidence_head.proj.bias.clone()
    got = calibrate(obj, [{"z": z[:2000]}, {"z": z[2000:]}])
    assert got["applied"] and got["slots"] == 4000 and abs(got["temperature"] - 3) < 1e-5
    assert got["ece_after"] < 1e-5 < 0.03 < got["ece_before"]
    assert sum(b["n"] for b in got["reliability_before"]) == sum(b["n"] for b in got["reliability_after"]) == 4000
    torch.testing.assert_close(obj.draft.confidence_head.proj.weight, weight / got["temperature"])
    torch.testing.assert_close(obj.draft.confidence_head.proj.bias, bias / got["temperature"])


def test_03_calibrates_dsparks_confidence_head_into_its_export(staged):
    """03's DSpark run: metrics.json holds the head's ECE before and after its temperature on the held-out slots
    (after <= before), ``calibration.png`` is drawn, and draft/'s head is the best evaluation's scaled by exactly
    1/temperature, so vLLM reads the calibrated confidence; DFlash has no head and no calibration."""
    out, metrics, draft = staged("dspark")
    cal = metrics["calibration"]
    assert cal["slots"] > 50 and cal["ece_after"] <= cal["ece_before"]
    assert sum(b["n"] for b in cal["reliability_before"]) == cal["slots"]
    assert (out / "calibration.png").stat().st_size > 0
    best = best_weights(out)
    scale = 1 / cal["temperature"] if cal["applied"] else 1.0
    for name in ("weight", "bias"):
        torch.testing.assert_close(getattr(draft.confidence_head.proj, name),
                                   best[f"confidence_head.proj.{name}"] * scale)
    assert "calibration" not in staged("dflash")[1] and not (staged("dflash")[0] / "calibration.png").exists()


@pytest.mark.parametrize("method", ["dflash", "dflash2"])
def test_a_block_trained_long_is_exported_and_read_as_the_block_it_is_served_with(method, toy_smoke, tmp_path):
    """Trained at block 8 and served at k = 3, as the papers train at 16 and serve at 8 (vLLM 0.32's DFlash runs
    the anchor and k masks whatever the trained block): 03 accepts it, the export's config is the served block of
    k + 1 slots, and the draft read back drafts k tokens a round with the trained weights unchanged."""
    from eagle3nb.drafts import load_draft
    from eagle3nb.drafts.dflash.layouts import save_draft
    from eagle3nb.drafts.dflash.model import DFlashDraft, from_target
    from eagle3nb.params import from_dict

    k, trained = 3, 8
    heads = {"dflash2": {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 4, "selector_top_k": 2}}
    P = from_dict("03_train", {"method": method, "block_size": trained, "num_speculative_tokens": k,
                               **heads.get(method, {})}, check_paths=False)
    assert (P.block_size, P.num_speculative_tokens) == (trained, k)
    target = json.loads((toy_smoke / "config.json").read_text())
    draft = DFlashDraft(from_target(target, block_size=trained, **heads.get(method, {})))
    folder = save_draft(draft, tmp_path / "draft", num_speculative_tokens=k)
    config = json.loads((folder / "config.json").read_text())
    assert config["block_size"] == config["dflash_config"]["block_size"] == k + 1
    again = load_draft(folder, embed_tokens=draft.embed_tokens.weight, lm_head=draft.lm_head.weight)
    assert again.config.drafts_per_block == k and again.config.block_size == k + 1
    assert all(torch.equal(v, again.state_dict()[n]) for n, v in draft.state_dict().items())
    full = json.loads((save_draft(draft, tmp_path / "full", num_speculative_tokens=trained - 1) / "config.json")
                      .read_text())
    assert full["block_size"] == trained  # served at the trained block: written as trained


@pytest.mark.parametrize("method", ["dflash", "dflash2"])
def test_a_causal_block_served_shorter_drafts_what_its_first_slots_drafted(method, toy_smoke, tmp_path):
    """block_causal: 03's run builds a causal draft, the export says so to vLLM (dflash_config.causal), and a block
    served shorter than trained gives its first slots exactly the states the trained block gave them; a
    whole-block draft's first slots change when the later slots go (what serving a long-trained block shorter
    costs it)."""
    import dataclasses

    from eagle3nb.drafts import get
    from eagle3nb.drafts.dflash.layouts import save_draft
    from eagle3nb.drafts.dflash.model import DFlashDraft, from_target
    from eagle3nb.params import from_dict

    heads = {"dflash2": {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 4, "selector_top_k": 2}}
    P = from_dict("03_train", {"method": method, "block_size": 8, "num_speculative_tokens": 3, "block_causal": True,
                               **heads.get(method, {})}, check_paths=False)
    target = json.loads((toy_smoke / "config.json").read_text())
    meta = {"vocab_size": target["vocab_size"], "hidden_size": target["hidden_size"], "layer_ids": [1]}
    data = type("Data", (), {"meta": meta, "embed_tokens": lambda self: torch.randn(target["vocab_size"], 64),
                             "lm_head": lambda self: torch.randn(target["vocab_size"], 64)})()
    draft = get(method).fresh(P, data, target)
    assert draft.config.causal and draft.config.block_size == 8
    config = json.loads((save_draft(draft, tmp_path / "draft", num_speculative_tokens=3) / "config.json").read_text())
    assert config["dflash_config"]["causal"] is True and config["block_size"] == 4
    torch.manual_seed(0)
    ctx, anchors, pos = torch.randn(1, 12, 64), torch.tensor([[5, 9]]), torch.tensor([[6, 10]])
    for causal in (True, False):
        model = DFlashDraft(from_target(target, block_size=8, causal=causal, **heads.get(method, {}))).eval()
        with torch.no_grad():
            for p in model.parameters():  # every weight live (DFlash2's convolutions start as the identity)
                p.add_(0.1 * torch.randn_like(p))
            served = DFlashDraft(dataclasses.replace(model.config, block_size=4)).eval()
            served.load_state_dict(model.state_dict())
            long, short = model(ctx, anchors, pos), served(ctx, anchors, pos)  # shape: [1, 2, 8 | 4, H]
        assert torch.allclose(long[:, :, :4], short, atol=1e-5) == causal
