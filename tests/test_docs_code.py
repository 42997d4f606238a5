"""The Python blocks of README.md and docs/*.md run as a reader would run them: top to bottom.

Each file's ```python blocks run in order in one fresh namespace, in a Python subprocess of
their own (so the frameworks they import stay out of this process), with a temporary folder as the
working directory: a block may use what an earlier block of the same file defined, nothing else.
A block of ``>>>`` lines runs as a doctest, its printed results checked. Blocks of other languages
(``sh``, ``text``, none) are not run.

A block that cannot run in CI says so in the docs, on the line before its fence::

    <!-- docs-test: skip (needs a GPU) -->

and is reported as skipped with that reason, by file and line. Nothing else is skipped: the
decision is the docs' marker, never a guess from the block's text. One test case a block, its id
``file:line`` (the line of the opening fence).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import asdict, dataclass
from pathlib import Path

import pytest

REPOSITORY = Path(__file__).resolve().parent.parent
FILES = [REPOSITORY / "README.md", *sorted((REPOSITORY / "docs").glob("*.md"))]
#: Seconds one file's blocks may take together.
TIMEOUT_S = 240
#: The marker: an HTML comment (invisible on GitHub and on the site) on the line before a fence.
MARKER = re.compile(r"<!--\s*docs-test:\s*(?P<rest>.*?)\s*-->")
SKIP = re.compile(r"skip \((?P<reason>[^()]+)\)")
#: Blocks known to fail, in pages outside the change that added this test, by file and first line
#: (their line numbers move as the page is edited); each such case must fail (strict), so the entry
#: goes once the block is fixed or marked.
KNOWN_BROKEN: dict = {}
#: The environment of the blocks: eight CPU devices for JAX, which docs/distributed.md's (2, 4)
#: mesh needs; no tuned tiles of this machine; TensorFlow's start-up lines off.
ENVIRONMENT = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "BSMM_TUNED": "0",
               "TF_CPP_MIN_LOG_LEVEL": "2"}


@dataclass(frozen=True)
class Block:
    """One fenced code block of a Markdown file."""

    file: str  #: relative to the repository
    line: int  #: of the opening fence, from 1
    language: str
    code: str  #: dedented to the fence's indentation
    skip: str | None  #: the marker's reason, None where the block runs

    @property
    def id(self) -> str:
        return f"{self.file}:{self.line}"


def blocks_of(path: Path) -> list[Block]:
    """Every fenced block of ``path``, with the skip marker on the non-blank line above it.

    Raises
    ------
    ValueError
        If a marker is not ``docs-test: skip (reason)``, stands before no code block, or a fence is
        not closed.
    """
    name = path.relative_to(REPOSITORY).as_posix()
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks, marker, number = [], None, 0
    while number < len(lines):
        text = lines[number]
        stripped = text.strip()
        found = MARKER.fullmatch(stripped)
        if found:
            skip = SKIP.fullmatch(found["rest"])
            if skip is None:
                raise ValueError(f"{name}:{number + 1}: expected <!-- docs-test: skip (reason) -->, got {stripped!r}")
            marker = (number + 1, skip["reason"])
        elif stripped.startswith("```"):
            fence = stripped[:len(stripped) - len(stripped.lstrip("`"))]
            language = stripped[len(fence):].strip().split(" ")[0]
            end = next((i for i in range(number + 1, len(lines)) if lines[i].strip() == fence), None)
            if end is None:
                raise ValueError(f"{name}:{number + 1}: the code block is not closed")
            code = textwrap.dedent("\n".join(lines[number + 1:end]))
            blocks.append(Block(name, number + 1, language, code + "\n", marker[1] if marker else None))
            marker, number = None, end
        elif stripped and marker:
            raise ValueError(f"{name}:{marker[0]}: a docs-test marker must be the line before a code block's fence")
        number += 1
    if marker:
        raise ValueError(f"{name}:{marker[0]}: a docs-test marker must be the line before a code block's fence")
    return blocks


PYTHON_BLOCKS = [block for path in FILES for block in blocks_of(path) if block.language == "python"]

#: Runs one file's blocks in order in one namespace; writes {line: [status, detail]} as JSON.
_RUNNER = r'''
import doctest, io, json, sys, traceback

blocks, results_file = json.load(open(sys.argv[1])), sys.argv[2]
namespace = {"__name__": "__main__"}
results, failed = {}, None
for block in blocks:
    where = f"{block['file']}:{block['line']}"
    if block["skip"]:
        results[block["line"]] = ["skipped", block["skip"]]
    elif failed:
        results[block["line"]] = ["failed", f"not run: the block at {failed} failed first"]
    elif block["code"].lstrip().startswith(">>>"):
        test = doctest.DocTestParser().get_doctest(block["code"], namespace, where, block["file"], block["line"])
        report = io.StringIO()
        runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
        outcome = runner.run(test, out=report.write, clear_globs=False)
        results[block["line"]] = ["failed", report.getvalue()] if outcome.failed else ["passed", ""]
        failed = where if outcome.failed else None
    else:
        try:  # blank lines in front: a traceback gives the line numbers of the Markdown file
            exec(compile("\n" * block["line"] + block["code"], block["file"], "exec"), namespace)
            results[block["line"]] = ["passed", ""]
        except BaseException:
            results[block["line"]] = ["failed", traceback.format_exc(limit=-8)]
            failed = where
    json.dump(results, open(results_file, "w"))
'''


@pytest.fixture(scope="session")
def file_results(tmp_path_factory):
    """file -> {line: (status, detail)}: each file's blocks run once, at its first case."""
    done = {}

    def results(file: str) -> dict:
        if file not in done:
            folder = tmp_path_factory.mktemp(Path(file).stem)
            blocks_file, results_file = folder.parent / f"{folder.name}.blocks.json", folder.parent / f"{folder.name}.json"
            blocks_file.write_text(json.dumps([asdict(b) for b in PYTHON_BLOCKS if b.file == file]))
            run = subprocess.run([sys.executable, "-c", _RUNNER, str(blocks_file), str(results_file)], cwd=folder,
                                 env={**os.environ, **ENVIRONMENT}, capture_output=True, text=True, timeout=TIMEOUT_S)
            found = json.loads(results_file.read_text()) if results_file.exists() else {}
            # A block that ended the process (a crash, os._exit) leaves the later ones without a result.
            done[file] = {int(line): tuple(result) for line, result in found.items()}
            done[file]["stderr"] = run.stderr[-4000:]
        return done[file]

    return results


def _case(block: Block):
    known = KNOWN_BROKEN.get((block.file, block.code.partition("\n")[0]))
    marks = [pytest.mark.xfail(reason=f"{block.id}: {known}", strict=True)] if known else []
    return pytest.param(block, id=block.id, marks=marks)


@pytest.mark.parametrize("block", [_case(block) for block in PYTHON_BLOCKS])
def test_the_block_runs_after_the_blocks_above_it(block, file_results):
    results = file_results(block.file)
    status, detail = results.get(block.line, ("failed", f"no result: the process ended early\n{results['stderr']}"))
    if status == "skipped":
        pytest.skip(f"{block.id}: {detail}")
    assert status == "passed", f"{block.id} failed:\n{detail}"


def test_the_docs_have_python_blocks_and_every_marker_names_a_reason():
    files = {block.file for block in PYTHON_BLOCKS}
    assert {"README.md", "docs/index.md", "docs/quickstart.md", "docs/concepts.md"} <= files, sorted(files)
    assert all(block.skip is None or block.skip.strip() for block in PYTHON_BLOCKS)
    firsts = {(block.file, block.code.partition("\n")[0]) for block in PYTHON_BLOCKS}
    assert set(KNOWN_BROKEN) <= firsts, f"KNOWN_BROKEN entries that name no python block: {set(KNOWN_BROKEN) - firsts}"


@pytest.mark.parametrize("text, message", [
    ("<!-- docs-test: skip -->\n```python\npass\n```\n", "expected <!-- docs-test: skip (reason) -->"),
    ("<!-- docs-test: run (always) -->\n```python\npass\n```\n", "expected <!-- docs-test: skip (reason) -->"),
    ("<!-- docs-test: skip (long) -->\nsome prose\n```python\npass\n```\n", "must be the line before"),
    ("text\n<!-- docs-test: skip (long) -->\n", "must be the line before"),
    ("```python\npass\n", "not closed"),
])
def test_a_misplaced_or_malformed_marker_is_refused(tmp_path, monkeypatch, text, message):
    monkeypatch.setattr(sys.modules[__name__], "REPOSITORY", tmp_path)
    (tmp_path / "page.md").write_text(text)
    with pytest.raises(ValueError, match=re.escape(message)):
        blocks_of(tmp_path / "page.md")


def test_markers_fences_and_indentation_are_read(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "REPOSITORY", tmp_path)
    (tmp_path / "page.md").write_text("# t\n\n<!-- docs-test: skip (needs a GPU) -->\n```python\nimport cupy\n```\n\n"
                                      "- item:\n\n    ```python\n    x = 1\n    ```\n\n```sh\nls\n```\n")
    blocks = blocks_of(tmp_path / "page.md")
    assert [(b.id, b.language, b.code, b.skip) for b in blocks] == [
        ("page.md:4", "python", "import cupy\n", "needs a GPU"),
        ("page.md:10", "python", "x = 1\n", None),
        ("page.md:14", "sh", "ls\n", None)]
