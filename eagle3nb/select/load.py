"""The user's load: the weight of each measured concurrency in the pick. Given (``weights``), equal, or from a
traffic log's arrival rate by Little's law: requests in flight = arrival rate x the time each spends in the server.
Both sides of that come from this run: the log's arrival times give the rate per window (``window_s``), and the
plain server's measured levels give the latency at each rate (a level of c requests in flight completes
requests_per_s = c / latency, so the rate a log brings is served at the c whose measured rate it equals,
interpolated between levels). Each window's requests weigh the two levels around its c, in proportion."""

from __future__ import annotations

import datetime as dt
import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

from eagle3nb.data.traffic import VLLM_BODY, log_files, log_lines
from eagle3nb.errors import InputError

# vLLM's log line stamp ("DEBUG 12-02 04:29:58"; its year is the log's, not written), and the keys a gateway's JSONL
# record may carry its arrival under (epoch seconds or ISO 8601)
VLLM_STAMP = re.compile(r"\b(\d\d)-(\d\d) (\d\d):(\d\d):(\d\d)(?:\.(\d+))?\b")
TIME_KEYS = ("timestamp", "time", "created", "arrival_time", "start_time", "received_at")


def _seconds(value: Any) -> float | None:
    """Epoch seconds (or milliseconds) as a number or an ISO 8601 string; None when neither."""
    if isinstance(value, (int, float)):
        return float(value) / (1000.0 if value > 1e11 else 1.0)
    if isinstance(value, str):
        try:
            return dt.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
        except ValueError:
            return None
    return None


def arrival(line: str, year: int = 2000) -> float | None:
    """When one request line of a log arrived, in seconds; None for a line that is no request or carries no time."""
    if m := VLLM_BODY.search(line):
        stamp = VLLM_STAMP.search(line[:m.start()])
        if not stamp:
            return None
        mo, d, h, mi, s, frac = stamp.groups()
        t = dt.datetime(year, int(mo), int(d), int(h), int(mi), int(s)).timestamp()
        return t + (float(f"0.{frac}") if frac else 0.0)
    try:
        record = json.loads(line)
    except ValueError:
        return None
    if not isinstance(record, dict):
        return None
    return next((t for key in TIME_KEYS if (t := _seconds(record.get(key))) is not None), None)


def arrivals(source: str | Path) -> list[float]:
    """The arrival times of every request of ``source`` (a log file or a folder, as 05 reads traffic), sorted."""
    times = [t for path in log_files(Path(source)) for line in log_lines(path) if (t := arrival(line)) is not None]
    if len(times) < 2 or times[-1] <= times[0]:
        raise InputError(f"traffic {source}: {len(times)} request(s) with an arrival time, too few for a rate; give a "
                         f"log whose lines carry one ({', '.join(TIME_KEYS)} in a JSONL record, or vLLM's request "
                         "log), or set weights")
    return sorted(times)


def concurrency_at(rate: float, plain: dict[int, float]) -> float:
    """The requests in flight at which the plain server completes ``rate`` requests/s (its measured levels:
    concurrency -> requests/s, interpolated; below the lowest level its c, above the highest its c)."""
    levels = sorted(plain)
    best, points = 0.0, []
    for c in levels:  # a rate that dips with more load (noise) is held at its best so far
        best = max(best, plain[c])
        points.append((best, c))
    if rate <= points[0][0]:
        return float(levels[0])
    for (r0, c0), (r1, c1) in zip(points, points[1:]):
        if r0 <= rate <= r1 and r1 > r0:
            return c0 + (rate - r0) / (r1 - r0) * (c1 - c0)
    return float(levels[-1])


def spread(c: float, levels: list[int]) -> dict[int, float]:
    """A load of ``c`` as weights on the two measured levels around it (in proportion to nearness)."""
    if c <= levels[0]:
        return {levels[0]: 1.0}
    for lo, hi in zip(levels, levels[1:]):
        if lo <= c <= hi:
            return {lo: (hi - c) / (hi - lo), hi: (c - lo) / (hi - lo)}
    return {levels[-1]: 1.0}


def traffic_weights(times: list[float], window_s: float, plain: dict[int, float]) -> tuple[dict[int, float], dict]:
    """Each measured level's share of the log's requests, each window's requests at the c its rate is served at
    (Little's law on the plain server's measured levels); and what was read (requests, seconds, mean rate, mean
    c)."""
    levels = sorted(plain)
    windows = Counter(int((t - times[0]) // window_s) for t in times)
    weights: Counter = Counter()
    in_flight = 0.0
    for n in windows.values():
        c = concurrency_at(n / window_s, plain)
        in_flight += n * c
        for level, share in spread(c, levels).items():
            weights[level] += n * share
    total = sum(windows.values())
    seconds = times[-1] - times[0]
    return ({c: weights[c] / total for c in levels},
            {"requests": total, "seconds": seconds, "rate_per_s": total / seconds, "window_s": window_s,
             "mean_concurrency": in_flight / total})


def load_weights(P, plain: dict[int, float]) -> tuple[dict[int, float], str, dict | None]:
    """The weight of each concurrency in the pick, how they were made (a line for the report), and the traffic's
    figures when a log made them. ``plain``: the plain server's requests/s at each level (the mean of its
    measurements)."""
    if P.weights is not None:
        total = sum(P.weights)
        return {c: w / total for c, w in zip(P.concurrencies, P.weights)}, "the weights given", None
    if not P.traffic:
        return {c: 1 / len(P.concurrencies) for c in P.concurrencies}, "equal weights", None
    weights, info = traffic_weights(arrivals(P.traffic), P.window_s, plain)
    how = (f"traffic {P.traffic}: {info['requests']} requests over {info['seconds']:.0f} s ({info['rate_per_s']:.3g} "
           f"req/s); by Little's law (in flight = arrival rate x latency, the latency the plain server gives at that "
           f"rate, per {P.window_s:g} s window) about {info['mean_concurrency']:.2f} requests in flight on average")
    return weights, how, info
