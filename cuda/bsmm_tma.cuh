// Hopper (sm_90a) tensor memory accelerator (TMA) and shared-memory barriers: one thread
// copies a whole swizzled tile from global memory with cp.async.bulk.tensor, and the copy's
// completion is counted in bytes on an mbarrier that the consumers wait on.
//
// The tensor maps are encoded on the host (bsmm/backends/cuda/tensor_maps.py, cuTensorMapEncodeTiled) and
// passed by value as __grid_constant__ kernel parameters, so their address is a valid operand
// of the copy instruction.
#pragma once
#include "bsmm_common.cuh"

namespace bsmm {

// The driver's CUtensorMap: 128 opaque bytes, 64-byte aligned (cuda.h is not needed for it).
struct alignas(64) TensorMap {
    unsigned long long opaque[16];
};

__device__ __forceinline__ void mbarrier_init(unsigned long long* bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}
// Makes initialised barriers visible to the async proxy (the TMA unit) before first use.
__device__ __forceinline__ void mbarrier_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }

__device__ __forceinline__ void mbarrier_arrive(unsigned long long* bar) {
    asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.shared::cta.b64 state, [%0];\n}\n" ::"r"(smem_addr(bar)) : "memory");
}
// Arrives and announces that `bytes` more will land on the barrier through TMA copies.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(unsigned long long* bar, unsigned bytes) {
    asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.expect_tx.shared::cta.b64 state, [%0], %1;\n}\n" ::"r"(smem_addr(bar)),
                 "r"(bytes)
                 : "memory");
}
// Waits until the barrier's phase with this parity has completed.
__device__ __forceinline__ void mbarrier_wait(unsigned long long* bar, unsigned parity) {
    unsigned done = 0;
    do {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done)
                     : "r"(smem_addr(bar)), "r"(parity)
                     : "memory");
    } while (!done);
}

// Copies the box of a 2-D tensor map at (inner, outer) element coordinates into shared memory;
// its bytes complete on `bar`. Elements outside the tensor arrive as zeros.
__device__ __forceinline__ void tma_load_2d(void* dst, const TensorMap* map, int inner, int outer, unsigned long long* bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(
            smem_addr(dst)),
        "l"(reinterpret_cast<unsigned long long>(map)), "r"(inner), "r"(outer), "r"(smem_addr(bar))
        : "memory");
}

// Stores a shared-memory tile as the box at (inner, outer) of a 2-D tensor map; parts of the box
// outside the tensor are not written. Completes in the thread's bulk group.
__device__ __forceinline__ void tma_store_2d(const TensorMap* map, int inner, int outer, const void* src) {
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];\n" ::"l"(
                     reinterpret_cast<unsigned long long>(map)),
                 "r"(inner), "r"(outer), "r"(smem_addr(src))
                 : "memory");
}
// Commits the thread's stores and waits until their shared-memory sources have been read (the
// global writes may still be in flight; the thread block may exit).
__device__ __forceinline__ void tma_store_commit_and_wait_read() {
    asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
    asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
}

// Fetches a tensor map into the cache ahead of its first copy.
__device__ __forceinline__ void tma_prefetch_map(const TensorMap* map) {
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<unsigned long long>(map)) : "memory");
}

}  // namespace bsmm
