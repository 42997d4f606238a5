"""Imports inside ``bsmm`` run down the stack: no module imports another ``bsmm`` module inside a
function to dodge an import cycle. A function-level import of a ``bsmm`` module is allowed only where
a comment on its line (or the line before) says it is done lazily or is optional: a framework's or
CuPy's module imported only when it is used.

The source files are read with :mod:`ast`, never imported; the modules are found with :mod:`pkgutil`.
Modules of a framework that is not installed (and ``bsmm.backends.cuda`` without CuPy) are skipped.
"""

from __future__ import annotations

import ast
import importlib.util
import io
import pkgutil
import re
import tokenize
from pathlib import Path

import bsmm

#: The directory that holds the ``bsmm`` package.
ROOT = Path(bsmm.__file__).parents[1]

#: Module prefixes and the distribution each needs: skipped where it is not installed.
NEEDS = {"bsmm.torch": "torch", "bsmm.jax": "jax", "bsmm.tf": "tensorflow", "bsmm.keras": "keras",
         "bsmm.flax": "flax", "bsmm.equinox": "equinox", "bsmm.backends.cuda": "cupy"}

#: A comment that makes a function-level import legitimate.
_EXCUSED = re.compile(r"lazily|optional", re.IGNORECASE)


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _skipped(module: str) -> bool:
    return any((module == prefix or module.startswith(prefix + ".")) and not _installed(needed)
               for prefix, needed in NEEDS.items())


def bsmm_sources() -> list[tuple[str, Path]]:
    """(module name, source file) of every module of the package, found with :mod:`pkgutil`."""
    found = [("bsmm", Path(bsmm.__file__))]

    def walk(path: list[str], prefix: str) -> None:
        for info in pkgutil.iter_modules(path, prefix):
            if _skipped(info.name):
                continue
            where = Path(info.module_finder.path) / info.name.rpartition(".")[2]
            if info.ispkg:
                found.append((info.name, where / "__init__.py"))
                walk([str(where)], info.name + ".")
            else:
                found.append((info.name, where.with_suffix(".py")))

    walk(list(bsmm.__path__), "bsmm.")
    return found


def _is_module(name: str) -> bool:
    """Whether ``name`` (``bsmm.x.y``) is a module or package of the source tree (not a name in one)."""
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _imported_bsmm(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """The ``bsmm`` modules ``node`` imports (none where it imports nothing of the package):
    ``from bsmm.cli import tune`` imports ``bsmm.cli.tune``, ``from bsmm.cli.tune import Case`` ``bsmm.cli.tune``."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names if alias.name == "bsmm" or alias.name.startswith("bsmm.")]
    if node.level:  # relative: always inside the package
        base = module.split(".") if is_package else module.split(".")[:-1]
        source = ".".join(base[:len(base) - (node.level - 1)] + ([node.module] if node.module else []))
    elif node.module == "bsmm" or (node.module or "").startswith("bsmm."):
        source = node.module
    else:
        return []
    found = []
    for alias in node.names:
        name = f"{source}.{alias.name}" if _is_module(f"{source}.{alias.name}") else source
        if name not in found:
            found.append(name)
    return found


def lazy_bsmm_imports(module: str, source_file: Path) -> list[tuple[str, int, str, str]]:
    """(file, line, function, imported module) of each unexcused function-level import of a ``bsmm`` module."""
    source = source_file.read_text(encoding="utf-8")
    comments: dict[int, str] = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            comments[token.start[0]] = comments.get(token.start[0], "") + token.string
    is_package = source_file.name == "__init__.py"
    found = []

    where = (source_file.relative_to(ROOT) if source_file.is_relative_to(ROOT) else source_file).as_posix()

    def visit(node: ast.AST, scope: str, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                visit(child, f"{scope}.{child.name}".lstrip("."),
                      in_function or not isinstance(child, ast.ClassDef))
                continue
            if in_function and isinstance(child, (ast.Import, ast.ImportFrom)):
                targets = _imported_bsmm(child, module, is_package)
                lines = range(child.lineno - 1, (child.end_lineno or child.lineno) + 1)
                if not any(_EXCUSED.search(comments.get(line, "")) for line in lines):
                    found.extend((where, child.lineno, scope, target) for target in targets)
            visit(child, scope, in_function)

    visit(ast.parse(source, str(source_file)), "", False)
    return found


def _found() -> list[tuple[str, int, str, str]]:
    return [found for name, path in bsmm_sources() for found in lazy_bsmm_imports(name, path)]


def test_the_package_is_walked():
    names = {name for name, _ in bsmm_sources()}
    assert {"bsmm", "bsmm.matmul", "bsmm.cli.tune", "bsmm.cli.tune_results", "bsmm.cli.tuned_file"} <= names
    assert all(path.is_file() for _, path in bsmm_sources())


def test_the_check_finds_function_imports_and_their_excuses(tmp_path):
    source = tmp_path / "example.py"
    source.write_text("import bsmm.matmul\n\n\n"
                      "def f():\n    from bsmm.cli import tune, tuned_file\n    import numpy\n\n\n"
                      "def g():\n    # imported lazily: only the GPU path needs it\n"
                      "    from bsmm.backends.cuda import launches\n"
                      "    import bsmm.torch  # optional: PyTorch\n\n\n"
                      "class C:\n    def h(self):\n        from . import passes\n")
    found = [(line, function, target) for _, line, function, target in lazy_bsmm_imports("bsmm.example", source)]
    assert found == [(5, "f", "bsmm.cli.tune"), (5, "f", "bsmm.cli.tuned_file"), (17, "C.h", "bsmm.passes")]


#: Function-level imports of bsmm modules found when this test was written, to be moved to the top
#: of their modules (or commented, where they are an optional framework's or deliberately lazy):
#: (file, function, imported module). Line numbers are left out so that edits elsewhere keep them.
KNOWN = {
    ("bsmm/cli/arguments.py", "gpu_problem", "bsmm.backends.cuda.environment"),
    ("bsmm/cli/arguments.py", "_tune_cases", "bsmm.cli.tune"),
    ("bsmm/cli/framework_bench.py", "bench_torch", "bsmm.torch"),
    ("bsmm/cli/framework_bench.py", "bench_cupy", "bsmm"),
    ("bsmm/cli/framework_bench.py", "bench_jax", "bsmm"),
    ("bsmm/cli/framework_bench.py", "bench_jax", "bsmm.jax"),
    ("bsmm/cli/main.py", "_demo", "bsmm"),
    ("bsmm/cli/main.py", "_demo", "bsmm.cli.bench"),
    ("bsmm/cli/main.py", "_demo", "bsmm.cli.bench_gpu"),
    ("bsmm/cli/main.py", "_torch_step", "bsmm.cli.framework_bench"),
    ("bsmm/cli/main.py", "_bench", "bsmm.cli.bench"),
    ("bsmm/cli/main.py", "_bench", "bsmm.cli.bench_gpu"),
    ("bsmm/cli/main.py", "_bench", "bsmm.cli.tuned_file"),
    ("bsmm/cli/main.py", "_bench", "bsmm.cli.plot"),
    ("bsmm/cli/main.py", "_bench_framework", "bsmm.cli.framework_bench"),
    ("bsmm/cli/main.py", "_tune", "bsmm.cli.tune"),
    ("bsmm/cli/main.py", "_tune", "bsmm.cli.tuned_file"),
}


def test_no_function_imports_another_bsmm_module_unless_lazily_or_optionally():
    new = [f"{where}:{line}: {function}() imports {target}" for where, line, function, target in _found()
           if (where, function, target) not in KNOWN]
    assert not new, ("function-level imports of bsmm modules (import at the top of the module, or say on the "
                     "line why it is done lazily / is optional):\n" + "\n".join(new))


def test_the_known_function_imports_are_still_there():
    # One fixed (or commented): take it off KNOWN, so that it does not come back unnoticed.
    found = {(where, function, target) for where, _, function, target in _found()}
    scanned = {path.relative_to(ROOT).as_posix() for _, path in bsmm_sources()}
    assert not {known for known in KNOWN if known[0] in scanned} - found
