// mt::smoothed_ce: the label-smoothed cross-entropy of a block of score rows and, in place, its
// gradient (mt/fast/native.py builds it; mt/fast/loss.py calls it for each row block of the CPU
// training loss).
//
// For each of the first `rows` rows z (V scores, float32 or bfloat16) with reference t:
//   lse    = log sum_j exp(z_j)
//   nll    = lse - z_t                      (-log p_t)
//   smooth = V lse - sum_j z_j              (-sum_j log p_j)
// and, with `grad`, the row is overwritten by the gradient of the smoothed loss for a unit
// upstream gradient, softmax(z) - q: exp(z_j - lse) - eps_i, plus `on_target` at t; rows from
// `rows` on (padding) are set to 0. Three passes over each row while it is in the cache, where
// torch's operators make about ten over the block.
//
// float32 arithmetic but for the sums of the row (double across lanes) and an exp of relative
// error ~1e-7 (vec.h); bfloat16 rows are widened exactly and the gradient is rounded to nearest
// even, as a cast of the float32 gradient would be (vec.h's bfloat16 conversions).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "vec.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

namespace {

using namespace mt_vec;

inline float hmax(fvec x) {
  float m = x[0];
  for (int i = 1; i < kLanes; ++i) m = x[i] > m ? x[i] : m;
  return m;
}

struct RowStats {
  float lse;
  double total;  // sum of the scores
};

// lse and the sum of one row of V float scores: a pass for the maximum and the sum, a pass for
// the sum of exp(z - max).
RowStats row_stats(const float* z, int64_t V) {
  const int64_t V8 = V / kLanes * kLanes;
  constexpr float neg_inf = -std::numeric_limits<float>::infinity();
  fvec m = fvec{} + neg_inf, s0{}, s1{};
  int64_t j = 0;
  for (; j + 2 * kLanes <= V8; j += 2 * kLanes) {
    const fvec a = load(z + j), b = load(z + j + kLanes);
    m = a > m ? a : m;
    m = b > m ? b : m;
    s0 += a;
    s1 += b;
  }
  for (; j < V8; j += kLanes) {
    const fvec a = load(z + j);
    m = a > m ? a : m;
    s0 += a;
  }
  float mx = hmax(m);
  double total = static_cast<double>(hsum(s0)) + static_cast<double>(hsum(s1));
  for (j = V8; j < V; ++j) {
    mx = z[j] > mx ? z[j] : mx;
    total += z[j];
  }
  fvec e0{}, e1{};
  for (j = 0; j + 2 * kLanes <= V8; j += 2 * kLanes) {
    e0 += exp_nonpositive(load(z + j) - mx);
    e1 += exp_nonpositive(load(z + j + kLanes) - mx);
  }
  for (; j < V8; j += kLanes) e0 += exp_nonpositive(load(z + j) - mx);
  double e = static_cast<double>(hsum(e0)) + static_cast<double>(hsum(e1));
  for (j = V8; j < V; ++j) e += std::exp(static_cast<double>(z[j]) - mx);
  return {static_cast<float>(mx + std::log(e)), total};
}

// The gradient of a row of float scores into `g` (float32: may be z itself) or `g16`
// (bfloat16): exp(z - lse) - eps_i.
void row_gradient(const float* z, int64_t V, float lse, float eps_i, float* g, uint16_t* g16) {
  const int64_t V8 = V / kLanes * kLanes;
  int64_t j = 0;
  for (; j < V8; j += kLanes) {
    const fvec p = exp_nonpositive(load(z + j) - lse) - eps_i;
    if (g != nullptr) {
      store(g + j, p);
    } else {
      store_bf16(g16 + j, p);
    }
  }
  for (; j < V; ++j) {
    const float p = static_cast<float>(std::exp(static_cast<double>(z[j]) - lse)) - eps_i;
    if (g != nullptr) {
      g[j] = p;
    } else {
      g16[j] = float_to_bf16(p);
    }
  }
}

std::tuple<at::Tensor, at::Tensor> smoothed_ce(at::Tensor z, const at::Tensor& target,
                                               int64_t rows, double eps_i, double on_target,
                                               bool grad) {
  TORCH_CHECK(z.dim() == 2 && z.is_contiguous(), "smoothed_ce: z must be a contiguous (R, V)");
  TORCH_CHECK(z.scalar_type() == at::kFloat || z.scalar_type() == at::kBFloat16,
              "smoothed_ce: z must be float32 or bfloat16, got ", z.scalar_type());
  TORCH_CHECK(target.dim() == 1 && target.scalar_type() == at::kLong,
              "smoothed_ce: target must be a 1-d int64 tensor");
  const int64_t R = z.size(0), V = z.size(1);
  TORCH_CHECK(0 <= rows && rows <= R && target.size(0) == rows,
              "smoothed_ce: target must hold `rows` (<= z's rows) ids");
  const at::Tensor t = target.contiguous();
  const int64_t* tp = t.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows; ++i) {
    TORCH_CHECK(0 <= tp[i] && tp[i] < V, "smoothed_ce: target id ", tp[i], " outside [0, ", V,
                ")");
  }
  at::Tensor nll = at::empty({rows}, z.options().dtype(at::kFloat));
  at::Tensor smooth = at::empty({rows}, z.options().dtype(at::kFloat));
  float* nll_p = nll.data_ptr<float>();
  float* smooth_p = smooth.data_ptr<float>();
  const bool bf16 = z.scalar_type() == at::kBFloat16;
  float* z32 = bf16 ? nullptr : z.data_ptr<float>();
  uint16_t* z16 = bf16 ? reinterpret_cast<uint16_t*>(z.data_ptr<at::BFloat16>()) : nullptr;
  const float ei = static_cast<float>(eps_i), on = static_cast<float>(on_target);
  const size_t row_bytes = V * z.element_size();
  at::parallel_for(0, R, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> wide(bf16 ? V : 0);
    for (int64_t i = begin; i < end; ++i) {
      if (i >= rows) {  // padding rows: no loss, no gradient
        if (grad) std::memset(static_cast<char*>(z.data_ptr()) + i * row_bytes, 0, row_bytes);
        continue;
      }
      const float* row = z32 + i * V;
      if (bf16) {
        const uint16_t* in = z16 + i * V;
        int64_t j = 0;
        for (; j + kLanes <= V; j += kLanes) store(wide.data() + j, load_bf16(in + j));
        for (; j < V; ++j) wide[j] = bf16_to_float(in[j]);
        row = wide.data();
      }
      const RowStats st = row_stats(row, V);
      const int64_t target_id = tp[i];
      const float zt = row[target_id];
      nll_p[i] = st.lse - zt;
      smooth_p[i] = static_cast<float>(static_cast<double>(V) * st.lse - st.total);
      if (!grad) continue;
      const float gt =
          static_cast<float>(std::exp(static_cast<double>(zt) - st.lse)) - ei + on;
      if (bf16) {
        row_gradient(row, V, st.lse, ei, nullptr, z16 + i * V);
        z16[i * V + target_id] = float_to_bf16(gt);
      } else {
        row_gradient(row, V, st.lse, ei, z32 + i * V, nullptr);
        z32[i * V + target_id] = gt;
      }
    }
  });
  return {nll, smooth};
}

// Shapes only (meta and fake tensors: mt's memory estimates trace the training step with them).
std::tuple<at::Tensor, at::Tensor> smoothed_ce_meta(at::Tensor z, const at::Tensor& target,
                                                    int64_t rows, double, double, bool) {
  return {at::empty({rows}, z.options().dtype(at::kFloat)),
          at::empty({rows}, z.options().dtype(at::kFloat))};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mt, m) {
  m.def("smoothed_ce(Tensor(a!) z, Tensor target, int rows, float eps_i, float on_target, "
        "bool grad) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(mt, CPU, m) { m.impl("smoothed_ce", &smoothed_ce); }

TORCH_LIBRARY_IMPL(mt, Meta, m) { m.impl("smoothed_ce", &smoothed_ce_meta); }
