"""What every draft algorithm shares: the interface a package offers (``DraftMethod``, ``Drafting``), the error a
draft that does not fit raises, fitting a draft's shape to the target's data, what a draft is served as
(``Serving``) and the rules every method's serving check shares, what an objective may add to 03's evaluations
(``EvalDiagnostics``), reading checkpoint tensors, and the acceptance of rejection sampling the offline simulations
score with."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from eagle3nb.errors import UserError
from eagle3nb.layers import default_aux_layer_ids, from_sglang

if TYPE_CHECKING:
    import torch
    from torch import nn

    from eagle3nb.verification.padded import PaddedKV
    from eagle3nb.verification.verify import Sampling

WEIGHTS_FILE = "model.safetensors"
# A loss_mask value past 1: a drafted token the target rejected, in 05's on-policy distillation records (1 there: one
# it accepted), read by the objectives; any nonzero value is a scored token to every other reader.
REJECTED = 2


class DraftMismatchError(UserError, ValueError):
    """A draft checkpoint that does not fit the data / target it is used with."""


class ServingError(DraftMismatchError):
    """A draft an engine would serve wrong without saying so (another method, k or layout than it was trained for,
    another target): refused in one line naming the flag or field that fixes it, before any server starts."""


# What is wrong with a served draft and the flag or field that fixes it: one line each.
Misfit = tuple[str, str]


@dataclass(frozen=True)
class ServedTarget:
    """The target a draft is about to be served beside, read by the caller from the target's folder (the drafts
    import no data layer). ``embed_row_norms()`` [V]: the L2 norm of each row of its input embedding, read only
    by a method whose draft embeds a mask token through it."""

    num_layers: int
    hidden_size: int
    vocab_size: int
    embed_row_norms: Callable[[], torch.Tensor]


@dataclass(frozen=True)
class Serving:
    """How a draft is about to be served: vLLM's speculative-config ``method`` and ``num_speculative_tokens``, the
    target, the names the user sets the first two by (each message names the one that fixes it), and whether the
    engine is one that runs only the checkpoint's whole block."""

    method: str
    num_speculative_tokens: int
    target: ServedTarget
    method_field: str = "the speculative-config method"
    k_field: str = "num_speculative_tokens"
    # the engine drafts a block drafter's whole checkpoint block, never fewer (eagle3nb's own decoder: ``eagle3nb
    # serve``, 04's embedded servers and local decoding); vLLM's DFlash proposer runs k masks whatever the block
    whole_block: bool = False


class Drafting(Protocol):
    """A draft's step inside the batched decoder (``eagle3nb.decoder.batch.SpecBatch``), for rows of different lengths
    sharing one ``PaddedKV``. Each row's *pending* state is the target's aux states of its verified tokens not yet
    fed to the draft (1..k+1 of them, right-padded), paired with the token after each."""

    def prefill(self, aux: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor) -> PaddedKV:
        """The draft's cache over new rows' prompts (aux [B, T, 3H_t], ids / pos / mask [B, T], left-padded): every
        prompt position but the last, whose aux state opens the row's first round."""

    def propose(self, kv: PaddedKV, pend_aux: torch.Tensor, pend_ids: torch.Tensor, pend_n: torch.Tensor,
                rows: Sequence[Sampling]) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """k drafted tokens per row [B, k] (target ids) and, for sampled rows, the distributions [k, V] they were
        drawn from; only the verified positions stay in ``kv``."""

    def step_timer(self, aux: torch.Tensor, ids: torch.Tensor) -> Callable[[], None]:
        """A function that runs one drafting step after the context ``aux`` [1, T, 3H_t], ``ids`` [1, T] and undoes
        it, for timing (what ``cost_ratio`` divides by a target step)."""


class DraftMethod(ABC):
    """One draft algorithm, as every stage, the decoder, the server and the doctor call it (``eagle3nb.drafts``):
    a package's ``method.py`` subclasses it once per method it serves, so a call such as
    ``drafts.get(name).fresh(P, data, target_config)`` leads, in the code as in a reader's eye, into the method's
    own package. The signatures below are the contract; ``calibrate`` and ``confidences`` are None where the method
    has no such head."""

    name: str  # vLLM's speculative-config "method", a speculators config's speculators_model_type
    title: str  # how papers and people write it, for messages
    layouts: tuple[str, ...]  # the formats ``save`` writes; the first is the one vLLM serves (03's draft/)
    # what a round's i-th drafted token is called (EAGLE-3's TTT step, a block drafter's block position): the label
    # 03's stats and 04's records and views carry
    unit: str
    # (03's objective on the best weights, the held-out micro-batches) -> metrics.json's "calibration": a post-hoc
    # calibration of the draft's own heads after training, folded into the exported weights (DSpark's confidence
    # head); None: the method has nothing to calibrate
    calibrate: Callable[..., dict[str, Any]] | None = None
    # (model, held-out item, target_argmax) -> per block a round can draft in the sample: ``anchors`` [A], the draft's
    # own acceptance estimates ``confidence`` [A, k], the accepted ``run`` [A] and ``full`` [A] (the block lies in
    # generated tokens): 04's adaptive-verification simulation (``eagle3nb.accept.adaptive``); None: the method
    # estimates no acceptance (DSpark's confidence head does)
    confidences: Callable[..., dict[str, Any]] | None = None

    def __repr__(self) -> str:
        return f"<draft method {self.name}>"

    @abstractmethod
    def claims(self, config: dict[str, Any]) -> bool:
        """Whether this method reads a draft whose config.json is ``config``."""

    @abstractmethod
    def load(self, path: str | Path, embed_tokens: torch.Tensor | None = None, device: Any = "cpu",
             dtype: Any = None, lm_head: torch.Tensor | None = None) -> nn.Module:
        """The draft in folder ``path``, in eval mode; the target's embedding and head [V, H] for a checkpoint that
        carries none (a block drafter never does); ``dtype`` None: float32."""

    @abstractmethod
    def save(self, model: nn.Module, path: str | Path, format: str, dtype: Any = None,
             include_embed: bool | None = None, verifier: str | None = None,
             num_speculative_tokens: int | None = None) -> Path:
        """Write ``model`` to ``path`` in ``format`` (one of ``layouts``); None: the method's own default."""

    @abstractmethod
    def config_json(self, model: nn.Module, format: str, dtype: Any = None, verifier: str | None = None,
                    num_speculative_tokens: int | None = None) -> dict[str, Any]:
        """The config.json ``save`` writes in ``format``."""

    @abstractmethod
    def objective(self, model: nn.Module, P: Any) -> nn.Module:
        """03's objective for ``model`` under 03's params ``P``: ``forward(batch)`` -> (loss, stats [4, steps]:
        loss sum, loss positions, correct, scored positions)."""

    @abstractmethod
    def drafting(self, model: nn.Module, k: int, device: Any) -> Drafting:
        """Its step in the batched decoder (``eagle3nb.decoder.batch.SpecBatch``), drafting ``k`` tokens a round."""

    @abstractmethod
    def chain_acceptance(self, model: nn.Module, item: dict, target_argmax: torch.Tensor,
                         target_probs: torch.Tensor | None, steps: int, temperature: float) -> dict[str, Any]:
        """04's offline simulation on one held-out sample: ``greedy`` / ``sampled`` / ``valid`` [steps, T-1],
        ``guess`` / ``target`` [T-1]."""

    @abstractmethod
    def fresh(self, P: Any, data: Any, target_config: dict[str, Any]) -> nn.Module:
        """03's fresh draft on 02's ``data`` (its meta, d2t / t2d, ``embed_tokens()`` and ``lm_head()`` [V, H]) and
        the target's config.json, shaped by the method's own 03 params ``P``."""

    @abstractmethod
    def serving_problems(self, path: Path, config: dict[str, Any], serving: Serving) -> list[Misfit]:
        """What vLLM would read wrong from the checkpoint in ``path`` (config.json ``config``) served as ``serving``
        says (k, layout, layer ids, vocabulary), [] when it fits; the registry has checked the method."""

    @abstractmethod
    def tensor_problems(self, config: dict[str, Any], shapes: dict[str, list[int]], hidden_size: int) -> list[Misfit]:
        """What the checkpoint's tensors (name -> shape, read raw) lack or shape wrong for a target of
        ``hidden_size``, [] when they fit: the doctor's shapes_vocab reads a broken checkpoint through it."""

    def check_usable(self, model: nn.Module, where: str) -> None:
        """Refuse, in one line (DraftMismatchError), a loaded draft that cannot work whatever its training (a block
        drafter whose mask slots read a dead row): 03 calls it before fine-tuning, the doctor before judging."""


class EvalDiagnostics(ABC):
    """What an objective may add to 03's held-out evaluations, 03's loop naming no method (LiLiCorr's lattice:
    the walk's, the backbone's top-1 and the oracle prefixes). After each held-out batch the loop reads
    ``eval_sums()``, one number per name of ``EVAL_SUMS``, adds them up over the batches and processes, and
    ``eval_diagnostics(totals)`` is what the evaluation row (``metrics.jsonl``) and ``metrics.json``'s ``best``
    carry under ``diagnostics``. An objective that does not subclass it adds nothing to either."""

    EVAL_SUMS: tuple[str, ...] = ()

    @abstractmethod
    def eval_sums(self) -> dict[str, torch.Tensor]:
        """The latest batch's sums, by the names of ``EVAL_SUMS`` (tensors: no device sync per batch)."""

    @abstractmethod
    def eval_diagnostics(self, totals: dict[str, float]) -> dict[str, float]:
        """The evaluation's diagnostics from the sums over all held-out batches."""


@dataclass(frozen=True)
class MethodRules:
    """What 03's parameters, the resume check, the benchmarks and the GPU check read of a method before any torch
    import: its package's light ``__init__`` holds them in ``RULES`` (name -> rules), read through
    ``eagle3nb.drafts.rules``, so no caller names a method to know its rules."""

    summary: str  # what 03's ``method`` help says of it
    # a block drafter: one forward drafts a block of 03's block_size, which vLLM sizes by num_speculative_tokens;
    # EAGLE-3's own settings (parallel_drafting, draft_attention, loss) are not its
    block: bool = False
    samples_from_anchor: bool = False  # a block drafter whose anchor slot drafts too (DSpark): block_size drafts
    # a block drafter vLLM serves at fewer drafts than its block (vLLM 0.32's DFlash proposer runs the anchor and
    # num_speculative_tokens masks whatever block it was trained with; its DSpark checks k against the block): the
    # papers train at 16 and serve at 8, and the export is the served block
    serves_shorter: bool = False
    # 03's settings it reads that EAGLE-3, the first method, does not (their help names the methods reading them;
    # another method's are left out of its runs' resume check)
    params: tuple[str, ...] = ()
    # the speculative-config method vLLM serves it as, when not its own name (DFlash2: dflash, vLLM choosing the
    # model by the draft's architecture)
    served_as: str = ""
    # (the target's decoder layers, the draft's) -> the target layers (HF/vLLM ids) its recipe reads, which 02
    # extracts when its aux_layer_ids is unset and the run's 03 trains this method; None: EAGLE-3's [2, L//2, L-3]
    layer_ids: Callable[[int, int], list[int]] | None = None
    # vLLM 0.32 drafts it in its V2 model runner only (DSpark's speculator, the candidate walk of DFlash2's and
    # LiLiCorr's heads: its V1 runner refuses them, config/vllm.py), which needs Triton: start_vllm pins V2 for it, so
    # an inherited VLLM_USE_V2_MODEL_RUNNER=0 cannot pick V1 and the CPU build refuses with that cause
    v2_only: bool = False
    # (the draft's config.json) -> the --speculative-config keys vLLM must be given to serve that draft as trained,
    # besides method, model and k (EAGLE-3's parallel drafting: a P-EAGLE draft's mask slots); None: none
    speculative: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    # (03's parameters) -> why they cannot train this method's draft as set, in one line naming the setting, or None:
    # the checks of its own settings (EAGLE-3's parallel drafting, DFlash2's convolutions), run by 03's schema
    check: Callable[[Any], str | None] | None = None
    # the recipes a selection (06) trains of this method when the user names none: each the 03 settings that make it,
    # num_speculative_tokens the k it is served at (recipes differing only in a chain drafter's k share one training)
    recipes: tuple[dict[str, Any], ...] = ()

    def drafts_per_block(self, block_size: int) -> int:
        """Tokens one block of a block drafter proposes (vLLM's num_speculative_tokens): the anchor slot drafts
        only when the method samples from it."""
        return block_size if self.samples_from_anchor else block_size - 1


def given(**options: Any) -> dict[str, Any]:
    """The options a caller set (not None), so a method's layout function keeps its own defaults for the rest."""
    return {k: v for k, v in options.items() if v is not None}


def check_fits(cfg, *, hidden_size: int, vocab_size: int, layer_ids: list[int] | None,
               num_layers: int | None = None, draft_vocab_size: int | None = None,
               draft: str = "the draft", data: str = "the data") -> None:
    """Raise DraftMismatchError naming both sides when a draft (its config: ``target_hidden_size``, ``vocab_size``,
    ``draft_vocab_size``, ``aux_layer_ids``) cannot be trained/used on this target's data."""
    problems = []
    if cfg.target_hidden_size != hidden_size:
        problems.append(f"target hidden size: {draft} has {cfg.target_hidden_size} (fc input "
                        f"{3 * cfg.target_hidden_size}), {data} has {hidden_size}")
    if cfg.vocab_size != vocab_size:
        problems.append(f"target vocab size: {draft} has {cfg.vocab_size}, {data} has {vocab_size}")
    if draft_vocab_size is not None and cfg.draft_vocab_size != draft_vocab_size:
        problems.append(f"draft vocab size: {draft} has {cfg.draft_vocab_size}, {data} has {draft_vocab_size}")

    ids = cfg.aux_layer_ids
    if ids is None and num_layers is not None:
        ids = default_aux_layer_ids(num_layers)  # what vLLM uses when a config names none
    if layer_ids is not None and ids is not None and list(ids) != list(layer_ids):
        hint = ""
        if from_sglang(ids) == list(layer_ids):
            hint = " (the draft's ids look like SGLang/SpecForge output-of-layer ids: add 1 to convert)"
        problems.append(f"aux layer ids (HF hidden_states index == vLLM ids): {draft} has {list(ids)}, "
                        f"{data} has {list(layer_ids)}{hint}")
    if problems:
        raise DraftMismatchError(
            "the draft does not fit the data:\n  - " + "\n  - ".join(problems)
            + "\nUse a checkpoint trained for this target (and these layers), or extract hidden states with the "
              "checkpoint's layer ids (02_hidden_states aux_layer_ids).")


def aux_ids_misfits(ids: list[int] | None, field: str, offset: int, target: ServedTarget) -> list[Misfit]:
    """The aux layer ids a checkpoint's ``field`` holds (ours: each id plus ``offset``, ``eagle3nb.layers``) that
    the target has no layer for: vLLM reads the input of layer ``id + offset``, which exists for ours in
    [0, L-1]."""
    if ids is None:
        return []
    L = target.num_layers
    bad = [int(i) for i in ids if not 0 <= int(i) + offset < L]
    if not bad:
        return []
    return [(f"{field} {list(ids)}: {bad} name no layer of the {L}-layer target ({field} runs "
             f"{-offset}..{L - 1 - offset})",
             f"fix {field} in the draft's config.json, or serve the draft beside the target it was trained for")]


def vocab_misfits(target_hidden_size: int | None, vocab_size: int | None, draft_vocab_size: int | None,
                  d2t: torch.Tensor | None, target: ServedTarget) -> list[Misfit]:
    """A draft's sizes and ``d2t`` against the target's (what vLLM builds the fc input, the embedding and the head
    from, and maps draft ids to target ids by: ``target id = i + d2t[i]``); ``d2t`` None: the checkpoint has
    none, so its draft ids are target ids."""
    fix = "serve the draft beside the target it was trained for, or train one for this target (03_train)"
    out = []
    if target_hidden_size is not None and target_hidden_size != target.hidden_size:
        out.append((f"target_hidden_size {target_hidden_size} is not the target's hidden_size {target.hidden_size}",
                    fix))
    if vocab_size is not None and vocab_size != target.vocab_size:
        out.append((f"vocab_size {vocab_size} is not the target's vocab_size {target.vocab_size}", fix))
    if d2t is None:
        if draft_vocab_size is not None and draft_vocab_size != target.vocab_size:
            out.append((f"draft_vocab_size {draft_vocab_size} without a d2t map: vLLM reads draft ids as target ids "
                        f"of a {target.vocab_size}-token vocabulary",
                        "re-export the draft with its d2t (02's draft_vocab.safetensors), or set draft_vocab_size "
                        f"to {target.vocab_size}"))
        return out
    import torch

    if draft_vocab_size is not None and d2t.numel() != draft_vocab_size:
        out.append((f"d2t has {d2t.numel()} entries, draft_vocab_size is {draft_vocab_size}",
                    "re-export the draft with the d2t of its draft vocabulary (02's draft_vocab.safetensors)"))
    ids = torch.arange(d2t.numel()) + d2t.long()
    outside = (ids < 0) | (ids >= target.vocab_size)
    if outside.any():
        i = int(outside.nonzero()[0])
        out.append((f"d2t maps {int(outside.sum())} draft ids outside the target's {target.vocab_size} tokens "
                    f"(first: draft {i} -> target {int(ids[i])})", fix))
    return out


def read_tensor(path: Path, name: str) -> torch.Tensor | None:
    """One tensor of a checkpoint folder's safetensors files (``model.safetensors`` or shards), None when absent;
    reads only that tensor (a draft carrying the target's embedding holds GBs)."""
    from safetensors import safe_open

    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            if name in st.keys():
                return st.get_tensor(name)
    return None


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint folder: ``model.safetensors``, sharded safetensors, or ``pytorch_model.bin``."""
    import torch
    from safetensors.torch import load_file

    if (path / WEIGHTS_FILE).exists():
        return load_file(path / WEIGHTS_FILE)
    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        out: dict[str, torch.Tensor] = {}
        for f in files:
            out.update(load_file(path / f))
        return out
    if (path / "pytorch_model.bin").exists():
        return torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"{path}: no model.safetensors, model.safetensors.index.json or pytorch_model.bin; "
                            "point at the draft checkpoint folder")


def expected_acceptance(q, p):
    """Probability that rejection sampling accepts a token drawn from q when the target's distribution is p
    (both over the same tokens, last axis): sum_v min(p_v, q_v) = 1 - TV(p, q) when p sums to 1."""
    import torch

    return torch.minimum(q, p).sum(-1)
