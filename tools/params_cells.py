"""Regenerate the notebooks' ``parameters`` cells from the stage schemas (``make params-cells``): the schema is
the one home of every default and help text; tests/test_params.py fails when a cell drifts from it."""

from eagle3nb.params_notebook import write_parameters_cells

if __name__ == "__main__":
    changed = write_parameters_cells()
    print("\n".join(f"rewrote {p}" for p in changed) or "parameters cells already match the schemas")
