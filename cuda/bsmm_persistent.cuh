// fprop/bprop on wgmma through TMA with thread blocks that walk many output tiles (persistent).
//
// Where a block column holds few blocks, a tile is a few steps long and one thread block an SM
// (block 128: 192 KB of stages) spends much of its life starting, filling its stages and storing
// its tile, each while the tensor cores idle. Here a grid of as many thread blocks as the SMs
// hold walks the tiles in the order of the one-tile grid (banded_tile_of), tile id, id + grid,
// ...: the copy warp runs on into the next tile's stages while the warps store the last one
// from their registers, so stores and start-up overlap the math. Tiles are cut into no parts
// (the planner's rule), so every tile stores its output itself.
#pragma once

namespace bsmm {

// The copies of one step of a block-column (fprop) or block-row (bprop) tile: the activation
// rows m0.. of feature block entry.y and the weight block entry.x, BK deep from kin.
template <class K, typename T, int BS, int BOX, Pass PASS>
__device__ __forceinline__ void copy_block_step(T* a, T* b, const TensorMap* act_map, const TensorMap* other_map,
                                                int2 entry, int kin, int m0, int n0, unsigned long long* bar) {
    const int w_row = entry.x * BS;
    tma_load_2d(a, act_map, entry.y * BS + kin, m0, bar);
    if constexpr (PASS == Pass::Fprop) {  // B(k, n) = W_b[kin + k][n0 + n]: BOX-column panels
#pragma unroll
        for (int p = 0; p < K::BN / BOX; ++p) tma_load_2d(b + p * K::BK * BOX, other_map, n0 + p * BOX, w_row + kin, bar);
    } else {  // bprop: B(k, n) = W_b[n0 + n][kin + k], K-major rows
        tma_load_2d(b, other_map, kin, w_row + n0, bar);
    }
}

// The copy warp's walk (all 32 lanes): per tile its lanes read the segment's table entries
// into part_table, then lane 0 fills the stages, the ring's phase running on across tiles.
template <class K, typename T, int BS, int STAGES, int BOX, Pass PASS>
__device__ void copy_tiles(T* sa, T* sb, unsigned long long* full, unsigned long long* empty, int2* part_table,
                           const int4* __restrict__ segments, const int2* __restrict__ table, const TensorMap* act_map,
                           const TensorMap* other_map, int segment_count, int row_tiles, int band_rows) {
    const int lane = threadIdx.x % 32;
    const long long tiles = (long long)segment_count * row_tiles;
    int issued = 0;  // steps of all this thread block's tiles so far
    for (long long id = blockIdx.x; id < tiles; id += gridDim.x) {
        const int2 tile = banded_tile_of(id, segment_count, row_tiles, band_rows);
        const int4 seg = segments[tile.x];
        __syncwarp();  // lane 0 has issued the previous tile from part_table
        for (int i = lane; i < seg.z - seg.y; i += 32) part_table[i] = table[seg.y + i];
        __syncwarp();
        const int n_steps = (seg.z - seg.y) * (BS / K::BK);
        if (lane == 0) {
            for (int step = 0; step < n_steps; ++step) {
                const int g = issued + step, s = g % STAGES;
                if (g >= STAGES) mbarrier_wait(&empty[s], (g / STAGES - 1) & 1);
#ifdef BSMM_PROBE_MATH_ONLY
                mbarrier_arrive(&full[s]);
                continue;
#endif
                mbarrier_arrive_expect_tx(&full[s], (K::A_STAGE + K::B_STAGE) * sizeof(T));
                copy_block_step<K, T, BS, BOX, PASS>(sa + s * K::A_STAGE, sb + s * K::B_STAGE, act_map, other_map,
                                                     part_table[step / (BS / K::BK)], (step % (BS / K::BK)) * K::BK,
                                                     tile.y * K::BM, 0, &full[s]);
            }
        }
        issued += n_steps;
    }
}

// The multiplying warps' walk: each tile's steps from the ring, then its output stored from
// the registers (pairs of elements, as store_sparse_tile does) while the copy warp fills the
// stages of the next tile.
template <class K, typename T, int BS, int STAGES>
__device__ void multiply_tiles(const T* sa, const T* sb, unsigned long long* full, unsigned long long* empty,
                               const int4* __restrict__ segments, T* __restrict__ out, int n_rows, int ld_other,
                               int ld_out, int accumulate, int segment_count, int row_tiles, int band_rows) {
    const long long tiles = (long long)segment_count * row_tiles;
    int used = 0;  // steps of all this thread block's tiles so far
    for (long long id = blockIdx.x; id < tiles; id += gridDim.x) {
        const int2 tile = banded_tile_of(id, segment_count, row_tiles, band_rows);
        const int4 seg = segments[tile.x];
        const int n_steps = (seg.z - seg.y) * (BS / K::BK);
        float acc[K::ACC];
#pragma unroll
        for (int i = 0; i < K::ACC; ++i) acc[i] = 0.f;
        for (int step = 0; step < n_steps; ++step, ++used) {
            const int s = used % STAGES;
            mbarrier_wait(&full[s], (used / STAGES) & 1);
#ifdef BSMM_PROBE_COPY_ONLY
            if (threadIdx.x % 32 == 0) mbarrier_arrive(&empty[s]);
            continue;
#endif
            wgmma_step<K, T>(acc, sa + s * K::A_STAGE, sb + s * K::B_STAGE);
            wgmma_wait<1>();  // the previous step's group has read its stage: release it
            if (step > 0 && threadIdx.x % 32 == 0) mbarrier_arrive(&empty[(used - 1) % STAGES]);
        }
#ifndef BSMM_PROBE_COPY_ONLY
        wgmma_wait<0>();
        fence_registers(acc);
        if (n_steps > 0 && threadIdx.x % 32 == 0) mbarrier_arrive(&empty[(used - 1) % STAGES]);
#endif
        store_sparse_tile<K, T, BS>(out, acc, seg.x, tile.y * K::BM, 0, n_rows, ld_other, ld_out, accumulate);
    }
}

}  // namespace bsmm
