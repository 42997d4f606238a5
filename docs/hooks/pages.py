"""MkDocs hook: the pages made when the site is built, and the docstrings' Sphinx roles as links.

- ``performance.md``, from ``results/README.md`` through ``tools/ci/perf_page.py``: the site's
  numbers are always those of ``results/``, and nothing generated is committed.
- ``notebooks/*.ipynb``, read from the repository's ``notebooks/`` (not copied into ``docs/``) and
  rendered by mkdocs-jupyter without running them: they are committed without outputs.
- The docstrings write cross-references as Sphinx roles (``:class:`bsmm.BlocksparseMatMul```);
  on the API pages each becomes an optional cross-reference, a link where its target is
  documented on the site and code otherwise, instead of the literal role.
"""

from __future__ import annotations

import html
import importlib.util
import re
from pathlib import Path

from mkdocs.plugins import event_priority
from mkdocs.structure.files import File

REPO = Path(__file__).resolve().parents[2]

# A role as Markdown renders it: :class:<code>bsmm.X</code>, :meth:<code>~bsmm.X.f</code>, ...
_ROLE = re.compile(r":(?:py:)?(?:mod|class|func|meth|attr|data|exc|obj|const):<code>(~?)([\w.]+)(\(\))?</code>")
# The same role where Markdown left it as text: inside a <code> span.
_ROLE_IN_CODE = re.compile(r":(?:py:)?(?:mod|class|func|meth|attr|data|exc|obj|const):`(~?)([\w.]+)`")
_CODE = re.compile(r"<code>([^<]*)</code>")
_ANCHOR = re.compile(r'id="(bsmm\.[\w.]+)"')


def _perf_page():
    spec = importlib.util.spec_from_file_location("perf_page", REPO / "tools" / "ci" / "perf_page.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@event_priority(50)  # before mkdocs-jupyter's on_files, which makes pages of the .ipynb files it is given
def on_files(files, config):
    perf_page = _perf_page()
    source = REPO / "results" / "README.md"
    page = perf_page.performance_page(source.read_text(encoding="utf-8"))
    files.append(File.generated(config, "performance.md", content=page))
    for notebook in sorted((REPO / "notebooks").glob("*.ipynb")):
        files.append(File(f"notebooks/{notebook.name}", src_dir=str(REPO), dest_dir=config.site_dir,
                          use_directory_urls=config.use_directory_urls))
    return files


def on_page_content(content, page, config, files):
    if not page.file.src_uri.startswith("api/"):
        return content  # roles come from docstrings, which only the API pages render
    # Objects documented on this page, for roles that name them relative to their module or class.
    anchors = set(_ANCHOR.findall(content))

    def target_of(name: str) -> str:
        if name in anchors:
            return name
        matches = [anchor for anchor in anchors if anchor.endswith("." + name)]
        return matches[0] if len(matches) == 1 else name

    def reference(match: re.Match) -> str:
        tilde, name, call = match[1], match[2], match[3] or ""
        shown = (name.rsplit(".", 1)[-1] if tilde else name) + call
        # mkdocs-autorefs resolves these after every page is rendered; "optional": no warning if unresolved.
        return (f'<autoref identifier="{html.escape(target_of(name))}" optional>'
                f"<code>{html.escape(shown)}</code></autoref>")

    def plain_code(match: re.Match) -> str:
        # Inside code (the types of numpydoc items) a role or a ``literal`` is shown as its text.
        text = _ROLE_IN_CODE.sub(lambda role: role[2].rsplit(".", 1)[-1] if role[1] else role[2], match[1])
        return f"<code>{text.replace('``', '')}</code>"

    return _CODE.sub(plain_code, _ROLE.sub(reference, content))
