// A gated unit's element-wise math, fused: h = A(g)·u, where a GLU-family MLP's gate and up
// projections are one product over [gate | up] (bsmm/torch/mlp.py), so that each row of that
// product holds g (hidden columns) then u (hidden columns). One launch forward, one backward:
//   forward   h = A(g)·u
//   backward  dg = dh·u·A'(g), du = dh·A(g), written side by side as d[gate | up], the gradient
//             the [gate | up] product's bprop and updat read (no concatenation follows).
// Unfused, PyTorch runs A, the product and, backward, two products, A's backward and a
// concatenation, each a pass over the (N, hidden) operands.
//
// Arithmetic is float32; T is what is read and written. One thread owns a column pair (j, j + 1)
// of one row (hidden is even: a multiple of the block size), so loads and stores are 4 bytes
// (half precision) or 8 (float32) wide and no thread reads what another writes. Rows are
// blockIdx.x (up to 2³¹ - 1), pairs threadIdx.x + blockIdx.y·blockDim.x. Parameters are 8 bytes
// each (bsmm/backends/cuda/gated_unit.py packs them as such).
#include "bsmm_common.cuh"
#include "bsmm_epilogue_types.cuh"

namespace bsmm {

// gate_up: (N, 2·hidden), row pitch 2·hidden; h: (N, hidden) written.
template <typename T, Act A>
__global__ void gated_unit_forward(const T* __restrict__ gate_up, T* __restrict__ h, long long hidden) {
    wait_for_prior_grid();
    const long long j = 2 * ((long long)blockIdx.y * blockDim.x + threadIdx.x);
    if (j >= hidden) return;
    const long long row = blockIdx.x;
    const T* in = gate_up + row * 2 * hidden;
    float g0, g1, u0, u1;
    Pair<T>::load(in + j, g0, g1);
    Pair<T>::load(in + hidden + j, u0, u1);
    Pair<T>::store(h + row * hidden + j, activate<A>(g0) * u0, activate<A>(g1) * u1);
}

// dh: (N, hidden); gate_up: (N, 2·hidden) as forward read it; d_gate_up: (N, 2·hidden) written,
// dg in the first hidden columns of a row, du in the last.
template <typename T, Act A>
__global__ void gated_unit_backward(const T* __restrict__ dh, const T* __restrict__ gate_up,
                                    T* __restrict__ d_gate_up, long long hidden) {
    wait_for_prior_grid();
    const long long j = 2 * ((long long)blockIdx.y * blockDim.x + threadIdx.x);
    if (j >= hidden) return;
    const long long row = blockIdx.x;
    const long long at = row * 2 * hidden + j;
    float d0, d1, g0, g1, u0, u1;
    Pair<T>::load(dh + row * hidden + j, d0, d1);
    Pair<T>::load(gate_up + at, g0, g1);
    Pair<T>::load(gate_up + at + hidden, u0, u1);
    Pair<T>::store(d_gate_up + at, d0 * u0 * activate_grad<A>(g0), d1 * u1 * activate_grad<A>(g1));
    Pair<T>::store(d_gate_up + at + hidden, d0 * activate<A>(g0), d1 * activate<A>(g1));
}

}  // namespace bsmm
