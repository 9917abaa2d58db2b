// The tiled FP8 cast + transpose (fp8_cast_transpose[_dbias], fp8_quantize_rowwise with
// transpose) and the row-per-block rowwise quantize. Element arithmetic is fp8_math.h's, so
// codes and scales are the CPU kernels' bits.
//
// Tile kernel: a block of 256 threads owns a 64 x 64 tile of the input. Each thread reads one
// 16-element segment of one tile row (four 16-byte loads of fp32, two of fp16/bf16) when the
// input is 16-byte aligned and k % 16 == 0, else element by element with bounds checks (odd
// sizes, the ragged edge tiles). It writes the segment's 16 codes to `out` as one 16-byte
// store and to a shared-memory tile; after a barrier each thread gathers 16 codes of one tile
// column (16 input rows) and writes them to out_t as one 16-byte store when m % 16 == 0.
// Reading [m, k] and writing [k, m] are then both whole 32-byte sectors, the whole point of
// staging the tile: a direct transposed store would write one byte per sector.
//
// dbias: each tile's column sums (64 rows, fp32, fixed order) go to a workspace row, and a
// second launch adds the tile rows in order. Atomics would save that launch, but float atomics
// sum in arrival order, so dbias would change from run to run; a bias grad that is the same
// bits on every run (as the CPU's) is worth the extra [m / 64, k] floats of traffic.
#include <cuda_runtime.h>

#include <algorithm>

#include "fp8_cuda.h"
#include "fp8_vector_io.cuh"
#include "launch_check.cuh"

namespace ampfuse::kernels::cuda {
namespace {

constexpr int kTile = 64;                          // rows and columns of a tile
constexpr int kSeg = 16;                           // elements per thread per tile row
constexpr int kSegsPerRow = kTile / kSeg;          // 4
constexpr int kTileThreads = kTile * kSegsPerRow;  // 256
// gridDim.y's limit: taller inputs go in bands of this many tile rows.
constexpr std::int64_t kMaxTileRowsPerLaunch = 65535;

enum class ScaleMode { kTensor, kColumn };

struct TileArgs {
  const void* src;
  std::int64_t rows, cols, first_row;
  const float* scale;                // kTensor: the one scale
  const std::uint32_t* column_amax;  // kColumn: abs_bits max of each column
  float fp8_max;
  float* amax;           // kTensor: folded into (atomicMax); may be null
  std::uint8_t* out;     // [rows, cols], may be null
  std::uint8_t* out_t;   // [cols, rows]
  float* scale_inv;      // kColumn: [cols], written by the first tile row
  float* dbias_partial;  // [tile rows, cols] when dbias is wanted
  bool vector_in;        // src 16-byte aligned and cols % 16 == 0
  bool vector_out_t;     // rows % 16 == 0
};

template <ScaleMode kMode>
__device__ __forceinline__ float scale_of(const TileArgs& a, std::int64_t col, float tensor_scale) {
  if constexpr (kMode == ScaleMode::kTensor) {
    return tensor_scale;
  } else {
    const std::uint32_t bits = col < a.cols ? a.column_amax[col] : 0u;
    return current_fp8_scale(fp8_detail::float_of(bits), a.fp8_max, 1.0f);
  }
}

template <Fp8Format kFormat, typename T, ScaleMode kMode, bool kDbias>
__global__ void __launch_bounds__(kTileThreads) cast_transpose_tile_kernel(TileArgs a) {
  // Codes as 4-byte words, rows of 17 words: the transposed gather below (8 columns x 4 row
  // segments per warp) then meets at most 2 threads per bank.
  __shared__ std::uint32_t codes[kTile][kTile / 4 + 1];
  __shared__ float sums[kDbias ? kTile : 1][kDbias ? kTile + 1 : 1];
  const T* src = static_cast<const T*>(a.src);
  const std::int64_t row0 = a.first_row + static_cast<std::int64_t>(blockIdx.y) * kTile;
  const std::int64_t col0 = static_cast<std::int64_t>(blockIdx.x) * kTile;
  const int r = threadIdx.x / kSegsPerRow;
  const int seg = threadIdx.x % kSegsPerRow;
  const std::int64_t row = row0 + r;
  const std::int64_t col = col0 + seg * kSeg;
  const bool row_in = row < a.rows;
  const bool whole = a.vector_in && row_in && col + kSeg <= a.cols;
  float x[kSeg];
  if (whole) {
    constexpr int kE = kElemsPer16B<T>;
#pragma unroll
    for (int v = 0; v < kSeg / kE; ++v) load_16b(src + row * a.cols + col + v * kE, x + v * kE);
  } else {
#pragma unroll
    for (int e = 0; e < kSeg; ++e) {
      x[e] = row_in && col + e < a.cols ? to_float(src[row * a.cols + col + e]) : 0.0f;
    }
  }
  const float tensor_scale = kMode == ScaleMode::kTensor ? *a.scale : 1.0f;
  std::uint32_t largest = 0;
  std::uint8_t c[kSeg];
#pragma unroll
  for (int e = 0; e < kSeg; ++e) {
    largest = max(largest, abs_bits(x[e]));
    c[e] = scale_to_fp8<kFormat>(x[e], scale_of<kMode>(a, col + e, tensor_scale));
  }
  if (a.out != nullptr && row_in) {
    if (whole) {
      store_codes<kSeg>(a.out + row * a.cols + col, c);
    } else {
      for (int e = 0; e < kSeg; ++e) {
        if (col + e < a.cols) a.out[row * a.cols + col + e] = c[e];
      }
    }
  }
#pragma unroll
  for (int w = 0; w < kSeg / 4; ++w) {
    codes[r][seg * (kSeg / 4) + w] = c[4 * w] | (c[4 * w + 1] << 8) | (c[4 * w + 2] << 16) |
                                     (static_cast<std::uint32_t>(c[4 * w + 3]) << 24);
  }
  if constexpr (kDbias) {
#pragma unroll
    for (int e = 0; e < kSeg; ++e) sums[r][seg * kSeg + e] = x[e];
  }
  __syncthreads();
  // Transposed: thread -> tile column tc and a segment of 16 tile rows.
  const int tc = threadIdx.x / kSegsPerRow;
  const int rseg = threadIdx.x % kSegsPerRow;
  const std::int64_t out_row = col0 + tc;
  const std::int64_t out_col = row0 + rseg * kSeg;
  if (out_row < a.cols) {
    std::uint8_t t[kSeg];
#pragma unroll
    for (int i = 0; i < kSeg; ++i)
      t[i] = (codes[rseg * kSeg + i][tc / 4] >> (8 * (tc % 4))) & 0xffu;
    std::uint8_t* dst = a.out_t + out_row * a.rows + out_col;
    if (a.vector_out_t && out_col + kSeg <= a.rows) {
      store_codes<kSeg>(dst, t);
    } else {
      for (int i = 0; i < kSeg; ++i) {
        if (out_col + i < a.rows) dst[i] = t[i];
      }
    }
  }
  if constexpr (kDbias) {
    if (threadIdx.x < kTile && col0 + threadIdx.x < a.cols) {
      float sum = 0.0f;
      for (int i = 0; i < kTile; ++i) sum = fp8_detail::add_rn(sum, sums[i][threadIdx.x]);
      a.dbias_partial[(row0 / kTile) * a.cols + col0 + threadIdx.x] = sum;
    }
  }
  if constexpr (kMode == ScaleMode::kTensor) {
    if (a.amax != nullptr) {
      largest = block_max_bits(largest);
      // The first tile folds even a 0, so that the sign of a -0.0 amax is cleared as on the
      // CPU (fold_amax_bits).
      if (threadIdx.x == 0 && (largest != 0 || (row0 == 0 && col0 == 0))) {
        fold_amax_bits(a.amax, largest);
      }
    }
  } else {
    if (row0 == 0 && threadIdx.x < kTile && col0 + threadIdx.x < a.cols) {
      const float s = scale_of<kMode>(a, col0 + threadIdx.x, 1.0f);
      a.scale_inv[col0 + threadIdx.x] = fp8_detail::div_rn(1.0f, s);
    }
  }
}

// dbias[c] = the tile rows' partial sums of column c, added in tile-row order.
__global__ void dbias_reduce_kernel(const float* partial, std::int64_t tile_rows, std::int64_t cols,
                                    float* dbias) {
  const std::int64_t c = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  float sum = 0.0f;
  for (std::int64_t t = 0; t < tile_rows; ++t) sum = fp8_detail::add_rn(sum, partial[t * cols + c]);
  dbias[c] = sum;
}

// column_amax[c] = max abs_bits of column c: 4 row lanes x 64 columns per block (each lane's
// 64 threads read 64 consecutive elements of a row), blocks over bands of rows, atomicMax.
constexpr int kColumnRowsPerBlock = 256;
template <typename T>
__global__ void __launch_bounds__(256)
    column_amax_kernel(const T* src, std::int64_t rows, std::int64_t cols,
                       std::uint32_t* column_amax) {
  __shared__ std::uint32_t lanes[4][kTile];
  const std::int64_t col = static_cast<std::int64_t>(blockIdx.x) * kTile + threadIdx.x % kTile;
  const int lane = threadIdx.x / kTile;
  std::uint32_t largest = 0;
  if (col < cols) {
    for (std::int64_t band = static_cast<std::int64_t>(blockIdx.y) * kColumnRowsPerBlock;
         band < rows; band += static_cast<std::int64_t>(gridDim.y) * kColumnRowsPerBlock) {
      const std::int64_t end =
          rows < band + kColumnRowsPerBlock ? rows : band + kColumnRowsPerBlock;
      for (std::int64_t r = band + lane; r < end; r += 4) {
        largest = max(largest, abs_bits(to_float(src[r * cols + col])));
      }
    }
  }
  lanes[lane][threadIdx.x % kTile] = largest;
  __syncthreads();
  if (lane == 0 && col < cols) {
    largest = max(max(lanes[0][threadIdx.x], lanes[1][threadIdx.x]),
                  max(lanes[2][threadIdx.x], lanes[3][threadIdx.x]));
    if (largest != 0) atomicMax(reinterpret_cast<unsigned int*>(column_amax + col), largest);
  }
}

// One block per row: the row's amax (block max), its scale, then its codes. The row is read
// twice; the second read mostly hits L2 for the row sizes of a GEMM operand.
constexpr int kRowThreads = 256;
// gridDim.x's limit. Below it a block takes one row; a taller input (2^31 rows or more) used to
// fail to launch, or from 2^32 rows wrap the unsigned grid size and leave rows unwritten:
// now each block moves on by gridDim.x rows instead.
constexpr std::int64_t kMaxRowBlocks = 0x7fffffff;

template <Fp8Format kFormat, typename T>
__device__ __forceinline__ void quantize_row(const T* src, std::int64_t row, std::int64_t cols,
                                             std::uint8_t* out, float* scale_inv, bool vector) {
  constexpr int kE = kElemsPer16B<T>;
  const T* in = src + row * cols;
  std::uint8_t* dst = out + row * cols;
  const std::int64_t vectors = vector ? cols / kE : 0;
  std::uint32_t largest = 0;
  for (std::int64_t v = threadIdx.x; v < vectors; v += kRowThreads) {
    float x[kE];
    load_16b(in + v * kE, x);
#pragma unroll
    for (int e = 0; e < kE; ++e) largest = max(largest, abs_bits(x[e]));
  }
  for (std::int64_t i = vectors * kE + threadIdx.x; i < cols; i += kRowThreads) {
    largest = max(largest, abs_bits(to_float(in[i])));
  }
  largest = block_max_bits(largest);
  const float scale = current_fp8_scale(fp8_detail::float_of(largest), fp8_max(kFormat), 1.0f);
  for (std::int64_t v = threadIdx.x; v < vectors; v += kRowThreads) {
    float x[kE];
    std::uint8_t c[kE];
    load_16b(in + v * kE, x);
#pragma unroll
    for (int e = 0; e < kE; ++e) c[e] = scale_to_fp8<kFormat>(x[e], scale);
    store_codes<kE>(dst + v * kE, c);
  }
  for (std::int64_t i = vectors * kE + threadIdx.x; i < cols; i += kRowThreads) {
    dst[i] = scale_to_fp8<kFormat>(to_float(in[i]), scale);
  }
  if (threadIdx.x == 0) scale_inv[row] = fp8_detail::div_rn(1.0f, scale);
}

template <Fp8Format kFormat, typename T>
__global__ void __launch_bounds__(kRowThreads)
    quantize_row_kernel(const T* src, std::int64_t rows, std::int64_t cols, std::uint8_t* out,
                        float* scale_inv, bool vector) {
  // Every thread of a block runs the same rows, so all of them reach block_max_bits' barriers
  // (whose leading barrier also keeps one row's warp maxima from being overwritten by the
  // next row's while still being read).
  for (std::int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    quantize_row<kFormat>(src, row, cols, out, scale_inv, vector);
  }
}

template <typename F>
void with_cuda_types(DType dtype, Fp8Format format, F&& f) {
  auto by_format = [&](auto* typed) {
    if (format == Fp8Format::kE4M3) {
      f(typed, std::integral_constant<Fp8Format, Fp8Format::kE4M3>{});
    } else {
      f(typed, std::integral_constant<Fp8Format, Fp8Format::kE5M2>{});
    }
  };
  switch (dtype) {
    case DType::kFloat32:
      by_format(static_cast<float*>(nullptr));
      break;
    case DType::kFloat16:
      by_format(static_cast<__half*>(nullptr));
      break;
    case DType::kBFloat16:
      by_format(static_cast<__nv_bfloat16*>(nullptr));
      break;
  }
}

template <Fp8Format kFormat, typename T, ScaleMode kMode, bool kDbias>
void launch_tiles(TileArgs a, cudaStream_t stream) {
  const std::int64_t tile_cols = (a.cols + kTile - 1) / kTile;
  const std::int64_t tile_rows = (a.rows + kTile - 1) / kTile;
  for (std::int64_t first = 0; first < tile_rows; first += kMaxTileRowsPerLaunch) {
    a.first_row = first * kTile;
    const dim3 grid(static_cast<unsigned>(tile_cols),
                    static_cast<unsigned>(std::min(kMaxTileRowsPerLaunch, tile_rows - first)));
    cast_transpose_tile_kernel<kFormat, T, kMode, kDbias><<<grid, kTileThreads, 0, stream>>>(a);
  }
}

bool is_aligned_16(const void* p) { return (reinterpret_cast<std::uintptr_t>(p) & 15u) == 0; }

}  // namespace

std::int64_t fp8_dbias_workspace_floats(std::int64_t rows, std::int64_t cols) {
  return (rows + kTile - 1) / kTile * cols;
}

void fp8_cast_transpose(const Fp8CastTransposeArgs& args, StreamHandle stream) {
  const auto s = reinterpret_cast<cudaStream_t>(stream);
  if (args.rows == 0 || args.cols == 0) {
    // No element: out and out_t are empty, amax is folded with nothing (its sign cleared, as
    // on the CPU) and dbias, cols long, is all zeros.
    if (args.amax != nullptr) {
      fold_empty_amax_kernel<<<1, 1, 0, s>>>(args.amax);
      throw_on_launch_error("fp8_cast_transpose");
    }
    if (args.dbias != nullptr && args.cols > 0 &&
        cudaMemsetAsync(args.dbias, 0, args.cols * sizeof(float), s) != cudaSuccess) {
      throw_on_launch_error("fp8_cast_transpose_dbias");
    }
    return;
  }
  TileArgs a{args.src,
             args.rows,
             args.cols,
             0,
             args.scale,
             nullptr,
             fp8_max(args.format),
             args.amax,
             args.out,
             args.out_t,
             nullptr,
             args.dbias_workspace,
             is_aligned_16(args.src) && is_aligned_16(args.out) && args.cols % kSeg == 0,
             is_aligned_16(args.out_t) && args.rows % kSeg == 0};
  with_cuda_types(args.src_dtype, args.format, [&](auto* typed, auto fmt) {
    using T = std::remove_pointer_t<decltype(typed)>;
    if (args.dbias != nullptr) {
      launch_tiles<decltype(fmt)::value, T, ScaleMode::kTensor, true>(a, s);
    } else {
      launch_tiles<decltype(fmt)::value, T, ScaleMode::kTensor, false>(a, s);
    }
  });
  throw_on_launch_error(args.dbias != nullptr ? "fp8_cast_transpose_dbias" : "fp8_cast_transpose");
  if (args.dbias != nullptr) {
    const auto blocks = static_cast<unsigned>((args.cols + 255) / 256);
    dbias_reduce_kernel<<<blocks, 256, 0, s>>>(
        args.dbias_workspace, (args.rows + kTile - 1) / kTile, args.cols, args.dbias);
    throw_on_launch_error("fp8_cast_transpose_dbias (column sums)");
  }
}

void fp8_quantize_rowwise(const void* src, DType src_dtype, std::int64_t rows, std::int64_t cols,
                          bool transpose, std::uint8_t* out, float* scale_inv,
                          std::uint32_t* column_amax_workspace, Fp8Format format,
                          StreamHandle stream) {
  const auto s = reinterpret_cast<cudaStream_t>(stream);
  if (rows == 0 || cols == 0) return;  // the op layer fills scale_inv with 1 for an empty row
  if (!transpose) {
    with_cuda_types(src_dtype, format, [&](auto* typed, auto fmt) {
      using T = std::remove_pointer_t<decltype(typed)>;
      const bool vector = is_aligned_16(src) && is_aligned_16(out) && cols % kElemsPer16B<T> == 0;
      const auto blocks = static_cast<unsigned>(std::min(rows, kMaxRowBlocks));
      quantize_row_kernel<decltype(fmt)::value, T><<<blocks, kRowThreads, 0, s>>>(
          static_cast<const T*>(src), rows, cols, out, scale_inv, vector);
    });
    throw_on_launch_error("fp8_quantize_rowwise");
    return;
  }
  if (cudaMemsetAsync(column_amax_workspace, 0, cols * sizeof(std::uint32_t), s) != cudaSuccess) {
    throw_on_launch_error("fp8_quantize_rowwise");
  }
  with_cuda_types(src_dtype, format, [&](auto* typed, auto fmt) {
    using T = std::remove_pointer_t<decltype(typed)>;
    const dim3 grid(static_cast<unsigned>((cols + kTile - 1) / kTile),
                    static_cast<unsigned>(std::min<std::int64_t>(
                        (rows + kColumnRowsPerBlock - 1) / kColumnRowsPerBlock, 1024)));
    column_amax_kernel<<<grid, 256, 0, s>>>(static_cast<const T*>(src), rows, cols,
                                            column_amax_workspace);
    TileArgs a{src,
               rows,
               cols,
               0,
               nullptr,
               column_amax_workspace,
               fp8_max(format),
               nullptr,
               nullptr,
               out,
               scale_inv,
               nullptr,
               is_aligned_16(src) && cols % kSeg == 0,
               is_aligned_16(out) && rows % kSeg == 0};
    launch_tiles<decltype(fmt)::value, T, ScaleMode::kColumn, false>(a, s);
  });
  throw_on_launch_error("fp8_quantize_rowwise (transposed)");
}

}  // namespace ampfuse::kernels::cuda
