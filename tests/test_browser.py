"""The notebooks and reports in a real browser: headless Chromium (Debian's chromium through its chromedriver, driven
by Selenium). JupyterLab as users open it: the 01 notebook opened in `jupyter lab`, run through its menu, its outputs
drawn and its sample browser answering a filter through the kernel. The rendered report as it travels: the HTML
`eagle3nb run` writes, opened with the network off, its widgets drawn by the inlined manager and a filter changing
the listed samples with no kernel. Both run 01 on a copy of the `trained` run's finished 01 folder (nothing left to
ask the server but the probe), so the notebook only reads it."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

from worlds import under_ci, write_run

ROOT = Path(__file__).resolve().parents[1]
JUPYTER = Path(sys.executable).with_name("jupyter")
TOKEN = "eagle3nb-browser-test"
WAIT_S = 240  # the longest wait for a page (01 run through JupyterLab: ~50 s on two shared cores)


def _chromium() -> tuple[str | None, str | None]:
    """(browser, driver) on PATH, either None when missing."""
    browser = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
    return browser, shutil.which("chromedriver")


def unavailable_reason() -> str | None:
    browser, driver = _chromium()
    if browser is None or driver is None:
        return "headless Chromium is not installed (`make chromium` installs Debian's chromium and chromium-driver)"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install -e '.[dev]')"
    return None


REASON = unavailable_reason()
if REASON and under_ci():
    raise RuntimeError(f"CI must run the browser tests, but: {REASON}")
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")


@contextmanager
def chrome(offline: bool = False) -> Iterator:
    """A headless Chromium; ``offline``: every host unresolvable and the network emulated off (DevTools)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    browser, driver = _chromium()
    opts = webdriver.ChromeOptions()
    opts.binary_location = browser
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1000"):
        opts.add_argument(arg)
    if offline:
        opts.add_argument("--host-resolver-rules=MAP * ~NOTFOUND")
    d = webdriver.Chrome(options=opts, service=Service(driver))
    try:
        if offline:
            d.execute_cdp_cmd("Network.enable", {})
            d.execute_cdp_cmd("Network.emulateNetworkConditions",
                              {"offline": True, "latency": 0, "downloadThroughput": -1, "uploadThroughput": -1})
        yield d
    finally:
        d.quit()


def wait(d, find, what: str):
    """``find(d)`` once it is truthy (Selenium's wait), failing with ``what`` after WAIT_S."""
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        return WebDriverWait(d, WAIT_S, poll_frequency=0.5).until(lambda drv: find(drv))
    except TimeoutException:  # what the page shows instead: a dialog, the last stderr outputs
        seen = [e.text for e in d.find_elements(By.CSS_SELECTOR, '.jp-Dialog, [data-mime-type$="stderr"]')]
        raise AssertionError(f"{what} (after {WAIT_S} s; the page shows {seen[-3:]})") from None


def dropdowns(d) -> dict:
    """The page's ipywidgets dropdowns by their description: label -> the <select>."""
    from selenium.webdriver.common.by import By

    return {e.find_element(By.TAG_NAME, "label").text: e.find_element(By.TAG_NAME, "select")
            for e in d.find_elements(By.CSS_SELECTOR, ".widget-dropdown")}


def listed(d) -> list[str]:
    """The sample ids in the browser's visible sample list (the Stack shows one list, the others are hidden)."""
    from selenium.webdriver.common.by import By

    return [r.get_attribute("data-sample-id") for r in d.find_elements(By.CSS_SELECTOR, "table.tv-rows tbody tr")
            if r.is_displayed()]


def choose(select, text: str) -> None:
    from selenium.webdriver.support.ui import Select

    Select(select).select_by_visible_text(text)


@pytest.fixture(scope="module")
def rows(trained) -> list[dict]:
    """The trained run's 01 samples as the sample browser lists them."""
    from eagle3nb.synth.report import sample_rows

    return sample_rows(trained["out"] / "01_synth")


@pytest.fixture(scope="module")
def stage_copy(trained, tmp_path_factory):
    """``make(name)``: a params folder whose 01 writes into a fresh copy of the trained run's 01 folder, and the
    copy; the run's other values are the trained run's (its server, its toy)."""

    def make(name: str) -> tuple[Path, Path]:
        base = tmp_path_factory.mktemp(name)
        stage_dir = base / "01_synth"
        shutil.copytree(trained["out"] / "01_synth", stage_dir)
        params = write_run(base / "params" / f"browser-{name}",
                           {"01_synth": {**trained["stages"]["01_synth"], "output_dir": stage_dir}})
        return params, stage_dir

    return make


def category_filter(rows: list[dict]) -> tuple[str, list[str]]:
    """The least common category and the ids the browser lists under it (its first ROWS_LISTED, in row order)."""
    from eagle3nb.tokenview import ROWS_LISTED

    size = {c: sum(r["category"] == c for r in rows) for c in {r["category"] for r in rows if r["category"]}}
    assert len(size) > 1, "the toy prompts carry several categories"
    cat = min(sorted(size), key=size.get)
    return cat, [r["id"] for r in rows if r["category"] == cat][:ROWS_LISTED]


def every(rows: list[dict]) -> list[str]:
    """What the browser lists with no filter."""
    from eagle3nb.tokenview import ROWS_LISTED

    return [r["id"] for r in rows][:ROWS_LISTED]


def match_line(d) -> str:
    """The visible sample list's count line ("N of M samples match")."""
    from selenium.webdriver.common.by import By

    lines = d.find_elements(By.XPATH, "//table[contains(@class, 'tv-rows')]/preceding-sibling::div")
    return " ".join(e.text for e in lines if e.is_displayed())


# -- the report as it travels -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def report(stage_copy) -> Path:
    """01's executed notebook and report, as `eagle3nb run` writes them (outputs/<run>/01_synth.{ipynb,html})."""
    from eagle3nb.paths import outputs_root
    from eagle3nb.run.execute import run

    params, _ = stage_copy("report")
    assert run(params, stages="01", console=False) == 0
    return outputs_root() / params.name / "01_synth.ipynb"


def test_report_widgets_work_offline(report, rows):
    """The rendered report loads nothing from the network (the widget manager inline, no CDN script), and with the
    network off Chromium draws the sample browser and its category filter changes the listed samples."""
    page = report.with_suffix(".html").read_text()
    assert re.findall(r"<script[^>]*\ssrc=\"(?!data:)", page) == [], "a script the page would fetch"
    assert "unpkg.com" not in page and '<script src="data:text/javascript;base64,' in page
    cat, ids = category_filter(rows)
    with chrome(offline=True) as d:
        d.get(report.with_suffix(".html").as_uri())
        got = d.execute_async_script("const done = arguments[arguments.length - 1];"
                                     "fetch('https://unpkg.com/').then(() => done('reached'), e => done(String(e)))")
        assert got != "reached", "the network is not off in this browser"
        wait(d, lambda drv: "category" in dropdowns(drv) and listed(drv), "no sample browser drawn (widget manager?)")
        assert listed(d) == every(rows) and match_line(d) == f"{len(rows)} of {len(rows)} samples match"
        choose(dropdowns(d)["category"], cat)
        wait(d, lambda drv: listed(drv) == ids, f"category {cat} listed {listed(d)}, not {ids}")
        assert match_line(d) == f"{len(ids)} of {len(rows)} samples match"
        choose(dropdowns(d)["category"], "(any)")
        wait(d, lambda drv: listed(drv) == every(rows), "back to every sample")


def test_report_without_the_registry_points_at_the_cdn_and_renders_again(report, tmp_path, monkeypatch, capsys):
    """No registry and no cache: the page takes the pinned bundle from nbconvert's CDN and the note names the
    command that renders it again; `python -m eagle3nb.render` inlines it once the manager can be had."""
    import urllib.error

    from eagle3nb import render

    nb = tmp_path / "01_synth.ipynb"
    shutil.copyfile(report, nb)
    cache = os.environ["EAGLE3NB_CACHE"]
    monkeypatch.setenv("EAGLE3NB_CACHE", str(tmp_path / "empty-cache"))

    def unreachable(url, timeout):
        raise urllib.error.URLError("Name or service not known")

    with monkeypatch.context() as m:
        m.setattr(urllib.request, "urlopen", unreachable)
        page, note = render.report_html(nb)
    spec = render.WIDGET_MANAGER
    assert f"{spec.package}@{spec.version}/dist/embed.js" in page and "data:text/javascript" not in page
    assert note and "cannot download" in note and "python -m eagle3nb.render" in note
    monkeypatch.setenv("EAGLE3NB_CACHE", cache)
    assert render.main([str(nb)]) == 0
    assert '<script src="data:text/javascript;base64,' in nb.with_suffix(".html").read_text()
    assert render.main([str(tmp_path / "nope.ipynb")]) == 2
    assert "nope.ipynb: no such notebook" in capsys.readouterr().err


# -- JupyterLab as users open it --------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lab(stage_copy, tmp_path_factory):
    """`jupyter lab` on a free loopback port (token set, no browser) serving a folder that holds notebooks/01_synth
    parameterized for the run copy as papermill injects it; yields ``(url of the notebook, stage_dir)``."""
    import papermill

    from eagle3nb.params_yaml import injectable, run_params

    params, stage_dir = stage_copy("lab")
    home = tmp_path_factory.mktemp("lab")
    papermill.execute_notebook(str(ROOT / "notebooks" / "01_synth.ipynb"), str(home / "01_synth.ipynb"),
                               parameters=injectable(run_params(params, "01_synth")), prepare_only=True,
                               kernel_name="python3", progress_bar=False)
    state = home / ".jupyter"
    news = state / "settings" / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings"
    news.parent.mkdir(parents=True)
    news.write_text('{"fetchNews": "false"}')  # no "get Jupyter news?" toast over the page
    tracker = state / "settings" / "@jupyterlab" / "notebook-extension" / "tracker.jupyterlab-settings"
    tracker.parent.mkdir(parents=True)
    tracker.write_text('{"autoStartDefaultKernel": true}')  # the notebook's own kernel, no "Select Kernel" dialog
    dirs = {"JUPYTER_CONFIG_DIR": "config", "JUPYTER_DATA_DIR": "data", "JUPYTER_RUNTIME_DIR": "runtime",
            "JUPYTERLAB_SETTINGS_DIR": "settings", "JUPYTERLAB_WORKSPACES_DIR": "workspaces", "IPYTHONDIR": "ipython"}
    env = {**os.environ, **{var: str(state / sub) for var, sub in dirs.items()}}  # nothing written under ~
    port = free_port()
    log = open(state / "lab.log", "w")
    proc = subprocess.Popen(
        [str(JUPYTER), "lab", "--no-browser", "--allow-root", "--ip=127.0.0.1", f"--port={port}",
         f"--IdentityProvider.token={TOKEN}", f"--ServerApp.root_dir={home}", "--LabApp.extension_manager=readonly",
         "--LabApp.news_url=None", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"],
        env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status?token={TOKEN}", timeout=2).close()
                break
            except OSError:
                assert proc.poll() is None and time.time() < deadline, (state / "lab.log").read_text()[-2000:]
                time.sleep(0.5)
        yield f"http://127.0.0.1:{port}", stage_dir
    finally:
        proc.terminate()  # the server shuts its kernels down on SIGTERM
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def test_jupyterlab_runs_the_notebook_and_its_widgets_respond(lab, rows):
    """Opened in JupyterLab and run through the Run menu: the figures and the counts table are drawn, and the
    sample browser answers a filter through the kernel (the sample picker, refilled by Python, follows)."""
    import json

    from selenium.webdriver.common.by import By

    server, stage_dir = lab
    cat, ids = category_filter(rows)

    def menu(label: str, css: str):
        xpath = f"//div[contains(@class, '{css}') and text()='{label}']"
        return wait(d, lambda drv: drv.find_elements(By.XPATH, xpath), f"JupyterLab's {label} menu item")[0]

    def kernel_started(drv) -> bool:
        """The notebook has its kernel (a "Select Kernel" dialog, where one shows, is answered with its default)."""
        for button in drv.find_elements(By.CSS_SELECTOR, ".jp-Dialog .jp-Dialog-button.jp-mod-accept"):
            button.click()
        with urllib.request.urlopen(f"{server}/api/sessions?token={TOKEN}", timeout=5) as r:
            return any(s["path"] == "01_synth.ipynb" and s.get("kernel") for s in json.load(r))

    with chrome() as d:
        d.get(f"{server}/lab/tree/01_synth.ipynb?token={TOKEN}")
        wait(d, lambda drv: drv.find_elements(By.CSS_SELECTOR, ".jp-Notebook .jp-Cell"), "the notebook never opened")
        wait(d, kernel_started, "the notebook's kernel never started")
        menu("Run", "lm-MenuBar-itemLabel").click()
        menu("Run All Cells", "lm-Menu-itemLabel").click()
        wait(d, lambda drv: "category" in dropdowns(drv) and listed(drv), "the sample browser (last cell) never drew")
        figures = sorted(p.name for p in stage_dir.glob("*.png"))
        images = d.find_elements(By.CSS_SELECTOR, ".jp-OutputArea-output img")
        assert figures and len(images) >= len(figures), (figures, len(images))
        counts = json.loads((stage_dir / "metrics.json").read_text())["counts"]  # the "What came out" table
        tables = [{th.text: td.text for th, td in zip(t.find_elements(By.CSS_SELECTOR, "thead th")[1:],
                                                      t.find_elements(By.CSS_SELECTOR, "tbody td"))}
                  for t in d.find_elements(By.CSS_SELECTOR, ".jp-OutputArea-output table.dataframe")]
        assert {k: str(v) for k, v in counts.items()} in tables, tables
        assert listed(d) == every(rows)
        choose(dropdowns(d)["category"], cat)
        wait(d, lambda drv: listed(drv) == ids, f"category {cat} listed {listed(d)}, not {ids}")

        def picker(drv) -> list[str]:
            return [o.text.split()[0] for o in dropdowns(drv)["sample"].find_elements(By.TAG_NAME, "option")]

        wait(d, lambda drv: picker(drv) == [r["id"] for r in rows if r["category"] == cat],
             "the kernel never refilled the sample picker")
