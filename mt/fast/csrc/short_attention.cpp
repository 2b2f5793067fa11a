// mt::short_attention: softmax(q k^T * scale + bias) v for a few queries per row, in one pass
// over each row's keys and values (mt/fast/native.py builds it; mt/fast/step.py calls it).
//
// A decoder step attends with one query per hypothesis against its own cached keys (self-
// attention) and with a sentence's G hypotheses against that sentence's encoder keys (encoder-
// decoder attention). Through torch that is a batched product per (row, head), a softmax and a
// second batched product: thousands of tiny matrix products a step, each a library call. Here
// each (row, head) is three short loops over its keys, the rows split over torch's threads.
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

// exp(x) for x <= 0: Cephes' single-precision polynomial (relative error ~1e-7); 0 below -87,
// where exp(x) is below float's smallest normal number. Written to vectorize.
inline float exp_nonpositive(float x) {
  const bool under = x < -87.f;
  x = under ? -87.f : x;
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);  // x / ln 2, rounded
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;     // x - n ln 2, in two parts
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // 2^n
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return under ? 0.f : y * scale;
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
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float neg_inf = -std::numeric_limits<float>::infinity();
  // (row, head) pairs per task: small problems stay on the calling thread, where a parallel
  // region would cost more than the work
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, G * T * d));

  at::parallel_for(0, N * H, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(static_cast<size_t>(G * T));
    std::vector<float> inv(static_cast<size_t>(G));
    float* s = scores.data();
    for (int64_t i = begin; i < end; ++i) {
      const int64_t n = i / H, h = i % H;
      const float* qr = qp + n * qn + h * qh;
      const float* kr = kp + n * kn + h * kh;
      const float* vr = vp + n * vn + h * vh;
      const float* br = masked ? bp + n * bn : nullptr;
      // scores: each key read once for the G queries
      for (int64_t t = 0; t < T; ++t) {
        const float* key = kr + t * kt;
        const float add = masked ? br[t * bt] : 0.f;
        for (int64_t g = 0; g < G; ++g) {
          const float* query = qr + g * qg;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t j = 0; j < d; ++j) dot += query[j] * key[j];
          s[g * T + t] = dot * sc + add;
        }
      }
      // softmax of each query's scores: exponentials here, 1 / their sum applied at the end
      for (int64_t g = 0; g < G; ++g) {
        float* sg = s + g * T;
        float m = neg_inf;
        for (int64_t t = 0; t < T; ++t) m = sg[t] > m ? sg[t] : m;
        if (m == neg_inf) {  // every key masked: NaN, as softmax gives
          std::fill(sg, sg + T, 0.f);
          inv[g] = nan;
          continue;
        }
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < T; ++t) {
          sg[t] = exp_nonpositive(sg[t] - m);
          sum += sg[t];
        }
        inv[g] = 1.f / sum;
      }
      // out[n, g, h] = weights v: each value read once for the G queries
      for (int64_t g = 0; g < G; ++g) std::fill_n(op + ((n * G + g) * H + h) * d, d, 0.f);
      for (int64_t t = 0; t < T; ++t) {
        const float* value = vr + t * vt;
        for (int64_t g = 0; g < G; ++g) {
          const float w = s[g * T + t];
          float* o = op + ((n * G + g) * H + h) * d;
#pragma omp simd
          for (int64_t j = 0; j < d; ++j) o[j] += w * value[j];
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* o = op + ((n * G + g) * H + h) * d;
        const float c = inv[g];
#pragma omp simd
        for (int64_t j = 0; j < d; ++j) o[j] *= c;
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(mt, m) {
  m.def("short_attention(Tensor q, Tensor k, Tensor v, Tensor? bias, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(mt, CPU, m) { m.impl("short_attention", &short_attention); }
