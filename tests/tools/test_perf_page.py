"""``tools/ci/perf_page.py``: the docs' performance page made from ``results/README.md`` keeps every
number and table of it, names its source, rewrites only relative links (not code), refuses a page
without a title or a date, and its command line writes the page or says in one line why not; the
docs hook that puts it on the site also turns the docstrings' Sphinx roles into references."""

from __future__ import annotations

import doctest
import importlib.util
import subprocess
import sys

import pytest

from conftest import REPO_ROOT

TOOL = REPO_ROOT / "tools" / "ci" / "perf_page.py"


def load_tool():
    spec = importlib.util.spec_from_file_location("perf_page", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


perf_page = load_tool()


def test_the_committed_results_page_is_carried_over_whole():
    source = (REPO_ROOT / "results" / "README.md").read_text(encoding="utf-8")
    page = perf_page.performance_page(source)
    assert page.startswith("# Performance\n\n*Generated from `results/README.md`")
    body = source.split("\n", 1)[1]
    if "](" not in body:  # no links to rewrite: the body must come through byte for byte
        assert body.strip() in page
    page_lines = set(page.splitlines())
    table_rows = [line for line in source.splitlines() if line.startswith("|")]
    assert table_rows, "results/README.md has no tables"
    assert [row for row in table_rows if row not in page_lines] == []


def test_title_replaced_and_sections_kept():
    source = "\n# Today\n\nMeasured 2026-01-02 on an H100, commit abc1234.\n\n## Kernels\n\n| a | b |\n| --- | --- |\n| 1 | 2 |\n"
    page = perf_page.performance_page(source)
    lines = page.splitlines()
    assert lines[0] == "# Performance" and "# Today" not in lines
    assert "## Kernels" in lines and "| 1 | 2 |" in lines
    assert "Measured 2026-01-02 on an H100, commit abc1234." in lines
    assert page.endswith("| 1 | 2 |\n")


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("see [the sweep](v19/sweep.md) here", "see the sweep (`results/v19/sweep.md`) here"),
        ("![figure](plots/speedup.png)", "figure (`results/plots/speedup.png`)"),
        ("[](archive/RESULTS.md)", "`results/archive/RESULTS.md`"),
        ("[NVIDIA](https://www.nvidia.com/) and [below](#kernels)", "[NVIDIA](https://www.nvidia.com/) and [below](#kernels)"),
        ("[mail](mailto:a@b.c) [root](/abs.md)", "[mail](mailto:a@b.c) [root](/abs.md)"),
        ("code `[x](y.md)` stays, [z](w.md) does not", "code `[x](y.md)` stays, z (`results/w.md`) does not"),
        ("two ``[a](b.md)`` [c](d.md)", "two ``[a](b.md)`` c (`results/d.md`)"),
    ],
)
def test_relative_links_become_paths_under_results(line, expected):
    page = perf_page.performance_page(f"# T\n\n2026-01-02\n\n{line}\n")
    assert page.splitlines()[-1] == expected


def test_fenced_code_is_left_alone():
    source = "# T\n\n2026-01-02\n\n```\n[x](y.md)\n```\n[x](y.md)\n"
    assert perf_page.performance_page(source).splitlines()[-4:] == ["```", "[x](y.md)", "```", "x (`results/y.md`)"]


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("", r"results/README.md must start with a level-1 title \('# \.\.\.'\); got an empty file"),
        ("## Section\n2026-01-02\n", r"must start with a level-1 title .*got '## Section'"),
        ("# T\n\nMeasured last week.\n\n## Kernels\n\n2026-01-02\n", r"must say when its numbers were measured"),
    ],
)
def test_refuses_a_page_without_title_or_date(source, message):
    with pytest.raises(ValueError, match=message):
        perf_page.performance_page(source)


def test_docstring_example():
    result = doctest.testmod(perf_page)
    assert result.attempted >= 1 and result.failed == 0


def test_command_line_writes_the_page(tmp_path):
    (tmp_path / "README.md").write_text("# Now\n\nMeasured 2026-03-04.\n\n[run](v1/run.md)\n", encoding="utf-8")
    output = tmp_path / "performance.md"
    done = subprocess.run([sys.executable, str(TOOL), "--results", str(tmp_path), "--output", str(output)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert output.read_text(encoding="utf-8").splitlines()[-1] == "run (`results/v1/run.md`)"


@pytest.mark.parametrize(
    ("readme", "message"),
    [(None, "No such file"), ("# Now\n\nno date\n", "must say when its numbers were measured")],
)
def test_command_line_says_why_in_one_line(tmp_path, readme, message):
    if readme is not None:
        (tmp_path / "README.md").write_text(readme, encoding="utf-8")
    done = subprocess.run([sys.executable, str(TOOL), "--results", str(tmp_path)], capture_output=True, text=True)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.startswith("perf_page: ") and message in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_docs_hook_makes_roles_references():
    """``docs/hooks/pages.py`` (the hook that adds the page to the site) turns the docstrings' Sphinx
    roles into cross-references, resolving names relative to the objects on the page."""
    pytest.importorskip("mkdocs")
    spec = importlib.util.spec_from_file_location("docs_pages_hook", REPO_ROOT / "docs" / "hooks" / "pages.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    page = type("Page", (), {"file": type("File", (), {"src_uri": "api/torch.md"})()})()
    content = ('<h2 id="bsmm.torch.register">register</h2><p>see :func:<code>register</code>, '
               ':class:<code>~bsmm.nn.conv.BlocksparseConv</code></p><code>:attr:`w_shape` array, ``x``</code>')
    html = hook.on_page_content(content, page, None, None)
    assert '<autoref identifier="bsmm.torch.register" optional><code>register</code></autoref>' in html
    assert '<autoref identifier="bsmm.nn.conv.BlocksparseConv" optional><code>BlocksparseConv</code></autoref>' in html
    assert "<code>w_shape array, x</code>" in html and ":func:" not in html and ":attr:" not in html
    other = type("Page", (), {"file": type("File", (), {"src_uri": "concepts.md"})()})()
    assert hook.on_page_content(content, other, None, None) == content
