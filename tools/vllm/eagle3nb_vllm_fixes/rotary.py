"""vLLM's CPU rotary kernel on strided 3-D views (to be written)."""


def install() -> None:
    """Placeholder until the fix lands."""
