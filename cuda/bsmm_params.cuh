// The parameters of one bsmm_matmul / bsmm_matmul_tma launch, passed by value as one struct.
//
// bsmm/backends/cuda/params.py (MatmulParams) mirrors it field for field, in this order, each
// field 8 bytes; tests/backends/cuda/test_params.py reads this file and compares the two. A new
// field goes at the end of both, and the host fills it by name.
#pragma once

namespace bsmm {

struct MatmulParams {
    const void* act;         // fprop x, bprop dy, updat x
    const void* other;       // fprop/bprop: the weight blocks (nnzb, BS, BS); updat: dy
    void* out;               // fprop y, bprop dx, updat dW
    const int4* segments;    // (unit, begin, end, part) per thread-block column (bsmm/backends/cuda/planner.py)
    const int2* units;       // (first workspace slot, parts) per output unit
    const int2* table;       // the step table
    float* workspace;        // float32 partial sums of units cut into parts
    int* counters;           // parts arrived per (unit, tile); each launch leaves them at 0
    const void* bias;        // BiasAct: one element per output feature, or null (no bias)
    void* pre;               // BiasAct: the pre-activation, laid out as out, or null (not kept)
    long long n_rows;        // N: rows of the batch (fprop/bprop), batch rows summed (updat)
    long long ld_act;        // elements between rows of act (feature axis 0: of its features)
    long long ld_other;      // updat: elements between rows of dy; fprop/bprop: unused
    long long ld_out;        // fprop/bprop: elements between rows of out
    long long out_blocks;    // fprop/bprop: output features / BS (column groups stop there); updat: unused
    long long accumulate;    // 1: add the result to what out holds (rounded once)
    long long band_rows;     // fprop/bprop: row tiles per band of the visiting order (banded_tile)
    const void* gate;        // per-block gates, nnzb elements of the weights' type: closed (0) blocks are skipped
                             // (bsmm_gates.cuh); null: none
};

}  // namespace bsmm
