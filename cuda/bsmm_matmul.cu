// The three block-sparse matmul passes as one family of gather-GEMM kernels.
//
// Every pass computes output tiles Out[BM x BN] = sum over steps of A[BM x BK] · B[BK x BN]:
//   fprop  y  = x·W      A = x rows,   B = W blocks of one block column   (sparse K)
//   bprop  dx = dy·Wᵀ    A = dy rows,  B = W blocks of one block row, transposed
//   updat  dW = xᵀ·dy    A = x columns, B = dy columns, K runs over the batch (dense K)
// For fprop/bprop the K dimension is the concatenation of the blocks listed in a
// segment of the step table, so absent blocks are never touched. A long block
// column (or row) is cut into several segments; each writes a float32 partial to
// a workspace and the last segment to finish sums the partials in segment order,
// so results do not depend on timing (no float atomics on results).
//
// feature_axis=1 stores activations (N, features) row-major, feature_axis=0 stores
// them (features, N); the loaders and the epilogue read either through address
// functions, so the same main loop serves both.
//
// The kernels below are assembled from, in order: bsmm_kernel_traits.cuh (struct Kernel and the
// enums), bsmm_loads.cuh (copies into the stages), bsmm_math.cuh (a step's math and the main
// loops) and bsmm_epilogue.cuh (outputs and partial sums).
#include "bsmm_common.cuh"
#include "bsmm_tma.cuh"
#include "bsmm_wgmma.cuh"
#include "bsmm_kernel_traits.cuh"
#include "bsmm_loads.cuh"
#include "bsmm_math.cuh"
#include "bsmm_epilogue.cuh"
#include "bsmm_gates.cuh"
#include "bsmm_params.cuh"

namespace bsmm {

// Segment table entry: (output unit, begin, end, part). For fprop/bprop a unit is an
// output block column/row and [begin, end) indexes the step table; for updat a unit
// is a weight block and [begin, end) are batch rows. units[u] = (first workspace slot, parts).
template <typename T, int BS, int BM, int BN, int BK, int WARPS_M, int WARPS_N, int STAGES, Math MATH, Pass PASS,
          FeatureAxis AXIS, int ALIGNED, int GROUPED, int COLS, class EPI>
__global__ void __launch_bounds__(WARPS_M* WARPS_N * 32) bsmm_matmul(const __grid_constant__ MatmulParams p) {
    using K = Kernel<T, BS, BM, BN, BK, WARPS_M, WARPS_N, STAGES, MATH, PASS, AXIS, ALIGNED, GROUPED, COLS>;
    static_assert(PASS != Pass::Updat || EPI::PLAIN, "weight gradients are stored as they are");
    const T* __restrict__ act = static_cast<const T*>(p.act);
    const T* __restrict__ other = static_cast<const T*>(p.other);
    T* __restrict__ out = static_cast<T*>(p.out);
    const int4* __restrict__ segments = p.segments;
    const int2* __restrict__ units = p.units;
    const int2* __restrict__ table = p.table;
    float* __restrict__ workspace = p.workspace;
    int* __restrict__ counters = p.counters;
    const int n_rows = (int)p.n_rows, ld_act = (int)p.ld_act, ld_other = (int)p.ld_other, accumulate = (int)p.accumulate;
    wait_for_prior_grid();
    extern __shared__ __align__(16) unsigned char smem_raw[];
    // wgmma reads swizzle atoms that must start on 1024-byte boundaries (SMEM_BYTES has the slack).
    T* smem = reinterpret_cast<T*>(MATH == Math::Wgmma ? (reinterpret_cast<size_t>(smem_raw) + 1023) & ~size_t(1023)
                                                       : reinterpret_cast<size_t>(smem_raw));
    __shared__ int last_part;
    // A part's entries of the step table, read once: the loaders would otherwise wait on a
    // dependent global load before every copy they issue.
    __shared__ int2 part_table[(PASS == Pass::Updat && !GROUPED) || COLS > 1 ? 1 : BSMM_MAX_PART];
    __shared__ int group_steps[COLS > 1 ? (PASS == Pass::Updat ? 2 * COLS + 1 : BSMM_MAX_PART * (COLS + 1)) : 1];
    __shared__ int warp_counts[K::NT / 32];  // (stage_open_entries)

    // updat: y and z index sub-tiles of one weight block, nothing to reorder.
    const int2 tile = PASS == Pass::Updat ? make_int2(blockIdx.x, blockIdx.y) : banded_tile((int)p.band_rows);
    const int4 seg = segments[tile.x];
    if constexpr (GROUPED) {
        // seg = (first weight block, end block, -, -); every block takes the whole batch in one step.
        const int count = seg.y - seg.x;
        for (int i = threadIdx.x; i < count; i += WARPS_M * WARPS_N * 32) part_table[i] = table[seg.x + i];
        __syncthreads();
        Operands<K, T, BS> ops;
        ops.act = act;
        ops.other = other;
        ops.table = part_table;
        ops.n_rows = n_rows;
        ops.ld_act = ld_act;
        ops.ld_other = ld_other;
        ops.seg_begin = 0;
        ops.seg_end = n_rows;
        ops.m0 = blockIdx.y * BM;
        ops.n0 = blockIdx.z * BN;
        ops.block = make_int2(0, 0);
        FastLoader<K, T, BS> loader;
        loader.init(ops, threadIdx.x);
        float acc[K::ACC];
        float* staging = reinterpret_cast<float*>(smem + K::STAGES * (K::A_STAGE + K::B_STAGE));
        main_loop<K, T>(loader, count, smem, acc, [&](int step, float(&sums)[K::ACC]) {
            T* block_out = out + (long long)(seg.x + step) * BS * BS;
            if constexpr (K::STAGED_STORE)
                store_block_tile_staged<K, T, BS>(block_out, sums, ops.m0, ops.n0, accumulate, staging);
            else
                store_block_tile<K, T, BS>(block_out, sums, ops.m0, ops.n0, accumulate);
#pragma unroll
            for (int i = 0; i < K::ACC; ++i) sums[i] = 0.f;
        }, [](int) { return false; }, [&](int step) { return ops.same_a(step); });
        return;
    }
    const int unit = seg.x, part = seg.w;
    const int2 unit_info = units[unit];
    const int tiles_per_unit = gridDim.y * gridDim.z;
    const int tile_in_unit = blockIdx.z * gridDim.y + tile.y;

    Operands<K, T, BS> ops;
    ops.act = act;
    ops.other = other;
    ops.table = PASS == Pass::Updat ? table : part_table;
    ops.n_rows = n_rows;
    ops.ld_act = ld_act;
    ops.ld_other = ld_other;
    ops.seg_begin = seg.y;
    ops.seg_end = seg.z;
    ops.m0 = tile.y * BM;
    ops.n0 = blockIdx.z * BN;
    int n_steps;
    if constexpr (PASS == Pass::Updat && COLS > 1) {
        // The group's entry: 2 COLS + 1 ints (see FastLoader::init).
        const int* entry = reinterpret_cast<const int*>(table) + (long long)unit * (2 * COLS + 1);
        for (int i = threadIdx.x; i < 2 * COLS + 1; i += K::NT) group_steps[i] = entry[i];
        __syncthreads();
        ops.block = make_int2(group_steps[0], 0);
        n_steps = (seg.z - seg.y + BK - 1) / BK;
        bool open = p.gate == nullptr;  // a group whose blocks are all closed copies nothing
        for (int j = 0; j < COLS && !open; ++j) open = group_steps[1 + COLS + j] >= 0 && !gate_closed<T>(p.gate, group_steps[1 + COLS + j]);
        if (!open) n_steps = 0;
    } else if constexpr (PASS == Pass::Updat) {
        ops.block = table[unit];
        n_steps = gate_closed<T>(p.gate, unit) ? 0 : (seg.z - seg.y + BK - 1) / BK;
    } else if constexpr (COLS > 1) {
        // The table holds COLS + 1 ints a step (see GroupLoader).
        ops.block = make_int2(0, 0);
        n_steps = seg.z - seg.y;
        const int* steps = reinterpret_cast<const int*>(table) + (long long)seg.y * (COLS + 1);
        if (p.gate != nullptr) {
            n_steps = stage_open_entries<T, COLS + 1, 1, COLS, K::NT>(group_steps, steps, n_steps, p.gate, warp_counts);
        } else {
            for (int i = threadIdx.x; i < n_steps * (COLS + 1); i += K::NT) group_steps[i] = steps[i];
            __syncthreads();
        }
    } else {
        ops.block = make_int2(0, 0);
        int entries = seg.z - seg.y;
        if (p.gate != nullptr) {
            // The open entries only; the loaders read part_table[0, entries).
            entries = stage_open_entries<T, 2, 0, 1, K::NT>(reinterpret_cast<int*>(part_table),
                                                            reinterpret_cast<const int*>(table + seg.y), entries,
                                                            p.gate, warp_counts);
        } else {
            for (int i = threadIdx.x; i < entries; i += K::NT) part_table[i] = table[seg.y + i];
            __syncthreads();
        }
        ops.seg_begin = 0;  // the loaders read part_table[0, entries)
        ops.seg_end = entries;
        n_steps = (entries * BS + BK - 1) / BK;
    }

    float acc[K::ACC];
    if constexpr (PASS == Pass::Updat && COLS > 1) {
        FastLoader<K, T, BS> loader;
        loader.init(ops, threadIdx.x, group_steps);
        // Warps of an absent block (a row's last group may be short) only keep the pipeline going.
        // (A closed block's warps skip their math too: their accumulators stay 0, the block's gradient.)
        const int warp_col = (threadIdx.x / 32) / K::WARPS_M;
        const bool absent = group_steps[1 + warp_col] < 0 || gate_closed<T>(p.gate, group_steps[1 + COLS + warp_col]);
        main_loop<K, T>(loader, n_steps, smem, acc, [](int, float (&)[K::ACC]) {}, [&](int) { return absent; });
    } else if constexpr (COLS > 1) {
        GroupLoader<K, T, BS> loader;
        loader.init(ops, group_steps, threadIdx.x);
        const int warp_col = (threadIdx.x / 32) / K::WARPS_M;
        main_loop<K, T>(loader, n_steps, smem, acc, [](int, float (&)[K::ACC]) {},
                        [&](int step) { return group_steps[step * (COLS + 1) + 1 + warp_col] < 0; });
    } else if constexpr (MATH == Math::Wgmma) {
        FastLoader<K, T, BS> loader;
        loader.init(ops, threadIdx.x);
        main_loop_wgmma<K, T>(loader, n_steps, smem, acc);
    } else if constexpr (ALIGNED && (PASS == Pass::Updat || BK <= BS)) {
        FastLoader<K, T, BS> loader;
        loader.init(ops, threadIdx.x);
        main_loop<K, T>(loader, n_steps, smem, acc);
    } else {
        main_loop<K, T>(
            [&](int step, T* sa, T* sb) {
                load_tile<K, K::A_ROWS, K::A_COLS, K::A_PITCH>(
                    sa, [&](int r, int c, int& valid) { return ops.a_src(step, r, c, valid); }, threadIdx.x);
                load_tile<K, K::B_ROWS, K::B_COLS, K::B_PITCH>(
                    sb, [&](int r, int c, int& valid) { return ops.b_src(step, r, c, valid); }, threadIdx.x);
            },
            n_steps, smem, acc);
    }

    if (unit_info.y > 1 && !reduce_parts<K>(acc, workspace, counters, unit_info, unit, part, tiles_per_unit, tile_in_unit,
                                            last_part))
        return;

    if constexpr (PASS == Pass::Updat && COLS > 1) {
        for_each_acc<K>([&](int i, int m, int n) {
            const int id = group_steps[1 + COLS + n / BS];
            if (i % 2 == 0 && id >= 0) store_pair(out + (long long)id * BS * BS + m * BS + n % BS, acc[i], acc[i + 1], accumulate);
        });
        return;
    } else if constexpr (PASS == Pass::Updat) {
        store_block_tile<K, T, BS>(out + (long long)unit * BS * BS, acc, ops.m0, ops.n0, accumulate);
        return;
    }
    store_sparse_tile<K, EPI, T, BS>(p, acc, unit, ops.m0, ops.n0);
}

// The passes on Hopper with a copy warp: warp NT / 32 (one thread of it) fills the stages with
// TMA copies of whole swizzled tiles, counted in bytes on a "full" barrier per stage; the K::NT
// threads of the warps only wait on it, multiply (wgmma_step, or mma16_step on 64-byte
// swizzled rows) and release the stage on its "empty" barrier once they have read it. No
// thread computes copy addresses and no block-wide barrier runs per step, so the stages run
// STAGES - 1 steps ahead of the math (main_loop_wgmma: STAGES - 2, after a barrier a step).
// Half precision, feature axis 1, aligned, plain layouts (no act_blocks / weight_blocks); one
// thread block per output tile (a persistent variant that kept the ring running across tiles
// was slower: results/archive/RESULTS.md, v9). BOX = 64 (wgmma) or 32 (mma.sync) elements.
// act_map: the activations (N rows, features), boxes of BK features x BM rows (fprop, bprop)
// or BOX x BK batch rows (updat). other_map: fprop/bprop, the weight blocks as (blocks x BS
// rows, BS columns), boxes of BOX x BK (fprop: one BOX-column panel) or BK x BN (bprop:
// K-major); updat, dy as (N rows, K features), boxes of BOX x BK. out_map (read by wgmma
// tiles not cut into parts, written without accumulate; zeros for mma.sync): the output,
// (N rows, features) or (blocks x BS rows, BS columns) for updat, boxes of 64 x BM.
// Transposed updat row groups (K::ROWS_T, blocks 16 to 64): act_map and other_map hold x and dy,
// boxes of BS features x BK batch rows (feature axis 0: BK x BS), and the table one row-group
// entry per unit; out_map is unused. fprop/bprop column groups (K::COLS_W, blocks 16 to 64):
// boxes of BS features x BM rows and of whole weight blocks; the table holds COLS + 1 ints a
// step (see GroupLoader), the output tile spans COLS block columns (rows). Other parameters
// as bsmm_matmul's.
template <typename T, int BS, int BM, int BN, int BK, int WARPS_M, int WARPS_N, int STAGES, Math MATH, Pass PASS,
          FeatureAxis AXIS, int ALIGNED, int GROUPED, int COLS, class EPI>
__global__ void __launch_bounds__(WARPS_M* WARPS_N * 32 + 32)
    bsmm_matmul_tma(const __grid_constant__ MatmulParams p, const __grid_constant__ TensorMap act_map,
                    const __grid_constant__ TensorMap other_map, const __grid_constant__ TensorMap out_map) {
    using K = Kernel<T, BS, BM, BN, BK, WARPS_M, WARPS_N, STAGES, MATH, PASS, AXIS, ALIGNED, GROUPED, COLS, 1>;
    static_assert(PASS != Pass::Updat || EPI::PLAIN, "weight gradients are stored as they are");
    static_assert(!GROUPED && ALIGNED && (sizeof(T) == 2 || (MATH == Math::Wgmma && PASS == Pass::Bprop && COLS == 1) ||
                                          (K::ROWS_T && !K::AXIS1)) &&
                      (K::ROWS_T || K::COLS_W || (COLS == 1 && K::AXIS1 &&
                                     (MATH == Math::Wgmma ? PASS == Pass::Updat || BS % BK == 0
                                                          : MATH == Math::Tensor16 && PASS != Pass::Updat && BK == BS))),
                  "TMA: wgmma passes, or mma.sync fprop/bprop one block a step; one block (column) a tile, or "
                  "wgmma groups");
    // Columns of a box: 128 (wgmma) or 64 (mma.sync, BK = BN = 32) bytes, the swizzle span.
    constexpr int BOX = MATH == Math::Wgmma ? 128 / (int)sizeof(T) : 32;
    static_assert(MATH != Math::Wgmma || BM * BN <= STAGES * (K::A_STAGE + K::B_STAGE), "the stored tile fits the stages");
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    const T* __restrict__ act = static_cast<const T*>(p.act);
    const T* __restrict__ other = static_cast<const T*>(p.other);
    T* __restrict__ out = static_cast<T*>(p.out);
    const int4* __restrict__ segments = p.segments;
    const int2* __restrict__ units = p.units;
    const int2* __restrict__ table = p.table;
    float* __restrict__ workspace = p.workspace;
    int* __restrict__ counters = p.counters;
    const int n_rows = (int)p.n_rows, ld_act = (int)p.ld_act, ld_other = (int)p.ld_other, accumulate = (int)p.accumulate;
    wait_for_prior_grid();
    extern __shared__ __align__(16) unsigned char smem_raw[];
    // The 128-byte swizzle TMA writes and wgmma reads repeats every 1024 bytes from an aligned base.
    T* smem = reinterpret_cast<T*>((reinterpret_cast<size_t>(smem_raw) + 1023) & ~size_t(1023));
    T* const sa = smem;
    T* const sb = smem + STAGES * K::A_STAGE;
    __shared__ __align__(8) unsigned long long full[STAGES], empty[STAGES];
    __shared__ int last_part;
    __shared__ int2 part_table[PASS == Pass::Updat || K::COLS_W ? 1 : BSMM_MAX_PART];
    // Row groups: (block row, block column of each of the COLS blocks or -1, storage index or -1).
    __shared__ int group[K::ROWS_T ? 2 * COLS + 1 : 1];
    // Column groups: the part's entries, (activation feature block, weight block of each column or
    // -1), padded with absent ones (-1) to whole steps of K::R.
    __shared__ int group_steps[K::COLS_W ? (BSMM_MAX_PART + K::R) * (COLS + 1) : 1];
    __shared__ int warp_counts[(K::NT + 32) / 32];  // (stage_open_entries)

    // updat: y and z index sub-tiles of one weight block, nothing to reorder.
    const int2 tile = PASS == Pass::Updat ? make_int2(blockIdx.x, blockIdx.y) : banded_tile((int)p.band_rows);
    const int4 seg = segments[tile.x];
    const int unit = seg.x, part = seg.w;
    const int m0 = tile.y * BM, n0 = blockIdx.z * BN;
    // fprop/bprop: the part's (weight block, activation feature block) entries, BS / BK steps
    // each; updat: the part's batch rows [seg.y, seg.z), BK a step, of block (row, column).
    int n_steps = PASS == Pass::Updat ? (seg.z - seg.y + BK - 1) / BK
                  : K::COLS_W ? (seg.z - seg.y + K::R - 1) / K::R : (seg.z - seg.y) * (BS / BK);
    if constexpr (K::ROWS_T) {
        // A closed block of the group is left out of the copies (-1) but keeps its storage index:
        // store_row_group_transposed writes its zeros.
        const int* entry = reinterpret_cast<const int*>(table) + (long long)unit * (2 * COLS + 1);
        for (int i = threadIdx.x; i < 2 * COLS + 1; i += K::NT + 32)
            group[i] = i >= 1 && i <= COLS && gate_closed<T>(p.gate, entry[i + COLS]) ? -1 : entry[i];
    } else if constexpr (K::COLS_W) {
        const int* steps = reinterpret_cast<const int*>(table) + (long long)seg.y * (COLS + 1);
        int rows = seg.z - seg.y;
        if (p.gate != nullptr) {
            rows = stage_open_entries<T, COLS + 1, 1, COLS, K::NT + 32>(group_steps, steps, rows, p.gate, warp_counts);
            n_steps = (rows + K::R - 1) / K::R;
            for (int i = rows * (COLS + 1) + threadIdx.x; i < n_steps * K::R * (COLS + 1); i += K::NT + 32)
                group_steps[i] = -1;
        } else {
            const int present = rows * (COLS + 1);
            for (int i = threadIdx.x; i < n_steps * K::R * (COLS + 1); i += K::NT + 32)
                group_steps[i] = i < present ? steps[i] : -1;
        }
    } else if constexpr (PASS != Pass::Updat) {
        if (p.gate != nullptr) {
            const int open = stage_open_entries<T, 2, 0, 1, K::NT + 32>(
                reinterpret_cast<int*>(part_table), reinterpret_cast<const int*>(table + seg.y), seg.z - seg.y, p.gate,
                warp_counts);
            n_steps = open * (BS / BK);
        } else {
            for (int i = threadIdx.x; i < seg.z - seg.y; i += K::NT + 32) part_table[i] = table[seg.y + i];
        }
    } else if (gate_closed<T>(p.gate, unit)) {
        n_steps = 0;
    }
    if (threadIdx.x == K::NT) {
#pragma unroll
        for (int s = 0; s < STAGES; ++s) {
            mbarrier_init(&full[s], 1);            // the copy thread's arrive, then the bytes
            mbarrier_init(&empty[s], K::NT / 32);  // one arrive per multiplying warp
        }
        mbarrier_init_fence();
    }
    __syncthreads();
    if constexpr (K::ROWS_T) {
        // A group whose blocks are all closed copies and multiplies nothing.
        bool open = false;
        for (int j = 0; j < COLS; ++j) open |= group[1 + j] >= 0;
        if (!open) n_steps = 0;
    }

    if (threadIdx.x >= K::NT) {  // the copy warp
        if (threadIdx.x == K::NT) {
            tma_prefetch_map(&act_map);
            tma_prefetch_map(&other_map);
            const int2 block = PASS == Pass::Updat && !K::ROWS_T ? table[unit] : make_int2(0, 0);
            // Row groups copy only their present blocks' rows (the others' accumulators are never stored).
            int present = COLS;
            if constexpr (K::ROWS_T)
                for (int j = 0; j < COLS; ++j) present -= group[1 + j] < 0;
            const unsigned step_bytes = (K::ROWS_T ? present * BS * BK + K::B_STAGE : K::A_STAGE + K::B_STAGE) * sizeof(T);
            for (int step = 0; step < n_steps; ++step) {
                const int s = step % STAGES;
                // Refilling stage s waits for the warps' release of its previous use.
                if (step >= STAGES) mbarrier_wait(&empty[s], (step / STAGES - 1) & 1);
                T* a = sa + s * K::A_STAGE;
                T* b = sb + s * K::B_STAGE;
#ifdef BSMM_PROBE_MATH_ONLY
                mbarrier_arrive(&full[s]);
                continue;
#endif
                if constexpr (K::COLS_W) {
                    // For each block row (column) r of the step: its activation panel, BM batch
                    // rows (past N: zeros), and its present weight blocks, block (r, j) at slot
                    // r x COLS + j. Padding entries past the part copy nothing.
                    const int* entries = group_steps + step * K::R * (COLS + 1);
                    int panels = 0, blocks = 0;
#pragma unroll
                    for (int r = 0; r < K::R; ++r) {
                        panels += entries[r * (COLS + 1)] >= 0;
#pragma unroll
                        for (int j = 0; j < COLS; ++j) blocks += entries[r * (COLS + 1) + 1 + j] >= 0;
                    }
                    mbarrier_arrive_expect_tx(&full[s], (panels * BM * BS + blocks * BS * BS) * sizeof(T));
#pragma unroll
                    for (int r = 0; r < K::R; ++r) {
                        const int* entry = entries + r * (COLS + 1);
                        if (entry[0] < 0) continue;
                        tma_load_2d(a + r * BM * BS, &act_map, entry[0] * BS, m0, &full[s]);
#pragma unroll
                        for (int j = 0; j < COLS; ++j)
                            if (entry[1 + j] >= 0)
                                tma_load_2d(b + (r * COLS + j) * BS * BS, &other_map, 0, entry[1 + j] * BS, &full[s]);
                    }
                    continue;
                }
                mbarrier_arrive_expect_tx(&full[s], step_bytes);
                if constexpr (K::ROWS_T) {
                    // A: the BS dy features of each present block of the group, B: the BS x
                    // features of its block row, BK batch rows (past N: zeros). Feature axis 0:
                    // K-major boxes of xᵀ and dyᵀ; axis 1: MN-major boxes of x and dy.
                    const int n = seg.y + step * BK;
#pragma unroll
                    for (int j = 0; j < COLS; ++j)
                        if (group[1 + j] >= 0)
                            tma_load_2d(a + j * BS * BK, &other_map, K::AXIS1 ? group[1 + j] * BS : n,
                                        K::AXIS1 ? n : group[1 + j] * BS, &full[s]);
                    tma_load_2d(b, &act_map, K::AXIS1 ? group[0] * BS : n, K::AXIS1 ? n : group[0] * BS, &full[s]);
                } else if constexpr (PASS == Pass::Updat) {
                    // A(m, k) = x[n, c·BS + m0 + m], B(k, n') = dy[n, k·BS + n0 + n']: 64-column
                    // panels BK batch rows deep; rows past N arrive as zeros (parts end on steps).
                    const int n = seg.y + step * BK;
#pragma unroll
                    for (int p = 0; p < BM / BOX; ++p) tma_load_2d(a + p * BK * BOX, &act_map, block.x * BS + m0 + p * BOX, n, &full[s]);
#pragma unroll
                    for (int p = 0; p < BN / BOX; ++p) tma_load_2d(b + p * BK * BOX, &other_map, block.y * BS + n0 + p * BOX, n, &full[s]);
                } else {
                    const int2 entry = part_table[step / (BS / BK)];  // (weight block, activation feature block)
                    const int kin = (step % (BS / BK)) * BK, w_row = entry.x * BS;
                    tma_load_2d(a, &act_map, entry.y * BS + kin, m0, &full[s]);
                    if constexpr (PASS == Pass::Fprop) {  // B(k, n) = W_b[kin + k][n0 + n]: BOX-column panels
#pragma unroll
                        for (int p = 0; p < BN / BOX; ++p) tma_load_2d(b + p * BK * BOX, &other_map, n0 + p * BOX, w_row + kin, &full[s]);
                    } else {  // bprop: B(k, n) = W_b[n0 + n][kin + k], K-major rows
                        tma_load_2d(b, &other_map, kin, w_row + n0, &full[s]);
                    }
                }
            }
        }
        return;
    }

    float acc[K::ACC];
#pragma unroll
    for (int i = 0; i < K::ACC; ++i) acc[i] = 0.f;
    // Row groups: a warpgroup whose 64 rows hold only gated-off or absent blocks (nothing copied for
    // them) multiplies nothing and only releases the stages; its accumulators stay 0, and the store
    // writes the closed blocks' zeros.
    bool idle = false;
    if constexpr (K::ROWS_T) {
        idle = true;
        const int first = (threadIdx.x / 128) * 64 / BS;
        for (int j = first; j < first + 64 / BS && j < COLS; ++j) idle &= group[1 + j] < 0;
        idle = __all_sync(0xffffffffu, idle);  // (uniform: said so to ptxas, which would serialize every wgmma: C7520)
    }
    for (int step = 0; step < n_steps; ++step) {
        const int s = step % STAGES;
        mbarrier_wait(&full[s], (step / STAGES) & 1);
#ifdef BSMM_PROBE_COPY_ONLY
        if (threadIdx.x % 32 == 0) mbarrier_arrive(&empty[s]);
        continue;
#endif
        if (idle) {  // (the same in every thread of the warpgroup)
            if (threadIdx.x % 32 == 0) mbarrier_arrive(&empty[s]);
            continue;
        }
        if constexpr (MATH == Math::Wgmma) {
            if constexpr (K::COLS_W)
                wgmma_group_step<K, T, BS>(acc, sa + s * K::A_STAGE, sb + s * K::B_STAGE,
                                           group_steps + step * K::R * (COLS + 1));
            else
                wgmma_step<K, T>(acc, sa + s * K::A_STAGE, sb + s * K::B_STAGE);
            wgmma_wait<1>();  // the previous step's group has read its stage: release it
            if (step > 0 && threadIdx.x % 32 == 0) mbarrier_arrive(&empty[(step - 1) % STAGES]);
        } else {
            unsigned a_frags[1][K::MI][4];
            mma16_step<K, T, 1>(acc, sa + s * K::A_STAGE, sb + s * K::B_STAGE, a_frags, true);
            // ldmatrix has read the stage into registers; the arrive orders those reads before it.
            __syncwarp();
            if (threadIdx.x % 32 == 0) mbarrier_arrive(&empty[s]);
        }
    }
    if constexpr (MATH == Math::Wgmma) {
        wgmma_wait<0>();
        fence_registers(acc);
    }

    const int2 unit_info = units[unit];
    const int tiles_per_unit = gridDim.y * gridDim.z;
    const int tile_in_unit = blockIdx.z * gridDim.y + tile.y;
    if (unit_info.y > 1 && !reduce_parts<K>(acc, workspace, counters, unit_info, unit, part, tiles_per_unit, tile_in_unit,
                                            last_part))
        return;
    if constexpr (K::ROWS_T) {
        store_row_group_transposed<K, T, BS>(out, acc, group, accumulate, reinterpret_cast<float*>(smem));
        return;
    } else if constexpr (MATH == Math::Wgmma && sizeof(T) == 2) {  // (TF32 tiles: fragment stores)
        if (EPI::PLAIN && !accumulate && unit_info.y == 1) {
            // The tile leaves through shared memory and TMA: the thread block may exit once the
            // copy has read it, while its writes drain and the next thread block starts on the
            // SM (fragment stores kept the block 4-byte store by 4-byte store until the end).
            // The stages are free: every copy has landed and every wgmma has read its stage.
            static_assert(BN % 64 == 0, "stored in 64-column panels");
            sync_threads_named<K::NT>();
            T* staging = smem;  // BN / 64 panels of BM rows x 64, 128-byte swizzled like the stages
            for_each_acc<K>([&](int i, int m, int n) {
                if (i % 2 == 0) Pair<T>::store(staging + swizzled_offset<BM>(m, n), acc[i], acc[i + 1]);
            });
            fence_proxy_async();  // written through the generic proxy, read next by the TMA unit
            sync_threads_named<K::NT>();
            if (threadIdx.x == 0) {
                // fprop/bprop: out is (N rows, features), updat: (blocks x BS rows, BS columns).
#pragma unroll
                for (int p = 0; p < BN / 64; ++p)
                    tma_store_2d(&out_map, PASS == Pass::Updat ? n0 + p * 64 : unit * (COLS > 1 ? BN : BS) + n0 + p * 64,
                                 PASS == Pass::Updat ? unit * BS + m0 : m0, staging + p * BM * 64);
                tma_store_commit_and_wait_read();
            }
            return;
        }
    }
    if constexpr (PASS == Pass::Updat)
        store_block_tile<K, T, BS>(out + (long long)unit * BS * BS, acc, m0, n0, accumulate);
    else
        store_sparse_tile<K, EPI, T, BS>(p, acc, unit, m0, n0);
#else
    __trap();  // TMA variants are built for sm_90a only
#endif
}

}  // namespace bsmm
