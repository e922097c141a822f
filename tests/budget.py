"""The suite's measured budget (a pytest plugin tests/conftest.py loads): wall time per module and per shared
fixture, printed at the end of every run and written beside pytest's cache, so a module that grows shows up in
the table instead of in CI's clock.

A shared (module- or session-scoped) fixture's set-up and teardown are timed apart and charged to the fixture, not
to the test that happened to request it first: a vLLM server, a trained run or a toy build is one row of its own.
A module's time is every phase of its tests (set-up, call, teardown) less the shared fixtures' time inside them.
Fixtures that request other shared fixtures are charged their own time only (the inner ones are their own rows).
The file: ``$EAGLE3NB_TEST_BUDGET`` if set, else ``.pytest_cache/budget.md`` under the rootdir. Under pytest-xdist
each worker times what it runs and the controller prints the merged table.
"""

from __future__ import annotations

import os
import platform
import time
from collections import Counter, defaultdict
from pathlib import Path

import pytest

BUDGET_ENV = "EAGLE3NB_TEST_BUDGET"
FIXTURE_MIN_S = 1.0  # shared fixtures below this are summed into one row: the table lists what costs


def machine() -> str:
    """The CPU model, its core count and the load when the run ended (two shared cores make every row slower)."""
    model = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        model = next((line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                      if line.startswith("model name")), model)
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"
    return f"{model}, {os.cpu_count()} cores, load average {load}"


class Budget:
    """Collects the times; ``table()`` renders them as markdown (the form docs/testing.md keeps)."""

    def __init__(self, config: pytest.Config):
        self.config = config
        self.start = time.perf_counter()
        self.modules: dict[str, float] = defaultdict(float)
        self.tests: dict[str, set[str]] = defaultdict(set)
        self.tiers: dict[str, Counter] = defaultdict(Counter)
        self.fixtures: dict[str, float] = defaultdict(float)
        self.charged = 0.0  # shared-fixture seconds so far (each test phase subtracts what fell inside it)
        self.seen = 0.0
        self.stack: list[float] = []  # inner shared-fixture seconds of each set-up under way
        self.workers = 0  # pytest-xdist workers whose times were merged (0: one process ran everything)

    @staticmethod
    def key(fixturedef: pytest.FixtureDef, request: pytest.FixtureRequest) -> str:
        """``name`` for a session fixture, ``module::name`` for one set up per module (each its own row)."""
        if fixturedef.scope == "session":
            return fixturedef.argname
        return f"{request.node.nodeid.split('::')[0].rsplit('/', 1)[-1]}::{fixturedef.argname}"

    def charge(self, key: str, took: float) -> None:
        self.fixtures[key] += took
        self.charged += took

    @pytest.hookimpl(wrapper=True)
    def pytest_fixture_setup(self, fixturedef: pytest.FixtureDef, request: pytest.FixtureRequest):
        if fixturedef.scope == "function":
            return (yield)
        key = self.key(fixturedef, request)
        began: list[float] = []

        def torn_down() -> None:
            if began:
                self.charge(key, time.perf_counter() - began.pop())

        # finalizers run last-in first-out: this one after the fixture's own teardown, the one added below before it
        fixturedef.addfinalizer(torn_down)
        self.stack.append(0.0)
        t0 = time.perf_counter()
        try:
            return (yield)
        finally:
            took = time.perf_counter() - t0
            inner = self.stack.pop()
            if self.stack:
                self.stack[-1] += took
            self.charge(key, took - inner)
            fixturedef.addfinalizer(lambda: began.append(time.perf_counter()))

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        for item in items:
            module = item.nodeid.split("::")[0]
            self.tiers[module].update(m for m in ("engine", "browser", "slow", "gpu") if item.get_closest_marker(m))

    @property
    def controller(self) -> bool:
        """Under pytest-xdist, the process that runs no test: the workers time, it merges their tables."""
        return not hasattr(self.config, "workerinput") and bool(getattr(self.config.option, "numprocesses", None))

    def pytest_sessionfinish(self) -> None:
        if hasattr(self.config, "workerinput"):  # a worker hands its times to the controller
            self.config.workeroutput["eagle3nb_budget"] = {
                "modules": dict(self.modules), "fixtures": dict(self.fixtures), "charged": self.charged,
                "tests": {m: sorted(t) for m, t in self.tests.items()},
                "tiers": {m: dict(c) for m, c in self.tiers.items()}}

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node, error) -> None:
        """A worker's times joined to the controller's table (modules and fixtures are each timed in the worker
        that ran them; a session fixture two workers set up is charged twice, as it costs twice)."""
        got = getattr(node, "workeroutput", {}).get("eagle3nb_budget")
        if not got:
            return
        for m, s in got["modules"].items():
            self.modules[m] += s
        for k, s in got["fixtures"].items():
            self.fixtures[k] += s
        self.charged += got["charged"]
        for m, t in got["tests"].items():
            self.tests[m].update(t)
        for m, c in got["tiers"].items():
            self.tiers[m] = Counter(c)
        self.workers += 1

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if self.controller:
            return
        module = report.nodeid.split("::")[0]
        self.modules[module] += report.duration - (self.charged - self.seen)
        self.seen = self.charged
        self.tests[module].add(report.nodeid)

    def tier(self, module: str) -> str:
        """``fast``, or how many of the module's collected tests each tier holds (``slow 3, engine 2``)."""
        return ", ".join(f"{t} {n}" for t, n in sorted(self.tiers[module].items())) or "fast"

    def table(self) -> str:
        wall = time.perf_counter() - self.start
        rows = [f"pytest {' '.join(self.config.invocation_params.args) or '(all)'}: {wall:.0f} s wall "
                f"on {machine()}", "", "| seconds | module | tests | tier |", "|---:|---|---:|---|"]
        rows += [f"| {s:.1f} | {m} | {len(self.tests[m])} | {self.tier(m)} |"
                 for m, s in sorted(self.modules.items(), key=lambda kv: -kv[1])]
        big = {k: s for k, s in self.fixtures.items() if s >= FIXTURE_MIN_S}
        rows += ["", "| seconds | shared fixture (set-up + teardown) |", "|---:|---|"]
        rows += [f"| {s:.1f} | {k} |" for k, s in sorted(big.items(), key=lambda kv: -kv[1])]
        rest = [s for k, s in self.fixtures.items() if k not in big]
        rows.append(f"| {sum(rest):.1f} | {len(rest)} more, each under {FIXTURE_MIN_S:.0f} s |")
        side = (f" in {self.workers} worker processes side by side (their seconds add up past the wall)"
                if self.workers else " (collection and start-up are the rest)")
        rows += ["", f"modules {sum(self.modules.values()):.0f} s + shared fixtures {self.charged:.0f} s; "
                     f"wall {wall:.0f} s{side}"]
        return "\n".join(rows) + "\n"

    def path(self) -> Path:
        return Path(os.environ.get(BUDGET_ENV) or self.config.rootpath / ".pytest_cache" / "budget.md")

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.modules:
            return
        text, path = self.table(), self.path()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        terminalreporter.section("budget: wall time per module and shared fixture")
        terminalreporter.write(text)
        terminalreporter.write_line(f"(written to {path})")


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(Budget(config), "eagle3nb-budget")
