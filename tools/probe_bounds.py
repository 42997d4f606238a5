"""What bounds each benchmark row: the bench run three times, with the kernels as they are, with
only their data movement (-DBSMM_PROBE_COPY_ONLY: every copy into shared memory and every store of
the output, no multiplication) and with only their math (-DBSMM_PROBE_MATH_ONLY: the
multiplications on whatever the stages hold, no copy in). Device call; the arguments go to
`python -m bsmm bench` (default: --workloads T --dtype float16).

    python tools/probe_bounds.py --workloads T --block-size 32,64,128 --dtype float16,bfloat16

Prints one Markdown table: each row's time three ways, and the efficiency per useful FLOP each
would give (dense time x density / time). A row whose full time sits near its copy-only time is
bound by moving its bytes, whatever the tensor cores could do; near its math-only time, by the
math. The copy-only and math-only cubins carry their own options, so the kernel cache keeps them
apart from the real ones. Full JSON of the three runs next to --out (default /tmp/bsmm-bounds).
"""
import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

MODES = {"full": "", "copy only": "-DBSMM_PROBE_COPY_ONLY", "math only": "-DBSMM_PROBE_MATH_ONLY"}


def run_bench(mode: str, options: str, bench_args: list[str], out: Path) -> list[dict]:
    path = out / f"bench_{mode.replace(' ', '_')}.json"
    env = dict(os.environ, BSMM_NVRTC_OPTIONS=(os.environ.get("BSMM_NVRTC_OPTIONS", "") + " " + options).strip())
    subprocess.run([sys.executable, "-m", "bsmm", "bench", "--backend", "gpu", "--json", str(path), *bench_args],
                   env=env, check=True, stdout=subprocess.DEVNULL)
    return json.loads(path.read_text())["rows"]


def row_key(row: dict) -> tuple:
    return row["workload"], row["dtype"], row["block_size"], row["density"], row["pass_name"]


def table(runs: dict[str, list[dict]]) -> str:
    by_mode = {mode: {row_key(r): r for r in rows} for mode, rows in runs.items()}
    lines = ["| load | dtype | block | density | pass | full us | copy only us | math only us "
             "| eff. | copy-only eff. | math-only eff. |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for key, full in by_mode["full"].items():
        others = [by_mode[m].get(key) for m in ("copy only", "math only")]
        if any(o is None for o in others):
            continue
        # Each run's own dense time: the efficiencies compare like with like within a run.
        times = [full] + others
        us = " | ".join(f"{r['sparse_s'] * 1e6:.1f}" for r in times)
        eff = " | ".join(f"{r['dense_s'] * r['density'] / r['sparse_s']:.0%}" for r in times)
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]:.0%} | {key[4]} | {us} | {eff} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="/tmp/bsmm-bounds", help="folder for the three runs' JSON")
    args, bench_args = parser.parse_known_args()
    bench_args = bench_args or ["--workloads", "T", "--dtype", "float16"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = {mode: run_bench(mode, options, bench_args, out) for mode, options in MODES.items()}
    print(table(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
