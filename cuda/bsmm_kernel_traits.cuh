// The compile-time description of one bsmm_matmul instance (struct Kernel: tile, warps, stages,
// math, pass, feature axis, shared-memory layout), the pass, math and feature-axis enums, and the banded order
// in which fprop/bprop thread blocks visit output tiles. Included by bsmm_matmul.cu.
#pragma once

#include "bsmm_common.cuh"

// Activation tiles of fprop/bprop go through L1: thread blocks on one SM walk their block
// columns (rows) in the same order and share them (workload S, fp16, 50 %: 93 -> 80 us per
// fprop, the L2 was the busiest unit). -DBSMM_ACT_L1=0 restores L2-only copies for comparison.
#ifndef BSMM_ACT_L1
#define BSMM_ACT_L1 1
#endif

// What bounds a pass (tools/probes/probe_bounds.py): -DBSMM_PROBE_COPY_ONLY keeps every copy into the
// stages and the store of the output but skips the multiplications; -DBSMM_PROBE_MATH_ONLY keeps
// the multiplications (of whatever the stages hold) but copies nothing in. Results are wrong under
// either; the kernel cache keys on the options, so such cubins never serve a real call.
#if defined(BSMM_PROBE_COPY_ONLY) && defined(BSMM_PROBE_MATH_ONLY)
#error "BSMM_PROBE_COPY_ONLY and BSMM_PROBE_MATH_ONLY exclude each other"
#endif

namespace bsmm {

// fprop/bprop: (segment, row tile) of this thread block when the output is visited in bands of
// band_rows row tiles: consecutive thread blocks take one segment (block column part) for every
// row tile of the band, then the next segment. Those running at one time then share a few weight
// columns and activation row tiles in L2, where launch order alone (x fastest) streams every
// weight column once per row tile (T at 50 %: 32 x 64 MB). A bijection of the grid; band_rows 1
// is launch order.
__device__ __forceinline__ int2 banded_tile(int band_rows) {
    const long long id = blockIdx.x + (long long)gridDim.x * blockIdx.y;
    const long long band_size = (long long)band_rows * gridDim.x;
    const int band = (int)(id / band_size);
    const int first_row = band * band_rows;
    const int rows_here = min(band_rows, (int)gridDim.y - first_row);
    const int within = (int)(id - band * band_size);
    return make_int2(within / rows_here, first_row + within % rows_here);
}

// The template parameters that pick a kernel's code paths, as the host names them in a name
// expression (bsmm/backends/cuda/kernels.py, Variant.name_expression): bsmm::Pass::Updat, ...
// Explicit values: they are what the kernels' mangled names spell.
enum class Pass : int { Fprop = 0, Bprop = 1, Updat = 2 };
// Simt: exact float32 FMA; Tensor16: mma.sync m16n8k16 (float16/bfloat16); Tf32: mma.sync m16n8k8;
// Wgmma: sm_90a warpgroup MMA (bsmm_wgmma.cuh), 16-bit or TF32 by the element type.
enum class Math : int { Simt = 0, Tensor16 = 1, Tf32 = 2, Wgmma = 3 };
// Where the features lie in the operands. Axis1: (N, features), rows of the batch with their
// features contiguous; Axis0: (features, N). TransposedActivations (fprop/bprop, cp.async): the
// activations come from a transposed copy, read as on axis 0, and the output is written on
// axis 1. At block 16 a row of axis-1 activations holds a block's features as one 32-byte
// segment, its own cache-line request, and those requests, not the bytes, bound the pass
// (bsmm/backends/cuda/plans.py, TransposedActivations).
enum class FeatureAxis : int { Axis0 = 0, Axis1 = 1, TransposedActivations = 2 };

template <typename T, int BS, int BM_, int BN_, int BK_, int WARPS_M_, int WARPS_N_, int STAGES_, Math MATH_, Pass PASS_,
          FeatureAxis AXIS_, int ALIGNED_, int GROUPED_, int COLS_, int TMA_ = 0>
struct Kernel {
    static constexpr int BM = BM_, BN = BN_, BK = BK_, WARPS_M = WARPS_M_, WARPS_N = WARPS_N_, STAGES = STAGES_;
    static constexpr Math MATH = MATH_;
    static constexpr Pass PASS = PASS_;
    static constexpr FeatureAxis AXIS = AXIS_;
    // AXIS1: the operands are read on feature axis 1; OUT_AXIS1: the output is written on it.
    static constexpr bool AXIS1 = AXIS_ == FeatureAxis::Axis1, OUT_AXIS1 = AXIS_ != FeatureAxis::Axis0,
                          ALIGNED = ALIGNED_ != 0;
    static_assert(AXIS_ != FeatureAxis::TransposedActivations || (PASS_ != Pass::Updat && MATH_ != Math::Wgmma && !TMA_),
                  "transposed activations: fprop/bprop of the cp.async kernel");
    // updat with the whole batch in one step: a thread block streams a group of weight blocks
    // through the pipeline, one block per step, instead of owning a single block.
    static constexpr bool GROUPED = GROUPED_ != 0;
    // fprop/bprop: an output tile spans COLS adjacent block columns (rows for bprop) and steps
    // over the union of their blocks' rows (columns), one block row per step: the activation
    // tile of a step is loaded once for every block of that row in the group. Warp column j
    // owns block column j and skips the steps where that block is absent.
    // updat: an output tile is up to COLS present blocks of one block row, side by side; each
    // step loads the x tile once for all of them (small blocks otherwise read it once per block).
    static constexpr int COLS = COLS_;
    // updat row groups on wgmma (bsmm_matmul_tma) compute the group's tile transposed,
    // dWᵀ = dyᵀ·x: M runs over the COLS blocks' dy features (BM = COLS x BS, 64 rows a
    // warpgroup, which a single block of 16 or 32 could not fill) and N over the block row's BS
    // x features (BN = BS). Feature axis 0: K-major 128-byte rows; feature axis 1: each block's
    // BK x BS panel as TMA writes it, BS x 2 bytes a row with the swizzle of that span (MN-major).
    static constexpr bool ROWS_T = MATH_ == Math::Wgmma && COLS_ > 1 && PASS_ == Pass::Updat;
    // fprop/bprop column groups on wgmma (bsmm_matmul_tma, blocks 16 to 64): a step is R = BK / BS
    // consecutive block rows (columns) of the union; warpgroups own 64 batch rows and issue one
    // m64nBSk16 per 16 deep of each present block of the step, on the activation panels they
    // share (one per block row, BM x BS). Their rows are BS x 2 bytes, swizzled over that span as
    // TMA writes them (K-major), and so are the weight blocks (fprop: N-major, bprop: K-major).
    static constexpr bool COLS_W = MATH_ == Math::Wgmma && COLS_ > 1 && PASS_ != Pass::Updat;
    static constexpr int R = COLS_W ? BK_ / BS : 1;
    static constexpr int NT = WARPS_M * WARPS_N * 32;
    static constexpr int VEC = 16 / sizeof(T);  // elements per 16-byte copy
    // Which operand dimension is contiguous in shared memory (as it is in global memory).
    static constexpr bool A_KMAJOR = PASS == Pass::Updat ? !AXIS1 : AXIS1;
    static constexpr bool B_KMAJOR = PASS == Pass::Updat ? !AXIS1 : PASS == Pass::Bprop;
    static constexpr int A_ROWS = A_KMAJOR ? BM : BK, A_COLS = A_KMAJOR ? BK : BM;
    static constexpr int B_ROWS = B_KMAJOR ? BN : BK, B_COLS = B_KMAJOR ? BK : BN;
    // Stages filled by TMA (bsmm_matmul_tma) arrive swizzled: 128-byte rows (wgmma) or, for
    // mma.sync, 64-byte rows with the 16-byte chunk c of row r at c ^ ((r / 2) % 4).
    static constexpr bool TMA = TMA_ != 0;
    static constexpr bool SWIZZLE64 = TMA && MATH != Math::Wgmma;
    // One 16-byte pad a row avoids bank conflicts; swizzled tiles need none.
    static constexpr int PAD = MATH == Math::Wgmma || TMA ? 0 : VEC;
    static constexpr int A_PITCH = A_COLS + PAD, B_PITCH = B_COLS + PAD;
    static constexpr int A_STAGE = A_ROWS * A_PITCH, B_STAGE = B_ROWS * B_PITCH;
    // Grouped updat on tensor cores stores each finished tile through a float staging tile
    // (store_block_tile_staged; float32 exact, S 50 %: 1.30x -> 1.07x through it, so not there).
    static constexpr bool STAGED_STORE = GROUPED && MATH != Math::Simt;
    static constexpr int STAGING_PITCH = BN + 4;
    static constexpr int STAGING_BYTES = STAGED_STORE ? BM * STAGING_PITCH * 4 : 0;
    // wgmma: 1 KiB to align the stages to the swizzle atom.
    static constexpr int SMEM_BYTES =
        STAGES * (A_STAGE + B_STAGE) * sizeof(T) + STAGING_BYTES + (MATH == Math::Wgmma || TMA ? 1024 : 0);

    // Tensor-core warp tiling.
    static constexpr int WTM = BM / WARPS_M, WTN = BN / WARPS_N;
    static constexpr int MI = WTM / 16, NJ = WTN / 8;
    // SIMT thread tiling: TX threads along N (4 columns each where the tile allows), TY along M.
    // Thread (ty, tx) owns TM rows and TN columns in runs of RM (RN) adjacent ones, so that a run
    // is one vector load from a stage whose rows run along M (N); see simt_row and simt_step.
    static constexpr int TX0 = BN / 4 < 16 ? BN / 4 : 16, TX = TX0 * BM < NT ? NT / BM : TX0;
    static constexpr int TY = NT / TX, TM = BM / TY, TN = BN / TX;
    // (Runs only where the stage is M- or N-major: on a K-major stage, rows a lane apart keep the
    // 4-deep loads of a warp on different banks.)
    static constexpr int RM = A_KMAJOR ? 1 : TM % 4 == 0 ? 4 : TM % 2 == 0 ? 2 : 1;
    static constexpr int RN = B_KMAJOR ? 1 : TN % 4 == 0 ? 4 : TN % 2 == 0 ? 2 : 1;
    __device__ __forceinline__ static int simt_row(int ty, int i) { return (i / RM) * TY * RM + ty * RM + i % RM; }
    __device__ __forceinline__ static int simt_col(int tx, int j) { return (j / RN) * TX * RN + tx * RN + j % RN; }
    static constexpr int ACC = MATH == Math::Simt ? TM * TN : MATH == Math::Wgmma ? BN / 2 : MI * NJ * 4;
    // wgmma instruction width along N (m64nWNk16): the widest that divides the tile; groups
    // issue one instruction per block (a row group's N, or one block column of a column group).
    static constexpr int WN = MATH == Math::Wgmma && COLS > 1 ? BS : BN % 128 == 0 ? 128 : BN % 64 == 0 ? 64 : BN;

    static_assert(BK % VEC == 0 && BM % VEC == 0 && BN % VEC == 0, "tiles must be whole 16-byte chunks");
    static_assert(COLS > 1 || (BN <= BS && BS % BN == 0), "an output tile stays inside one block column");
    static_assert(COLS == 1 || (ROWS_T ? BM == COLS * BS && BN == BS :
                                COLS_W ? BN == COLS * BS && BK % BS == 0 && AXIS1 :
                                (BN == COLS * BS && WARPS_N == COLS && (MATH_ == Math::Tensor16 || MATH_ == Math::Tf32) &&
                                 (PASS_ == Pass::Updat ? BM == BS && !GROUPED_ : BK == BS))) && ALIGNED_,
                  "column groups: one block per warp column, one block row per step (updat: whole blocks), "
                  "aligned tensor-core copies; transposed wgmma row groups: the blocks along M");
    static_assert(MATH != Math::Tensor16 || (BK % 16 == 0 && WTM % 16 == 0 && WTN % 8 == 0), "m16n8k16 tiling");
    static_assert(MATH != Math::Tf32 || (BK % 8 == 0 && WTM % 16 == 0 && WTN % 8 == 0), "m16n8k8 tiling");
    static_assert(MATH != Math::Simt || (TY * TX == NT && TM * TY == BM && TN * TX == BN && TX <= BN && BK % 4 == 0), "SIMT tiling");
    static_assert(!GROUPED || (PASS == Pass::Updat && ALIGNED), "grouping is an updat mode of the aligned copy path");
    // wgmma: a warpgroup (4 warps) owns 64 rows and all BN columns, as BN / WN m64nWNk16 tiles.
    static_assert(MATH != Math::Wgmma || ((sizeof(T) == 2 || (PASS == Pass::Bprop && COLS == 1) || (ROWS_T && !AXIS1)) &&
                                    (COLS_W ? BK % BS == 0 : BK * sizeof(T) == 128 && (PASS == Pass::Updat || BK <= BS)) &&
                                    BM % 64 == 0 && WARPS_N == 1 && WARPS_M * 16 == BM && ALIGNED_ && !GROUPED_ &&
                                    (COLS > 1 ? BS == 16 || BS == 32 || BS == 64 : BN % 64 == 0 && AXIS1)),
                  "wgmma: 16-bit (TF32: bprop or axis-0 row groups, both operands K-major), aligned, feature axis 1 (row groups: "
                  "either), BK one 128-byte row (column groups: blocks), 64-row warpgroups; groups at blocks 16 to "
                  "64 (a block's row spans one swizzle at most)");

    // Where element (row, col) of a ROWS x COLS tile (COLS contiguous) lives in its stage.
    template <int ROWS, int PITCH>
    __device__ __forceinline__ static int smem_offset(int row, int col) {
        if constexpr (MATH == Math::Wgmma) return swizzled_offset<ROWS>(row, col);
        return row * PITCH + col;
    }

    static_assert(!SWIZZLE64 || (A_COLS * sizeof(T) == 64 && B_COLS * sizeof(T) == 64), "64-byte swizzle: 64-byte rows");
    // Element (row, col) of a stage tile, COLS contiguous: padded rows, or TMA's 64-byte swizzle
    // (callers pass columns on 8-element chunks or within one).
    template <int PITCH>
    __device__ __forceinline__ static int at(int row, int col) {
        if constexpr (SWIZZLE64) return row * PITCH + (((col >> 3) ^ ((row >> 1) & 3)) << 3) + (col & 7);
        return row * PITCH + col;
    }
    __device__ __forceinline__ static T* a_at(T* s, int m, int k) { return s + (A_KMAJOR ? at<A_PITCH>(m, k) : at<A_PITCH>(k, m)); }
    __device__ __forceinline__ static T* b_at(T* s, int k, int n) { return s + (B_KMAJOR ? at<B_PITCH>(n, k) : at<B_PITCH>(k, n)); }
};

}  // namespace bsmm
