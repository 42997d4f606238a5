// Row gather with zero fill: dst row r = src row row_map[r], or zeros where row_map[r] < 0.
//
// Every layout change of a convolution (bsmm/nn/conv.py) is one of these over channels-last
// rows: padding the input into its canvas, cropping the result grid into the output,
// placing an output gradient on the grid, gathering an input gradient back out. One launch
// with 16-byte accesses replaces a zero fill plus a strided copy per slice (each of which
// moved 2-byte elements through generic N-d index arithmetic at a tenth of copy bandwidth).
//
// V is the access unit (uint4 = 16 bytes where rows and pointers allow it, else smaller);
// a row is row_units units. Rows are independent, so any grid covers them.

namespace bsmm {

template <typename V>
__global__ void gather_rows(const V* __restrict__ src, V* __restrict__ dst, const int* __restrict__ row_map,
                            long long dst_rows, int row_units) {
    // threadIdx.x walks the units of a row (coalesced), threadIdx.y picks the row: no division.
    for (long long row = (long long)blockIdx.x * blockDim.y + threadIdx.y; row < dst_rows;
         row += (long long)gridDim.x * blockDim.y) {
        const int from = __ldg(row_map + row);
        V* out = dst + row * row_units;
        if (from >= 0) {
            const V* in = src + (long long)from * row_units;
            for (int unit = threadIdx.x; unit < row_units; unit += blockDim.x) out[unit] = in[unit];
        } else {
            for (int unit = threadIdx.x; unit < row_units; unit += blockDim.x) out[unit] = V{};
        }
    }
}

}  // namespace bsmm
