"""The ten checks, one module per area: ``server`` (family, server, token stream, thinking), ``draft`` (layer
ids, shapes and vocab, serving, draft sanity), ``data`` (data health, disk); ``causes`` ranks their results. Each takes
the run's ``Context`` and returns one ``CheckResult``; raising ``Unavailable`` means "nothing to check yet"
(skip, with the reason). Thresholds are named constants at the top of each module so a reader can argue with
them."""

from __future__ import annotations

import traceback

from eagle3nb.doctor.checks.data import check_data_health, check_disk
from eagle3nb.doctor.checks.draft import check_draft_sanity, check_layer_ids, check_serving, check_shapes_vocab
from eagle3nb.doctor.checks.server import check_family, check_server, check_thinking, check_token_stream
from eagle3nb.doctor.context import Context, Unavailable
from eagle3nb.doctor.result import FAIL, SKIP, CheckResult
from eagle3nb.params import ParamsError

FUNCS = {
    "family": check_family, "server": check_server, "token_stream": check_token_stream, "thinking": check_thinking,
    "layer_ids": check_layer_ids, "shapes_vocab": check_shapes_vocab, "serving": check_serving,
    "data_health": check_data_health,
    "disk": check_disk,
}


def run_one(name: str, ctx: Context, prior: list[CheckResult]) -> CheckResult:
    """Run one check; a missing artifact is a skip, a crash is a fail that says it is the doctor's."""
    try:
        if name == "draft_sanity":
            return check_draft_sanity(ctx, prior)
        return FUNCS[name](ctx)
    except Unavailable as e:
        return CheckResult(name, SKIP, str(e), "")
    except ParamsError as e:  # e.g. api_key_env names an unset variable: the message says what to do
        return CheckResult(name, FAIL, str(e), "fix the parameter or environment variable named above")
    except Exception as e:  # noqa: BLE001 - one broken check must not hide the others
        return CheckResult(name, FAIL, f"the check could not run: {type(e).__name__}: {e}",
                           "fix the artifact named above (or report a doctor bug with details.traceback)",
                           {"traceback": traceback.format_exc()})

