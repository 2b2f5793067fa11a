// mt::short_attention: softmax(q k^T * scale + bias) v for a few queries per row, in one pass
// over each row's keys and values (mt/fast/native.py builds it; mt/fast/step.py calls it).
//
// A decoder step attends with one query per hypothesis against its own cached keys (self-
// attention) and with a sentence's G hypotheses against that sentence's encoder keys (encoder-
// decoder attention). Through torch that is a batched product per (row, head), a softmax and a
// second batched product: thousands of tiny matrix products a step, each a library call. Here
// each (row, head) is three short loops over its keys in vector registers, the rows split over
// torch's threads.
//
//   q     (N, H, G, d)  float32: G queries of each of N rows (sentences) and H heads
//   k, v  (N, H, T, d)  float32: T keys/values (views into larger caches are fine)
//   bias  (N, T)        float32 added to every head's scores (0 or -inf: a source mask), or none
//   out   (N, G, H, d)  float32, contiguous: (N * G, H * d), the layout the output projection
//                       takes, so no copy follows
// Any strides, but the last dimension of q, k and v must be contiguous.
//
// The same arithmetic as the formula in float32 but for the order of the sums and an exp of
// relative error ~1e-7; a row whose keys are all masked gets NaN, as softmax gives.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

namespace {

// 8 floats as one value (GCC and Clang vector extensions): an AVX register. 8 lanes ran faster
// than 16 on an AMD Zen 4 even with AVX-512 (which it executes in 256-bit halves).
constexpr int kLanes = 8;
typedef float fvec __attribute__((vector_size(kLanes * 4)));
typedef int32_t ivec __attribute__((vector_size(kLanes * 4)));
typedef float f4v __attribute__((vector_size(16)));

#if defined(__has_builtin)
#if __has_builtin(__builtin_shufflevector)
#define MT_SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#endif
#endif
#ifndef MT_SHUFFLE  // GCC before 12
#define MT_SHUFFLE(a, b, ...) __builtin_shuffle(a, b, ivec{__VA_ARGS__})
#endif

inline fvec load(const float* p) {
  fvec x;
  std::memcpy(&x, p, sizeof x);
  return x;
}

inline void store(float* p, fvec x) { std::memcpy(p, &x, sizeof x); }

// The lanes of x added up, as a tree of halves (a loop of adds would wait on each other).
inline float hsum(fvec x) {
  f4v lo, hi;
  std::memcpy(&lo, &x, sizeof lo);
  std::memcpy(&hi, reinterpret_cast<const char*>(&x) + sizeof lo, sizeof hi);
  const f4v q = lo + hi;
  return (q[0] + q[2]) + (q[1] + q[3]);
}

// The lane sums of 8 registers as the 8 lanes of one: an 8 x 8 transpose folded into adds.
inline fvec hsum8(const fvec* p) {
  auto pairs = [](fvec x, fvec y) {  // lanes: x0+x1, y0+y1, x2+x3, y2+y3, ...
    return MT_SHUFFLE(x, y, 0, 8, 2, 10, 4, 12, 6, 14) +
           MT_SHUFFLE(x, y, 1, 9, 3, 11, 5, 13, 7, 15);
  };
  auto quads = [](fvec x, fvec y) {
    return MT_SHUFFLE(x, y, 0, 1, 8, 9, 4, 5, 12, 13) +
           MT_SHUFFLE(x, y, 2, 3, 10, 11, 6, 7, 14, 15);
  };
  const fvec lo = quads(pairs(p[0], p[1]), pairs(p[2], p[3]));  // halves of p0..p3
  const fvec hi = quads(pairs(p[4], p[5]), pairs(p[6], p[7]));
  return MT_SHUFFLE(lo, hi, 0, 1, 2, 3, 8, 9, 10, 11) +
         MT_SHUFFLE(lo, hi, 4, 5, 6, 7, 12, 13, 14, 15);
}

// exp(x) for x <= 0, a register at a time: Cephes' single-precision polynomial (relative
// error ~1e-7); 0 below -87, where exp(x) is below float's smallest normal number.
inline fvec exp_nonpositive(fvec x) {
  const ivec under = x < -87.f;
  x = under ? fvec{} - 87.f : x;
  const fvec y = x * 1.44269504088896341f + 0.5f;  // x / ln 2 + 1/2, floored below
  ivec n = __builtin_convertvector(y, ivec);        // truncated toward 0
  n += __builtin_convertvector(n, fvec) > y;        // -1 where that rounded up: the floor
  const fvec nf = __builtin_convertvector(n, fvec);
  const fvec r = x - nf * 0.693359375f + nf * 2.12194440e-4f;  // x - n ln 2, in two parts
  fvec p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const fvec scale = reinterpret_cast<fvec>((n + 127) << 23);  // 2^n
  return under ? fvec{} : p * scale;
}

// The problem of one (row, head): G queries (stride qg) against T keys/values (strides kt, vt),
// an additive bias per key (stride bt) or none, into G outputs (stride og); `s` holds T rounded
// up to 8 floats. D is the head size where it is known at compile time (a multiple of 8: the
// loops unroll, the query and the output row stay in registers), 0 for any size d.
template <int D>
void attend_one(const float* q, int64_t qg, int64_t G, const float* k, int64_t kt,
                const float* v, int64_t vt, int64_t T, const float* bias, int64_t bt, int64_t d,
                float sc, float* out, int64_t og, float* s) {
  static_assert(D % kLanes == 0, "a known head size is a multiple of 8");
  constexpr int W = D / kLanes;  // registers per head row
  constexpr float neg_inf = -std::numeric_limits<float>::infinity();
  const int64_t Tp = (T + kLanes - 1) / kLanes * kLanes;  // s[T:Tp] = -inf: exp gives 0
  for (int64_t g = 0; g < G; ++g) {
    const float* query = q + g * qg;
    float* o = out + g * og;
    // scores: 8 keys at a time, their products' lanes added up at once
    if constexpr (D > 0) {
      fvec qv[W];
      for (int j = 0; j < W; ++j) qv[j] = load(query + j * kLanes);
      for (int64_t t0 = 0; t0 < T; t0 += kLanes) {
        fvec p[kLanes];
        float add[kLanes];
        for (int i = 0; i < kLanes; ++i) {
          const int64_t t = t0 + i;
          fvec even{}, odd{};  // two chains of products, half the wait on each other
          if (t < T) {
            const float* key = k + t * kt;
            for (int j = 0; j < W; j += 2) {
              even += qv[j] * load(key + j * kLanes);
              if (j + 1 < W) odd += qv[j + 1] * load(key + (j + 1) * kLanes);
            }
          }
          p[i] = even + odd;
          add[i] = bias != nullptr && t < T ? bias[t * bt] : 0.f;
        }
        store(s + t0, hsum8(p) * sc + load(add));
      }
    } else {
      for (int64_t t = 0; t < T; ++t) {
        const float* key = k + t * kt;
        float dot = 0.f;
        for (int64_t j = 0; j < d; ++j) dot += query[j] * key[j];
        s[t] = dot * sc + (bias != nullptr ? bias[t * bt] : 0.f);
      }
    }
    std::fill(s + T, s + Tp, neg_inf);
    // softmax: the maximum, the exponentials (in s) and 1 / their sum
    fvec mv = load(s);
    for (int64_t t = kLanes; t < Tp; t += kLanes) {
      const fvec x = load(s + t);
      mv = x > mv ? x : mv;
    }
    float m = neg_inf;
    for (int l = 0; l < kLanes; ++l) m = mv[l] > m ? mv[l] : m;
    if (m == neg_inf) {  // every key masked: NaN, as softmax gives
      std::fill_n(o, D > 0 ? D : d, std::numeric_limits<float>::quiet_NaN());
      continue;
    }
    fvec sum{};
    for (int64_t t = 0; t < Tp; t += kLanes) {
      const fvec e = exp_nonpositive(load(s + t) - m);
      store(s + t, e);
      sum += e;
    }
    const float inv = 1.f / hsum(sum);
    // out = (exponentials . values) / their sum
    if constexpr (D > 0) {
      fvec acc[W] = {};
      for (int64_t t = 0; t < T; ++t) {
        const float w = s[t];
        const float* value = v + t * vt;
        for (int j = 0; j < W; ++j) acc[j] += w * load(value + j * kLanes);
      }
      for (int j = 0; j < W; ++j) store(o + j * kLanes, acc[j] * inv);
    } else {
      std::fill_n(o, d, 0.f);
      for (int64_t t = 0; t < T; ++t) {
        const float w = s[t];
        const float* value = v + t * vt;
        for (int64_t j = 0; j < d; ++j) o[j] += w * value[j];
      }
      for (int64_t j = 0; j < d; ++j) o[j] *= inv;
    }
  }
}

using AttendOne = void (*)(const float*, int64_t, int64_t, const float*, int64_t, const float*,
                           int64_t, int64_t, const float*, int64_t, int64_t, float, float*,
                           int64_t, float*);

AttendOne attend_for(int64_t d) {
  switch (d) {
    case 32: return &attend_one<32>;
    case 64: return &attend_one<64>;
    case 128: return &attend_one<128>;
    default: return &attend_one<0>;
  }
}

at::Tensor short_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const std::optional<at::Tensor>& bias, double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
              "short_attention: q (N, H, G, d), k and v (N, H, T, d)");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat &&
                  v.scalar_type() == at::kFloat,
              "short_attention: float32 only");
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(),
              "short_attention: CPU tensors only");
  const int64_t N = q.size(0), H = q.size(1), G = q.size(2), d = q.size(3), T = k.size(2);
  TORCH_CHECK(k.size(0) == N && v.size(0) == N && k.size(1) == H && v.size(1) == H &&
                  v.size(2) == T && k.size(3) == d && v.size(3) == d,
              "short_attention: q ", q.sizes(), ", k ", k.sizes(), ", v ", v.sizes(),
              " do not match");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1,
              "short_attention: the last dimension must be contiguous");
  const bool masked = bias.has_value() && bias->defined();
  if (masked) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->dim() == 2 && bias->size(0) == N &&
                    bias->size(1) == T && bias->device().is_cpu(),
                "short_attention: bias must be float32 (N, T) on the CPU, got ", bias->sizes());
  }
  at::Tensor out = at::empty({N, G, H, d}, q.options());
  if (N == 0 || H == 0 || G == 0 || d == 0) return out;
  TORCH_CHECK(T > 0, "short_attention: no keys");

  const float* qp = q.const_data_ptr<float>();
  const float* kp = k.const_data_ptr<float>();
  const float* vp = v.const_data_ptr<float>();
  const float* bp = masked ? bias->const_data_ptr<float>() : nullptr;
  float* op = out.mutable_data_ptr<float>();
  const int64_t qn = q.stride(0), qh = q.stride(1), qg = q.stride(2);
  const int64_t kn = k.stride(0), kh = k.stride(1), kt = k.stride(2);
  const int64_t vn = v.stride(0), vh = v.stride(1), vt = v.stride(2);
  const int64_t bn = masked ? bias->stride(0) : 0, bt = masked ? bias->stride(1) : 0;
  const float sc = static_cast<float>(scale);
  const AttendOne attend = attend_for(d);
  // (row, head) pairs per task: small problems stay on the calling thread, where a parallel
  // region would cost more than the work
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, G * T * d));

  at::parallel_for(0, N * H, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(static_cast<size_t>((T + kLanes - 1) / kLanes * kLanes));
    for (int64_t i = begin; i < end; ++i) {
      const int64_t n = i / H, h = i % H;
      attend(qp + n * qn + h * qh, qg, G, kp + n * kn + h * kh, kt, vp + n * vn + h * vh, vt,
             T, masked ? bp + n * bn : nullptr, bt, d, sc, op + (n * G * H + h) * d, H * d,
             scores.data());
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(mt, m) {
  m.def("short_attention(Tensor q, Tensor k, Tensor v, Tensor? bias, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(mt, CPU, m) { m.impl("short_attention", &short_attention); }
