// Per-block gates in the matmul kernels: a block whose gate is 0 is skipped (its copies and its
// multiplications), with the same plan and the same step tables.
//
// The caller passes the gated weights (g ⊙ W, bsmm/matmul.py gated_weights) and p.gate, the
// gates themselves (nnzb elements of the weights' type, null: no gates). So a closed block holds
// zeros and skipping it changes no output: the gate only tells the kernel which blocks it may
// leave out. A path that does not read p.gate computes the same result (the grouped updat and
// the transposed-weights fprop do not), and every output a launch owns is still written.
//
// fprop/bprop drop the closed blocks while staging a part's entries in shared memory
// (stage_open_entries): the kernel steps over the open ones only. updat leaves out a closed
// block's steps (one block a unit: no steps; row groups: that block's copies and its
// accumulators) and stores zeros for it.
#pragma once

#include "bsmm_common.cuh"

namespace bsmm {

// Whether block ``block`` (a storage index into the weights) is gated off; false without gates
// or for an absent entry (negative).
template <typename T>
__device__ __forceinline__ bool gate_closed(const void* gate, int block) {
    return gate != nullptr && block >= 0 && Elem<T>::to_float(static_cast<const T*>(gate)[block]) == 0.f;
}

// Copies the rows of src[0, count) (ROW ints each, BLOCKS weight blocks from int FIRST on, -1 where
// absent) to dst in order, closed blocks turned into -1 and rows with no open block left out;
// returns how many rows dst holds (the same in every thread). Called by all THREADS threads of
// the block together (it synchronizes them; warp_counts: THREADS / 32 ints of shared memory).
template <typename T, int ROW, int FIRST, int BLOCKS, int THREADS>
__device__ __forceinline__ int stage_open_entries(int* dst, const int* __restrict__ src, int count, const void* gate,
                                                  int* warp_counts) {
    static_assert(THREADS % 32 == 0, "whole warps");
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    int kept = 0;
    for (int base = 0; base < count; base += THREADS) {  // (the same trip count in every thread)
        const int i = base + tid;
        int row[ROW];
        bool open = false;
        if (i < count) {
#pragma unroll
            for (int c = 0; c < ROW; ++c) row[c] = src[(long long)i * ROW + c];
#pragma unroll
            for (int j = 0; j < BLOCKS; ++j) {
                int& block = row[FIRST + j];
                if (gate_closed<T>(gate, block)) block = -1;
                open |= block >= 0;
            }
        }
        const unsigned ballot = __ballot_sync(0xffffffffu, open);
        if (lane == 0) warp_counts[warp] = __popc(ballot);
        __syncthreads();
        int before = kept, total = kept;
#pragma unroll
        for (int w = 0; w < THREADS / 32; ++w) {
            before += w < warp ? warp_counts[w] : 0;
            total += warp_counts[w];
        }
        if (open) {
            int* out = dst + (long long)(before + __popc(ballot & ((1u << lane) - 1u))) * ROW;
#pragma unroll
            for (int c = 0; c < ROW; ++c) out[c] = row[c];
        }
        kept = total;
        __syncthreads();  // warp_counts is rewritten by the next round; dst is complete after the last
    }
    return kept;
}

}  // namespace bsmm
