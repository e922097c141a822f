"""Reading stored hidden states for training: ours, and the per-sample files vLLM/speculators write.

``HiddenStates(data_dir)`` opens our format (``index.json`` + shards). Pointed at a folder of vLLM
``extract_hidden_states`` / speculators files instead (``*.safetensors`` with ``token_ids [T]`` and
``hidden_states [T, n, H]``, the last state being layer ``L`` before the final norm), it returns a
:class:`VllmSampleStates`, which exposes the same interface; it needs ``model_path`` for the target's norm and
head, and a draft vocabulary (``draft_vocab.safetensors`` in the folder, or ``draft_vocab_size`` to build one).
Those files carry no loss mask: every position counts unless a file has a ``loss_mask`` tensor.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from eagle3nb.data.head import read_head_tensors, rms_norm, target_info
from eagle3nb.data.shards import ShardError, check_shard, decode
from eagle3nb.data.vocab import VOCAB_FILE, build_draft_vocab, draft_target_ids, load_draft_vocab
from eagle3nb.errors import InputError
from eagle3nb.paths import file_sha256
from eagle3nb.toy import resolve_model_path

if TYPE_CHECKING:
    import torch

INDEX_FILE = "index.json"
HEAD_FILE = "target_head.safetensors"
FIELDS = {"fp32": ("input_ids", "loss_mask", "aux", "final"), "bf16": ("input_ids", "loss_mask", "aux", "final"),
          "fp8": ("input_ids", "loss_mask", "aux", "aux_scale", "final", "final_scale"),
          "topk": ("input_ids", "loss_mask", "aux", "aux_scale", "topk_ids", "topk_logp", "argmax")}


class HiddenStates:
    """Stage 02's output: ``len``, ``[i]`` -> ``{"id", "input_ids" int64 [T], "loss_mask" int64 [T], "aux" float32
    [T, 3H], "category"}`` (plus the stored loss-target fields that :meth:`target_probs` reads), ``.meta`` (the
    index), ``.d2t``, ``.t2d``, ``.embed_tokens()``, ``.lm_head()``."""

    def __new__(cls, data_dir, **kwargs):
        if cls is HiddenStates and not (Path(data_dir) / INDEX_FILE).exists():
            return super().__new__(VllmSampleStates)
        return super().__new__(cls)

    def __init__(self, data_dir: str | Path, **kwargs):
        self.dir = Path(data_dir)
        path = self.dir / INDEX_FILE
        self.meta: dict = json.loads(path.read_text())
        if not self.meta.get("format", "").startswith("eagle3nb-hidden"):
            raise InputError(f"{path} is not an eagle3nb hidden-states index")
        self.storage = self.meta["storage"]
        self.samples = self.meta["samples"]
        self._shards = {s["file"]: s for s in self.meta["shards"]}
        for s in self.meta["shards"]:
            try:
                check_shard(self.dir / s["file"], s["bytes"])
            except ShardError as e:
                raise ShardError(f"{e}: rerun 02_hidden_states (it redoes damaged shards) before training") from None
        self.d2t, self.t2d = load_draft_vocab(self.dir / VOCAB_FILE)
        self._open: dict = {}
        self._head: dict | None = None
        self._rows: "torch.Tensor | None" = None

    def __len__(self) -> int:
        return len(self.samples)

    def _file(self, name: str):
        from safetensors import safe_open

        if name not in self._open:
            self._open[name] = safe_open(str(self.dir / name), "pt")
        return self._open[name]

    def __getitem__(self, i: int) -> dict:
        s = self.samples[i]
        f = self._file(s["shard"])
        try:
            raw = {k: f.get_tensor(f"{s['index']}.{k}") for k in FIELDS[self.storage]}
        except Exception as e:  # a damaged file surfaces here as a safetensors error
            raise ShardError(f"{self.dir / s['shard']}: cannot read sample {s['id']} ({e}); "
                             "rerun 02_hidden_states") from None
        return {"id": s["id"], "input_ids": raw["input_ids"].long(), "loss_mask": raw["loss_mask"].long(),
                "category": s.get("category"), **decode(raw, self.storage)}

    def verify(self) -> None:
        """Re-hash every shard against the index (slow on big runs; the size check at open is always done)."""
        for s in self.meta["shards"]:
            if file_sha256(self.dir / s["file"]) != s["sha256"]:
                raise ShardError(f"{self.dir / s['file']}: sha256 differs from the index; rerun 02_hidden_states")

    # ------------------------------------------------------------------ the target's head and the loss target

    def _head_tensors(self) -> dict:
        if self._head is None:
            from safetensors.torch import load_file

            self._head = load_file(str(self.dir / HEAD_FILE))
        return self._head

    def embed_tokens(self) -> "torch.Tensor":
        """The target's input embedding [V, H] (frozen in the draft)."""
        return self._head_tensors()["embed_tokens.weight"]

    def lm_head(self) -> "torch.Tensor":
        """The target's output head [V, H]."""
        return self._head_tensors()["lm_head.weight"]

    def _draft_rows(self) -> "torch.Tensor":
        if self._rows is None:
            self._rows = self.lm_head().float()[draft_target_ids(self.d2t)]
        return self._rows

    def target_probs(self, item: dict, temperature: float = 1.0) -> "torch.Tensor":
        """float32 [T, draft_vocab]: the target's distribution of the *next* token at each position (position t
        predicts token t+1), restricted to the draft vocabulary and renormalised."""
        import torch

        if temperature <= 0:
            raise ValueError("temperature must be > 0")
        if "final" in item:
            return torch.softmax(item["final"].float() @ self._draft_rows().T / temperature, dim=-1)
        out = torch.zeros(item["topk_ids"].shape[0], self.d2t.shape[0])
        return out.scatter_(1, item["topk_ids"], torch.softmax(item["topk_logp"] / temperature, dim=-1))

    def target_argmax(self, item: dict) -> "torch.Tensor":
        """int64 [T]: the target's greedy next token (target-vocabulary id) at each position."""
        import torch

        if "argmax" in item:
            return item["argmax"]
        head = self.lm_head().float()
        final = item["final"].float()
        return torch.cat([(final[s:s + 1024] @ head.T).argmax(-1) for s in range(0, final.shape[0], 1024)])


class VllmSampleStates(HiddenStates):
    """The same interface over a folder of vLLM ``extract_hidden_states`` / speculators per-sample files."""

    def __init__(self, data_dir: str | Path, model_path: str | Path | None = None, draft_vocab_size: int | None = None,
                 layer_ids: list[int] | None = None):
        from safetensors import safe_open

        self.dir = Path(data_dir)
        self.files = sorted(p for p in self.dir.glob("*.safetensors") if p.name not in (VOCAB_FILE, HEAD_FILE))
        if not self.files:
            raise FileNotFoundError(f"{self.dir}: neither {INDEX_FILE} (02_hidden_states output) nor per-sample "
                                    "*.safetensors files (vLLM/speculators output)")
        if model_path is None:
            raise InputError(f"{self.dir} holds vLLM/speculators per-sample files: pass model_path=<the target's "
                             "folder> to read its final norm and head")
        model_dir = resolve_model_path(str(model_path))
        info = target_info(model_dir)
        self._head = read_head_tensors(model_dir)
        self._eps = info["rms_norm_eps"]
        with safe_open(str(self.files[0]), "pt") as f:
            keys = set(f.keys())
            n_states = f.get_slice("hidden_states").get_shape()[1]
        if not {"token_ids", "hidden_states"} <= keys:
            raise InputError(f"{self.files[0]}: expected token_ids and hidden_states tensors, found {sorted(keys)}")
        self.storage = "vllm"
        self._has_mask = "loss_mask" in keys
        if (self.dir / VOCAB_FILE).exists():
            self.d2t, self.t2d = load_draft_vocab(self.dir / VOCAB_FILE)
        elif draft_vocab_size:
            self.d2t, self.t2d = self._vocab(info["vocab_size"], draft_vocab_size)
        else:
            raise InputError(f"{self.dir} has no {VOCAB_FILE}: pass draft_vocab_size to build one from these files")
        self.samples = [{"id": p.stem, "file": p.name} for p in self.files]
        self.meta = {"format": "vllm-per-sample", "storage": "vllm", "num_layers": info["num_layers"],
                     "hidden_size": info["hidden_size"], "vocab_size": info["vocab_size"],
                     "layer_ids": layer_ids, "num_aux": n_states - 1, "model_path": str(model_dir),
                     "model_fingerprint": info["fingerprint"],
                     "loss_mask": "from the files" if self._has_mask else "all ones: the files carry no loss mask",
                     "samples": self.samples}
        self._open, self._rows = {}, None

    def _vocab(self, vocab_size: int, draft_vocab_size: int):
        from safetensors import safe_open

        rows = []
        for p in self.files:
            with safe_open(str(p), "pt") as f:
                ids = f.get_tensor("token_ids").tolist()
                mask = f.get_tensor("loss_mask").tolist() if self._has_mask else [1] * len(ids)
            rows.append({"id": p.stem, "input_ids": ids, "loss_mask": mask})
        v = build_draft_vocab(rows, vocab_size, draft_vocab_size)
        return v["d2t"], v["t2d"]

    def __getitem__(self, i: int) -> dict:
        import torch

        s = self.samples[i]
        f = self._file(s["file"])
        ids = f.get_tensor("token_ids").long()
        hs = f.get_tensor("hidden_states")
        mask = f.get_tensor("loss_mask").long() if self._has_mask else torch.ones_like(ids)
        final = rms_norm(hs[:, -1], self._head["norm.weight"].to(hs.dtype), self._eps)
        return {"id": s["id"], "input_ids": ids, "loss_mask": mask, "category": None,
                "aux": hs[:, :-1].float().flatten(1), "final": final.float()}

    def verify(self) -> None:
        """Every file readable, with matching token and state counts."""
        for i in range(len(self)):
            item = self[i]
            if item["aux"].shape[0] != item["input_ids"].shape[0]:
                raise ShardError(f"{self.files[i]}: hidden_states and token_ids disagree in length")
