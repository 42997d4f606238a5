// Hopper (sm_90a) warpgroup MMA: wgmma.mma_async on operands in shared memory.
//
// Tiles are stored in the 128-byte swizzled layout the tensor cores read through a matrix
// descriptor: a panel of rows 64 elements (128 bytes) wide, eight rows (1024 bytes) to a
// swizzle atom, the 16-byte chunk c of row r stored at chunk c ^ (r % 8). The same layout
// serves a K-major operand (rows along M or N, K contiguous) and an MN-major one (rows along
// K, N contiguous); panels of a wider MN-major tile follow each other.
#pragma once
#include "bsmm_common.cuh"

namespace bsmm {

// Element offset of (row, col) in a ROWS x COLS tile stored as 64-column swizzled panels.
template <int ROWS>
__device__ __forceinline__ int swizzled_offset(int row, int col) {
    const int panel = col / 64, chunk = (col % 64) / 8;
    return panel * ROWS * 64 + row * 64 + ((chunk ^ (row % 8)) * 8) + col % 8;
}

// Matrix descriptor of a swizzled operand starting at p; lbo/sbo in bytes. SWIZZLE: the bytes
// of a swizzled row, 128 (mode 1 in bits 62-63), 64 (mode 2) or 32 (mode 3), the span of the
// TMA swizzle that wrote the tile. Moving the start by 32 bytes steps 16 elements along K
// inside a K-major 128-byte row; the hardware applies the swizzle to the resulting addresses.
template <int SWIZZLE = 128>
__device__ __forceinline__ unsigned long long wgmma_descriptor(const void* p, unsigned lbo, unsigned sbo) {
    static_assert(SWIZZLE == 128 || SWIZZLE == 64 || SWIZZLE == 32, "wgmma swizzle modes");
    constexpr unsigned long long MODE = SWIZZLE == 128 ? 1 : SWIZZLE == 64 ? 2 : 3;
    const unsigned long long addr = smem_addr(p);
    return ((addr & 0x3FFFF) >> 4) | ((unsigned long long)((lbo >> 4) & 0x3FFF) << 16) |
           ((unsigned long long)((sbo >> 4) & 0x3FFF) << 32) | (MODE << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
// Shared memory written through the generic proxy (cp.async) and read next by the tensor cores.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// Keeps the compiler from moving accumulator accesses across an in-flight wgmma.
template <int N>
__device__ __forceinline__ void fence_registers(float (&r)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

// D[64 x N] += A[64 x 16] · B[16 x N], float32 accumulators (N / 2 a thread).
// TRANS_A: A is M-major (updat reads x's columns); TRANS_B: B is N-major. (TF32: m64nNk8.)
template <typename T, int N>
struct Wgmma {
    template <bool TRANS_A, bool TRANS_B>
    static __device__ __forceinline__ void run(float (&)[N / 2], unsigned long long, unsigned long long) {
        __trap();  // wgmma variants are built for sm_90a only
    }
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// The accumulator operands of one instruction: registers %0 .. %(N/2 - 1).
#define BSMM_WGMMA_D8 "{%0, %1, %2, %3, %4, %5, %6, %7}"
#define BSMM_WGMMA_D16 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"
#define BSMM_WGMMA_D32 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define BSMM_WGMMA_D64 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define BSMM_WGMMA_OUT8 "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
#define BSMM_WGMMA_OUT16 "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
#define BSMM_WGMMA_OUT32 "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define BSMM_WGMMA_OUT64 "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
// One specialization per (element type, N); the descriptors and transpose flags follow the
// accumulators (operands %N/2 ...). The scale-d predicate is true: D accumulates. K: the depth
// of one instruction, 32 bytes (16 half-precision elements, 8 TF32 ones). TRANS: the transpose
// immediates, which only 16-bit types take; TF32 (float operands, of which the tensor cores read
// the top 19 bits) takes both operands K-major.
#define BSMM_WGMMA(CTYPE, PTX_TYPE, K, N, D, OUT, A, B, TRANS)                                                   \
    template <>                                                                                                    \
    struct Wgmma<CTYPE, N> {                                                                                       \
        template <bool TRANS_A, bool TRANS_B>                                                                      \
        static __device__ __forceinline__ void run(float (&d)[N / 2], unsigned long long a_desc,                   \
                                                   unsigned long long b_desc) {                                    \
            static_assert(sizeof(CTYPE) == 2 || (!TRANS_A && !TRANS_B), "TF32 wgmma: K-major operands only");      \
            asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"                                                  \
                         "wgmma.mma_async.sync.aligned.m64n" #N "k" #K ".f32." PTX_TYPE "." PTX_TYPE " " D ", " A     \
                         ", " B ", p, 1, 1" TRANS ";\n}\n"                                                          \
                         : OUT                                                                                     \
                         : "l"(a_desc), "l"(b_desc), "n"(TRANS_A ? 1 : 0), "n"(TRANS_B ? 1 : 0));                  \
        }                                                                                                          \
    };
BSMM_WGMMA(__half, "f16", 16, 16, BSMM_WGMMA_D8, BSMM_WGMMA_OUT8, "%8", "%9", ", %10, %11")
BSMM_WGMMA(__half, "f16", 16, 32, BSMM_WGMMA_D16, BSMM_WGMMA_OUT16, "%16", "%17", ", %18, %19")
BSMM_WGMMA(__half, "f16", 16, 64, BSMM_WGMMA_D32, BSMM_WGMMA_OUT32, "%32", "%33", ", %34, %35")
BSMM_WGMMA(__half, "f16", 16, 128, BSMM_WGMMA_D64, BSMM_WGMMA_OUT64, "%64", "%65", ", %66, %67")
BSMM_WGMMA(__nv_bfloat16, "bf16", 16, 16, BSMM_WGMMA_D8, BSMM_WGMMA_OUT8, "%8", "%9", ", %10, %11")
BSMM_WGMMA(__nv_bfloat16, "bf16", 16, 32, BSMM_WGMMA_D16, BSMM_WGMMA_OUT16, "%16", "%17", ", %18, %19")
BSMM_WGMMA(__nv_bfloat16, "bf16", 16, 64, BSMM_WGMMA_D32, BSMM_WGMMA_OUT32, "%32", "%33", ", %34, %35")
BSMM_WGMMA(__nv_bfloat16, "bf16", 16, 128, BSMM_WGMMA_D64, BSMM_WGMMA_OUT64, "%64", "%65", ", %66, %67")
BSMM_WGMMA(float, "tf32", 8, 64, BSMM_WGMMA_D32, BSMM_WGMMA_OUT32, "%32", "%33", "")
BSMM_WGMMA(float, "tf32", 8, 128, BSMM_WGMMA_D64, BSMM_WGMMA_OUT64, "%64", "%65", "")
#undef BSMM_WGMMA
#undef BSMM_WGMMA_D8
#undef BSMM_WGMMA_D16
#undef BSMM_WGMMA_D32
#undef BSMM_WGMMA_D64
#undef BSMM_WGMMA_OUT8
#undef BSMM_WGMMA_OUT16
#undef BSMM_WGMMA_OUT32
#undef BSMM_WGMMA_OUT64
#endif

}  // namespace bsmm
