#!/usr/bin/env bash
# Build the wheel, check that it holds only the package, its kernels, bsmm.toml and py.typed, then
# install it into fresh virtual environments of Python 3.11 and 3.12 and use it from outside the
# source tree: the installed package must find bsmm.toml and the CUDA sources on its own, and a CPU
# subset of the tests (tests/test_passes.py) runs against it.
#     PYTHON=.venv/bin/python bash tools/ci/check_wheel.sh
# PYTHON builds the wheel (it needs `build` and pip 22.3 or newer); each Python version is found as
# pythonX.Y, else in pyenv's versions; a missing one fails the check (ALLOW_MISSING_PYTHON=1: SKIP).
set -euo pipefail
PYTHON=${PYTHON:-python3}
# A relative path (.venv/bin/python) must still work from the folders the commands below run in.
[[ $PYTHON == */* ]] && PYTHON="$(cd "$(dirname "$PYTHON")" && pwd)/$(basename "$PYTHON")"
here=$(cd "$(dirname "$0")/../.." && pwd)
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$work"' EXIT
start=$SECONDS

# Build from a copy of what the wheel is made of: in the checkout, setuptools would also pack
# whatever earlier builds left in build/lib.
mkdir "$work/src"
# There, the commands docs/install.md gives a user: `python -m build --wheel`, then
# `pip install dist/bsmm-*.whl` (below, into each fresh environment).
(cd "$here" && cp -r setup.cfg pyproject.toml README.md LICENSE bsmm.toml bsmm cuda "$work/src/")
echo "in a copy of the sources: python -m build --wheel; pip install dist/bsmm-*.whl"
(cd "$work/src" && "$PYTHON" -m build --wheel) >"$work/build.log" 2>&1 || { cat "$work/build.log"; exit 1; }
wheel=$(echo "$work"/src/dist/bsmm-*.whl)

"$PYTHON" - "$wheel" "$work/src" <<'PY'
import email, pathlib, re, sys, zipfile

wheel, src = zipfile.ZipFile(sys.argv[1]), pathlib.Path(sys.argv[2])
names = set(wheel.namelist())
modules = {p.relative_to(src).as_posix() for p in (src / "bsmm").rglob("*.py") if "__pycache__" not in p.parts}
kernels = {f"bsmm/data/cuda/{p.name}" for p in (src / "cuda").iterdir() if p.suffix in (".cu", ".cuh")}
expected = modules | kernels | {"bsmm/data/bsmm.toml", "bsmm/py.typed"}
dist_info = re.compile(r"bsmm-[^/]+\.dist-info/(METADATA|WHEEL|RECORD|entry_points\.txt|top_level\.txt|(licenses/)?LICENSE)")
unexpected = sorted(n for n in names - expected if not dist_info.fullmatch(n))
assert not unexpected, f"the wheel holds files that are not the package's: {unexpected}"
assert not expected - names, f"the wheel lacks {sorted(expected - names)}"
metadata = email.message_from_bytes(wheel.read(next(n for n in names if n.endswith(".dist-info/METADATA"))))
extras = set(metadata.get_all("Provides-Extra"))
assert {"cuda12", "cuda13", "jax-cuda12", "jax-cuda13", "notebooks"} <= extras, f"extras: {sorted(extras)}"
assert metadata["License-File"] == "LICENSE", metadata["License-File"]
print(f"wheel contents: {len(modules)} modules, {len(kernels)} kernel sources, bsmm.toml, py.typed, "
      f"dist-info; extras {', '.join(sorted(extras))}")
PY

# Python X.Y that runs: a pyenv shim of a version that is not selected exists but fails.
find_python() {
  local candidate
  for candidate in "python$1" "${PYENV_ROOT:-$HOME/.pyenv}/versions/$1".*/bin/"python$1"; do
    if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c "" >/dev/null 2>&1; then
      echo "$candidate"
      return
    fi
  done
}

# The tests run from a folder of their own: only the installed wheel can be imported as bsmm.
mkdir -p "$work/run/tests"
cp "$here"/tests/{conftest.py,reference.py,test_passes.py} "$work/run/tests/"
cat >"$work/run/tests/test_installed_wheel.py" <<'PY'
import bsmm


def test_bsmm_is_the_installed_wheel():
    assert "site-packages" in bsmm.__file__, bsmm.__file__
PY
# Every kind of pass on the CPU backend (about 150 cases, seconds).
subset="installed_wheel or full_and_thin or empty_block or accumulate or never_modified or bitwise or no_rows"

# Both environments install at once: pip mostly waits on the disk and the package index.
versions=()
declare -A installs
for version in 3.11 3.12; do
  python=$(find_python "$version")
  if [[ -z $python ]]; then
    # bsmm is tested on both versions: a missing one fails the check unless skipping is asked for.
    if [[ ${ALLOW_MISSING_PYTHON:-0} == 1 ]]; then
      echo "SKIP python $version: no python$version that runs on this machine (ALLOW_MISSING_PYTHON=1)"
      continue
    fi
    echo "FAIL python $version: no python$version that runs on this machine (ALLOW_MISSING_PYTHON=1 skips it)"
    exit 1
  fi
  versions+=("$version")
  "$python" -m venv --without-pip "$work/venv$version"
  # The documented `pip install dist/bsmm-*.whl`, by $PYTHON's pip into the new environment.
  (cd "$work/src" && "$PYTHON" -m pip --python "$work/venv$version/bin/python" install --quiet dist/bsmm-*.whl \
    pytest hypothesis) >"$work/pip$version.log" 2>&1 &
  installs[$version]=$!
done
for version in "${versions[@]}"; do
  wait "${installs[$version]}" || { cat "$work/pip$version.log"; exit 1; }
done

for version in "${versions[@]}"; do
  venv="$work/venv$version"
  (cd "$work/run" && BSMM_TUNED=0 BSMM_CACHE_DIR="$work/cache" REPO_CUDA="$here/cuda" "$venv/bin/python" - <<'PY'
import importlib.resources, os, pathlib, sys
import numpy as np, bsmm, bsmm.config
import bsmm.backends.cuda.planner, bsmm.backends.cuda.kernels, bsmm.cli.main, bsmm.nn.conv, bsmm.layouts.small_world  # every subpackage shipped
assert "site-packages" in bsmm.__file__, bsmm.__file__
assert importlib.resources.files("bsmm").joinpath("py.typed").is_file(), "py.typed is not installed"
sources = sorted(p.name for p in bsmm.config.CUDA_DIR.glob("*.cu*"))
expected = sorted(p.name for p in pathlib.Path(os.environ["REPO_CUDA"]).glob("*.cu*"))
assert sources == expected, f"wheel has CUDA sources {sources}, repository has {expected}"
op = bsmm.BlocksparseMatMul(np.eye(4, dtype=np.uint8), block_size=8)
x = np.random.default_rng(0).standard_normal((3, 32)).astype(np.float32)
w = np.random.default_rng(1).standard_normal(op.w_shape).astype(np.float32)
assert np.allclose(op(x, w), x @ op.to_dense(w), atol=1e-5)
print(f"python {sys.version.split()[0]}: installed bsmm {bsmm.__version__} at {bsmm.__file__}; "
      f"data dir {bsmm.config.DATA_DIR}; {len(sources)} cuda sources; settings {sorted(bsmm.config.settings())}")
PY
  )
  log="$work/pytest$version.log"
  (cd "$work/run" && BSMM_TUNED=0 BSMM_CACHE_DIR="$work/cache" \
    "$venv/bin/python" -m pytest -q -x -p no:cacheprovider tests -m "not gpu" -k "$subset") >"$log" 2>&1 \
    || { cat "$log"; exit 1; }
  echo "python $version: $(tail -1 "$log") [$((SECONDS - start)) s]"
done
echo "wheel check passed in $((SECONDS - start)) s"
