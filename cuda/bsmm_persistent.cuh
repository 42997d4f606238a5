// fprop/bprop on wgmma through TMA with thread blocks that walk many output tiles (persistent).
//
// Where a block column holds few blocks, a tile is a few steps long and one thread block an SM
// (block 128: 192 KB of stages) spends much of its life starting, filling its stages and storing
// its tile, each while the tensor cores idle. Here a grid of as many thread blocks as the SMs
// hold walks the tiles, each thread block taking the next one from a counter as it needs it:
// the copy warp runs on into the next tile's stages while the warps store the last one from
// their registers, so stores and start-up overlap the math. Tiles are cut into no parts
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

// What a stage holds, written by the copy thread before it arrives on the stage's full barrier:
// (segment, row tile, step of the tile, steps of the tile); segment -1: no tile is left. A tile
// of no step (an empty block column) takes a stage of its own, copied nothing into.
struct StageTile {
    int segment, row_tile, step, steps;
};

// The copy warp's walk: lane 0 takes the next tile from the launch's counter (tiles go out in
// the one-tile grid's order, so those in flight at one time share their activation rows in L2,
// and long and short tiles balance over the thread blocks), the warp's lanes read its table
// entries into part_table, and lane 0 fills the stages, the ring's phase running on across
// tiles. The last thread block to finish resets the two counters for the next launch.
template <class K, typename T, int BS, int STAGES, int BOX, Pass PASS>
__device__ void copy_tiles(T* sa, T* sb, unsigned long long* full, unsigned long long* empty, StageTile* stage_tiles,
                           int2* part_table, const int4* __restrict__ segments, const int2* __restrict__ table,
                           int* counters, const TensorMap* act_map, const TensorMap* other_map, int segment_count,
                           int row_tiles, int band_rows) {
    const int lane = threadIdx.x % 32;
    const long long tiles = (long long)segment_count * row_tiles;
    int issued = 0;  // stages filled so far
    auto next_stage = [&](StageTile what) {  // lane 0: the stage to fill, once it is free
        const int s = issued % STAGES;
        if (issued >= STAGES) mbarrier_wait(&empty[s], (issued / STAGES - 1) & 1);
        stage_tiles[s] = what;
        ++issued;
        return s;
    };
    for (;;) {
        int id = lane == 0 ? atomicAdd(&counters[0], 1) : 0;
        id = __shfl_sync(0xffffffffu, id, 0);
        if (id >= tiles) break;
        const int2 tile = banded_tile_of(id, segment_count, row_tiles, band_rows);
        const int4 seg = segments[tile.x];
        __syncwarp();  // lane 0 has issued the previous tile from part_table
        for (int i = lane; i < seg.z - seg.y; i += 32) part_table[i] = table[seg.y + i];
        __syncwarp();
        if (lane != 0) continue;
        const int n_steps = (seg.z - seg.y) * (BS / K::BK);
        if (n_steps == 0) {
            mbarrier_arrive(&full[next_stage({tile.x, tile.y, 0, 0})]);
            continue;
        }
        for (int step = 0; step < n_steps; ++step) {
            const int s = next_stage({tile.x, tile.y, step, n_steps});
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
    if (lane == 0) {
        mbarrier_arrive(&full[next_stage({-1, 0, 0, 0})]);
        __threadfence();
        if (atomicAdd(&counters[1], 1) == (int)gridDim.x - 1) {
            counters[0] = 0;
            counters[1] = 0;
        }
    }
}

// The multiplying warps' walk: the stages in order, each saying which tile and step it holds;
// at a tile's last step its output is stored from the registers (pairs of elements, as
// store_sparse_tile does) while the copy warp fills the stages of the next tiles.
template <class K, typename T, int BS, int STAGES>
__device__ void multiply_tiles(const T* sa, const T* sb, unsigned long long* full, unsigned long long* empty,
                               const StageTile* stage_tiles, T* __restrict__ out, int n_rows, int ld_other, int ld_out,
                               int accumulate) {
    float acc[K::ACC];
    for (int used = 0;; ++used) {
        const int s = used % STAGES;
        mbarrier_wait(&full[s], (used / STAGES) & 1);
        const StageTile held = stage_tiles[s];
        if (held.segment < 0) return;
        if (held.step == 0) {
#pragma unroll
            for (int i = 0; i < K::ACC; ++i) acc[i] = 0.f;
        }
        if (held.steps == 0) {  // an empty block column: zeros
            if (threadIdx.x % 32 == 0) mbarrier_arrive(&empty[s]);
        } else {
#ifdef BSMM_PROBE_COPY_ONLY
            if (threadIdx.x % 32 == 0) mbarrier_arrive(&empty[s]);
#else
            wgmma_step<K, T>(acc, sa + s * K::A_STAGE, sb + s * K::B_STAGE);
            wgmma_wait<1>();  // the previous step's group has read its stage: release it
            if (held.step > 0 && threadIdx.x % 32 == 0) mbarrier_arrive(&empty[(used + STAGES - 1) % STAGES]);
            if (held.step == held.steps - 1) {
                wgmma_wait<0>();
                fence_registers(acc);
                if (threadIdx.x % 32 == 0) mbarrier_arrive(&empty[s]);
            }
#endif
        }
        if (held.step == held.steps - 1 || held.steps == 0)
            store_sparse_tile<K, T, BS>(out, acc, held.segment, held.row_tile * K::BM, 0, n_rows, ld_other, ld_out,
                                        accumulate);
    }
}

}  // namespace bsmm
