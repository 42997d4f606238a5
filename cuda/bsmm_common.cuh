// Shared device helpers for bsmm's kernels: element types, asynchronous copies,
// ldmatrix and the tensor-core mma instructions (sm_80 and newer).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace bsmm {

// ---- programmatic dependent launch (sm_90) -----------------------------------------------
// On Hopper, passes are launched with programmatic stream serialization (bsmm/backends/cuda/launches.py): the
// grid may be scheduled before the one ahead of it on the stream has completed. Waiting here,
// before any global access, orders every read and write after that grid's (its memory is
// visible once the wait returns), so only the launch itself overlaps. No thread block signals
// its dependents early: with the signal at the start of each block, the next pass's blocks
// took SMs while this one still ran and eager calls at workload S 2 % slowed from 9.9 to 20 us
// (results/archive/v11/pdl_*). Without that launch attribute (and before sm_90) the wait is a no-op.
__device__ __forceinline__ void wait_for_prior_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// ---- element types --------------------------------------------------------------------
template <typename T> struct Elem;
template <> struct Elem<float> {
    static __device__ __forceinline__ float to_float(float v) { return v; }
    static __device__ __forceinline__ float from_float(float v) { return v; }
};
template <> struct Elem<__half> {
    static __device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
    static __device__ __forceinline__ __half from_float(float v) { return __float2half_rn(v); }
};
template <> struct Elem<__nv_bfloat16> {
    static __device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
    static __device__ __forceinline__ __nv_bfloat16 from_float(float v) { return __float2bfloat16_rn(v); }
};

// Two adjacent elements in one store (and load): the accumulator fragments of the tensor-core
// paths hold column pairs, and 2-byte stores would halve the write bandwidth.
template <typename T> struct Pair;
template <> struct Pair<float> {
    static __device__ __forceinline__ void load(const float* p, float& a, float& b) { float2 v = *reinterpret_cast<const float2*>(p); a = v.x; b = v.y; }
    static __device__ __forceinline__ void store(float* p, float a, float b) { *reinterpret_cast<float2*>(p) = make_float2(a, b); }
};
template <> struct Pair<__half> {
    static __device__ __forceinline__ void load(const __half* p, float& a, float& b) { float2 v = __half22float2(*reinterpret_cast<const __half2*>(p)); a = v.x; b = v.y; }
    static __device__ __forceinline__ void store(__half* p, float a, float b) { *reinterpret_cast<__half2*>(p) = __floats2half2_rn(a, b); }
};
template <> struct Pair<__nv_bfloat16> {
    static __device__ __forceinline__ void load(const __nv_bfloat16* p, float& a, float& b) { float2 v = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(p)); a = v.x; b = v.y; }
    static __device__ __forceinline__ void store(__nv_bfloat16* p, float a, float b) { *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(a, b); }
};

// Stores a column pair, added to what is there first when accumulating (in float, rounded once).
template <typename T>
__device__ __forceinline__ void store_pair(T* dst, float a, float b, int accumulate) {
    if (accumulate) {
        float old_a, old_b;
        Pair<T>::load(dst, old_a, old_b);
        a += old_a;
        b += old_b;
    }
    Pair<T>::store(dst, a, b);
}

// ---- asynchronous global -> shared copies -----------------------------------------------
__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// Copies 16 bytes, or zero-fills them when src_bytes is 0 (the source is then not read).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(src_bytes)
                 : "memory");
}
// The same copy through L1 (.ca): for tiles that other thread blocks on the SM read soon after.
__device__ __forceinline__ void cp_async16_l1(void* dst, const void* src, int src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(src_bytes)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

// A barrier among the first THREADS threads of the block only (barrier 1; __syncthreads is 0):
// lets a kernel's copy warp leave early while the others still synchronise.
template <int THREADS>
__device__ __forceinline__ void sync_threads_named() {
    asm volatile("bar.sync 1, %0;\n" ::"n"(THREADS) : "memory");
}

// ---- ldmatrix and mma (16-bit operands) -----------------------------------------------------
template <bool TRANS>
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* p) {
    if (TRANS)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
    else
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}
template <bool TRANS>
__device__ __forceinline__ void ldmatrix_x2(unsigned (&r)[2], const void* p) {
    if (TRANS)
        asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
                     : "=r"(r[0]), "=r"(r[1]) : "r"(smem_addr(p)));
    else
        asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
                     : "=r"(r[0]), "=r"(r[1]) : "r"(smem_addr(p)));
}

template <typename T> struct Mma;
template <> struct Mma<__half> {
    static __device__ __forceinline__ void run(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    }
};
template <> struct Mma<__nv_bfloat16> {
    static __device__ __forceinline__ void run(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    }
};

// TF32 m16n8k8: operands are float bit patterns rounded to tf32.
__device__ __forceinline__ unsigned to_tf32(float v) {
    unsigned r;
    asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(v));
    return r;
}
__device__ __forceinline__ void mma_tf32(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

}  // namespace bsmm
