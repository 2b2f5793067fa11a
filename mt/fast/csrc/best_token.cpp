// mt::best_token: a greedy decoding step's choice from its logits, without the log-softmax
// (mt/fast/native.py builds it; mt/decode/search.py calls it).
//
// For each row of z = logits (+ bias, a shortlist's 0 / -inf per column), V columns:
//   token = the first column of the largest z_j among the columns not in `forbid`
//           (a bit mask over columns 0-3, the special pieces: PAD, BOS, EOS before min_len)
//   lprob = z_token - log sum_j exp(z_j)   (all columns, the forbidden ones included)
// which is what log_softmax(z), then -inf at the forbidden columns, then the row's argmax and
// its value give: the normalizer is the same, only the order of the rounding differs (lprob
// within a few float32 ulps of torch's). A row with a NaN gives its first allowed column and
// NaN, as the log-softmax (NaN everywhere but at the forbidden -inf) and NumPy's argmax would.
// Torch's way writes and reads a (rows, V) float block three more times: a greedy step of 32
// rows over 8,000 pieces spent 160 us in the log-softmax alone (AMD Zen 4).
//
// mt::top_tokens: the same for a beam step, the k best allowed columns of each row (k = 2K for
// beam K: a sentence's 2K best candidates are among its rows' 2K best each) and their
// log-probabilities z_j - log sum exp(z), best first, the lower column first among equal
// values; a shortlist's bias has one row per `width` rows (a sentence's hypotheses).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "vec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <tuple>

namespace {

using namespace mt_vec;

constexpr int kSpecial = 4;  // columns that `forbid` may name

// sum_j exp(z_j - all) over a row, z = x (+ b), all >= every z_j: four sums in vector registers
// (shorter chains of rounding, and of waiting), the tail in double.
double exp_sum(const float* x, const float* b, int64_t V, float all) {
  fvec sum[4] = {};
  int64_t j = 0;
  for (; j + 4 * kLanes <= V; j += 4 * kLanes) {
    for (int u = 0; u < 4; ++u) {
      fvec v = load(x + j + u * kLanes);
      if (b) v += load(b + j + u * kLanes);
      sum[u] += exp_nonpositive(v - all);
    }
  }
  for (; j + kLanes <= V; j += kLanes) {
    fvec v = load(x + j);
    if (b) v += load(b + j);
    sum[0] += exp_nonpositive(v - all);
  }
  double s = static_cast<double>(hsum(sum[0] + sum[1])) + hsum(sum[2] + sum[3]);
  for (; j < V; ++j) s += std::exp(static_cast<double>((b ? x[j] + b[j] : x[j]) - all));
  return s;
}

// Pass 1's block of 8 columns from j: z = x (+ b), folded into the running maximum of all
// columns (`top`) and the NaN flags; returned with the forbidden special columns at -inf.
inline fvec scan_block(const float* x, const float* b, int64_t j, int64_t forbid, fvec& top,
                       ivec& nan) {
  fvec v = load(x + j);
  if (b) v += load(b + j);
  nan |= v != v;
  top = v > top ? v : top;
  if (j < kSpecial) {  // the first block holds the special columns
    for (int i = 0; i < kLanes && j + i < kSpecial; ++i) {
      if (forbid >> (j + i) & 1) v[i] = -std::numeric_limits<float>::infinity();
    }
  }
  return v;
}

// One row: (token, lprob).
std::pair<int64_t, float> pick(const float* x, const float* b, int64_t V, int64_t forbid) {
  const float inf = std::numeric_limits<float>::infinity();
  auto z = [&](int64_t j) { return b ? x[j] + b[j] : x[j]; };
  // pass 1: the allowed argmax (per lane, first occurrence), the largest of all, any NaN
  fvec best = fvec{} - inf, top = fvec{} - inf;
  ivec where = ivec{} - 1, nan = ivec{};
  ivec lane;
  for (int i = 0; i < kLanes; ++i) lane[i] = i;
  int64_t j = 0;
  for (; j + kLanes <= V; j += kLanes) {
    const fvec v = scan_block(x, b, j, forbid, top, nan);
    const ivec more = v > best;
    best = more ? v : best;
    where = more ? lane + static_cast<int32_t>(j) : where;
  }
  float m = -inf, all = -inf;
  int64_t token = -1;
  bool has_nan = false;
  for (int i = 0; i < kLanes; ++i) {
    all = top[i] > all ? top[i] : all;
    has_nan |= nan[i] != 0;
    if (where[i] >= 0 && (best[i] > m || (best[i] == m && where[i] < token))) {
      m = best[i];
      token = where[i];
    }
  }
  for (; j < V; ++j) {  // the tail
    float v = z(j);
    has_nan |= v != v;
    all = v > all ? v : all;
    if (j < kSpecial && (forbid >> j & 1)) v = -inf;
    if (v > m || token < 0) {
      m = v;
      token = j;
    }
  }
  if (has_nan) {
    int64_t first = 0;
    while (first < V && first < kSpecial && (forbid >> first & 1)) ++first;
    return {first < V ? first : 0, std::numeric_limits<float>::quiet_NaN()};
  }
  if (token < 0) token = 0;  // every allowed column -inf: torch's argmax of -inf is column 0
  if (!(all > -inf)) return {token, std::numeric_limits<float>::quiet_NaN()};
  // pass 2: the normalizer
  const double s = exp_sum(x, b, V, all);
  return {token, z(token) - (all + static_cast<float>(std::log(s)))};
}

std::tuple<at::Tensor, at::Tensor> best_token(const at::Tensor& logits,
                                              const std::optional<at::Tensor>& bias,
                                              int64_t forbid) {
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.device().is_cpu() &&
                  logits.dim() == 2 && logits.is_contiguous(),
              "best_token: logits must be float32 (rows, V), contiguous, on the CPU");
  const int64_t N = logits.size(0), V = logits.size(1);
  TORCH_CHECK(V > 0, "best_token: no columns");
  TORCH_CHECK(forbid >= 0 && forbid < (1 << kSpecial), "best_token: forbid is a mask of ",
              kSpecial, " bits, got ", forbid);
  const bool biased = bias.has_value() && bias->defined();
  if (biased) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->sizes() == logits.sizes() &&
                    bias->is_contiguous(),
                "best_token: bias must be float32 like logits ", logits.sizes());
  }
  at::Tensor token = at::empty({N}, logits.options().dtype(at::kLong));
  at::Tensor lprob = at::empty({N}, logits.options());
  const float* x = logits.const_data_ptr<float>();
  const float* b = biased ? bias->const_data_ptr<float>() : nullptr;
  int64_t* t = token.mutable_data_ptr<int64_t>();
  float* l = lprob.mutable_data_ptr<float>();
  at::parallel_for(0, N, std::max<int64_t>(1, 65536 / V), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const auto [k, v] = pick(x + r * V, b ? b + r * V : nullptr, V, forbid);
      t[r] = k;
      l[r] = v;
    }
  });
  return {token, lprob};
}

// One row of mt::top_tokens: the k best allowed columns of z (values into val, best first;
// among equal values the lower column first) and the row's log sum_j exp(z_j) over all
// columns, returned (NaN where the row holds a NaN). Slots no allowed finite value fills keep
// -inf, and the first allowed columns not chosen.
float top_row(const float* x, const float* b, int64_t V, int64_t forbid, int64_t k, float* val,
              int64_t* idx) {
  const float inf = std::numeric_limits<float>::infinity();
  std::fill_n(val, k, -inf);
  std::fill_n(idx, k, int64_t{-1});
  auto offer = [&](float v, int64_t j) {  // v > val[k - 1]: in, after any equal value
    int64_t at = k - 1;
    while (at > 0 && val[at - 1] < v) {
      val[at] = val[at - 1];
      idx[at] = idx[at - 1];
      --at;
    }
    val[at] = v;
    idx[at] = j;
  };
  fvec top = fvec{} - inf;
  ivec nan = ivec{};
  int64_t j = 0;
  for (; j + kLanes <= V; j += kLanes) {
    const fvec v = scan_block(x, b, j, forbid, top, nan);
    const ivec above = v > val[k - 1];  // rare once the list holds k good values
    bool any = false;
    for (int i = 0; i < kLanes; ++i) any |= above[i] != 0;
    if (any) {
      for (int i = 0; i < kLanes; ++i) {
        if (v[i] > val[k - 1]) offer(v[i], j + i);
      }
    }
  }
  float all = -inf;
  bool has_nan = false;
  for (int i = 0; i < kLanes; ++i) {
    all = top[i] > all ? top[i] : all;
    has_nan |= nan[i] != 0;
  }
  for (; j < V; ++j) {  // the tail
    float v = b ? x[j] + b[j] : x[j];
    has_nan |= v != v;
    all = v > all ? v : all;
    if (j < kSpecial && (forbid >> j & 1)) continue;
    if (v > val[k - 1]) offer(v, j);
  }
  // slots left empty: the first allowed columns not chosen, at -inf
  for (int64_t slot = 0, next = 0; slot < k; ++slot) {
    if (idx[slot] >= 0) continue;
    for (;; ++next) {
      const bool allowed = !(next < kSpecial && (forbid >> next & 1));
      if (allowed && std::find(idx, idx + k, next) == idx + k) break;
    }
    idx[slot] = next++;
  }
  if (has_nan) return std::numeric_limits<float>::quiet_NaN();
  if (!(all > -inf)) return -inf;
  return all + static_cast<float>(std::log(exp_sum(x, b, V, all)));
}

std::tuple<at::Tensor, at::Tensor> top_tokens(const at::Tensor& logits,
                                              const std::optional<at::Tensor>& bias,
                                              int64_t width, int64_t forbid, int64_t k) {
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.device().is_cpu() &&
                  logits.dim() == 2 && logits.is_contiguous(),
              "top_tokens: logits must be float32 (rows, V), contiguous, on the CPU");
  const int64_t N = logits.size(0), V = logits.size(1);
  TORCH_CHECK(forbid >= 0 && forbid < (1 << kSpecial), "top_tokens: forbid is a mask of ",
              kSpecial, " bits, got ", forbid);
  const int64_t allowed = V - __builtin_popcountll(static_cast<uint64_t>(forbid) &
                                                   ((uint64_t{1} << std::min<int64_t>(V, 4)) - 1));
  TORCH_CHECK(k >= 1 && k <= allowed, "top_tokens: k ", k, " of ", allowed,
              " allowed columns");
  TORCH_CHECK(width >= 1 && N % width == 0, "top_tokens: ", N, " rows in groups of ", width);
  const bool biased = bias.has_value() && bias->defined();
  if (biased) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->dim() == 2 &&
                    bias->size(0) == N / width && bias->size(1) == V && bias->is_contiguous(),
                "top_tokens: bias must be float32 (", N / width, ", ", V, "), got ",
                bias->sizes());
  }
  at::Tensor lprob = at::empty({N, k}, logits.options());
  at::Tensor token = at::empty({N, k}, logits.options().dtype(at::kLong));
  const float* x = logits.const_data_ptr<float>();
  const float* b = biased ? bias->const_data_ptr<float>() : nullptr;
  float* l = lprob.mutable_data_ptr<float>();
  int64_t* t = token.mutable_data_ptr<int64_t>();
  at::parallel_for(0, N, std::max<int64_t>(1, 65536 / std::max<int64_t>(1, V)),
                   [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float lse = top_row(x + r * V, b ? b + (r / width) * V : nullptr, V, forbid, k,
                                l + r * k, t + r * k);
      for (int64_t i = 0; i < k; ++i) l[r * k + i] -= lse;
    }
  });
  return {lprob, token};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mt, m) {
  m.def("best_token(Tensor logits, Tensor? bias, int forbid) -> (Tensor, Tensor)");
  m.def("top_tokens(Tensor logits, Tensor? bias, int width, int forbid, int k) -> "
        "(Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(mt, CPU, m) {
  m.impl("best_token", &best_token);
  m.impl("top_tokens", &top_tokens);
}
