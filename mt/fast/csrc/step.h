// What mt's C++ decoding loops share (decoder_step.cpp, greedy_search.cpp): the products of a
// decoding copy by kind, oneDNN's row buckets, LayerNorm over rows, and the decoder step itself.

#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/relu.h>

#include "vec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace mt_step {

using namespace mt_vec;

// a layer's parameters: 4 tensors for each of its six products, its three LayerNorms' 2
constexpr int64_t kProducts = 6, kTensorsPerLayer = kProducts * 4 + 3 * 2;

using Int8Fn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                          const at::Tensor&, const std::optional<at::Tensor>&, int64_t, bool);
using F32Fn = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                         int64_t, bool);
using AttentionFn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                               const std::optional<at::Tensor>&, double);

inline c10::TypedOperatorHandle<Int8Fn> int8_op(bool vnni) {
  static const auto vnni_op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mt::int8_linear", "").typed<Int8Fn>();
  static const auto avx2_op = c10::Dispatcher::singleton()
                                  .findSchemaOrThrow("mt::int8_linear_avx2", "")
                                  .typed<Int8Fn>();
  return vnni ? vnni_op : avx2_op;
}

inline const c10::OperatorHandle& onednn_op() {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  return op;
}

inline c10::TypedOperatorHandle<AttentionFn> attention_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("mt::short_attention", "")
                             .typed<AttentionFn>();
  return op;
}

// out = LN(x), row by row (D floats each).
inline void norm_rows(const float* x, float* out, int64_t B, int64_t D, const float* g,
                      const float* b, float eps) {
  for (int64_t r = 0; r < B; ++r) {
    const float* row = x + r * D;
    float* y = out + r * D;
    fvec acc{};
    int64_t j = 0;
    for (; j + kLanes <= D; j += kLanes) acc += load(row + j);
    float sum = hsum(acc);
    for (; j < D; ++j) sum += row[j];
    const float mean = sum / static_cast<float>(D);
    fvec sq{};
    j = 0;
    for (; j + kLanes <= D; j += kLanes) {
      const fvec c = load(row + j) - mean;
      sq += c * c;
    }
    float var = hsum(sq);
    for (; j < D; ++j) var += (row[j] - mean) * (row[j] - mean);
    const float rstd = 1.f / std::sqrt(var / static_cast<float>(D) + eps);
    j = 0;
    for (; j + kLanes <= D; j += kLanes) {
      store(y + j, (load(row + j) - mean) * rstd * load(g + j) + load(b + j));
    }
    for (; j < D; ++j) y[j] = (row[j] - mean) * rstd * g[j] + b[j];
  }
}

// Row by row, in place: x = LN(x + o) (post-norm) or x = x + o (pre-norm: `g` null).
inline void add_norm(float* x, const float* o, int64_t B, int64_t D, const float* g,
                     const float* b, float eps) {
  for (int64_t i = 0; i < B * D; ++i) x[i] += o[i];
  if (g != nullptr) norm_rows(x, x, B, D, g, b, eps);
}

// mt.fast.onednn.bucket_rows: rows rounded up to a multiple of 8, or of 1/16 of their power of
// two (oneDNN keeps a kernel per row count; these few sizes keep that bounded).
inline int64_t bucket_rows(int64_t rows) {
  int bits = 0;
  for (int64_t r = rows; r > 0; r >>= 1) ++bits;
  const int64_t step = std::max<int64_t>(8, int64_t{1} << std::max(0, bits - 5));
  return (rows + step - 1) / step * step;
}

// The products of one step, of one kind (see decoder_step.cpp's header).
class Products {
 public:
  explicit Products(std::string_view kind) {
    if (kind == "int8-vnni" || kind == "int8-avx2") {
      int8_ = int8_op(kind == "int8-vnni");
    } else if (kind == "onednn") {
      onednn_ = onednn_op();
    } else if (kind == "f32-avx2") {
      f32_ = c10::Dispatcher::singleton().findSchemaOrThrow("mt::f32_linear", "").typed<F32Fn>();
    } else {
      TORCH_CHECK(kind == "linear", "decoder_step: products ", kind, " are not int8-vnni, "
                  "int8-avx2, onednn, f32-avx2 or linear");
    }
  }

  // p[at .. at + 4) on x (M, K) -> (M, width), ReLU inside where asked; contiguous.
  at::Tensor operator()(const at::TensorList p, int64_t at, int64_t width, const at::Tensor& x,
                        bool relu = false) const {
    const at::Tensor& bias = p[at + (int8_ ? 3 : 1)];
    const std::optional<at::Tensor> b =
        bias.numel() > 0 ? std::optional<at::Tensor>(bias) : std::nullopt;
    if (int8_) return int8_->call(x, p[at], p[at + 1], p[at + 2], b, width, relu);
    if (f32_) return f32_->call(x, p[at], b, width, relu);
    if (onednn_) {
      const int64_t rows = x.size(0), padded = bucket_rows(rows);
      std::vector<c10::IValue> stack;
      stack.reserve(6);
      stack.emplace_back(padded == rows ? x : at::constant_pad_nd(x, {0, 0, 0, padded - rows}));
      stack.emplace_back(p[at]);
      stack.emplace_back(b);
      stack.emplace_back(std::string(relu ? "relu" : "none"));
      stack.emplace_back(c10::impl::GenericList(c10::OptionalType::create(c10::NumberType::get())));
      stack.emplace_back(std::string());
      onednn_->callBoxed(&stack);
      at::Tensor y = stack[0].toTensor();
      return padded == rows ? y : y.narrow(0, 0, rows);
    }
    at::Tensor y = at::linear(x, p[at], b);
    return relu ? at::relu_(y) : y;
  }

 private:
  std::optional<c10::TypedOperatorHandle<Int8Fn>> int8_;
  std::optional<c10::TypedOperatorHandle<F32Fn>> f32_;
  std::optional<c10::OperatorHandle> onednn_;
};

// mt::decoder_step's work (decoder_step.cpp's header says what it takes and gives).
at::Tensor decoder_step(const at::Tensor& x_in, at::TensorList params, at::IntArrayRef widths,
                        at::TensorList self_k, at::TensorList self_v, int64_t past,
                        at::TensorList cross_k, at::TensorList cross_v,
                        const std::optional<at::Tensor>& bias, int64_t heads, bool pre_norm,
                        double eps, std::string_view products);

}  // namespace mt_step
