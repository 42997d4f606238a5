// The epilogue: accumulators to outputs (stores, accumulate, float32 partials of cut columns
// and their ordered reduction). Included by bsmm_matmul.cu.
#pragma once

#include "bsmm_kernel_traits.cuh"
#include "bsmm_epilogue_types.cuh"

namespace bsmm {

// Calls f(index into acc, tile row, tile column) for every accumulator this thread holds.
template <class K, typename F>
__device__ __forceinline__ void for_each_acc(F f) {
    const int tid = threadIdx.x;
    if constexpr (K::MATH == Math::Simt) {
        const int tx = tid % K::TX, ty = tid / K::TX;
#pragma unroll
        for (int i = 0; i < K::TM; ++i)
#pragma unroll
            for (int j = 0; j < K::TN; ++j) f(i * K::TN + j, K::simt_row(ty, i), K::simt_col(tx, j));
    } else if constexpr (K::MATH == Math::Wgmma) {
        // Per 64 x WN instruction tile, warp w of the warpgroup holds rows 16w + lane/4 (+8) and,
        // for each 8-column group j, columns 8j + 2(lane % 4) (+1): the m16n8 layout along N.
        const int row0 = (tid / 128) * 64 + ((tid / 32) % 4) * 16 + (tid % 32) / 4, col0 = (tid % 4) * 2;
#pragma unroll
        for (int nc = 0; nc < K::BN / K::WN; ++nc)
#pragma unroll
            for (int j = 0; j < K::WN / 8; ++j)
#pragma unroll
                for (int r = 0; r < 4; ++r)
                    f(nc * K::WN / 2 + j * 4 + r, row0 + (r / 2) * 8, nc * K::WN + j * 8 + col0 + r % 2);
    } else {
        const int warp = tid / 32, lane = tid % 32;
        const int wm0 = (warp % K::WARPS_M) * K::WTM, wn0 = (warp / K::WARPS_M) * K::WTN;
#pragma unroll
        for (int i = 0; i < K::MI; ++i)
#pragma unroll
            for (int j = 0; j < K::NJ; ++j)
#pragma unroll
                for (int r = 0; r < 4; ++r)
                    f((i * K::NJ + j) * 4 + r, wm0 + i * 16 + lane / 4 + (r / 2) * 8, wn0 + j * 8 + (lane % 4) * 2 + r % 2);
    }
}

// Writes (or adds, if accumulate) a thread block's BM x BN tile of one weight block's gradient.
template <class K, typename T, int BS>
__device__ __forceinline__ void store_block_tile(T* block_out, const float (&acc)[K::ACC], int m0, int n0, int accumulate) {
    if constexpr (K::MATH == Math::Simt) {
        for_each_acc<K>([&](int i, int m, int n) {
            T* dst = block_out + (m0 + m) * BS + n0 + n;
            *dst = Elem<T>::from_float(acc[i] + (accumulate ? Elem<T>::to_float(*dst) : 0.f));
        });
    } else {
        for_each_acc<K>([&](int i, int m, int n) {
            if (i % 2) return;  // fragments hold column pairs (i, i + 1) = (n, n + 1)
            store_pair(block_out + (m0 + m) * BS + n0 + n, acc[i], acc[i + 1], accumulate);
        });
    }
}

// Writes K::VEC consecutive outputs from float sums (added to what dst holds if accumulate) as
// one 16-byte store.
template <class K, typename T>
__device__ __forceinline__ void store_chunk(T* dst, const float* sums, int accumulate) {
    uint4 pack = accumulate ? *reinterpret_cast<const uint4*>(dst) : make_uint4(0, 0, 0, 0);
    T* v = reinterpret_cast<T*>(&pack);
#pragma unroll
    for (int e = 0; e < K::VEC; ++e) v[e] = Elem<T>::from_float(sums[e] + (accumulate ? Elem<T>::to_float(v[e]) : 0.f));
    *reinterpret_cast<uint4*>(dst) = pack;
}

// The same for grouped updat, through shared memory: the tile is parked in ``staging`` as floats
// and each thread then writes whole 16-byte runs of the block's rows (one 2 KiB run for a
// 32 x 32 block). Fragments would store 4-byte pairs, eight rows a warp instruction, and those
// partial-sector stores kept the L2 busy (workload S updat, fp16, 50 %: L2 83 %, DRAM 31 %).
// Called by every thread; the caller's next barrier guards ``staging`` before its next use.
template <class K, typename T, int BS>
__device__ __forceinline__ void store_block_tile_staged(T* block_out, const float (&acc)[K::ACC], int m0, int n0,
                                                        int accumulate, float* staging) {
    constexpr int PITCH = K::STAGING_PITCH, CHUNKS = K::BM * K::BN / K::VEC;
    static_assert(K::STAGED_STORE, "tensor-core fragments: column pairs");
    for_each_acc<K>([&](int i, int m, int n) {
        if (i % 2 == 0) *reinterpret_cast<float2*>(staging + m * PITCH + n) = make_float2(acc[i], acc[i + 1]);
    });
    __syncthreads();
#pragma unroll
    for (int c = threadIdx.x; c < CHUNKS; c += K::NT) {
        const int row = c / (K::BN / K::VEC), col = (c % (K::BN / K::VEC)) * K::VEC;
        store_chunk<K, T>(block_out + (m0 + row) * BS + n0 + col, staging + row * PITCH + col, accumulate);
    }
}

// The tile of a transposed wgmma row group (K::ROWS_T): accumulator (m, n) is element (n, m % BS)
// of the group's block m / BS. Parked transposed in `staging` as floats (rows BS + 4 apart: the
// fragment writes of a warp then hit 32 different banks), then written as 16-byte runs of the
// blocks' rows; absent blocks of the group are not written, gated-off ones (bsmm_gates.cuh: copy
// entry -1, storage index kept) are written as zeros. Called by the K::NT consumer threads once the
// stages are free.
template <class K, typename T, int BS>
__device__ __forceinline__ void store_row_group_transposed(T* __restrict__ out, const float (&acc)[K::ACC],
                                                           const int* group, int accumulate, float* staging) {
    constexpr int PITCH = BS + 4, CHUNKS = K::COLS * BS * BS / K::VEC, BLOCK_CHUNKS = BS * BS / K::VEC;
    static_assert(K::ROWS_T && K::COLS * BS * PITCH * 4 <= K::STAGES * (K::A_STAGE + K::B_STAGE) * (int)sizeof(T),
                  "the staged group fits the stages");
    sync_threads_named<K::NT>();  // both warpgroups are done with the stages
    for_each_acc<K>([&](int i, int m, int n) { staging[((m / BS) * BS + n) * PITCH + m % BS] = acc[i]; });
    sync_threads_named<K::NT>();
#pragma unroll
    for (int c = threadIdx.x; c < CHUNKS; c += K::NT) {
        const int j = c / BLOCK_CHUNKS, row = (c % BLOCK_CHUNKS) / (BS / K::VEC), col = (c % (BS / K::VEC)) * K::VEC;
        const int id = group[1 + K::COLS + j];
        if (id < 0) continue;
        T* dst = out + (long long)id * BS * BS + row * BS + col;
        if (group[1 + j] >= 0)
            store_chunk<K, T>(dst, staging + (j * BS + row) * PITCH + col, accumulate);
        else if (!accumulate)  // gated off (bsmm_gates.cuh): nothing was copied for it, its gradient is 0
            *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
    }
}

// A unit cut into parts: parks this part's sums in the workspace; the last part to arrive adds
// all parts in part order into acc and returns true, the others return false. Called by the
// K::NT threads that hold accumulators (all of the block, or the consumers of bsmm_matmul_tma).
template <class K>
__device__ __forceinline__ bool reduce_parts(float (&acc)[K::ACC], float* __restrict__ workspace, int* __restrict__ counters,
                                             int2 unit_info, int unit, int part, int tiles_per_unit, int tile_in_unit,
                                             int& last_part) {
    const long long slot_stride = (long long)K::ACC * K::NT;
    float* mine = workspace + ((long long)(unit_info.x + part) * tiles_per_unit + tile_in_unit) * slot_stride;
#pragma unroll
    for (int i = 0; i < K::ACC; ++i) mine[i * K::NT + threadIdx.x] = acc[i];
    __threadfence();
    sync_threads_named<K::NT>();
    if (threadIdx.x == 0) {
        int* counter = counters + (long long)unit * tiles_per_unit + tile_in_unit;
        const int arrived = atomicAdd(counter, 1);
        last_part = arrived == unit_info.y - 1;
        if (last_part) *counter = 0;  // ready for the next launch
    }
    sync_threads_named<K::NT>();
    if (!last_part) return false;
    __threadfence();
#pragma unroll
    for (int i = 0; i < K::ACC; ++i) acc[i] = 0.f;
    for (int p = 0; p < unit_info.y; ++p) {
        const float* theirs = workspace + ((long long)(unit_info.x + p) * tiles_per_unit + tile_in_unit) * slot_stride;
#pragma unroll
        for (int i = 0; i < K::ACC; ++i) acc[i] += __ldcg(theirs + i * K::NT + threadIdx.x);
    }
    return true;
}

// Writes an fprop/bprop output tile through the epilogue E (bsmm_epilogue_types.cuh): rows
// m0.. of the batch, columns n0.. of output block column (row) `unit`.
template <class K, class E, typename T, int BS>
__device__ __forceinline__ void store_sparse_tile(const MatmulParams& p, const float (&acc)[K::ACC], int unit, int m0,
                                                  int n0) {
    // Tensor-core fragments hold column pairs (i, i + 1) = (n, n + 1): with features along rows
    // and aligned rows, each pair is one 4- or 8-byte access (and so is the read of accumulate).
    constexpr bool PAIRS = K::OUT_AXIS1 && K::ALIGNED && K::MATH != Math::Simt;
    const int n_rows = (int)p.n_rows, accumulate = (int)p.accumulate;
    const long long ld_out = p.ld_out;
    for_each_acc<K>([&](int i, int m, int n) {
        if (PAIRS && i % 2) return;
        const int row = m0 + m;
        if (row >= n_rows) return;
        const long long feature = (long long)unit * (K::COLS > 1 ? K::BN : BS) + n0 + n;
        // Column groups: the last group may reach past the output.
        if (K::COLS > 1 && feature >= p.out_blocks * BS) return;
        const long long at = K::OUT_AXIS1 ? row * ld_out + feature : feature * ld_out + row;
        if constexpr (PAIRS)
            E::template pair<T>(p, at, feature, acc[i], acc[i + 1], accumulate);
        else
            E::template one<T>(p, at, feature, acc[i], accumulate);
    });
}

}  // namespace bsmm
