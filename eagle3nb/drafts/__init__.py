"""Draft algorithms, one package each (the lead merges the registry keyed by the draft config's method)."""
