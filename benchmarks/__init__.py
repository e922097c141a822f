"""The benchmarks: speed and acceptance ratios measured side by side (docs/benchmarks.md), one module each, run from
the repository root as ``python -m benchmarks.<name>``; ``python -m benchmarks`` (``make bench``) runs the quick
ones and names the long ones (``benchmarks/harness.py`` ``QUICK`` / ``LONG``). Not part of the library (not
installed)."""
