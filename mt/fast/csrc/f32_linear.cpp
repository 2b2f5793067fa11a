// mt::f32_linear: y = x W^T + b in float32, for the rows of a decoding copy's products (the
// encoder's, a decoder step's few, the projection's): AVX2 and FMA (mt/fast/native.py builds it;
// mt/fast/fp32.py calls it). Where it measures faster than oneDNN's and torch's products
// (mt/fast/decoding.py's probe), float32 decoding runs on it.
//
// Each output is its bias plus the sum over k of x[m, k] W[n, k], added in k's order with
// fused multiply-adds, whatever the number of rows and wherever the row sits: a row's result
// depends on that row alone, so a batch decodes as its sentences would one by one (oneDNN's
// and MKL's kernels block K and split the work differently by shape).
//
//   x      (M, K)             float32 (any leading dims are flattened)
//   w      (Np/16, K, 16)     float32: W (N, K) padded with zero rows to Np (a multiple of 16),
//                             each block of 16 output channels stored input by input (one
//                             64-byte line, two AVX registers, per k)
//   bias   (n,) float32 or none
//   out    (..., n) float32, max(0, y) where relu
//
// The micro-kernel: up to 6 rows by 16 channels, 12 accumulators in registers, per k two loads
// of the block's line and one broadcast per row; each block of channels goes over a chunk of
// rows (at most 256 KB of x, kept in the core's L2) while the next block is prefetched.
// Threads share the blocks. On a 2-core AMD Zen 3 a decoder step's products ran at 1.0-1.25x
// oneDNN's packed kernel (docs/performance.md).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "vec.h"

#if defined(__AVX2__) && defined(__FMA__)
#define MT_F32_AVX2 1
#include <immintrin.h>
#else
#define MT_F32_AVX2 0
#endif

namespace {

bool f32_linear_available() { return MT_F32_AVX2; }

#if MT_F32_AVX2

constexpr int64_t kTileRows = 6;                // rows per micro-kernel call
constexpr int64_t kChunkBytes = 256 * 1024;     // x's rows per pass over the blocks

// R rows of x (ldx apart) by the 16 channels of block `w` (K lines of 16): the sums, the bias,
// the ReLU where asked, `valid` of the 16 columns stored (ldo apart). `next`: the block to
// prefetch into L2, a line per k, or null.
template <int R>
void rows_by_16(const float* x, int64_t ldx, const float* w, int64_t K, const float* bias,
                bool relu, float* out, int64_t ldo, int64_t valid, const float* next) {
  __m256 lo[R], hi[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    lo[r] = _mm256_setzero_ps();
    hi[r] = _mm256_setzero_ps();
  }
  for (int64_t k = 0; k < K; ++k) {
    if (next) _mm_prefetch(reinterpret_cast<const char*>(next + k * 16), _MM_HINT_T1);
    const __m256 b0 = _mm256_loadu_ps(w + k * 16), b1 = _mm256_loadu_ps(w + k * 16 + 8);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 a = _mm256_broadcast_ss(x + r * ldx + k);
      lo[r] = _mm256_fmadd_ps(a, b0, lo[r]);
      hi[r] = _mm256_fmadd_ps(a, b1, hi[r]);
    }
  }
  float bias16[16] = {};
  if (bias) std::memcpy(bias16, bias, sizeof(float) * valid);
  const __m256 c0 = _mm256_loadu_ps(bias16), c1 = _mm256_loadu_ps(bias16 + 8);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    __m256 y0 = _mm256_add_ps(lo[r], c0), y1 = _mm256_add_ps(hi[r], c1);
    if (relu) {
      y0 = _mm256_max_ps(y0, _mm256_setzero_ps());
      y1 = _mm256_max_ps(y1, _mm256_setzero_ps());
    }
    if (valid == 16) {
      _mm256_storeu_ps(out + r * ldo, y0);
      _mm256_storeu_ps(out + r * ldo + 8, y1);
    } else {
      float row[16];
      _mm256_storeu_ps(row, y0);
      _mm256_storeu_ps(row + 8, y1);
      std::memcpy(out + r * ldo, row, sizeof(float) * valid);
    }
  }
}

using RowsBy16 = void (*)(const float*, int64_t, const float*, int64_t, const float*, bool,
                          float*, int64_t, int64_t, const float*);

RowsBy16 rows16_kernel(int64_t r) {
  switch (r) {
    case 1: return &rows_by_16<1>;
    case 2: return &rows_by_16<2>;
    case 3: return &rows_by_16<3>;
    case 4: return &rows_by_16<4>;
    case 5: return &rows_by_16<5>;
    default: return &rows_by_16<6>;
  }
}

void product(const float* x, int64_t M, int64_t K, const float* w, int64_t blocks,
             const float* bias, int64_t n, bool relu, float* out) {
  // rows of x per pass over the blocks: at most 256 KB of them, in even chunks
  const int64_t most =
      std::max<int64_t>(kTileRows, kChunkBytes / static_cast<int64_t>(sizeof(float)) / K);
  // blocks of 16 channels per task: a small product stays on the calling thread
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 17) / std::max<int64_t>(1, M * K * 16));
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    auto pass = [&](int64_t m0, int64_t rows) {
      for (int64_t j = begin; j < end; ++j) {
        const float* wj = w + j * K * 16;
        const float* next = j + 1 < end ? wj + K * 16 : nullptr;
        const int64_t col = 16 * j, valid = std::min<int64_t>(16, n - col);
        const float* bj = bias ? bias + col : nullptr;
        bool first = true;
        mt_vec::even_chunks(rows, kTileRows, [&](int64_t m, int64_t r) {
          rows16_kernel(r)(x + (m0 + m) * K, K, wj, K, bj, relu, out + (m0 + m) * n + col, n,
                           valid, first ? next : nullptr);
          first = false;
        });
      }
    };
    mt_vec::even_chunks(M, most, pass);
  });
}

#endif  // MT_F32_AVX2

at::Tensor f32_linear(const at::Tensor& x, const at::Tensor& w,
                      const std::optional<at::Tensor>& bias, int64_t n, bool relu) {
#if !MT_F32_AVX2
  TORCH_CHECK(false, "f32_linear: built without AVX2 and FMA (see f32_linear_available)");
#else
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.device().is_cpu() && x.dim() >= 1,
              "f32_linear: x must be float32 on the CPU");
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.dim() == 3 && w.size(2) == 16 &&
                  w.is_contiguous() && w.device().is_cpu(),
              "f32_linear: w must be float32 (Np/16, K, 16), contiguous, got ", w.sizes());
  const int64_t K = x.size(-1), blocks = w.size(0);
  TORCH_CHECK(w.size(1) == K, "f32_linear: x has ", K, " inputs, w ", w.size(1));
  TORCH_CHECK(n > 0 && n <= blocks * 16 && blocks * 16 - n < 16, "f32_linear: n ", n, " for ",
              blocks * 16, " rows");
  const bool biased = bias.has_value() && bias->defined();
  if (biased) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == n && bias->is_contiguous(),
                "f32_linear: bias must be float32 (", n, ")");
  }
  const at::Tensor x2 = x.reshape({-1, K}).contiguous();
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  at::Tensor out = at::empty(shape, x.options());
  if (x2.size(0) > 0 && K > 0) {
    product(x2.const_data_ptr<float>(), x2.size(0), K, w.const_data_ptr<float>(), blocks,
            biased ? bias->const_data_ptr<float>() : nullptr, n, relu,
            out.mutable_data_ptr<float>());
  } else if (x2.size(0) > 0) {  // no inputs: the bias alone
    out.zero_();
    if (biased) out.add_(*bias);
    if (relu) out.relu_();
  }
  return out;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mt, m) {
  m.def("f32_linear(Tensor x, Tensor w, Tensor? bias, int n, bool relu) -> Tensor");
  m.def("f32_linear_available() -> bool", &f32_linear_available);
}

TORCH_LIBRARY_IMPL(mt, CPU, m) { m.impl("f32_linear", &f32_linear); }
