"""The target's Hugging Face folder loaded one way everywhere: its tokenizer and weights with the run's
``trust_remote_code``, in the dtype and on the device decided here.

A folder can name Python files of its own in ``auto_map`` that transformers imports while loading it; that
code runs with the user's rights, so it runs only when the stage's params say ``trust_remote_code: true``.

Device and dtype (02 and 03's online source, 04, the embedded server and the doctor all load through here):

- ``compute_device()``: ``cuda`` when torch sees a GPU, else ``cpu``; where the draft, the target's head and
  a decoding target go.
- ``load_target(..., use=STATES)`` (02, 03's online source): forward passes whose states are stored. ``dtype``
  as the params ask, ``auto`` being bfloat16 on CUDA (what vLLM serves, so the states are those production
  computes, at half the memory) and float32 on CPU; on CUDA spread over every GPU (``device_map="auto"``,
  accelerate), since a forward pass needs nothing but its activations on the next layer's device.
- ``load_target(..., use=DECODER)`` (04's local decoding, the embedded server): float32 on one device, CPU or
  GPU alike. Their tokens are compared one for one with the target's own greedy decoding (04's lossless check,
  the server standing in for vLLM), which half-precision rounding breaks at near-ties, and their KV caches are
  indexed as one tensor per layer, which a model spread over several GPUs does not give.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from eagle3nb.errors import UserError

if TYPE_CHECKING:
    import torch

STATES, DECODER = "states", "decoder"


class RemoteCodeRequired(UserError, ValueError):
    """The folder loads only by running its own code, and trust_remote_code is off; the message says how."""


def from_pretrained(auto_class: Any, model_dir: str | Path, *, trust_remote_code: bool, **kwargs: Any) -> Any:
    """``auto_class.from_pretrained(model_dir, **kwargs)`` honouring ``trust_remote_code``; a folder that needs
    its own code while it is off raises RemoteCodeRequired naming the parameter, not transformers' argument."""
    try:
        return auto_class.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code, **kwargs)
    except ValueError as e:
        if trust_remote_code or "trust_remote_code" not in str(e):
            raise
        raise RemoteCodeRequired(
            f"{model_dir} loads only by running Python code shipped in that folder (its auto_map), and "
            f"trust_remote_code is false: if you trust that code, set trust_remote_code: true in the stage's "
            f"params (Kimi's tokenizer needs it)") from None


def compute_device() -> str:
    """``cuda`` when torch sees a GPU, else ``cpu``: where everything that is not spread goes."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def compute_dtype(name: str = "auto") -> "torch.dtype":
    """The torch dtype for a ``dtype`` parameter (``auto``: bfloat16 on CUDA, float32 on CPU)."""
    import torch

    if name == "auto":
        return torch.bfloat16 if compute_device() == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def load_tokenizer(model_dir: str | Path, *, trust_remote_code: bool) -> Any:
    """The target's tokenizer."""
    from transformers import AutoTokenizer

    return from_pretrained(AutoTokenizer, model_dir, trust_remote_code=trust_remote_code)


def load_target(model_dir: str | Path, *, trust_remote_code: bool, use: Literal["states", "decoder"],
                dtype: str = "auto") -> Any:
    """The target causal LM in eval mode, placed for its ``use`` (the module docstring): ``STATES`` in ``dtype``,
    spread over the GPUs; ``DECODER`` in float32 on ``compute_device()`` (``dtype`` is for ``STATES`` only)."""
    from transformers import AutoModelForCausalLM

    if use == DECODER:
        model = from_pretrained(AutoModelForCausalLM, model_dir, trust_remote_code=trust_remote_code,
                                dtype=compute_dtype("float32"))
        return model.to(compute_device()).eval()
    kw = {"device_map": "auto"} if compute_device() == "cuda" else {}
    return from_pretrained(AutoModelForCausalLM, model_dir, trust_remote_code=trust_remote_code,
                           dtype=compute_dtype(dtype), **kw).eval()
