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

#include "vec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

namespace {

using namespace mt_vec;

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
