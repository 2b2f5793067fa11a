// mt::int8_linear: y = x W^T + b with W int8 per output channel and x quantized per row, for
// the few rows of a decoder step (mt/fast/native.py builds it; mt/fast/quantize.py calls it).
//
// Each row of x is quantized on its own, symmetric: s = max|x_row| / L, q = round(x / s) in
// [-L, L]; y = (sum_k q_k W[n, k]) * s_row * s_channel + b, and max(0, y) where asked. A row's
// result depends on that row alone, so a batch decodes as its sentences would one by one. The
// integer sums are exact; the float32 epilogue rounds as the formula does, up to the order of
// its two products and a fused multiply-add. Two kernels on one weight layout:
//
// * mt::int8_linear, AVX-512 VNNI, 8 bits (L = 127): the row shifted to unsigned (u = q + 128)
//   so that vpdpbusd can multiply it with the signed weights, four products summed into each
//   int32 lane; the shift is taken back with the weights' row sums (comp):
//   sum_k u_k w_k - 128 sum_k w_k = sum_k q_k w_k.
// * mt::int8_linear_avx2, AVX2 without VNNI, 7 bits (L = 63), as fbgemm's and oneDNN's AVX2
//   products do (fbgemm's over the whole tensor, these per row): u = q + 64 in [1, 127], so
//   that vpmaddubsw's pair sums of u times the signed weights, at most 2 * 127 * 128 = 32,512,
//   never saturate its 16 bits; vpmaddwd adds the pairs into int32 lanes, and comp / 2 takes
//   the shift back. 8 bits there would need vpsignb on every product (|w| times q with w's
//   sign): 20-30% slower on an AMD Zen 3.
//
//   x      (M, K)             float32, rows contiguous (any leading dims are flattened)
//   w      (Np/16, Kp/4, 16, 4) int8: W (N, K) padded with zeros to Np (a multiple of 32) rows
//                             and Kp (a multiple of 4) columns, 16 output channels by 4 inputs
//                             a 64-byte block: one AVX-512 register per (channel block, k/4),
//                             or two AVX2 registers of 8 channels
//   scale  (Np,) float32      the channels' scales
//   comp   (Np,) int32        128 * sum_k W[n, k]
//   bias   (n,) float32 or none
//   out    (..., n) float32
//
// Built with -march=native: each kernel where the compiler targets its instructions (both on
// a VNNI CPU); mt::int8_linear_available and mt::int8_linear_avx2_available say which.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "vec.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define MT_INT8_VNNI 1
#else
#define MT_INT8_VNNI 0
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define MT_INT8_AVX2 1
#else
#define MT_INT8_AVX2 0
#endif
#if MT_INT8_VNNI || MT_INT8_AVX2
#include <immintrin.h>
#endif

namespace {

bool int8_linear_available() { return MT_INT8_VNNI; }
bool int8_linear_avx2_available() { return MT_INT8_AVX2; }

#if MT_INT8_VNNI

constexpr int64_t kRows = 8;  // rows of x per micro-kernel call

// Rows of x to u8 (q + 128), Kp bytes each (the padding: 128, i.e. q = 0), and their scales.
void quantize_rows(const float* x, int64_t ldx, int64_t M, int64_t K, int64_t Kp, uint8_t* u,
                   float* scales) {
  const __m512i shift = _mm512_set1_epi32(128);
  for (int64_t m = 0; m < M; ++m) {
    const float* row = x + m * ldx;
    uint8_t* out = u + m * Kp;
    __m512 largest = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
      largest = _mm512_max_ps(largest, _mm512_abs_ps(_mm512_loadu_ps(row + k)));
    }
    const __mmask16 tail = static_cast<__mmask16>((1u << (K - k)) - 1u);
    if (k < K) {
      largest = _mm512_max_ps(largest, _mm512_abs_ps(_mm512_maskz_loadu_ps(tail, row + k)));
    }
    const float a = _mm512_reduce_max_ps(largest);
    const float s = a > 0.0f ? a / 127.0f : 1.0f;
    scales[m] = s;
    const __m512 inv = _mm512_set1_ps(1.0f / s);
    // round to nearest, ties to even (the default rounding mode), then + 128 in [1, 255]
    for (k = 0; k + 16 <= K; k += 16) {
      __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(row + k), inv));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + k),
                       _mm512_cvtusepi32_epi8(_mm512_add_epi32(q, shift)));
    }
    if (k < K) {
      __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_maskz_loadu_ps(tail, row + k), inv));
      _mm512_mask_cvtusepi32_storeu_epi8(out + k, tail, _mm512_add_epi32(q, shift));
    }
    std::memset(out + K, 128, static_cast<size_t>(Kp - K));
  }
}

// R rows (R <= kRows) by 32 output channels (two blocks of 16): the sums over K in registers,
// then the float32 epilogue, `valid` of the 32 columns stored.
template <int R>
void rows_by_32(const uint8_t* u, int64_t Kp, const int8_t* w0, const int8_t* w1,
                const float* sx, const float* sw, const int32_t* comp, const float* bias,
                bool relu, float* out, int64_t ldo, int64_t valid) {
  __m512i acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_si512();
  const int64_t Kq = Kp / 4;
  for (int64_t kq = 0; kq < Kq; ++kq) {
    const __m512i b0 = _mm512_loadu_si512(w0 + kq * 64);
    const __m512i b1 = _mm512_loadu_si512(w1 + kq * 64);
    for (int r = 0; r < R; ++r) {
      int32_t four;
      std::memcpy(&four, u + r * Kp + kq * 4, 4);
      const __m512i a = _mm512_set1_epi32(four);
      acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], a, b0);
      acc[r][1] = _mm512_dpbusd_epi32(acc[r][1], a, b1);
    }
  }
  for (int h = 0; h < 2; ++h) {
    const int64_t left = valid - 16 * h;
    if (left <= 0) break;
    const __mmask16 mask =
        left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1u);
    const __m512i c = _mm512_loadu_si512(comp + 16 * h);
    const __m512 s = _mm512_loadu_ps(sw + 16 * h);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + 16 * h) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
      __m512 y = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][h], c));
      y = _mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(y, _mm512_set1_ps(sx[r])), s), b);
      if (relu) y = _mm512_max_ps(y, _mm512_setzero_ps());
      _mm512_mask_storeu_ps(out + r * ldo + 16 * h, mask, y);
    }
  }
}

using RowsBy32 = void (*)(const uint8_t*, int64_t, const int8_t*, const int8_t*, const float*,
                          const float*, const int32_t*, const float*, bool, float*, int64_t,
                          int64_t);

RowsBy32 rows_kernel(int64_t r) {
  switch (r) {
    case 1: return &rows_by_32<1>;
    case 2: return &rows_by_32<2>;
    case 3: return &rows_by_32<3>;
    case 4: return &rows_by_32<4>;
    case 5: return &rows_by_32<5>;
    case 6: return &rows_by_32<6>;
    case 7: return &rows_by_32<7>;
    default: return &rows_by_32<8>;
  }
}

#endif  // MT_INT8_VNNI

#if MT_INT8_AVX2

constexpr int64_t kRowsAvx2 = 6;  // rows of x per AVX2 micro-kernel call: 6 accumulators

// Rows of x to 7-bit levels q in [-63, 63] shifted to u = q + 64 (Kp bytes each, the padding
// 64, i.e. q = 0) and their scales: the VNNI path's rounding (x times the reciprocal of the
// scale, to nearest, ties to even).
void quantize_rows_7(const float* x, int64_t ldx, int64_t M, int64_t K, int64_t Kp,
                     uint8_t* q, float* scales) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t m = 0; m < M; ++m) {
    const float* row = x + m * ldx;
    uint8_t* out = q + m * Kp;
    __m256 largest = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
      largest = _mm256_max_ps(largest, _mm256_andnot_ps(sign, _mm256_loadu_ps(row + k)));
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, largest);
    float a = 0.0f;
    for (float v : lanes) a = std::max(a, v);
    for (int64_t t = k; t < K; ++t) a = std::max(a, std::fabs(row[t]));
    const float s = a > 0.0f ? a / 63.0f : 1.0f;
    scales[m] = s;
    const float inv = 1.0f / s;
    const __m256 vinv = _mm256_set1_ps(inv);
    const __m256i shift = _mm256_set1_epi32(64);
    for (k = 0; k + 8 <= K; k += 8) {
      const __m256i v = _mm256_add_epi32(
          _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(row + k), vinv)), shift);
      // 8 int32 to 8 uint8 (the values fit: no saturation happens)
      const __m128i w16 =
          _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
      const __m128i w8 = _mm_packus_epi16(w16, w16);
      _mm_storel_epi64(reinterpret_cast<__m128i*>(out + k), w8);
    }
    for (; k < K; ++k) out[k] = static_cast<uint8_t>(std::nearbyint(row[k] * inv) + 64);
    for (; k < Kp; ++k) out[k] = 64;
  }
}

// The lanes of `valid` (< 8) columns: a mask for _mm256_maskstore_ps.
inline __m256i first_lanes(int64_t valid) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(valid)),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// R rows (R <= kRowsAvx2) by 8 output channels (one half of the VNNI layout's block of 16
// channels by 4 inputs, `w` pointing at it, the next k's 64 bytes on): the sums over K in
// registers, then the float32 epilogue, `valid` of the 8 columns stored. vpmaddubsw multiplies
// the unsigned 7-bit row values with the signed weights and adds pairs into 16 bits, at most
// 2 * 127 * 128 = 32,512 in magnitude, so it never saturates; vpmaddwd with ones adds those
// pairs into the int32 lanes. `next`: a block to prefetch into L2, a line per k/4, or null
// (on an AMD Zen 3 a base-size beam search ran 1.05x as fast with it).
template <int R>
void rows_by_8(const uint8_t* q, int64_t Kp, const int8_t* w, const float* sx, const float* sw,
               const int32_t* comp, const float* bias, bool relu, float* out, int64_t ldo,
               int64_t valid, const int8_t* next) {
  __m256i acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_si256();
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t Kq = Kp / 4;
  for (int64_t kq = 0; kq < Kq; ++kq) {
    if (next) _mm_prefetch(reinterpret_cast<const char*>(next + kq * 64), _MM_HINT_T1);
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + kq * 64));
    for (int r = 0; r < R; ++r) {
      int32_t four;
      std::memcpy(&four, q + r * Kp + kq * 4, 4);
      const __m256i p = _mm256_maddubs_epi16(_mm256_set1_epi32(four), b);
      acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(p, ones));
    }
  }
  const __m256i mask = first_lanes(std::min<int64_t>(valid, 8));
  const __m256 s = _mm256_loadu_ps(sw);
  const __m256 b = bias ? _mm256_maskload_ps(bias, mask) : _mm256_setzero_ps();
  // comp is 128 sum_k w (the VNNI shift's); this kernel's shift is 64
  const __m256i c =
      _mm256_srai_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(comp)), 1);
  for (int r = 0; r < R; ++r) {
    __m256 y = _mm256_cvtepi32_ps(_mm256_sub_epi32(acc[r], c));
    y = _mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(y, _mm256_set1_ps(sx[r])), s), b);
    if (relu) y = _mm256_max_ps(y, _mm256_setzero_ps());
    if (valid >= 8) {
      _mm256_storeu_ps(out + r * ldo, y);
    } else {
      _mm256_maskstore_ps(out + r * ldo, mask, y);
    }
  }
}

using RowsBy8 = void (*)(const uint8_t*, int64_t, const int8_t*, const float*, const float*,
                         const int32_t*, const float*, bool, float*, int64_t, int64_t,
                         const int8_t*);

RowsBy8 rows8_kernel(int64_t r) {
  switch (r) {
    case 1: return &rows_by_8<1>;
    case 2: return &rows_by_8<2>;
    case 3: return &rows_by_8<3>;
    case 4: return &rows_by_8<4>;
    case 5: return &rows_by_8<5>;
    default: return &rows_by_8<6>;
  }
}

#endif  // MT_INT8_AVX2

#if MT_INT8_VNNI
void vnni_product(const at::Tensor& x2, const at::Tensor& w, const at::Tensor& comp,
                  const float* sp, const float* bp, int64_t n, bool relu, float* op) {
  const int64_t M = x2.size(0), K = x2.size(1);
  const int64_t Np = w.size(0) * 16, Kp = w.size(1) * 4;
  std::vector<uint8_t> u(static_cast<size_t>(M * Kp));
  std::vector<float> sx(static_cast<size_t>(M));
  quantize_rows(x2.const_data_ptr<float>(), K, M, K, Kp, u.data(), sx.data());
  const int8_t* wp = w.const_data_ptr<int8_t>();
  const int32_t* cp = comp.const_data_ptr<int32_t>();
  const int64_t blocks = Np / 32, block_bytes = Kp * 16;
  // blocks of 32 channels per task: a small product stays on the calling thread
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, M * Kp * 32 / 64));
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const int8_t* w0 = wp + (2 * j) * block_bytes;
      const int8_t* w1 = w0 + block_bytes;
      const int64_t col = 32 * j, valid = std::min<int64_t>(32, n - col);
      const float* bj = bp ? bp + col : nullptr;
      mt_vec::even_chunks(M, kRows, [&](int64_t m, int64_t r) {
        rows_kernel(r)(u.data() + m * Kp, Kp, w0, w1, sx.data() + m, sp + col, cp + col, bj, relu,
                       op + m * n + col, n, valid);
      });
    }
  });
}
#endif

#if MT_INT8_AVX2
void avx2_product(const at::Tensor& x2, const at::Tensor& w, const at::Tensor& comp,
                  const float* sp, const float* bp, int64_t n, bool relu, float* op) {
  const int64_t M = x2.size(0), K = x2.size(1), Kp = w.size(1) * 4;
  std::vector<uint8_t> q(static_cast<size_t>(M * Kp));
  std::vector<float> sx(static_cast<size_t>(M));
  quantize_rows_7(x2.const_data_ptr<float>(), K, M, K, Kp, q.data(), sx.data());
  const int8_t* wp = w.const_data_ptr<int8_t>();
  const int32_t* cp = comp.const_data_ptr<int32_t>();
  const int64_t blocks = w.size(0), block_bytes = Kp * 16;
  // blocks of 16 channels per task: a small product stays on the calling thread
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, M * Kp * 16 / 64));
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const int8_t* wj = wp + j * block_bytes;
      for (int64_t h = 0; h < 2; ++h) {
        const int64_t col = 16 * j + 8 * h, valid = std::min<int64_t>(8, n - col);
        if (valid <= 0) break;
        const float* bj = bp ? bp + col : nullptr;
        // the next block's lines into L2 while the first rows go over this one's
        const int8_t* next = h == 0 && j + 1 < end ? wj + block_bytes : nullptr;
        mt_vec::even_chunks(M, kRowsAvx2, [&](int64_t m, int64_t r) {
          rows8_kernel(r)(q.data() + m * Kp, Kp, wj + 32 * h, sx.data() + m, sp + col, cp + col,
                          bj, relu, op + m * n + col, n, valid, next);
          next = nullptr;
        });
      }
    }
  });
}
#endif

// The operators' common part: the checks, the output, then product(x2, scale, bias, out) on
// x as (M, K), rows contiguous, where M > 0.
template <typename Product>
at::Tensor checked_product(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                           const at::Tensor& comp, const std::optional<at::Tensor>& bias,
                           int64_t n, Product&& product) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.device().is_cpu() && x.dim() >= 1,
              "int8_linear: x must be float32 on the CPU");
  TORCH_CHECK(w.scalar_type() == at::kChar && w.dim() == 4 && w.size(2) == 16 &&
                  w.size(3) == 4 && w.size(0) % 2 == 0 && w.is_contiguous(),
              "int8_linear: w must be int8 (Np/16, Kp/4, 16, 4), contiguous, got ", w.sizes());
  const int64_t Np = w.size(0) * 16, Kp = w.size(1) * 4, K = x.size(-1);
  TORCH_CHECK(K <= Kp && Kp - K < 4, "int8_linear: x has ", K, " inputs, w ", Kp);
  TORCH_CHECK(n > 0 && n <= Np && Np - n < 32, "int8_linear: n ", n, " for ", Np, " rows");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == Np && scale.is_contiguous(),
              "int8_linear: scale must be float32 (", Np, ")");
  TORCH_CHECK(comp.scalar_type() == at::kInt && comp.numel() == Np && comp.is_contiguous(),
              "int8_linear: comp must be int32 (", Np, ")");
  const bool biased = bias.has_value() && bias->defined();
  if (biased) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == n && bias->is_contiguous(),
                "int8_linear: bias must be float32 (", n, ")");
  }
  const at::Tensor x2 = x.reshape({-1, K}).contiguous();
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  at::Tensor out = at::empty(shape, x.options());
  if (x2.size(0) > 0) {
    product(x2, scale.const_data_ptr<float>(), biased ? bias->const_data_ptr<float>() : nullptr,
            out.mutable_data_ptr<float>());
  }
  return out;
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                       const at::Tensor& comp, const std::optional<at::Tensor>& bias, int64_t n,
                       bool relu) {
#if !MT_INT8_VNNI
  TORCH_CHECK(false, "int8_linear: built without AVX-512 VNNI (see int8_linear_available)");
#else
  return checked_product(x, w, scale, comp, bias, n,
                         [&](const at::Tensor& x2, const float* sp, const float* bp, float* op) {
                           vnni_product(x2, w, comp, sp, bp, n, relu, op);
                         });
#endif
}

// The same product on AVX2 (no VNNI; 7-bit rows), the same arguments.
at::Tensor int8_linear_avx2(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                            const at::Tensor& comp, const std::optional<at::Tensor>& bias,
                            int64_t n, bool relu) {
#if !MT_INT8_AVX2
  TORCH_CHECK(false, "int8_linear_avx2: built without AVX2 (see int8_linear_avx2_available)");
#else
  return checked_product(x, w, scale, comp, bias, n,
                         [&](const at::Tensor& x2, const float* sp, const float* bp, float* op) {
                           avx2_product(x2, w, comp, sp, bp, n, relu, op);
                         });
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mt, m) {
  m.def("int8_linear(Tensor x, Tensor w, Tensor scale, Tensor comp, Tensor? bias, int n, "
        "bool relu) -> Tensor");
  m.def("int8_linear_available() -> bool", &int8_linear_available);
  m.def("int8_linear_avx2(Tensor x, Tensor w, Tensor scale, Tensor comp, Tensor? bias, int n, "
        "bool relu) -> Tensor");
  m.def("int8_linear_avx2_available() -> bool", &int8_linear_avx2_available);
}

TORCH_LIBRARY_IMPL(mt, CPU, m) {
  m.impl("int8_linear", &int8_linear);
  m.impl("int8_linear_avx2", &int8_linear_avx2);
}
