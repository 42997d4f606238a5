"""The sparse-wide LSTM's recurrent fprop (H 12288 -> 4H, 10 %, block 32, bfloat16) at N 8 and 32, three
calls each, for Nsight Compute: which unit bounds the per-step pass (results/v24/).

    ncu --target-processes all -k regex:bsmm_matmul --launch-skip 2 --launch-count 1 \
        --metrics gpu__time_duration.sum,dram__bytes_read.sum,lts__t_bytes.sum,... \
        python tools/probes/ncu_lstm_stream.py
"""

from __future__ import annotations

import cupy

import bsmm
from bsmm.layouts.small_world import small_world_layout
from bsmm.nn.lstm_gates import gate_layout

HIDDEN_BLOCKS = 12288 // 32


def main() -> None:
    graph = small_world_layout(HIDDEN_BLOCKS, round(0.1 * HIDDEN_BLOCKS ** 2), "barabasi_albert", 0)
    op = bsmm.BlocksparseMatMul(gate_layout(graph, HIDDEN_BLOCKS), block_size=32)
    weights = cupy.random.standard_normal(op.w_shape, dtype=cupy.float32).astype("bfloat16")
    for rows in (8, 32):  # the profiled launch is the third of each: kernels loaded, plans made
        states = cupy.random.standard_normal((rows, op.C), dtype=cupy.float32).astype("bfloat16")
        gates = cupy.empty((rows, op.K), "bfloat16")
        for _ in range(3):
            op.fprop(states, weights, out=gates)
    cupy.cuda.Device().synchronize()


if __name__ == "__main__":
    main()
