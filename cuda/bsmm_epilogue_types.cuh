// Epilogues as types: what a pass does with each finished output element. A kernel instance
// names one (the last template parameter of bsmm_matmul / bsmm_matmul_tma, spelled by
// bsmm/epilogues.py); fprop and bprop tiles leave through it, updat's weight gradients always
// through Store.
//
// The hook an epilogue type E provides (see docs/internals.md):
//   E::PLAIN                 true where E stores the sums as they are (the TMA tile store may be used)
//   E::pair<T>(p, at, feature, a, b, accumulate)
//                            the column pair (feature, feature + 1) of one row, element offset `at`
//                            into p.out (and p.pre), a and b the float32 sums
//   E::one<T>(p, at, feature, a, accumulate)
//                            one element (feature axis 0, unaligned or SIMT tiles)
// Per-element epilogues (Store, BiasAct) need no more. A gated unit (an LSTM cell, SwiGLU) or
// per-block gates read several columns of a tile at once: they are to provide a whole-tile hook
// beside these (store_sparse_tile in bsmm_epilogue.cuh is where it would be called).
#pragma once

#include "bsmm_common.cuh"
#include "bsmm_params.cuh"

namespace bsmm {

// The activations of BiasAct, spelled by bsmm/activations.py (ACTIVATIONS[name].cuda).
enum class Act : int { None = 0, Relu = 1, Gelu = 2, GeluTanh = 3, Silu = 4 };

// A(z) in float32. Gelu is the erf form (PyTorch's default), GeluTanh the tanh approximation.
template <Act A>
__device__ __forceinline__ float activate(float z) {
    if constexpr (A == Act::Relu) {
        return fmaxf(z, 0.f);
    } else if constexpr (A == Act::Gelu) {
        return 0.5f * z * (1.f + erff(z * 0.7071067811865476f));
    } else if constexpr (A == Act::GeluTanh) {
        const float u = 0.7978845608028654f * (z + 0.044715f * z * z * z);
        return 0.5f * z * (1.f + tanhf(u));
    } else if constexpr (A == Act::Silu) {
        return z / (1.f + expf(-z));
    } else {
        return z;
    }
}

// A'(z) in float32, the derivative of activate<A> at the pre-activation z (relu: 0 at z <= 0, as
// PyTorch's threshold_backward gives).
template <Act A>
__device__ __forceinline__ float activate_grad(float z) {
    if constexpr (A == Act::Relu) {
        return z > 0.f ? 1.f : 0.f;
    } else if constexpr (A == Act::Gelu) {
        return 0.5f * (1.f + erff(z * 0.7071067811865476f)) + z * 0.3989422804014327f * expf(-0.5f * z * z);
    } else if constexpr (A == Act::GeluTanh) {
        const float u = 0.7978845608028654f * (z + 0.044715f * z * z * z);
        const float t = tanhf(u);
        return 0.5f * (1.f + t) + 0.5f * z * (1.f - t * t) * 0.7978845608028654f * (1.f + 0.134145f * z * z);
    } else if constexpr (A == Act::Silu) {
        const float s = 1.f / (1.f + expf(-z));
        return s * (1.f + z * (1.f - s));
    } else {
        return 1.f;
    }
}

// Today's store: the sums, added to what out holds where accumulate (in float, rounded once).
struct Store {
    static constexpr bool PLAIN = true;

    template <typename T>
    __device__ __forceinline__ static void pair(const MatmulParams& p, long long at, long long, float a, float b,
                                                int accumulate) {
        store_pair(static_cast<T*>(p.out) + at, a, b, accumulate);
    }

    template <typename T>
    __device__ __forceinline__ static void one(const MatmulParams& p, long long at, long long, float a, int accumulate) {
        T* dst = static_cast<T*>(p.out) + at;
        *dst = Elem<T>::from_float(accumulate ? a + Elem<T>::to_float(*dst) : a);
    }
};

// z = sums (+ what out holds where accumulate) + bias[feature] (where p.bias is set); the
// pre-activation z is written to p.pre (where set: a backward that needs A'(z) reads it), and
// A(z) to p.out, each rounded once from float32.
template <Act A>
struct BiasAct {
    static constexpr bool PLAIN = false;

    template <typename T>
    __device__ __forceinline__ static void pair(const MatmulParams& p, long long at, long long feature, float a, float b,
                                                int accumulate) {
        T* dst = static_cast<T*>(p.out) + at;
        if (accumulate) {
            float old_a, old_b;
            Pair<T>::load(dst, old_a, old_b);
            a += old_a;
            b += old_b;
        }
        if (p.bias != nullptr) {
            const T* bias = static_cast<const T*>(p.bias) + feature;
            a += Elem<T>::to_float(bias[0]);
            b += Elem<T>::to_float(bias[1]);
        }
        if (p.pre != nullptr) Pair<T>::store(static_cast<T*>(p.pre) + at, a, b);
        Pair<T>::store(dst, activate<A>(a), activate<A>(b));
    }

    template <typename T>
    __device__ __forceinline__ static void one(const MatmulParams& p, long long at, long long feature, float a,
                                               int accumulate) {
        T* dst = static_cast<T*>(p.out) + at;
        if (accumulate) a += Elem<T>::to_float(*dst);
        if (p.bias != nullptr) a += Elem<T>::to_float(static_cast<const T*>(p.bias)[feature]);
        if (p.pre != nullptr) static_cast<T*>(p.pre)[at] = Elem<T>::from_float(a);
        *dst = Elem<T>::from_float(activate<A>(a));
    }
};

}  // namespace bsmm
