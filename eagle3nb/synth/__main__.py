"""``python -m eagle3nb.synth PARAMS [key=value ...]``: run 01_synth without a notebook.

PARAMS is a YAML file (``params/demo/01_synth.yaml``) or a run folder (``params/demo/``); ``key=value``
pairs override it (values parsed as YAML). Exit code 130 after a clean stop (Ctrl-C / SIGTERM).
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

from eagle3nb.params import ParamsError, from_dict, load_yaml, run_params
from eagle3nb.synth.params import STAGE
from eagle3nb.synth.runner import SynthError, run


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    src = Path(argv[0])
    try:
        if not src.exists():
            raise ParamsError(f"{src} does not exist; pass params/<run>/01_synth.yaml or params/<run>/")
        if src.is_dir():
            values = run_params(src, STAGE)
        else:
            values = {"run_name": src.parent.name, **load_yaml(src), "params_file": str(src)}
        for pair in argv[1:]:
            key, sep, value = pair.partition("=")
            if not sep:
                raise ParamsError(f"override {pair!r} is not key=value")
            values[key] = yaml.safe_load(value)
        P = from_dict(STAGE, values)
        run(P)
    except (ParamsError, SynthError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        print(e or "01_synth stopped", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
