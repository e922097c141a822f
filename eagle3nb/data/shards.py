"""How hidden states are laid out on disk: per-storage encoding, the bytes each costs, and safe shard files.

A shard is one safetensors file holding whole samples; sample ``j`` of a shard owns the tensors
``{j}.input_ids`` (int32 [T]), ``{j}.loss_mask`` (uint8 [T]) and, by ``storage``:

- ``fp32`` / ``bf16``: ``{j}.aux`` [T, nH] (the aux states concatenated low..high) and ``{j}.final`` [T, H]
  (the final *normed* state) in that dtype;
- ``fp8``: the same two in float8 e4m3 plus ``{j}.aux_scale`` float32 [T, n] and ``{j}.final_scale``
  float32 [T, 1] (one scale per token per state: value = fp8 * scale);
- ``topk``: fp8 ``aux`` + ``aux_scale``, and instead of the final state the target's top-k log-probabilities
  over the draft vocabulary (``{j}.topk_ids`` draft ids int16/int32 [T, k], ``{j}.topk_logp`` float16
  [T, k]) plus ``{j}.argmax`` int32 [T], the target's full-vocabulary argmax.

Files are written to a temporary name, fsynced and renamed, and their sha256 is recorded in the index, so
a shard is either complete and verifiable or absent.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path
from typing import TYPE_CHECKING

from eagle3nb.params import StageError
from eagle3nb.paths import file_sha256

if TYPE_CHECKING:
    import torch

FORMAT = "eagle3nb-hidden-v1"
STORAGES = ("fp32", "bf16", "fp8", "topk")
FP8_MAX = 448.0  # largest finite float8 e4m3fn value
TOKEN_BYTES = 4 + 1  # input_ids int32 + loss_mask uint8, stored with every layout


class ShardError(StageError):
    """A shard file that is missing, truncated or corrupt."""


def shard_name(i: int) -> str:
    return f"shard-{i:05d}.safetensors"


def draft_id_bytes(draft_vocab_size: int) -> int:
    return 2 if draft_vocab_size <= 32767 else 4


def bytes_per_token(storage: str, hidden_size: int, num_aux: int = 3, topk: int = 32,
                    draft_vocab_size: int = 32000) -> int:
    """Bytes one token costs in a shard with this storage (the exact tensor payload, ids and mask included)."""
    h = hidden_size
    if storage == "fp32":
        return (num_aux + 1) * h * 4 + TOKEN_BYTES
    if storage == "bf16":
        return (num_aux + 1) * h * 2 + TOKEN_BYTES
    if storage == "fp8":
        return (num_aux + 1) * (h + 4) + TOKEN_BYTES
    if storage == "topk":
        return num_aux * (h + 4) + topk * (draft_id_bytes(draft_vocab_size) + 2) + 4 + TOKEN_BYTES
    raise ValueError(f"unknown storage {storage!r}: use one of {', '.join(STORAGES)}")


def quantize_fp8(x: "torch.Tensor") -> tuple["torch.Tensor", "torch.Tensor"]:
    """Per-row (last dim) float8 e4m3 with a float32 scale: ``x ~= q.float() * scale``."""
    import torch

    x = x.float()
    scale = (x.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_min(1e-12)
    return (x / scale).to(torch.float8_e4m3fn), scale


def dequantize_fp8(q: "torch.Tensor", scale: "torch.Tensor") -> "torch.Tensor":
    return q.float() * scale.float()


def encode(aux: "torch.Tensor", final: "torch.Tensor", storage: str, head=None, topk: int = 32,
           ) -> dict[str, "torch.Tensor"]:
    """Stored tensors for a batch: ``aux`` [..., n, H] and the normed ``final`` [..., H] -> name -> tensor
    (leading dims kept, on the input's device). ``topk`` needs ``head`` (a :class:`TargetHead`)."""
    import torch

    flat = aux.flatten(-2)
    if storage in ("fp32", "bf16"):
        dt = torch.float32 if storage == "fp32" else torch.bfloat16
        return {"aux": flat.to(dt), "final": final.to(dt)}
    q, s = quantize_fp8(aux)
    out = {"aux": q.flatten(-2), "aux_scale": s.squeeze(-1)}
    if storage == "fp8":
        qf, sf = quantize_fp8(final)
        return {**out, "final": qf, "final_scale": sf}
    if storage == "topk":
        if head is None:
            raise ValueError("storage 'topk' needs the target head to compute the draft-vocab distribution")
        logits_d, argmax = head.draft_logits_and_argmax(final)
        logp = torch.log_softmax(logits_d, dim=-1)
        k = min(topk, logp.shape[-1])
        vals, ids = logp.topk(k, dim=-1)
        id_dtype = torch.int16 if draft_id_bytes(logp.shape[-1]) == 2 else torch.int32
        return {**out, "topk_ids": ids.to(id_dtype), "topk_logp": vals.to(torch.float16),
                "argmax": argmax.to(torch.int32)}
    raise ValueError(f"unknown storage {storage!r}: use one of {', '.join(STORAGES)}")


def decode(tensors: dict[str, "torch.Tensor"], storage: str) -> dict[str, "torch.Tensor"]:
    """Stored tensors of one sample -> ``aux`` float32 [T, nH] and either ``final`` float32 [T, H] or the
    top-k fields (``topk_ids`` int64, ``topk_logp`` float32, ``argmax`` int64)."""
    import torch

    if storage in ("fp32", "bf16"):
        return {"aux": tensors["aux"].float(), "final": tensors["final"].float()}
    scale = tensors["aux_scale"].float()
    n = scale.shape[-1]
    aux = dequantize_fp8(tensors["aux"].unflatten(-1, (n, -1)), scale.unsqueeze(-1)).flatten(-2)
    if storage == "fp8":
        return {"aux": aux, "final": dequantize_fp8(tensors["final"], tensors["final_scale"])}
    return {"aux": aux, "topk_ids": tensors["topk_ids"].to(torch.int64), "topk_logp": tensors["topk_logp"].float(),
            "argmax": tensors["argmax"].to(torch.int64)}


def write_shard(path: Path, tensors: dict[str, "torch.Tensor"]) -> dict:
    """Write a shard atomically (temp name, fsync, rename); return ``{"file", "bytes", "sha256"}``. The only
    metadata is the format name: safetensors writes a metadata map in a random key order, and equal data
    must give equal bytes (a resumed run is checked against its hashes)."""
    from safetensors.torch import save

    data = save({k: v.contiguous() for k, v in tensors.items()}, metadata={"format": FORMAT})
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return {"file": path.name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def check_shard(path: Path, expect_bytes: int | None = None, expect_sha256: str | None = None) -> None:
    """Raise :class:`ShardError` unless ``path`` is a whole safetensors file of the recorded size (and hash)."""
    if not path.exists():
        raise ShardError(f"{path} is missing")
    size = path.stat().st_size
    if expect_bytes is not None and size != expect_bytes:
        raise ShardError(f"{path} has {size} bytes, the index says {expect_bytes} (truncated or overwritten)")
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    except (struct.error, ValueError, KeyError, TypeError) as e:
        raise ShardError(f"{path}: unreadable safetensors header ({e})") from None
    if 8 + n + end != size:
        raise ShardError(f"{path}: header describes {8 + n + end} bytes but the file has {size} (truncated)")
    if expect_sha256 is not None and file_sha256(path) != expect_sha256:
        raise ShardError(f"{path}: sha256 differs from the index (corrupt)")
