"""The lost temperature of vLLM's CPU rejection sampler (to be written)."""


def install() -> None:
    """Placeholder until the fix lands."""
