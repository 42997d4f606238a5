// One LSTM step's elementwise math, fused: one launch a step forward, one backward.
//
// The gate pre-activations of a step are z = x_t·Wx + h_{t-1}·Wh + b, (N, 4H), the gates
// input i, forget f, output o, candidate g along the columns, H apart (bsmm/nn/lstm_gates.py):
//   i, f, o = sigmoid(z_i, z_f, z_o), g = tanh(z_g), c_t = f·c_{t-1} + i·g, h_t = o·tanh(c_t)
// and backward, from dh = (the step's output gradient) + (what flows back from step t + 1):
//   dc = dc_next + dh·o·(1 - tanh²c_t); dz_i = dc·g·i(1-i), dz_f = dc·c_{t-1}·f(1-f),
//   dz_o = dh·tanh(c_t)·o(1-o), dz_g = dc·i·(1-g²); dc_{t-1} = dc·f.
// The same math as bsmm/nn/lstm_cell.py (NumPy, the reference) and bsmm/torch/lstm.py's CPU
// path; unfused, a step was about thirty element-wise kernels each way.
//
// The cell state, the gate activations and all arithmetic are float32; T (the passes' dtype)
// is only what is read from and written for the passes. One thread owns one hidden unit j of
// one row: it reads the unit's four gate columns and writes its c and h (or its four dz), so
// no thread reads what another writes (dc is updated in place). Rows are blockIdx.x (up to 2³¹ - 1),
// units threadIdx.x + blockIdx.y·blockDim.x: adjacent threads touch adjacent columns of every gate.
// Parameters are 8 bytes each (bsmm/backends/cuda/lstm_cell.py packs them as such).
#include "bsmm_common.cuh"

namespace bsmm {

__device__ __forceinline__ float sigmoid(float z) {
    // 1/(1 + e^-z): for very negative z, e^-z is +inf and the quotient 0, never NaN.
    return 1.f / (1.f + expf(-z));
}

// z_in: (N, 4H) x·Wx (+ h·Wh where z_rec is null), row pitch 4H; z_rec: (N, 4H) h·Wh or null;
// bias: (4H,) float or null; c_prev: (N, H) float; gates: (N, 4H) float, the activations
// written; c: (N, H) float written; h: (N, H) in T and/or h_master in float, either may be null.
template <typename T>
__global__ void lstm_cell_forward(const T* __restrict__ z_in, const T* __restrict__ z_rec,
                                  const float* __restrict__ bias, const float* __restrict__ c_prev,
                                  float* __restrict__ gates, float* __restrict__ c, T* __restrict__ h,
                                  float* __restrict__ h_master, long long hidden) {
    wait_for_prior_grid();
    const long long j = (long long)blockIdx.y * blockDim.x + threadIdx.x;
    if (j >= hidden) return;
    const long long row = blockIdx.x;
    const long long zrow = row * 4 * hidden, srow = row * hidden;
    float z[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        const long long at = zrow + q * hidden + j;
        z[q] = Elem<T>::to_float(z_in[at]);
        if (z_rec != nullptr) z[q] += Elem<T>::to_float(z_rec[at]);
        if (bias != nullptr) z[q] += bias[q * hidden + j];
    }
    const float i = sigmoid(z[0]), f = sigmoid(z[1]), o = sigmoid(z[2]), g = tanhf(z[3]);
    const float cell = f * c_prev[srow + j] + i * g;
    const float out = o * tanhf(cell);
    gates[zrow + j] = i;
    gates[zrow + hidden + j] = f;
    gates[zrow + 2 * hidden + j] = o;
    gates[zrow + 3 * hidden + j] = g;
    c[srow + j] = cell;
    if (h != nullptr) h[srow + j] = Elem<T>::from_float(out);
    if (h_master != nullptr) h_master[srow + j] = out;
}

// d_out: (N, H) float, the step's output gradient, or null; dh_rec: (N, H) dz_{t+1}·Whᵀ in T, or null
// (the last step); dh_init: (N, H) float, the final state's gradient, or null; dc: (N, H) float,
// dc_next in, dc_{t-1} out; gates, c_prev, c: the forward's; dz: (N, 4H) in T and/or dz_master in
// float, either may be null.
template <typename T>
__global__ void lstm_cell_backward(const float* __restrict__ d_out, const T* __restrict__ dh_rec,
                                   const float* __restrict__ dh_init, float* __restrict__ dc,
                                   const float* __restrict__ gates, const float* __restrict__ c_prev,
                                   const float* __restrict__ c, T* __restrict__ dz, float* __restrict__ dz_master,
                                   long long hidden) {
    wait_for_prior_grid();
    const long long j = (long long)blockIdx.y * blockDim.x + threadIdx.x;
    if (j >= hidden) return;
    const long long row = blockIdx.x;
    const long long zrow = row * 4 * hidden, srow = row * hidden;
    float dh = 0.f;
    if (d_out != nullptr) dh += d_out[srow + j];
    if (dh_rec != nullptr) dh += Elem<T>::to_float(dh_rec[srow + j]);
    if (dh_init != nullptr) dh += dh_init[srow + j];
    const float i = gates[zrow + j], f = gates[zrow + hidden + j], o = gates[zrow + 2 * hidden + j],
                g = gates[zrow + 3 * hidden + j];
    const float tanh_c = tanhf(c[srow + j]);
    const float d_cell = dc[srow + j] + dh * o * (1.f - tanh_c * tanh_c);
    const float d[4] = {d_cell * g * i * (1.f - i), d_cell * c_prev[srow + j] * f * (1.f - f),
                        dh * tanh_c * o * (1.f - o), d_cell * i * (1.f - g * g)};
    dc[srow + j] = d_cell * f;
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        if (dz != nullptr) dz[zrow + q * hidden + j] = Elem<T>::from_float(d[q]);
        if (dz_master != nullptr) dz_master[zrow + q * hidden + j] = d[q];
    }
}

}  // namespace bsmm
