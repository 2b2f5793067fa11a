// mt::decoder_step: one incremental decoder step of a decoding copy, every layer in one call
// (mt/fast/native.py builds it; mt/fast/step.py's FusedStep calls it).
//
// mt/fast/step.py's decoder_step computes a step through the layers' modules: ~20 calls from
// Python a layer (products, cache writes, attention, additions, LayerNorms), each a few
// microseconds of interpreter and dispatch around work of about as long at a greedy step's few
// rows. Here the same formula runs from C++: the products on the copy's own kernels, the
// attention on mt::short_attention, both reached through torch's dispatcher; the new
// keys/values written into the caches, the residual additions and the LayerNorms as loops here.
//
//   x          (B, D) float32: the step's embedded input, B = n * G rows (G per sentence)
//   params     30 tensors a layer: 4 for each of its six products (self-attention's qkv and
//              out, encoder-decoder attention's q and out, the feed-forward block's w1 and w2),
//              then its three LayerNorms' weight and bias. A product's 4, by `products`:
//                "int8-vnni", "int8-avx2"  mt::int8_linear(_avx2)'s w, scale, comp, bias
//                "onednn"   oneDNN's weight (its packed layout or torch's), bias, -, -: float32
//                           products through mkldnn::_linear_pointwise, the rows padded to
//                           mt.fast.onednn.bucket_rows' sizes as OneDNNLinear pads them
//                "f32-avx2" mt::f32_linear's weight (16-channel blocks), bias, -, -: float32
//                "linear"   torch's weight, bias, -, -: at::linear
//              (an empty tensor for a missing bias and the unused places)
//   widths     6 ints a layer: the products' output widths
//   self_k, self_v    a layer each: (B, H, C, d) float32 caches with C > past; the step writes
//                     position `past` and attends over positions 0..past
//   cross_k, cross_v  a layer each: (n, H, S, d) float32 encoder-decoder keys/values
//   bias       (n, S) float32 added to the encoder-decoder scores (0 or -inf), or none
//   heads, pre_norm (x + f(LN(x)) where true, LN(x + f(x)) where false), eps (the LayerNorms')
// Returns (B, D): the last layer's output (a pre-norm model's final LayerNorm not applied).
//
// The products and the attention are the modules' own kernels, so they give the same bits;
// the LayerNorms are torch's formula (biased variance, eps inside the square root) with their
// sums in another order: results agree with the modules' to float rounding.

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/relu.h>
#include <torch/library.h>

#include "step.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

namespace mt_step {

at::Tensor decoder_step(const at::Tensor& x_in, at::TensorList params, at::IntArrayRef widths,
                        at::TensorList self_k, at::TensorList self_v, int64_t past,
                        at::TensorList cross_k, at::TensorList cross_v,
                        const std::optional<at::Tensor>& bias, int64_t heads, bool pre_norm,
                        double eps, std::string_view products) {
  const int64_t L = static_cast<int64_t>(self_k.size());
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat && x_in.device().is_cpu(),
              "decoder_step: x must be float32 (B, D) on the CPU");
  TORCH_CHECK(static_cast<int64_t>(params.size()) == L * kTensorsPerLayer &&
                  static_cast<int64_t>(widths.size()) == L * kProducts &&
                  static_cast<int64_t>(self_v.size()) == L &&
                  static_cast<int64_t>(cross_k.size()) == L &&
                  static_cast<int64_t>(cross_v.size()) == L,
              "decoder_step: ", L, " layers need ", L * kTensorsPerLayer, " parameters, ",
              L * kProducts, " widths and a cache of each kind a layer");
  const int64_t B = x_in.size(0), D = x_in.size(1);
  TORCH_CHECK(heads > 0 && D % heads == 0, "decoder_step: ", heads, " heads for D ", D);
  const int64_t H = heads, d = D / H;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  const float e = static_cast<float>(eps);
  const Products product{products};
  const auto attend = attention_op();
  at::Tensor x = x_in.clone(at::MemoryFormat::Contiguous);  // the residual stream, updated in place
  float* xp = x.mutable_data_ptr<float>();

  // The input of a sublayer: x itself (post-norm) or LN(x) (pre-norm, the sublayer's norm).
  auto sublayer_input = [&](const at::TensorList p, int64_t norm) -> at::Tensor {
    if (!pre_norm) return x;
    at::Tensor y = at::empty({B, D}, x.options());
    norm_rows(xp, y.mutable_data_ptr<float>(), B, D, p[24 + 2 * norm].const_data_ptr<float>(),
              p[25 + 2 * norm].const_data_ptr<float>(), e);
    return y;
  };
  auto residual = [&](const at::TensorList p, int64_t norm, const at::Tensor& out) {
    TORCH_CHECK(out.is_contiguous() && out.numel() == B * D, "decoder_step: a sublayer "
                "gave ", out.sizes(), " for (", B, ", ", D, ")");
    add_norm(xp, out.const_data_ptr<float>(), B, D,
             pre_norm ? nullptr : p[24 + 2 * norm].const_data_ptr<float>(),
             pre_norm ? nullptr : p[25 + 2 * norm].const_data_ptr<float>(), e);
  };

  for (int64_t l = 0; l < L; ++l) {
    const at::TensorList p = params.slice(l * kTensorsPerLayer, kTensorsPerLayer);
    const int64_t* n = widths.data() + l * kProducts;
    for (int64_t i = 24; i < kTensorsPerLayer; ++i) {
      TORCH_CHECK(p[i].scalar_type() == at::kFloat && p[i].numel() == D && p[i].is_contiguous(),
                  "decoder_step: layer ", l, "'s LayerNorm parameters must be float32 (",
                  D, ")");
    }
    TORCH_CHECK(n[0] == 3 * D && n[1] == D && n[2] == D && n[3] == D && n[5] == D,
                "decoder_step: layer ", l, "'s product widths do not fit D ", D);
    const at::Tensor& kc = self_k[l];
    const at::Tensor& vc = self_v[l];
    TORCH_CHECK(kc.dim() == 4 && vc.dim() == 4 && kc.scalar_type() == at::kFloat &&
                    vc.scalar_type() == at::kFloat && kc.size(0) == B && vc.size(0) == B &&
                    kc.size(1) == H && vc.size(1) == H && kc.size(3) == d && vc.size(3) == d &&
                    kc.size(2) > past && vc.size(2) > past && past >= 0 &&
                    kc.stride(3) == 1 && vc.stride(3) == 1,
                "decoder_step: layer ", l, "'s self-attention caches ", kc.sizes(), ", ",
                vc.sizes(), " have no room for position ", past, " of (", B, ", ", H, ", ", d,
                ")");

    // self-attention: the new position's keys/values into the caches, then its query
    // against positions 0..past
    at::Tensor qkv = product(p, 0, n[0], sublayer_input(p, 0));  // (B, 3D)
    const float* qkvp = qkv.const_data_ptr<float>();
    float* kp = kc.mutable_data_ptr<float>();
    float* vp = vc.mutable_data_ptr<float>();
    for (int64_t r = 0; r < B; ++r) {
      for (int64_t h = 0; h < H; ++h) {
        std::memcpy(kp + r * kc.stride(0) + h * kc.stride(1) + past * kc.stride(2),
                    qkvp + r * 3 * D + D + h * d, d * sizeof(float));
        std::memcpy(vp + r * vc.stride(0) + h * vc.stride(1) + past * vc.stride(2),
                    qkvp + r * 3 * D + 2 * D + h * d, d * sizeof(float));
      }
    }
    const at::Tensor q = qkv.view({B, 3, H, 1, d}).select(1, 0);  // (B, H, 1, d)
    at::Tensor a = attend.call(q, kc.narrow(2, 0, past + 1), vc.narrow(2, 0, past + 1),
                               std::nullopt, scale);  // (B, 1, H, d)
    residual(p, 0, product(p, 4, n[1], a.view({B, D})));

    // encoder-decoder attention: a sentence's G rows against its encoder keys/values
    const at::Tensor& ck = cross_k[l];
    const int64_t sents = ck.size(0);
    TORCH_CHECK(sents > 0 && B % sents == 0, "decoder_step: ", B, " rows for ", sents,
                " sentences");
    const int64_t G = B / sents;
    const at::Tensor cq = product(p, 8, n[2], sublayer_input(p, 1))
                              .view({sents, G, H, d})
                              .transpose(1, 2);  // (n, H, G, d)
    a = attend.call(cq, ck, cross_v[l], bias, scale);  // (n, G, H, d)
    residual(p, 1, product(p, 12, n[3], a.view({B, D})));

    // feed-forward: the ReLU inside the first product
    const at::Tensor hidden = product(p, 16, n[4], sublayer_input(p, 2), true);
    residual(p, 2, product(p, 20, n[5], hidden));
  }
  return x;
}

}  // namespace mt_step

TORCH_LIBRARY_FRAGMENT(mt, m) {
  m.def("decoder_step(Tensor x, Tensor[] params, int[] widths, Tensor(a!)[] self_k, "
        "Tensor(b!)[] self_v, int past, Tensor[] cross_k, Tensor[] cross_v, Tensor? bias, "
        "int heads, bool pre_norm, float eps, str products) -> Tensor");
}

TORCH_LIBRARY_IMPL(mt, CPU, m) { m.impl("decoder_step", &mt_step::decoder_step); }

// oneDNN's packed weights are tensors of its own backend: a step that holds them dispatches here
TORCH_LIBRARY_IMPL(mt, MkldnnCPU, m) { m.impl("decoder_step", &mt_step::decoder_step); }
