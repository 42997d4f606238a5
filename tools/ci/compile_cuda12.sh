#!/usr/bin/env bash
# Compile a representative sample of the kernel variants with CUDA 12's NVRTC, for sm_80 and
# sm_90a, through the library's own compile_variant: what `pip install 'bsmm[cuda12]'` compiles at
# run time. A throwaway environment gets pyproject.toml's nvrtc12 group (cupy-cuda12x, the CUDA 12
# NVRTC and runtime wheels) and bsmm with its plain dependencies. Needs no GPU.
#     bash tools/ci/compile_cuda12.sh [compile_kernels.py options: --sample N, --jobs ..., --quiet]
# The default sample, 40 variants (73 compiles), holds every pair of two fields' values (kernel
# kind, pass, block size, dtype, flags); --sample 151 every combination, at 3.5 times the compiles.
# The listing goes to build/compile_report_cuda12.txt.
set -euo pipefail
PYTHON=${PYTHON:-python3.11}
here=$(cd "$(dirname "$0")/../.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
start=$SECONDS

# bsmm from a copy of its sources: a build in the checkout would also pack what build/lib holds.
mkdir "$work/src"
(cd "$here" && cp -r setup.cfg pyproject.toml README.md LICENSE bsmm.toml bsmm cuda "$work/src/")
"$PYTHON" -m venv "$work/venv"
"$work/venv/bin/python" -m pip install --quiet --upgrade pip  # dependency groups: pip 25.1
"$work/venv/bin/python" -m pip install --quiet --group "$here/pyproject.toml:nvrtc12" "$work/src"

# From outside the checkout: the installed bsmm, the CUDA 12 NVRTC and the headers of its runtime wheel.
cd "$work"
"$work/venv/bin/python" - <<'PY'
from cupy_backends.cuda.libs import nvrtc
import bsmm
from bsmm.backends.cuda.kernels import cuda_include_dirs

assert "site-packages" in bsmm.__file__, bsmm.__file__
assert nvrtc.getVersion()[0] == 12, f"NVRTC {nvrtc.getVersion()} is not CUDA 12's"
print(f"bsmm at {bsmm.__file__}; NVRTC {'.'.join(map(str, nvrtc.getVersion()))}; headers from {cuda_include_dirs()[0]}")
PY
echo "environment ready in $((SECONDS - start)) s"
"$work/venv/bin/python" "$here/tools/ci/compile_kernels.py" --arch sm_80 --arch sm_90a --jobs "$(nproc)" \
  --sample 40 --report "$here/build/compile_report_cuda12.txt" "$@"
echo "CUDA 12 compile check passed in $((SECONDS - start)) s"
