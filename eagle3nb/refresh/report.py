"""05's report: the verdict first, then where the current draft was weak, what the refresh trained on, and the gate's
per-group table before and after (read from ``metrics.json``)."""

from __future__ import annotations

from typing import Any


def verdict_lines(metrics: dict[str, Any]) -> list[str]:
    """Three lines: what was measured, whether the refresh pays, what to do next."""
    gate, t = metrics["gate"], metrics["traffic"]
    groups = gate["groups"]
    lines = [f"measured: the current draft and {len(metrics['gate']['groups'])} group(s) of served traffic "
             f"({t['requests']} requests read, {t['heldout']} held out), before and after a refresh on "
             f"{sum(metrics['refresh_data']['traffic'].values())} on-policy requests + "
             f"{metrics['refresh_data']['replayed']} replayed samples"]
    if gate["ship"]:
        best = max((g for g in groups if g["change"] is not None), key=lambda g: g["change"])
        lines.append(f"pays: traffic-weighted speedup {gate['speedup_before']:.3f}x -> {gate['speedup_after']:.3f}x "
                     f"(lower bound of the gain {gate['gain_lower']:+.3f}x), {best['name']} {best['before']:.2f} -> "
                     f"{best['after']:.2f}, no group significantly down")
        lines.append(f"next: serve {metrics['draft']} (the current draft is untouched at {metrics['current_draft']})")
    else:
        lines.append(f"does not pay: {gate['reason']}")
        lines.append("next: keep the current draft; widen replay or the budget of the weak group, then refresh again")
    return lines


def gate_table(metrics: dict[str, Any]):
    """Per group of the traffic (every one read, those with no held-out request left after de-duplication
    included), on its judging requests: share of all traffic, how many, acceptance length before and after (the
    chosen seed), the change, its standard error and one-sided upper bound, the status (held, fell, not judged) and
    why a group is not judged."""
    import pandas as pd

    rows = [{"group": g["name"], "share": g["share"], "judged on": g["requests"], "before": g["before"],
             "after": g["after"], "change": g["change"], "se": g["se"], "upper bound": g["upper"],
             "status": g["status"], "why not judged": g.get("why") or ""} for g in metrics["gate"]["groups"]]
    return pd.DataFrame(rows).set_index("group").round(3)


def served_table(metrics: dict[str, Any]):
    """The served A/B (``served_ab: vllm``): per draft, vLLM's own acceptance on the weakest group's held-out
    requests; None when it was not asked for."""
    import pandas as pd

    ab = metrics.get("served_ab")
    if not ab:
        return None
    rows = {name: v for name, v in ab.items() if isinstance(v, dict)}
    return pd.DataFrame.from_dict(rows, orient="index").rename_axis(f"{ab['group']} ({ab['requests']} requests)")


def opd_table(metrics: dict[str, Any]):
    """With ``opd_steps``: per held-out group, the refreshed drafts' acceptance length without on-policy
    distillation and with it (mean over seeds), and the traffic-weighted speedup of each; None when not run."""
    import pandas as pd

    opd = metrics.get("opd")
    if not opd:
        return None
    rows = {side: {**opd[side]["groups"], "speedup": opd[side]["speedup"]} for side in ("without", "with")}
    return pd.DataFrame.from_dict(rows, orient="index").rename_axis(f"on-policy distillation ({opd['steps']} steps)"
                                                                    ).round(3)


def weak_table(metrics: dict[str, Any]):
    """The current draft's groups, the one losing the most speedup first (the offline column when measured)."""
    import pandas as pd

    return pd.DataFrame(metrics["weak"]).set_index("group").dropna(axis=1, how="all")


def plot_gate(metrics: dict[str, Any]):
    """Acceptance length per judged group before and after (the chosen seed, on the judging requests), the after
    bar with the change's standard error as an error bar."""
    import matplotlib.pyplot as plt

    groups = [g for g in metrics["gate"]["groups"] if g["status"] != "not judged"]
    x = range(len(groups))
    fig, ax = plt.subplots(figsize=(max(4.0, 1.2 * len(groups) + 2), 3.2))
    ax.bar([i - 0.2 for i in x], [g["before"] for g in groups], 0.4, label="current draft")
    ax.bar([i + 0.2 for i in x], [g["after"] for g in groups], 0.4, yerr=[g["se"] for g in groups], capsize=3,
           label="refreshed (chosen seed, standard error)")
    ax.set_xticks(list(x), [f"{g['name']}\n{g['share']:.0%}" for g in groups])
    ax.set_ylabel("acceptance length")
    ax.set_title("held-out traffic by group (share of traffic)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.tight_layout()
    return fig
