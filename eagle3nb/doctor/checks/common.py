"""What every check shares: the engines' names, how problems become one result, the target's family."""

from __future__ import annotations

from eagle3nb.doctor.context import Context, Unavailable
from eagle3nb.doctor.result import FAIL, PASS, WARN, CheckResult
from eagle3nb.families import Family, FamilyError

ENGINES = {"vllm": "vLLM", "sglang": "SGLang"}


def worst_of(name: str, problems: list[tuple[str, str, str]], measured: str, details: dict) -> CheckResult:
    """Worst of ``problems`` ((status, what, fix) triples) or a pass with ``measured``."""
    fails = [p for p in problems if p[0] == FAIL]
    worst = fails or problems
    if not worst:
        return CheckResult(name, PASS, measured, "", details)
    status = FAIL if fails else WARN
    what = "; ".join(p[1] for p in worst)
    fix = "; ".join(dict.fromkeys(p[2] for p in worst if p[2]))
    return CheckResult(name, status, f"{what} ({measured})" if measured else what, fix, details)



def no_parser_fix(family: Family) -> str:
    return (f"start the server with the {family.name} family's reasoning parser: vLLM {family.parser_flag('vllm')}, "
            f"SGLang {family.parser_flag('sglang')} (docs/families.md); then re-run the doctor")


def target_family(ctx: Context) -> Family:
    """The target's family, or the fix when it cannot be told."""
    try:
        return ctx.family
    except FamilyError as e:
        raise Unavailable(str(e)) from None

