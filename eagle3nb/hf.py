"""Loading the target's Hugging Face folder (tokenizer, weights) with the run's ``trust_remote_code``.

A folder can name Python files of its own in ``auto_map`` that transformers imports while loading it; that
code runs with the user's rights, so it runs only when the stage's params say ``trust_remote_code: true``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eagle3nb.errors import UserError


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
