// The math of a step (mma.sync m16n8k16, exact float32 SIMT, wgmma on sm_90a) and the main
// loops that feed it from the stages. Included by bsmm_matmul.cu.
#pragma once

#include "bsmm_kernel_traits.cuh"
#include "bsmm_loads.cuh"
#include "bsmm_wgmma.cuh"

namespace bsmm {

// One step of mma.sync m16n8k16 on a stage: this warp's WTM x WTN of A[BM x BK] · B[BK x BN].
// a_frags (A_KEPT > 1, grouped updat) keeps a step's A fragments: with load_a false they are
// reused instead of read again from the stage.
template <class K, typename T, int A_KEPT>
__device__ __forceinline__ void mma16_step(float (&acc)[K::ACC], T* a, T* b, unsigned (&a_frags)[A_KEPT][K::MI][4],
                                           bool load_a) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int wm0 = (warp % K::WARPS_M) * K::WTM, wn0 = (warp / K::WARPS_M) * K::WTN;
#pragma unroll
    for (int kk = 0; kk < K::BK; kk += 16) {
        unsigned(&af)[K::MI][4] = a_frags[A_KEPT == 1 ? 0 : kk / 16];
        unsigned bf[K::NJ][2];
        if (load_a) {
#pragma unroll
            for (int i = 0; i < K::MI; ++i) {
                const int mb = wm0 + i * 16;
                if (K::A_KMAJOR)
                    ldmatrix_x4<false>(af[i], K::a_at(a, mb + lane % 16, kk + (lane / 16) * 8));
                else
                    ldmatrix_x4<true>(af[i], K::a_at(a, mb + ((lane / 8) % 2) * 8, kk + lane % 8 + (lane / 16) * 8));
            }
        }
#pragma unroll
        for (int j = 0; j + 1 < K::NJ; j += 2) {
            const int nb = wn0 + j * 8, mat = lane / 8;
            unsigned r[4];
            if (K::B_KMAJOR)
                ldmatrix_x4<false>(r, K::b_at(b, kk + (mat % 2) * 8, nb + lane % 8 + (mat / 2) * 8));
            else
                ldmatrix_x4<true>(r, K::b_at(b, kk + lane % 8 + (mat % 2) * 8, nb + (mat / 2) * 8));
            bf[j][0] = r[0]; bf[j][1] = r[1]; bf[j + 1][0] = r[2]; bf[j + 1][1] = r[3];
        }
        if constexpr (K::NJ % 2 == 1) {
            const int nb = wn0 + (K::NJ - 1) * 8, mat = (lane / 8) % 2;
            if (K::B_KMAJOR)
                ldmatrix_x2<false>(bf[K::NJ - 1], K::b_at(b, kk + mat * 8, nb + lane % 8));
            else
                ldmatrix_x2<true>(bf[K::NJ - 1], K::b_at(b, kk + lane % 8 + mat * 8, nb));
        }
#pragma unroll
        for (int i = 0; i < K::MI; ++i)
#pragma unroll
            for (int j = 0; j < K::NJ; ++j) {
                float(&d)[4] = *reinterpret_cast<float(*)[4]>(&acc[(i * K::NJ + j) * 4]);
                Mma<T>::run(d, af[i], bf[j]);
            }
    }
}

// RUN adjacent elements of a stage (at an offset that is a multiple of RUN) in one vector load.
template <int RUN, typename T>
__device__ __forceinline__ void load_run(const T* p, float (&out)[RUN]) {
    struct alignas(RUN * sizeof(T)) Run { T v[RUN]; };
    const Run r = *reinterpret_cast<const Run*>(p);
#pragma unroll
    for (int e = 0; e < RUN; ++e) out[e] = Elem<T>::to_float(r.v[e]);
}

// A SIMT thread's COUNT rows (of M or N, in runs of RUN, see Kernel::simt_row) of one operand at
// depths k0 .. k0 + 3: from a K-major stage one 4-deep load a row, otherwise one load a run and depth.
template <bool KMAJOR, int COUNT, int RUN, int THREADS, int PITCH, typename T>
__device__ __forceinline__ void load_simt_operand(float (&v)[COUNT][4], const T* s, int t, int k0) {
#pragma unroll
    for (int i = 0; i < COUNT; i += RUN) {
        const int row = (i / RUN) * THREADS * RUN + t * RUN;
        if constexpr (KMAJOR) {
#pragma unroll
            for (int e = 0; e < RUN; ++e) load_run<4>(s + (row + e) * PITCH + k0, v[i + e]);
        } else {
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) {
                float run[RUN];
                load_run<RUN>(s + (k0 + kk) * PITCH + row, run);
#pragma unroll
                for (int e = 0; e < RUN; ++e) v[i + e][kk] = run[e];
            }
        }
    }
}

// One step of exact float32 (SIMT) math, 4 deep at a time. Scalar shared-memory reads, one per
// row and column per depth, bounded these kernels (S fp32 fprop at 10 %: about 6 loads per 8
// FFMA, 49 us against 20 us of weight traffic); vector runs cut that to (TM + TN) / 4 loads or
// fewer per TM x TN FFMAs.
template <class K, typename T>
__device__ __forceinline__ void simt_step(float (&acc)[K::ACC], const T* a, const T* b) {
    const int tx = threadIdx.x % K::TX, ty = threadIdx.x / K::TX;
#pragma unroll 2
    for (int k0 = 0; k0 < K::BK; k0 += 4) {
        float av[K::TM][4], bv[K::TN][4];
        load_simt_operand<K::A_KMAJOR, K::TM, K::RM, K::TY, K::A_PITCH>(av, a, ty, k0);
        load_simt_operand<K::B_KMAJOR, K::TN, K::RN, K::TX, K::B_PITCH>(bv, b, tx, k0);
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
#pragma unroll
            for (int i = 0; i < K::TM; ++i)
#pragma unroll
                for (int j = 0; j < K::TN; ++j) acc[i * K::TN + j] = fmaf(av[i][kk], bv[j][kk], acc[i * K::TN + j]);
    }
}

// The main loop: a STAGES-deep cp.async pipeline feeding tensor-core or SIMT math.
// load(step, a_stage, b_stage) issues the copies of one step's A and B tiles.
// skip(step): this warp has nothing to multiply in that step (column groups).
// keep_a(step) (grouped updat): the A fragments of the previous step still hold this step's A
// tile; they stay in registers and the stage's A tile (not copied) is not read.
template <class K, typename T, class Load, class After, class Skip, class KeepA>
__device__ __forceinline__ void main_loop(Load&& load, int n_steps, T* smem, float (&acc)[K::ACC], After&& after,
                                          Skip&& skip, KeepA&& keep_a) {
    const int tid = threadIdx.x;
    const Stages<K, T, Load> stages(smem, load);
    stages.template zero_and_start<K::STAGES - 1>(acc, n_steps);
    const int warp = tid / 32, lane = tid % 32;
    const int wm0 = (warp % K::WARPS_M) * K::WTM, wn0 = (warp / K::WARPS_M) * K::WTN;
    // Tensor-core A fragments of a whole step, kept across steps where keep_a allows (grouped
    // updat only: one BK-deep step, few registers); other kernels load them per 16-deep slice.
    // Grouped updat's loader skips the copy of a kept A tile, so its stage holds another step's
    // data (or nothing): the fragments must then be kept whatever BK is, one 16-deep slice too.
    constexpr bool KEEPS_A = K::GROUPED && K::MATH == Math::Tensor16;
    constexpr int A_KEPT = KEEPS_A ? K::BK / 16 : 1;
    unsigned a_frags[A_KEPT][K::MI > 0 ? K::MI : 1][4];  // (SIMT tiles have no MI)
    for (int step = 0; step < n_steps; ++step) {
        cp_async_wait<K::STAGES - 2>();
        __syncthreads();
        // The stage refilled here was read in the previous iteration, which every thread has finished.
        if (step + K::STAGES - 1 < n_steps) stages.fill(step + K::STAGES - 1);
        cp_async_commit();
        if (skip(step)) continue;
#ifdef BSMM_PROBE_COPY_ONLY
        after(step, acc);  // (grouped updat stores a block a step)
        continue;
#endif
        T* a = stages.a(step);
        T* b = stages.b(step);
        if constexpr (K::MATH == Math::Tensor16) {
            mma16_step<K, T, A_KEPT>(acc, a, b, a_frags, !KEEPS_A || !keep_a(step));
        } else if constexpr (K::MATH == Math::Tf32) {
#pragma unroll
            for (int kk = 0; kk < K::BK; kk += 8) {
                unsigned af[K::MI][4], bf[K::NJ][2];
                const int r = lane / 4, c = lane % 4;
#pragma unroll
                for (int i = 0; i < K::MI; ++i) {
                    const int mb = wm0 + i * 16;
                    af[i][0] = to_tf32(*K::a_at(a, mb + r, kk + c));
                    af[i][1] = to_tf32(*K::a_at(a, mb + r + 8, kk + c));
                    af[i][2] = to_tf32(*K::a_at(a, mb + r, kk + c + 4));
                    af[i][3] = to_tf32(*K::a_at(a, mb + r + 8, kk + c + 4));
                }
#pragma unroll
                for (int j = 0; j < K::NJ; ++j) {
                    bf[j][0] = to_tf32(*K::b_at(b, kk + c, wn0 + j * 8 + r));
                    bf[j][1] = to_tf32(*K::b_at(b, kk + c + 4, wn0 + j * 8 + r));
                }
#pragma unroll
                for (int i = 0; i < K::MI; ++i)
#pragma unroll
                    for (int j = 0; j < K::NJ; ++j) {
                        float(&d)[4] = *reinterpret_cast<float(*)[4]>(&acc[(i * K::NJ + j) * 4]);
                        mma_tf32(d, af[i], bf[j]);
                    }
            }
        } else {
            simt_step<K, T>(acc, a, b);
        }
        after(step, acc);
    }
    cp_async_wait<0>();
}

// One BK-deep step of a warpgroup on Hopper: its 64 rows of the A stage times the B stage, issued
// as asynchronous wgmma and committed as one group (the caller waits for it).
template <class K, typename T>
__device__ __forceinline__ void wgmma_step(float (&acc)[K::ACC], const T* a_stage, const T* b) {
    // This warpgroup's 64 rows of A: 64 K-major rows, or (updat, M-major) one 64-column panel
    // (row groups on feature axis 1: 64 / BS panels of BS columns).
    const T* a = a_stage + (threadIdx.x / 128) * 64 * K::BK;
    wgmma_fence();
    fence_registers(acc);
    if constexpr (K::ROWS_T && !K::A_KMAJOR) {
        // MN-major panels of BN (= BS) columns, BK rows of BN x 2 bytes, swizzled over that span:
        // 8-row atoms BN x 16 bytes apart along K (stride offset), panels BN x BK elements
        // apart along M (leading offset; B is a single panel). 16 rows of K start 16 BN
        // elements further, a whole number of atoms.
        constexpr int SWIZZLE = K::BN * sizeof(T);
        constexpr unsigned ATOMS = 8 * K::BN * sizeof(T), PANELS = K::BN * K::BK * sizeof(T);
#pragma unroll
        for (int kk = 0; kk < K::BK; kk += 16)
            Wgmma<T, K::BN>::template run<true, true>(acc, wgmma_descriptor<SWIZZLE>(a + kk * K::BN, PANELS, ATOMS),
                                                      wgmma_descriptor<SWIZZLE>(b + kk * K::BN, PANELS, ATOMS));
        wgmma_commit();
        fence_registers(acc);
        return;
    }
    // One instruction is 32 bytes deep: 16 half-precision elements or 8 TF32 ones.
    constexpr int KSTEP = 32 / sizeof(T);
#pragma unroll
    for (int kk = 0; kk < K::BK; kk += KSTEP) {
        // A: K-major rows of 128 bytes, atoms 1024 bytes apart along M; M-major (updat): rows
        // along K, atoms 1024 bytes apart along K, a single atom along M.
        const unsigned long long a_desc =
            K::A_KMAJOR ? wgmma_descriptor(a + kk, 16, 1024) : wgmma_descriptor(a + kk * 64, 1024, 1024);
#pragma unroll
        for (int nc = 0; nc < K::BN / K::WN; ++nc) {
            float(&d)[K::WN / 2] = *reinterpret_cast<float(*)[K::WN / 2]>(&acc[nc * K::WN / 2]);
            if constexpr (K::B_KMAJOR) {  // bprop: rows along N, K contiguous
                Wgmma<T, K::WN>::template run<false, false>(d, a_desc, wgmma_descriptor(b + nc * K::WN * K::BK + kk, 16, 1024));
            } else {  // fprop, updat: rows along K, N contiguous, 64-column panels BK rows long
                // N-major descriptor: leading offset = stride between 64-column panels along N
                // (measured on the H100: the swapped assignment fails), stride offset = 1024
                // bytes between 8-row atoms along K. A 64-wide instruction sees one panel.
                constexpr unsigned PANEL = K::WN == 64 ? 1024 : K::BK * 64 * sizeof(T);
                Wgmma<T, K::WN>::template run<!K::A_KMAJOR, true>(
                    d, a_desc, wgmma_descriptor(b + nc * (K::WN / 64) * K::BK * 64 + kk * 64, PANEL, 1024));
            }
        }
    }
    wgmma_commit();
    fence_registers(acc);
}

// One step of a column group on wgmma (K::COLS_W): for each of its K::R block rows r (entries
// of K::COLS + 1 ints: activation block, then block j or -1), this warpgroup's 64 rows of
// activation panel r times each present block (r, j), into block column j's BS / 2
// accumulators; absent blocks issue nothing (the test is uniform across the warpgroup).
template <class K, typename T, int BS>
__device__ __forceinline__ void wgmma_group_step(float (&acc)[K::ACC], const T* a_stage, const T* b_stage,
                                                 const int* entries) {
    // Rows of BS x 2 bytes swizzled over that span: 8-row atoms ATOMS bytes apart (stride offset;
    // the leading offset is unused, K and N each fit one atom). 16 elements further along K are
    // 32 bytes into a K-major row, or 16 rows further down an N-major block.
    constexpr int SWIZZLE = BS * sizeof(T);
    constexpr unsigned ATOMS = 8 * BS * sizeof(T);
    wgmma_fence();
    fence_registers(acc);
#pragma unroll
    for (int r = 0; r < K::R; ++r) {
        const int* blocks = entries + r * (K::COLS + 1) + 1;
        const T* a = a_stage + (r * K::BM + (threadIdx.x / 128) * 64) * BS;
#pragma unroll
        for (int j = 0; j < K::COLS; ++j) {
            // The same for every thread; the vote says so to ptxas, which otherwise serializes
            // every wgmma of the kernel behind this branch (C7520).
            if (!__all_sync(0xffffffffu, blocks[j] >= 0)) continue;
            float(&d)[BS / 2] = *reinterpret_cast<float(*)[BS / 2]>(&acc[j * BS / 2]);
            const T* b = b_stage + (r * K::COLS + j) * BS * BS;
#pragma unroll
            for (int kk = 0; kk < BS; kk += 16) {
                const unsigned long long a_desc = wgmma_descriptor<SWIZZLE>(a + kk, ATOMS, ATOMS);
                if constexpr (K::B_KMAJOR)  // bprop: B(k, n) = W[n][k], rows along N
                    Wgmma<T, BS>::template run<false, false>(d, a_desc, wgmma_descriptor<SWIZZLE>(b + kk, ATOMS, ATOMS));
                else  // fprop: B(k, n) = W[k][n], rows along K
                    Wgmma<T, BS>::template run<false, true>(d, a_desc,
                                                            wgmma_descriptor<SWIZZLE>(b + kk * BS, ATOMS, ATOMS));
            }
        }
    }
    wgmma_commit();
    fence_registers(acc);
}

// The sm_90a main loop: cp.async fills swizzled stages, each warpgroup multiplies its 64 rows
// with asynchronous wgmma and keeps one step's group in flight while the next is issued.
// The copies therefore run STAGES - 2 steps ahead (not STAGES - 1): the stage read one step
// ago may still be in use by the tensor cores until the wait after the next issue.
template <class K, typename T, class Load>
__device__ __forceinline__ void main_loop_wgmma(Load&& load, int n_steps, T* smem, float (&acc)[K::ACC]) {
    static_assert(K::STAGES >= 3, "wgmma pipeline: one stage in flight, one being read, one filling");
    constexpr int AHEAD = K::STAGES - 2;
    const Stages<K, T, Load> stages(smem, load);
    stages.template zero_and_start<AHEAD>(acc, n_steps);
    for (int step = 0; step < n_steps; ++step) {
        cp_async_wait<AHEAD - 1>();
        fence_proxy_async();
        __syncthreads();
        if (step + AHEAD < n_steps) stages.fill(step + AHEAD);
        cp_async_commit();
#ifndef BSMM_PROBE_COPY_ONLY
        wgmma_step<K, T>(acc, stages.a(step), stages.b(step));
        wgmma_wait<1>();
#endif
    }
    wgmma_wait<0>();
    fence_registers(acc);
    cp_async_wait<0>();
}

template <class K, typename T, class Load, class After, class Skip>
__device__ __forceinline__ void main_loop(Load&& load, int n_steps, T* smem, float (&acc)[K::ACC], After&& after,
                                          Skip&& skip) {
    main_loop<K, T>(load, n_steps, smem, acc, after, skip, [](int) { return false; });
}

template <class K, typename T, class Load, class After>
__device__ __forceinline__ void main_loop(Load&& load, int n_steps, T* smem, float (&acc)[K::ACC], After&& after) {
    main_loop<K, T>(load, n_steps, smem, acc, after, [](int) { return false; });
}

template <class K, typename T, class Load>
__device__ __forceinline__ void main_loop(Load&& load, int n_steps, T* smem, float (&acc)[K::ACC]) {
    main_loop<K, T>(load, n_steps, smem, acc, [](int, float (&)[K::ACC]) {});
}

}  // namespace bsmm
