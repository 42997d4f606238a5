// Transpose of a row-major matrix of 2- or 4-byte elements: dst (cols x ld) = srcᵀ, src (rows x
// cols), with zeros in dst columns rows..ld-1.
//
// The updat pass at blocks 16 and 32 on feature axis 1 reads x and dy as 32/64-byte row
// segments, one cache line each, and the number of lines, not the bytes, bounds it; on the
// transposed copies every row of a tile is whole lines (bsmm/backends/cuda/backend.py, TransposedUpdat).
// The zero columns pad the batch to whole 16-byte chunks, which the kernel's tail copies read.
//
// A 64 x 64 tile goes through shared memory so that both the reads and the writes are
// 16-byte accesses along rows; the odd pitch (33 or 65 words) keeps the column reads to at most
// two-way bank conflicts. Needs cols and ld whole 16-byte runs and 16-byte aligned pointers.
// (TF32 updat on Hopper reads the 4-byte copies: wgmma takes 32-bit operands K-major only.)

#include "bsmm_common.cuh"

namespace bsmm {

template <typename T>
__global__ void __launch_bounds__(256) transpose_tiles(const T* __restrict__ src, T* __restrict__ dst, int rows,
                                                       int cols, int ld) {
    static_assert(sizeof(T) == 2 || sizeof(T) == 4, "16-byte accesses of 8 or 4 elements");
    wait_for_prior_grid();
    constexpr int TILE = 64, VEC = 16 / sizeof(T), PITCH = TILE + 4 / sizeof(T), CHUNKS = TILE * TILE / VEC;
    __shared__ T tile[TILE * PITCH];
    const int r0 = blockIdx.x * TILE, c0 = blockIdx.y * TILE;
    for (int q = threadIdx.x; q < CHUNKS; q += blockDim.x) {
        const int r = q / (TILE / VEC), c = (q % (TILE / VEC)) * VEC;
        uint4 pack = make_uint4(0, 0, 0, 0);  // rows past the source are the zero padding
        if (r0 + r < rows && c0 + c < cols) pack = *reinterpret_cast<const uint4*>(src + (long long)(r0 + r) * cols + c0 + c);
        const T* v = reinterpret_cast<const T*>(&pack);
#pragma unroll
        for (int e = 0; e < VEC; ++e) tile[r * PITCH + c + e] = v[e];
    }
    __syncthreads();
    // Eight (sixteen) consecutive lanes write one 128 (256)-byte run of a dst row.
    for (int q = threadIdx.x; q < CHUNKS; q += blockDim.x) {
        const int c = q / (TILE / VEC), r = (q % (TILE / VEC)) * VEC;
        if (c0 + c >= cols || r0 + r >= ld) continue;
        uint4 pack;
        T* v = reinterpret_cast<T*>(&pack);
#pragma unroll
        for (int e = 0; e < VEC; ++e) v[e] = tile[(r + e) * PITCH + c];
        *reinterpret_cast<uint4*>(dst + (long long)(c0 + c) * ld + r0 + r) = pack;
    }
}

// Weight blocks transposed and reordered: dst block b = (src block order[b])ᵀ, BS x BS floats
// each. TF32 fprop on Hopper runs as a bprop over the transposed layout (wgmma reads 32-bit
// operands K-major only, which fprop's weight rows are not; bsmm/backends/cuda/backend.py,
// TransposedWeightsFprop); order lists the layout's blocks in the transposed layout's order.
// A thread block moves one TILE x TILE sub-tile through shared memory (pitch TILE + 1: the
// column reads meet no bank conflicts); grid (blocks, (BS / TILE)^2).
template <int BS>
__global__ void __launch_bounds__(256) transpose_blocks(const float* __restrict__ src, float* __restrict__ dst,
                                                        const int* __restrict__ order) {
    wait_for_prior_grid();
    constexpr int TILE = BS < 32 ? BS : 32, PER_ROW = BS / TILE;
    __shared__ float tile[TILE * (TILE + 1)];
    const int r0 = (blockIdx.y / PER_ROW) * TILE, c0 = (blockIdx.y % PER_ROW) * TILE;
    const float* s = src + (long long)order[blockIdx.x] * BS * BS;
    float* d = dst + (long long)blockIdx.x * BS * BS;
    for (int i = threadIdx.x; i < TILE * TILE; i += blockDim.x)
        tile[(i / TILE) * (TILE + 1) + i % TILE] = s[(r0 + i / TILE) * BS + c0 + i % TILE];
    __syncthreads();
    for (int i = threadIdx.x; i < TILE * TILE; i += blockDim.x)
        d[(c0 + i / TILE) * BS + r0 + i % TILE] = tile[(i % TILE) * (TILE + 1) + i / TILE];
}

}  // namespace bsmm
