"""01_synth: ask the target to answer prompts, keep its reasoning, and build the exact training token stream.

Light to import (the CLI and ``eagle3nb status`` import it for the schema): the openai client, numpy, torch
and transformers load only when a run, a probe or a plot starts.
"""

from eagle3nb.synth.params import STAGE, SynthParams
from eagle3nb.synth.report import figures
from eagle3nb.synth.runner import SynthError, probe, run
from eagle3nb.synth.store import load_samples

__all__ = ["STAGE", "SynthParams", "SynthError", "load_samples", "run", "probe", "figures"]
