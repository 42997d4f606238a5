// Copies into shared memory: where each pass's operands live (Operands), the fast and the
// column-group loaders, and the cp.async stages of a main loop. Included by bsmm_matmul.cu.
#pragma once

#include "bsmm_kernel_traits.cuh"

namespace bsmm {

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
        return K::GROUPED && K::MATH == Math::Tensor16 && step > 0 && table[step].x == table[step - 1].x;
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
        if (K::PASS == Pass::Updat) {  // A(m, k) = x[n = kg, feature c·BS + m0 + m]
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
        if (K::PASS == Pass::Updat) {  // B(k, n) = dy[batch kg, feature kb·BS + n0 + n]
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
        ld_other = K::PASS == Pass::Updat ? o.ld_other : BS;
        const int rows_left = K::PASS == Pass::Updat ? K::BM : o.n_rows - o.m0;  // batch rows past N are absent
        a.init(tid, ld_act, K::A_KMAJOR, rows_left);
        b.init(tid, ld_other, K::B_KMAJOR, ChunkPlan<K, K::B_ROWS, K::B_COLS, K::B_PITCH>::ABSENT);
        if constexpr (K::PASS == Pass::Updat && K::COLS > 1) {
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
        if constexpr (K::PASS == Pass::Updat) {
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
        if (!o.same_a(step)) a.copy<BSMM_ACT_L1 && K::PASS != Pass::Updat>(sa, a_base, k_limit, tid);
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

}  // namespace bsmm
