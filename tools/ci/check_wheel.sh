#!/usr/bin/env bash
# Build the wheel, install it into a fresh virtual environment and use it from
# outside the source tree: the installed package must find bsmm.toml and the
# CUDA sources on its own.
set -euo pipefail
PYTHON=${PYTHON:-python3}
here=$(cd "$(dirname "$0")/../.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$PYTHON" -m build --wheel --outdir "$work/dist" "$here" >"$work/build.log" 2>&1 || { cat "$work/build.log"; exit 1; }
"$PYTHON" -m venv "$work/venv"
"$work/venv/bin/python" -m pip install --quiet "$work"/dist/bsmm-*.whl
cd "$work"
REPO_CUDA="$here/cuda" "$work/venv/bin/python" - <<'PY'
import os, pathlib, numpy as np, bsmm, bsmm.config
import bsmm.backends.cuda.planner, bsmm.backends.cuda.kernels, bsmm.cli.main, bsmm.nn.conv, bsmm.layouts.small_world  # every subpackage shipped
assert "site-packages" in bsmm.__file__, bsmm.__file__
sources = sorted(p.name for p in bsmm.config.CUDA_DIR.glob("*.cu*"))
expected = sorted(p.name for p in pathlib.Path(os.environ["REPO_CUDA"]).glob("*.cu*"))
assert sources == expected, f"wheel has CUDA sources {sources}, repository has {expected}"
op = bsmm.BlocksparseMatMul(np.eye(4, dtype=np.uint8), block_size=8)
x = np.random.default_rng(0).standard_normal((3, 32)).astype(np.float32)
w = np.random.default_rng(1).standard_normal(op.w_shape).astype(np.float32)
assert np.allclose(op(x, w), x @ op.to_dense(w), atol=1e-5)
print(f"wheel check: installed bsmm at {bsmm.__file__}; data dir {bsmm.config.DATA_DIR}; "
      f"cuda sources {sources}; settings {sorted(bsmm.config.settings())}")
PY
