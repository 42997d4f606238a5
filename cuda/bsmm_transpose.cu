// Transpose of a row-major matrix of 2-byte elements: dst (cols x ld) = srcᵀ, src (rows x cols),
// with zeros in dst columns rows..ld-1.
//
// The updat pass at blocks 16 and 32 on feature axis 1 reads x and dy as 32/64-byte row
// segments, one cache line each, and the number of lines, not the bytes, bounds it; on the
// transposed copies every row of a tile is whole lines (bsmm/cuda_backend.py, TransposedUpdat).
// The zero columns pad the batch to whole 16-byte chunks, which the kernel's tail copies read.
//
// A 64 x 64 tile goes through shared memory so that both the reads and the writes are
// 16-byte accesses along rows; the odd pitch (33 words) keeps the column reads to at most
// two-way bank conflicts. Needs cols and ld multiples of 8 and 16-byte aligned pointers.

#include "bsmm_common.cuh"

namespace bsmm {

template <typename T>
__global__ void __launch_bounds__(256) transpose_tiles(const T* __restrict__ src, T* __restrict__ dst, int rows,
                                                       int cols, int ld) {
    static_assert(sizeof(T) == 2, "16-byte accesses of 8 elements");
    wait_for_prior_grid();
    constexpr int TILE = 64, VEC = 8, PITCH = TILE + 2, CHUNKS = TILE * TILE / VEC;
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
    // Eight consecutive lanes write one 128-byte run of a dst row.
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

}  // namespace bsmm
