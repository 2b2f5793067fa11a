// mt::dropout and mt::masked_scale: the CPU training copy's dropout in one pass over a tensor
// (mt/fast/native.py builds them; mt/fast/dropout.py calls them).
//
// dropout(x, seed, dropped, scale) -> (y, keep):
//   element i of x (contiguous order) draws the 16 bits d_i = (h >> 16 (i mod 4)) & 0xffff of
//   h = mix64(seed + (i div 4 + 1) * 0x9e3779b97f4a7c15), SplitMix64's output function over a
//   counter: four draws per 64-bit word, each element's draw a function of the seed and its
//   index alone, so any split of the work over threads gives the same mask. The element is kept
//   when d_i >= dropped (P = (65536 - dropped) / 65536), keep_i says so, and
//   y_i = keep_i ? x_i * scale : 0, the product in float32 (also for 16-bit x).
// masked_scale(g, keep, scale) -> keep_i ? g_i * scale : 0 (the backward pass; the dropped
//   weights the attention's backward pass recomputes).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "vec.h"

#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>

namespace {

constexpr uint64_t kGamma = 0x9e3779b97f4a7c15ULL;
constexpr int64_t kGrain = 4096;  // words (16,384 elements) per task at the least

// SplitMix64's output function, on one word or on the lanes of a vector of words.
template <typename U>
inline U mix64(U z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// Elements [4 w, 4 w + 4) of word w (fewer in the last word), branch-free: a tenth of the
// elements dropped at random would mispredict a branch on each.
template <typename T>
inline void drop_word(const T* x, T* y, bool* keep, int64_t w, int count, uint64_t seed,
                      uint32_t dropped, float scale) {
  const uint64_t h = mix64<uint64_t>(seed + static_cast<uint64_t>(w + 1) * kGamma);
  for (int j = 0; j < count; ++j) {
    const uint32_t d = static_cast<uint32_t>(h >> (16 * j)) & 0xffffu;
    const bool k = d >= dropped;
    keep[4 * w + j] = k;
    y[4 * w + j] = static_cast<T>(static_cast<float>(x[4 * w + j]) * (k ? scale : 0.f));
  }
}

// The vector path reads a word's four draws as 16-bit lanes in memory order: little-endian only.
constexpr bool kVectorPath = __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__;

typedef uint64_t u64x4 __attribute__((vector_size(32)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef int16_t i16x16 __attribute__((vector_size(32)));
typedef int16_t i16x8 __attribute__((vector_size(16)));
typedef int8_t i8x16 __attribute__((vector_size(16)));

// 8 elements as float32 lanes, and back (bfloat16 through vec.h, 8 lanes at once: element-wise
// conversions would make bfloat16's dropout far slower than float32's).
inline mt_vec::fvec load8(const float* p) { return mt_vec::load(p); }
inline void store8(float* p, mt_vec::fvec v) { mt_vec::store(p, v); }

inline mt_vec::fvec load8(const c10::BFloat16* p) {
  return mt_vec::load_bf16(reinterpret_cast<const uint16_t*>(p));
}

inline void store8(c10::BFloat16* p, mt_vec::fvec v) {
  mt_vec::store_bf16(reinterpret_cast<uint16_t*>(p), v);
}

// The element types with a vector path (load8 / store8); float16 takes drop_word alone.
template <typename T>
constexpr bool kVectorType = std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>;

// Words [w, w + 4) of x, in vector registers: mix64 on the four words' lanes, their 16 draws
// compared at once, the mask stored as 16 bytes and the kept units scaled in float32.
template <typename T>
inline void drop_4words(const T* x, T* y, bool* keep, int64_t w, uint64_t seed, uint32_t dropped,
                        float scale) {
  const u64x4 index = {static_cast<uint64_t>(w + 1), static_cast<uint64_t>(w + 2),
                       static_cast<uint64_t>(w + 3), static_cast<uint64_t>(w + 4)};
  const u64x4 z = mix64(seed + index * kGamma);
  u16x16 d;
  std::memcpy(&d, &z, sizeof d);  // little-endian: draw j of word i is element 4 i + j
  const i16x16 k = d >= static_cast<uint16_t>(dropped);  // -1 (kept) or 0
  const int64_t at = 4 * w;
  const i8x16 bytes = __builtin_convertvector(-k, i8x16);  // 1 or 0
  std::memcpy(keep + at, &bytes, sizeof bytes);
  int32_t bits;
  std::memcpy(&bits, &scale, sizeof bits);
  const mt_vec::ivec scale_bits = mt_vec::ivec{} + bits;
  for (int half = 0; half < 2; ++half) {
    i16x8 kh;
    std::memcpy(&kh, reinterpret_cast<const char*>(&k) + 16 * half, sizeof kh);
    const mt_vec::ivec k32 = __builtin_convertvector(kh, mt_vec::ivec);  // -1 or 0, widened
    const mt_vec::fvec factor = reinterpret_cast<mt_vec::fvec>(k32 & scale_bits);  // scale or 0
    store8(y + at + 8 * half, load8(x + at + 8 * half) * factor);
  }
}

template <typename T>
void drop(const T* x, T* y, bool* keep, int64_t n, uint64_t seed, uint32_t dropped, float scale) {
  const int64_t whole = n / 4, words = (n + 3) / 4;
  at::parallel_for(0, words, kGrain, [&](int64_t begin, int64_t end) {
    const int64_t stop = end < whole ? end : whole;
    int64_t w = begin;
    if constexpr (kVectorPath && kVectorType<T>) {
      for (; w + 4 <= stop; w += 4) drop_4words(x, y, keep, w, seed, dropped, scale);
    }
    for (; w < stop; ++w) drop_word(x, y, keep, w, 4, seed, dropped, scale);
    if (end > whole) drop_word(x, y, keep, whole, static_cast<int>(n - 4 * whole), seed, dropped,
                               scale);
  });
}

template <typename T>
void scale_kept(const T* g, const bool* keep, T* out, int64_t n, float scale) {
  const uint8_t* k = reinterpret_cast<const uint8_t*>(keep);  // 0 or 1
  at::parallel_for(0, n, 4 * kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      out[i] = static_cast<T>(static_cast<float>(g[i]) * (static_cast<float>(k[i]) * scale));
    }
  });
}

// Calls f with a null pointer of x's element type: float32, bfloat16 or float16.
template <typename F>
void by_dtype(const at::Tensor& x, const char* op, F&& f) {
  switch (x.scalar_type()) {
    case at::kFloat: return f(static_cast<float*>(nullptr));
    case at::kBFloat16: return f(static_cast<c10::BFloat16*>(nullptr));
    case at::kHalf: return f(static_cast<c10::Half*>(nullptr));
    default: TORCH_CHECK(false, op, ": float32, bfloat16 or float16, got ", x.scalar_type());
  }
}

std::tuple<at::Tensor, at::Tensor> dropout(const at::Tensor& x_in, int64_t seed, int64_t dropped,
                                           double scale) {
  TORCH_CHECK(dropped >= 0 && dropped < 65536, "mt::dropout: dropped must be in [0, 65536)");
  const at::Tensor x = x_in.contiguous();
  at::Tensor y = at::empty(x.sizes(), x.options());
  at::Tensor keep = at::empty(x.sizes(), x.options().dtype(at::kBool));
  by_dtype(x, "mt::dropout", [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    drop<T>(x.data_ptr<T>(), y.data_ptr<T>(), keep.data_ptr<bool>(), x.numel(),
            static_cast<uint64_t>(seed), static_cast<uint32_t>(dropped), static_cast<float>(scale));
  });
  return {y, keep};
}

at::Tensor masked_scale(const at::Tensor& g_in, const at::Tensor& keep_in, double scale) {
  TORCH_CHECK(keep_in.scalar_type() == at::kBool, "mt::masked_scale: keep must be bool");
  TORCH_CHECK(g_in.sizes() == keep_in.sizes(), "mt::masked_scale: shapes differ: ",
              g_in.sizes(), " and ", keep_in.sizes());
  const at::Tensor g = g_in.contiguous(), keep = keep_in.contiguous();
  at::Tensor out = at::empty(g.sizes(), g.options());
  by_dtype(g, "mt::masked_scale", [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    scale_kept<T>(g.data_ptr<T>(), keep.data_ptr<bool>(), out.data_ptr<T>(), g.numel(),
                  static_cast<float>(scale));
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mt, m) {
  m.def("dropout(Tensor x, int seed, int dropped, float scale) -> (Tensor, Tensor)");
  m.def("masked_scale(Tensor g, Tensor keep, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(mt, CPU, m) {
  m.impl("dropout", &dropout);
  m.impl("masked_scale", &masked_scale);
}
