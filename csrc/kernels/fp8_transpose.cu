// The FP8 transpose: out[c, r] = in[r, c] for one-byte codes. cuBLASLt's FP8 GEMMs take both
// operands K-contiguous, so an FP8 layer's backward needs its grad, input and weight transposed.
// A plain strided copy of one-byte elements reads one byte per 32-byte sector on one side;
// here a block stages a 32 x 32 tile in shared memory, so that both its reads and its writes
// are 32 contiguous bytes per warp.
#include <cuda_runtime.h>

#include <algorithm>

#include "fp8_cuda.h"
#include "launch_check.cuh"

namespace ampfuse::kernels::cuda {
namespace {

constexpr int kTile = 32;
constexpr int kRowsPerPass = 8;  // blockDim.y: each thread moves kTile / kRowsPerPass bytes
// gridDim.y's limit; taller inputs are transposed in bands of this many tiles.
constexpr std::int64_t kMaxTileRowsPerLaunch = 65535;

__global__ void __launch_bounds__(kTile* kRowsPerPass)
    transpose_bytes_kernel(const std::uint8_t* in, std::uint8_t* out, std::int64_t rows,
                           std::int64_t cols, std::int64_t first_row) {
  // A row of 36 bytes: thread x of a warp reading column r finds its byte at x * 36 + r, in
  // bank (9x + r / 4) mod 32, a different bank for each of the 32 threads.
  __shared__ std::uint8_t tile[kTile][kTile + 4];
  const std::int64_t row0 = first_row + static_cast<std::int64_t>(blockIdx.y) * kTile;
  const std::int64_t col0 = static_cast<std::int64_t>(blockIdx.x) * kTile;
  for (int r = threadIdx.y; r < kTile; r += kRowsPerPass) {
    const std::int64_t row = row0 + r;
    const std::int64_t col = col0 + threadIdx.x;
    if (row < rows && col < cols) tile[r][threadIdx.x] = in[row * cols + col];
  }
  __syncthreads();
  // out is [cols, rows]: tile column r becomes out row col0 + r.
  for (int r = threadIdx.y; r < kTile; r += kRowsPerPass) {
    const std::int64_t out_row = col0 + r;
    const std::int64_t out_col = row0 + threadIdx.x;
    if (out_row < cols && out_col < rows) out[out_row * rows + out_col] = tile[threadIdx.x][r];
  }
}

}  // namespace

void fp8_transpose(const std::uint8_t* in, std::uint8_t* out, std::int64_t rows, std::int64_t cols,
                   StreamHandle stream) {
  if (rows == 0 || cols == 0) return;
  const auto s = reinterpret_cast<cudaStream_t>(stream);
  const std::int64_t tile_cols = (cols + kTile - 1) / kTile;
  const std::int64_t tile_rows = (rows + kTile - 1) / kTile;
  for (std::int64_t first = 0; first < tile_rows; first += kMaxTileRowsPerLaunch) {
    const dim3 grid(static_cast<unsigned>(tile_cols),
                    static_cast<unsigned>(std::min(kMaxTileRowsPerLaunch, tile_rows - first)));
    transpose_bytes_kernel<<<grid, dim3(kTile, kRowsPerPass), 0, s>>>(in, out, rows, cols,
                                                                      first * kTile);
    throw_on_launch_error("fp8_transpose");
  }
}

}  // namespace ampfuse::kernels::cuda
