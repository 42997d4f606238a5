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
#include "bsmm_common.cuh"
#include "bsmm_tma.cuh"
#include "bsmm_wgmma.cuh"

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

enum Pass { FPROP = 0, BPROP = 1, UPDAT = 2 };
// WGMMA: float16/bfloat16 fprop/bprop on sm_90a warpgroup MMA (bsmm_wgmma.cuh).
enum Math { SIMT = 0, TENSOR16 = 1, TF32 = 2, WGMMA = 3 };

template <typename T, int BS, int BM_, int BN_, int BK_, int WARPS_M_, int WARPS_N_, int STAGES_, int MATH_, int PASS_,
          int AXIS1_, int ALIGNED_, int GROUPED_, int COLS_, int TMA_ = 0>
struct Kernel {
    static constexpr int BM = BM_, BN = BN_, BK = BK_, WARPS_M = WARPS_M_, WARPS_N = WARPS_N_, STAGES = STAGES_;
    static constexpr int MATH = MATH_, PASS = PASS_;
    // AXIS1_: the feature axis of the operands, 1 (rows of the batch, features contiguous) or 0;
    // 2 (fprop/bprop, cp.async): the activations come from a transposed copy, read as on axis 0,
    // and the output is written on axis 1. At block 16 a row of axis-1 activations holds a block's
    // features as one 32-byte segment, its own cache-line request, and those requests, not the
    // bytes, bound the pass (bsmm/backends/cuda/backend.py, TransposedActivations).
    static constexpr bool AXIS1 = AXIS1_ == 1, OUT_AXIS1 = AXIS1_ != 0, ALIGNED = ALIGNED_ != 0;
    static_assert(AXIS1_ != 2 || (PASS_ != UPDAT && MATH_ != WGMMA && !TMA_),
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
    static constexpr bool ROWS_T = MATH_ == WGMMA && COLS_ > 1 && PASS_ == UPDAT;
    // fprop/bprop column groups on wgmma (bsmm_matmul_tma, blocks 16 to 64): a step is R = BK / BS
    // consecutive block rows (columns) of the union; warpgroups own 64 batch rows and issue one
    // m64nBSk16 per 16 deep of each present block of the step, on the activation panels they
    // share (one per block row, BM x BS). Their rows are BS x 2 bytes, swizzled over that span as
    // TMA writes them (K-major), and so are the weight blocks (fprop: N-major, bprop: K-major).
    static constexpr bool COLS_W = MATH_ == WGMMA && COLS_ > 1 && PASS_ != UPDAT;
    static constexpr int R = COLS_W ? BK_ / BS : 1;
    static constexpr int NT = WARPS_M * WARPS_N * 32;
    static constexpr int VEC = 16 / sizeof(T);  // elements per 16-byte copy
    // Which operand dimension is contiguous in shared memory (as it is in global memory).
    static constexpr bool A_KMAJOR = PASS == UPDAT ? !AXIS1 : AXIS1;
    static constexpr bool B_KMAJOR = PASS == UPDAT ? !AXIS1 : PASS == BPROP;
    static constexpr int A_ROWS = A_KMAJOR ? BM : BK, A_COLS = A_KMAJOR ? BK : BM;
    static constexpr int B_ROWS = B_KMAJOR ? BN : BK, B_COLS = B_KMAJOR ? BK : BN;
    // Stages filled by TMA (bsmm_matmul_tma) arrive swizzled: 128-byte rows (wgmma) or, for
    // mma.sync, 64-byte rows with the 16-byte chunk c of row r at c ^ ((r / 2) % 4).
    static constexpr bool TMA = TMA_ != 0;
    static constexpr bool SWIZZLE64 = TMA && MATH != WGMMA;
    // One 16-byte pad a row avoids bank conflicts; swizzled tiles need none.
    static constexpr int PAD = MATH == WGMMA || TMA ? 0 : VEC;
    static constexpr int A_PITCH = A_COLS + PAD, B_PITCH = B_COLS + PAD;
    static constexpr int A_STAGE = A_ROWS * A_PITCH, B_STAGE = B_ROWS * B_PITCH;
    // Grouped updat on tensor cores stores each finished tile through a float staging tile
    // (store_block_tile_staged; float32 exact, S 50 %: 1.30x -> 1.07x through it, so not there).
    static constexpr bool STAGED_STORE = GROUPED && MATH != SIMT;
    static constexpr int STAGING_PITCH = BN + 4;
    static constexpr int STAGING_BYTES = STAGED_STORE ? BM * STAGING_PITCH * 4 : 0;
    // wgmma: 1 KiB to align the stages to the swizzle atom.
    static constexpr int SMEM_BYTES =
        STAGES * (A_STAGE + B_STAGE) * sizeof(T) + STAGING_BYTES + (MATH == WGMMA || TMA ? 1024 : 0);

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
    static constexpr int ACC = MATH == SIMT ? TM * TN : MATH == WGMMA ? BN / 2 : MI * NJ * 4;
    // wgmma instruction width along N (m64nWNk16): the widest that divides the tile; groups
    // issue one instruction per block (a row group's N, or one block column of a column group).
    static constexpr int WN = MATH == WGMMA && COLS > 1 ? BS : BN % 128 == 0 ? 128 : BN % 64 == 0 ? 64 : BN;

    static_assert(BK % VEC == 0 && BM % VEC == 0 && BN % VEC == 0, "tiles must be whole 16-byte chunks");
    static_assert(COLS > 1 || (BN <= BS && BS % BN == 0), "an output tile stays inside one block column");
    static_assert(COLS == 1 || (ROWS_T ? BM == COLS * BS && BN == BS :
                                COLS_W ? BN == COLS * BS && BK % BS == 0 && AXIS1_ :
                                (BN == COLS * BS && WARPS_N == COLS && (MATH_ == TENSOR16 || MATH_ == TF32) &&
                                 (PASS_ == UPDAT ? BM == BS && !GROUPED_ : BK == BS))) && ALIGNED_,
                  "column groups: one block per warp column, one block row per step (updat: whole blocks), "
                  "aligned tensor-core copies; transposed wgmma row groups: the blocks along M");
    static_assert(MATH != TENSOR16 || (BK % 16 == 0 && WTM % 16 == 0 && WTN % 8 == 0), "m16n8k16 tiling");
    static_assert(MATH != TF32 || (BK % 8 == 0 && WTM % 16 == 0 && WTN % 8 == 0), "m16n8k8 tiling");
    static_assert(MATH != SIMT || (TY * TX == NT && TM * TY == BM && TN * TX == BN && TX <= BN && BK % 4 == 0), "SIMT tiling");
    static_assert(!GROUPED || (PASS == UPDAT && ALIGNED), "grouping is an updat mode of the aligned copy path");
    // wgmma: a warpgroup (4 warps) owns 64 rows and all BN columns, as BN / WN m64nWNk16 tiles.
    static_assert(MATH != WGMMA || ((sizeof(T) == 2 || (PASS == BPROP && COLS == 1) || (ROWS_T && !AXIS1)) &&
                                    (COLS_W ? BK % BS == 0 : BK * sizeof(T) == 128 && (PASS == UPDAT || BK <= BS)) &&
                                    BM % 64 == 0 && WARPS_N == 1 && WARPS_M * 16 == BM && ALIGNED_ && !GROUPED_ &&
                                    (COLS > 1 ? BS == 16 || BS == 32 || BS == 64 : BN % 64 == 0 && AXIS1_)),
                  "wgmma: 16-bit (TF32: bprop or axis-0 row groups, both operands K-major), aligned, feature axis 1 (row groups: "
                  "either), BK one 128-byte row (column groups: blocks), 64-row warpgroups; groups at blocks 16 to "
                  "64 (a block's row spans one swizzle at most)");

    // Where element (row, col) of a ROWS x COLS tile (COLS contiguous) lives in its stage.
    template <int ROWS, int PITCH>
    __device__ __forceinline__ static int smem_offset(int row, int col) {
        if constexpr (MATH == WGMMA) return swizzled_offset<ROWS>(row, col);
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

// Copies a ROWS x COLS tile (COLS contiguous) into shared memory. src(row, col, valid)
// returns the global address of element (row, col) and sets how many of the VEC
// elements from there exist (0 to VEC); missing ones become zeros.
template <class K, int ROWS, int COLS, int PITCH, typename T, typename Src>
__device__ __forceinline__ void load_tile(T* dst, Src src, int tid) {
    constexpr int CHUNKS = ROWS * COLS / K::VEC;
#pragma unroll
    for (int c = tid; c < CHUNKS; c += K::NT) {
        const int row = c / (COLS / K::VEC), col = (c % (COLS / K::VEC)) * K::VEC;
        int valid;
        const T* p = src(row, col, valid);
        T* d = dst + row * PITCH + col;
        if (K::ALIGNED && (valid == K::VEC || valid == 0)) {
            // Every lane issues the same copy; missing chunks copy 0 bytes and are zero-filled.
            cp_async16(d, p, valid == 0 ? 0 : 16);
        } else {
#pragma unroll
            for (int e = 0; e < K::VEC; ++e) d[e] = e < valid ? p[e] : Elem<T>::from_float(0.f);
        }
    }
}

// Where one output tile's inputs and outputs live, for each pass.
template <class K, typename T, int BS>
struct Operands {
    const T* __restrict__ act;    // fprop: x, bprop: dy, updat: x
    const T* __restrict__ other;  // fprop/bprop: w, updat: dy
    const int2* __restrict__ table;
    int n_rows, ld_act, ld_other;
    int seg_begin, seg_end;  // sparse K: entries of table; dense K: batch rows [seg_begin, seg_end)
    int m0, n0;              // tile origin: rows of N (sparse K) or of the block (updat), columns of the block
    int2 block;              // updat: (block row c, block column k)

    // Grouped updat on tensor cores: step s multiplies the same x tile as step s - 1 (consecutive
    // blocks of one block row, the storage order); its copy and its fragment loads are skipped
    // (main_loop keeps the fragments in registers).
    __device__ __forceinline__ bool same_a(int step) const {
        return K::GROUPED && K::MATH == TENSOR16 && step > 0 && table[step].x == table[step - 1].x;
    }

    // Sparse K: step s covers K positions [s*BK, s*BK + BK) of the concatenated blocks;
    // table is the segment's slice of the step table, staged in shared memory.
    __device__ __forceinline__ bool locate(int kg, int2& entry, int& kin) const {
        const int j = kg / BS;
        kin = kg % BS;
        if (j >= seg_end - seg_begin) return false;
        entry = table[j];  // (weight block, activation feature block)
        return true;
    }

    __device__ __forceinline__ const T* a_src(int step, int row, int col, int& valid) const {
        const int m = K::A_KMAJOR ? row : col, k = K::A_KMAJOR ? col : row;
        const int kg = step * K::BK + k;
        if (K::PASS == UPDAT) {  // A(m, k) = x[n = kg, feature c·BS + m0 + m]
            const int n = seg_begin + kg;
            const long long feature = (long long)block.x * BS + m0 + m;
            if (K::A_KMAJOR) {  // axis 0: x is (C, N); contiguous along n
                valid = max(0, min(K::VEC, seg_end - n));
                return act + feature * ld_act + n;
            }
            valid = n < seg_end ? K::VEC : 0;  // axis 1: x is (N, C); contiguous along features
            return act + (long long)n * ld_act + feature;
        }
        int2 entry;
        int kin;
        if (!locate(kg, entry, kin)) { valid = 0; return act; }
        const int row_n = m0 + m;  // activation row (batch index)
        if (K::A_KMAJOR) {  // axis 1: (N, F); contiguous along features
            valid = row_n < n_rows ? K::VEC : 0;
            return act + (long long)row_n * ld_act + (long long)entry.y * BS + kin;
        }
        valid = max(0, min(K::VEC, n_rows - row_n));  // axis 0: (F, N); contiguous along the batch
        return act + ((long long)entry.y * BS + kin) * ld_act + row_n;
    }

    __device__ __forceinline__ const T* b_src(int step, int row, int col, int& valid) const {
        const int n = K::B_KMAJOR ? row : col, k = K::B_KMAJOR ? col : row;
        const int kg = step * K::BK + k;
        if (K::PASS == UPDAT) {  // B(k, n) = dy[batch kg, feature kb·BS + n0 + n]
            const int nb = seg_begin + kg;
            const long long feature = (long long)block.y * BS + n0 + n;
            if (K::B_KMAJOR) {
                valid = max(0, min(K::VEC, seg_end - nb));
                return other + feature * ld_other + nb;
            }
            valid = nb < seg_end ? K::VEC : 0;
            return other + (long long)nb * ld_other + feature;
        }
        int2 entry;
        int kin;
        if (!locate(kg, entry, kin)) { valid = 0; return other; }
        valid = K::VEC;
        const T* w = other + (long long)entry.x * BS * BS;
        // fprop: B(k, n) = W_b[kin][n0 + n]; bprop: B(k, n) = W_b[n0 + n][kin]
        return K::B_KMAJOR ? w + (long long)(n0 + n) * BS + kin : w + (long long)kin * BS + n0 + n;
    }
};


// The fast copy path (16-byte aligned operands, one block per step or dense K): every
// address a thread copies is a fixed offset from a per-step base pointer, so the offsets and
// range checks are computed once per thread block instead of once per chunk and step.
template <class K, int ROWS, int COLS, int PITCH>
struct ChunkPlan {
    static constexpr int CHUNKS = ROWS * COLS / K::VEC;
    static constexpr int PER_THREAD = (CHUNKS + K::NT - 1) / K::NT;
    static constexpr int ABSENT = 0x7fffffff;
    long long offset[PER_THREAD];  // from the step's base pointer, in elements
    int k[PER_THREAD];             // K coordinate of the chunk within the step; ABSENT if it never exists

    // ld: elements between stored rows; k_is_col: columns run along K; mn_limit: rows/columns
    // of the non-K dimension that exist (batch rows past N do not).
    __device__ __forceinline__ void init(int tid, long long ld, bool k_is_col, int mn_limit) {
#pragma unroll
        for (int i = 0; i < PER_THREAD; ++i) {
            const int c = tid + i * K::NT;
            const int row = c / (COLS / K::VEC), col = (c % (COLS / K::VEC)) * K::VEC;
            const int mn = k_is_col ? row : col;
            offset[i] = row * ld + col;
            k[i] = (c < CHUNKS && mn < mn_limit) ? (k_is_col ? col : row) : ABSENT;
        }
    }

    // Copies the chunks whose K coordinate is below k_limit; the rest of the tile becomes zeros.
    template <bool VIA_L1, typename T>
    __device__ __forceinline__ void copy(T* dst, const T* base, int k_limit, int tid) const {
#pragma unroll
        for (int i = 0; i < PER_THREAD; ++i) {
            const int c = tid + i * K::NT;
            if (CHUNKS % K::NT == 0 || c < CHUNKS) {
                const int row = c / (COLS / K::VEC), col = (c % (COLS / K::VEC)) * K::VEC;
                const bool valid = k[i] < k_limit;
                T* d = dst + K::template smem_offset<ROWS, PITCH>(row, col);
                if (VIA_L1)
                    cp_async16_l1(d, valid ? base + offset[i] : base, valid ? 16 : 0);
                else
                    cp_async16(d, valid ? base + offset[i] : base, valid ? 16 : 0);
            }
        }
    }
};

template <class K, typename T, int BS>
struct FastLoader {
    ChunkPlan<K, K::A_ROWS, K::A_COLS, K::A_PITCH> a;
    ChunkPlan<K, K::B_ROWS, K::B_COLS, K::B_PITCH> b;
    const Operands<K, T, BS>* ops;
    long long ld_act, ld_other;

    // group (updat row groups, K::COLS > 1): the staged entry (block row, block column of each of
    // the COLS blocks or -1, storage index of each or -1); tile block j (columns of the B tile on
    // feature axis 1, rows on axis 0) then reads dy's block group[1 + j], a fixed offset from the
    // step's base, and absent ones are never read.
    __device__ __forceinline__ void init(const Operands<K, T, BS>& o, int tid, const int* group = nullptr) {
        ops = &o;
        ld_act = o.ld_act;
        ld_other = K::PASS == UPDAT ? o.ld_other : BS;
        const int rows_left = K::PASS == UPDAT ? K::BM : o.n_rows - o.m0;  // batch rows past N are absent
        a.init(tid, ld_act, K::A_KMAJOR, rows_left);
        b.init(tid, ld_other, K::B_KMAJOR, ChunkPlan<K, K::B_ROWS, K::B_COLS, K::B_PITCH>::ABSENT);
        if constexpr (K::PASS == UPDAT && K::COLS > 1) {
#pragma unroll
            for (int i = 0; i < decltype(b)::PER_THREAD; ++i) {
                const int c = tid + i * K::NT;
                const int j = (K::B_KMAJOR ? c / (K::B_COLS / K::VEC) : (c % (K::B_COLS / K::VEC)) * K::VEC) / BS;
                const int kb = group[1 + j];
                if (kb < 0) b.k[i] = decltype(b)::ABSENT;
                else b.offset[i] += (long long)(kb - j) * BS * (K::B_KMAJOR ? ld_other : 1);
            }
        }
    }

    __device__ __forceinline__ void operator()(int step, T* sa, T* sb) const {
        const Operands<K, T, BS>& o = *ops;
        const int tid = threadIdx.x;
        const T* a_base;
        const T* b_base;
        int k_limit;
        if constexpr (K::PASS == UPDAT) {
            // Grouped: step = one weight block of the group, all batch rows; else: BK batch rows.
            const long long n = K::GROUPED ? 0 : o.seg_begin + step * K::BK;  // first batch row of the step
            const int2 block = K::GROUPED ? o.table[step] : o.block;
            const long long feature_a = (long long)block.x * BS + o.m0, feature_b = (long long)block.y * BS + o.n0;
            a_base = K::A_KMAJOR ? o.act + feature_a * ld_act + n : o.act + n * ld_act + feature_a;
            b_base = K::B_KMAJOR ? o.other + feature_b * ld_other + n : o.other + n * ld_other + feature_b;
            k_limit = o.seg_end - (int)n;
        } else {
            const int kg = step * K::BK, j = kg / BS, kin = kg % BS;
            const bool present = j < o.seg_end - o.seg_begin;
            const int2 entry = present ? o.table[j] : make_int2(0, 0);
            const long long feature = (long long)entry.y * BS + kin;
            a_base = K::A_KMAJOR ? o.act + (long long)o.m0 * ld_act + feature : o.act + feature * ld_act + o.m0;
            const T* w = o.other + (long long)entry.x * BS * BS;
            b_base = K::B_KMAJOR ? w + (long long)o.n0 * BS + kin : w + (long long)kin * BS + o.n0;
            k_limit = present ? K::BK : 0;
        }
        // Weights are read once: they bypass L1 (see BSMM_ACT_L1 for the activations).
        if (!o.same_a(step)) a.copy<BSMM_ACT_L1 && K::PASS != UPDAT>(sa, a_base, k_limit, tid);
        b.copy<false>(sb, b_base, k_limit, tid);
    }
};


// Column groups (K::COLS > 1): step s of the staged table holds (activation feature block,
// weight block of each of the COLS block columns or -1). The activation tile takes the
// ChunkPlan path; a weight chunk is a fixed offset inside its block plus that block's base,
// and is not copied at all where the block is absent (that warp column skips the step).
template <class K, typename T, int BS>
struct GroupLoader {
    static constexpr int ROW = K::COLS + 1;  // ints per step in the staged table
    static constexpr int B_CHUNKS = K::B_ROWS * K::B_COLS / K::VEC;
    static constexpr int B_PER_THREAD = (B_CHUNKS + K::NT - 1) / K::NT;
    ChunkPlan<K, K::A_ROWS, K::A_COLS, K::A_PITCH> a;
    int b_offset[B_PER_THREAD];  // element offset of the chunk inside its weight block
    int b_block[B_PER_THREAD];   // which block of the group the chunk belongs to
    const T* act;
    const T* w;
    const int* steps;
    long long ld_act;
    int m0;

    __device__ __forceinline__ void init(const Operands<K, T, BS>& o, const int* staged, int tid) {
        act = o.act;
        w = o.other;
        steps = staged;
        ld_act = o.ld_act;
        m0 = o.m0;
        a.init(tid, ld_act, K::A_KMAJOR, o.n_rows - o.m0);
#pragma unroll
        for (int i = 0; i < B_PER_THREAD; ++i) {
            const int c = tid + i * K::NT;
            const int row = c / (K::B_COLS / K::VEC), col = (c % (K::B_COLS / K::VEC)) * K::VEC;
            // bprop (K-major): tile row = output column n, col = k; fprop: tile row = k, col = n.
            b_block[i] = K::B_KMAJOR ? row / BS : col / BS;
            b_offset[i] = K::B_KMAJOR ? (row % BS) * BS + col : row * BS + col % BS;
        }
    }

    __device__ __forceinline__ void operator()(int step, T* sa, T* sb) const {
        const int tid = threadIdx.x;
        const int* entry = steps + step * ROW;
        const long long feature = (long long)entry[0] * BS;
        const T* a_base = K::A_KMAJOR ? act + (long long)m0 * ld_act + feature : act + feature * ld_act + m0;
        a.template copy<BSMM_ACT_L1 != 0>(sa, a_base, K::BK, tid);
#pragma unroll
        for (int i = 0; i < B_PER_THREAD; ++i) {
            const int c = tid + i * K::NT;
            if (B_CHUNKS % K::NT == 0 || c < B_CHUNKS) {
                const int id = entry[1 + b_block[i]];
                const int row = c / (K::B_COLS / K::VEC), col = (c % (K::B_COLS / K::VEC)) * K::VEC;
                if (id >= 0) cp_async16(sb + row * K::B_PITCH + col, w + (long long)id * BS * BS + b_offset[i], 16);
            }
        }
    }
};


// The shared-memory stages of a main loop's cp.async pipeline. zero_and_start clears the
// accumulators and issues the first AHEAD steps' copies, one commit group a step (empty past
// the last step, so the group count the waits rely on is the same for any n_steps).
template <class K, typename T, class Load>
struct Stages {
    T* sa;
    T* sb;
    Load& load;
    __device__ __forceinline__ Stages(T* smem, Load& l) : sa(smem), sb(smem + K::STAGES * K::A_STAGE), load(l) {}
    __device__ __forceinline__ T* a(int step) const { return sa + (step % K::STAGES) * K::A_STAGE; }
    __device__ __forceinline__ T* b(int step) const { return sb + (step % K::STAGES) * K::B_STAGE; }
    __device__ __forceinline__ void fill(int step) const {
#ifndef BSMM_PROBE_MATH_ONLY
        load(step, a(step), b(step));
#endif
    }
    template <int AHEAD>
    __device__ __forceinline__ void zero_and_start(float (&acc)[K::ACC], int n_steps) const {
#pragma unroll
        for (int i = 0; i < K::ACC; ++i) acc[i] = 0.f;
#pragma unroll
        for (int s = 0; s < AHEAD; ++s) {
            if (s < n_steps) fill(s);
            cp_async_commit();
        }
    }
};

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
    constexpr bool KEEPS_A = K::GROUPED && K::MATH == TENSOR16;
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
        if constexpr (K::MATH == TENSOR16) {
            mma16_step<K, T, A_KEPT>(acc, a, b, a_frags, !KEEPS_A || !keep_a(step));
        } else if constexpr (K::MATH == TF32) {
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

// Calls f(index into acc, tile row, tile column) for every accumulator this thread holds.
template <class K, typename F>
__device__ __forceinline__ void for_each_acc(F f) {
    const int tid = threadIdx.x;
    if constexpr (K::MATH == SIMT) {
        const int tx = tid % K::TX, ty = tid / K::TX;
#pragma unroll
        for (int i = 0; i < K::TM; ++i)
#pragma unroll
            for (int j = 0; j < K::TN; ++j) f(i * K::TN + j, K::simt_row(ty, i), K::simt_col(tx, j));
    } else if constexpr (K::MATH == WGMMA) {
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
    if constexpr (K::MATH == SIMT) {
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
// blocks' rows; absent blocks of the group are not written. Called by the K::NT consumer threads
// once the stages are free.
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
        if (id >= 0) store_chunk<K, T>(out + (long long)id * BS * BS + row * BS + col, staging + (j * BS + row) * PITCH + col,
                                       accumulate);
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

// Writes (or adds, if accumulate) an fprop/bprop output tile: rows m0.. of the batch, columns
// n0.. of output block column (row) `unit`.
template <class K, typename T, int BS>
__device__ __forceinline__ void store_sparse_tile(T* __restrict__ out, const float (&acc)[K::ACC], int unit, int m0, int n0,
                                                  int n_rows, int ld_other, int ld_out, int accumulate) {
    // Column groups: the last group may reach past the output; ld_other (unused by fprop and
    // bprop otherwise) carries how many output blocks exist.
    // Tensor-core fragments hold column pairs (i, i + 1) = (n, n + 1): with features along rows
    // and aligned rows, each pair is one 4- or 8-byte access (and so is the read of accumulate).
    constexpr bool PAIRS = K::OUT_AXIS1 && K::ALIGNED && K::MATH != SIMT;
    for_each_acc<K>([&](int i, int m, int n) {
        if (PAIRS && i % 2) return;
        const int row = m0 + m;
        if (row >= n_rows) return;
        const long long feature = (long long)unit * (K::COLS > 1 ? K::BN : BS) + n0 + n;
        if (K::COLS > 1 && feature >= (long long)ld_other * BS) return;
        T* dst = K::OUT_AXIS1 ? out + (long long)row * ld_out + feature : out + feature * ld_out + row;
        // accumulate: added in float and rounded once (strided convolutions sum their offsets here).
        if constexpr (PAIRS) {
            store_pair(dst, acc[i], acc[i + 1], accumulate);
        } else {
            *dst = Elem<T>::from_float(accumulate ? acc[i] + Elem<T>::to_float(*dst) : acc[i]);
        }
    });
}

// Segment table entry: (output unit, begin, end, part). For fprop/bprop a unit is an
// output block column/row and [begin, end) indexes the step table; for updat a unit
// is a weight block and [begin, end) are batch rows. units[u] = (first workspace slot, parts).
template <typename T, int BS, int BM, int BN, int BK, int WARPS_M, int WARPS_N, int STAGES, int MATH, int PASS, int AXIS1,
          int ALIGNED, int GROUPED, int COLS>
__global__ void __launch_bounds__(WARPS_M* WARPS_N * 32)
    bsmm_matmul(const T* __restrict__ act, const T* __restrict__ other, T* __restrict__ out,
                const int4* __restrict__ segments, const int2* __restrict__ units, const int2* __restrict__ table,
                float* __restrict__ workspace, int* __restrict__ counters, int n_rows, int ld_act, int ld_other,
                int ld_out, int accumulate, int band_rows) {
    using K = Kernel<T, BS, BM, BN, BK, WARPS_M, WARPS_N, STAGES, MATH, PASS, AXIS1, ALIGNED, GROUPED, COLS>;
    wait_for_prior_grid();
    extern __shared__ __align__(16) unsigned char smem_raw[];
    // wgmma reads swizzle atoms that must start on 1024-byte boundaries (SMEM_BYTES has the slack).
    T* smem = reinterpret_cast<T*>(MATH == WGMMA ? (reinterpret_cast<size_t>(smem_raw) + 1023) & ~size_t(1023)
                                                 : reinterpret_cast<size_t>(smem_raw));
    __shared__ int last_part;
    // A part's entries of the step table, read once: the loaders would otherwise wait on a
    // dependent global load before every copy they issue.
    __shared__ int2 part_table[(PASS == UPDAT && !GROUPED) || COLS > 1 ? 1 : BSMM_MAX_PART];
    __shared__ int group_steps[COLS > 1 ? (PASS == UPDAT ? 2 * COLS + 1 : BSMM_MAX_PART * (COLS + 1)) : 1];

    // updat: y and z index sub-tiles of one weight block, nothing to reorder.
    const int2 tile = PASS == UPDAT ? make_int2(blockIdx.x, blockIdx.y) : banded_tile(band_rows);
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
    ops.table = PASS == UPDAT ? table : part_table;
    ops.n_rows = n_rows;
    ops.ld_act = ld_act;
    ops.ld_other = ld_other;
    ops.seg_begin = seg.y;
    ops.seg_end = seg.z;
    ops.m0 = tile.y * BM;
    ops.n0 = blockIdx.z * BN;
    int n_steps;
    if constexpr (PASS == UPDAT && COLS > 1) {
        // The group's entry: 2 COLS + 1 ints (see FastLoader::init).
        const int* entry = reinterpret_cast<const int*>(table) + (long long)unit * (2 * COLS + 1);
        for (int i = threadIdx.x; i < 2 * COLS + 1; i += K::NT) group_steps[i] = entry[i];
        __syncthreads();
        ops.block = make_int2(group_steps[0], 0);
        n_steps = (seg.z - seg.y + BK - 1) / BK;
    } else if constexpr (PASS == UPDAT) {
        ops.block = table[unit];
        n_steps = (seg.z - seg.y + BK - 1) / BK;
    } else if constexpr (COLS > 1) {
        // The table holds COLS + 1 ints a step (see GroupLoader).
        ops.block = make_int2(0, 0);
        n_steps = seg.z - seg.y;
        const int* steps = reinterpret_cast<const int*>(table) + (long long)seg.y * (COLS + 1);
        for (int i = threadIdx.x; i < n_steps * (COLS + 1); i += K::NT) group_steps[i] = steps[i];
        __syncthreads();
    } else {
        ops.block = make_int2(0, 0);
        n_steps = ((seg.z - seg.y) * BS + BK - 1) / BK;
        for (int i = threadIdx.x; i < seg.z - seg.y; i += K::NT) part_table[i] = table[seg.y + i];
        __syncthreads();
    }

    float acc[K::ACC];
    if constexpr (PASS == UPDAT && COLS > 1) {
        FastLoader<K, T, BS> loader;
        loader.init(ops, threadIdx.x, group_steps);
        // Warps of an absent block (a row's last group may be short) only keep the pipeline going.
        const bool absent = group_steps[1 + (threadIdx.x / 32) / K::WARPS_M] < 0;
        main_loop<K, T>(loader, n_steps, smem, acc, [](int, float (&)[K::ACC]) {}, [&](int) { return absent; });
    } else if constexpr (COLS > 1) {
        GroupLoader<K, T, BS> loader;
        loader.init(ops, group_steps, threadIdx.x);
        const int warp_col = (threadIdx.x / 32) / K::WARPS_M;
        main_loop<K, T>(loader, n_steps, smem, acc, [](int, float (&)[K::ACC]) {},
                        [&](int step) { return group_steps[step * (COLS + 1) + 1 + warp_col] < 0; });
    } else if constexpr (MATH == WGMMA) {
        FastLoader<K, T, BS> loader;
        loader.init(ops, threadIdx.x);
        main_loop_wgmma<K, T>(loader, n_steps, smem, acc);
    } else if constexpr (ALIGNED && (PASS == UPDAT || BK <= BS)) {
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

    if constexpr (PASS == UPDAT && COLS > 1) {
        for_each_acc<K>([&](int i, int m, int n) {
            const int id = group_steps[1 + COLS + n / BS];
            if (i % 2 == 0 && id >= 0) store_pair(out + (long long)id * BS * BS + m * BS + n % BS, acc[i], acc[i + 1], accumulate);
        });
        return;
    } else if constexpr (PASS == UPDAT) {
        store_block_tile<K, T, BS>(out + (long long)unit * BS * BS, acc, ops.m0, ops.n0, accumulate);
        return;
    }
    store_sparse_tile<K, T, BS>(out, acc, unit, ops.m0, ops.n0, n_rows, ld_other, ld_out, accumulate);
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
template <typename T, int BS, int BM, int BN, int BK, int WARPS_M, int WARPS_N, int STAGES, int MATH, int PASS, int AXIS1,
          int ALIGNED, int GROUPED, int COLS>
__global__ void __launch_bounds__(WARPS_M* WARPS_N * 32 + 32)
    bsmm_matmul_tma(const T* __restrict__ act, const T* __restrict__ other, T* __restrict__ out,
                    const int4* __restrict__ segments, const int2* __restrict__ units, const int2* __restrict__ table,
                    float* __restrict__ workspace, int* __restrict__ counters, int n_rows, int ld_act, int ld_other,
                    int ld_out, int accumulate, int band_rows, const __grid_constant__ TensorMap act_map,
                    const __grid_constant__ TensorMap other_map, const __grid_constant__ TensorMap out_map) {
    using K = Kernel<T, BS, BM, BN, BK, WARPS_M, WARPS_N, STAGES, MATH, PASS, AXIS1, ALIGNED, GROUPED, COLS, 1>;
    static_assert(!GROUPED && ALIGNED && (sizeof(T) == 2 || (MATH == WGMMA && PASS == BPROP && COLS == 1) ||
                                          (K::ROWS_T && !AXIS1)) &&
                      (K::ROWS_T || K::COLS_W || (COLS == 1 && AXIS1 &&
                                     (MATH == WGMMA ? PASS == UPDAT || BS % BK == 0
                                                    : MATH == TENSOR16 && PASS != UPDAT && BK == BS))),
                  "TMA: wgmma passes, or mma.sync fprop/bprop one block a step; one block (column) a tile, or "
                  "wgmma groups");
    // Columns of a box: 128 (wgmma) or 64 (mma.sync, BK = BN = 32) bytes, the swizzle span.
    constexpr int BOX = MATH == WGMMA ? 128 / (int)sizeof(T) : 32;
    static_assert(MATH != WGMMA || BM * BN <= STAGES * (K::A_STAGE + K::B_STAGE), "the stored tile fits the stages");
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    wait_for_prior_grid();
    extern __shared__ __align__(16) unsigned char smem_raw[];
    // The 128-byte swizzle TMA writes and wgmma reads repeats every 1024 bytes from an aligned base.
    T* smem = reinterpret_cast<T*>((reinterpret_cast<size_t>(smem_raw) + 1023) & ~size_t(1023));
    T* const sa = smem;
    T* const sb = smem + STAGES * K::A_STAGE;
    __shared__ __align__(8) unsigned long long full[STAGES], empty[STAGES];
    __shared__ int last_part;
    __shared__ int2 part_table[PASS == UPDAT || K::COLS_W ? 1 : BSMM_MAX_PART];
    // Row groups: (block row, block column of each of the COLS blocks or -1, storage index or -1).
    __shared__ int group[K::ROWS_T ? 2 * COLS + 1 : 1];
    // Column groups: the part's entries, (activation feature block, weight block of each column or
    // -1), padded with absent ones (-1) to whole steps of K::R.
    __shared__ int group_steps[K::COLS_W ? (BSMM_MAX_PART + K::R) * (COLS + 1) : 1];

    // updat: y and z index sub-tiles of one weight block, nothing to reorder.
    const int2 tile = PASS == UPDAT ? make_int2(blockIdx.x, blockIdx.y) : banded_tile(band_rows);
    const int4 seg = segments[tile.x];
    const int unit = seg.x, part = seg.w;
    const int m0 = tile.y * BM, n0 = blockIdx.z * BN;
    // fprop/bprop: the part's (weight block, activation feature block) entries, BS / BK steps
    // each; updat: the part's batch rows [seg.y, seg.z), BK a step, of block (row, column).
    const int n_steps = PASS == UPDAT ? (seg.z - seg.y + BK - 1) / BK
                        : K::COLS_W ? (seg.z - seg.y + K::R - 1) / K::R : (seg.z - seg.y) * (BS / BK);
    if constexpr (K::ROWS_T) {
        const int* entry = reinterpret_cast<const int*>(table) + (long long)unit * (2 * COLS + 1);
        for (int i = threadIdx.x; i < 2 * COLS + 1; i += K::NT + 32) group[i] = entry[i];
    } else if constexpr (K::COLS_W) {
        const int* steps = reinterpret_cast<const int*>(table) + (long long)seg.y * (COLS + 1);
        const int present = (seg.z - seg.y) * (COLS + 1);
        for (int i = threadIdx.x; i < n_steps * K::R * (COLS + 1); i += K::NT + 32)
            group_steps[i] = i < present ? steps[i] : -1;
    } else if constexpr (PASS != UPDAT) {
        for (int i = threadIdx.x; i < seg.z - seg.y; i += K::NT + 32) part_table[i] = table[seg.y + i];
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

    if (threadIdx.x >= K::NT) {  // the copy warp
        if (threadIdx.x == K::NT) {
            tma_prefetch_map(&act_map);
            tma_prefetch_map(&other_map);
            const int2 block = PASS == UPDAT && !K::ROWS_T ? table[unit] : make_int2(0, 0);
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
                            tma_load_2d(a + j * BS * BK, &other_map, AXIS1 ? group[1 + j] * BS : n,
                                        AXIS1 ? n : group[1 + j] * BS, &full[s]);
                    tma_load_2d(b, &act_map, AXIS1 ? group[0] * BS : n, AXIS1 ? n : group[0] * BS, &full[s]);
                } else if constexpr (PASS == UPDAT) {
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
                    if constexpr (PASS == FPROP) {  // B(k, n) = W_b[kin + k][n0 + n]: BOX-column panels
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
    for (int step = 0; step < n_steps; ++step) {
        const int s = step % STAGES;
        mbarrier_wait(&full[s], (step / STAGES) & 1);
#ifdef BSMM_PROBE_COPY_ONLY
        if (threadIdx.x % 32 == 0) mbarrier_arrive(&empty[s]);
        continue;
#endif
        if constexpr (MATH == WGMMA) {
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
    if constexpr (MATH == WGMMA) {
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
    } else if constexpr (MATH == WGMMA && sizeof(T) == 2) {  // (TF32 tiles: fragment stores)
        if (!accumulate && unit_info.y == 1) {
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
                    tma_store_2d(&out_map, PASS == UPDAT ? n0 + p * 64 : unit * (COLS > 1 ? BN : BS) + n0 + p * 64,
                                 PASS == UPDAT ? unit * BS + m0 : m0, staging + p * BM * 64);
                tma_store_commit_and_wait_read();
            }
            return;
        }
    }
    if constexpr (PASS == UPDAT)
        store_block_tile<K, T, BS>(out + (long long)unit * BS * BS, acc, m0, n0, accumulate);
    else
        store_sparse_tile<K, T, BS>(out, acc, unit, m0, n0, n_rows, ld_other, ld_out, accumulate);
#else
    __trap();  // TMA variants are built for sm_90a only
#endif
}

}  // namespace bsmm
