// mt::greedy_search: a batch's whole greedy search in one call (mt/fast/native.py builds it;
// mt/fast/step.py's FusedStep.greedy calls it, mt/decode/search.py's generate through it).
//
// The search loop of mt/decode/search.py for one hypothesis a sentence, step by step the same:
// the sentences at their length limit end first (without EOS); the rest are embedded, stepped
// (mt_step::decoder_step, every layer), normed (a pre-norm model's final LayerNorm, torch's),
// projected (the copy's head, a product of decoder_step's kinds) and searched (mt::best_token:
// the best allowed token and its log-probability); a sentence ends at EOS; ended sentences
// leave the rows, the last rows taking their places (mt.decode.rows.fill_from_the_end), so
// the products see the rows the Python loop gives them and compute the same bits. From
// Python the same search is ~20 operator calls a step around the step's own: on an AMD Zen 3,
// one thread, a fifth of the time of a greedy int8 batch of 32 Multi30k sentences.
//
//   emb, pe, scale     the target embedding (V', D), the positional encodings (P, D), sqrt(D):
//                      a step's input is emb[token] * scale + pe[position]
//   params ... products  mt::decoder_step's (decoder_step.cpp); self-attention caches are the
//                      search's own, (n, H, T, d) a layer
//   cross_k, cross_v   a layer each: (n, H, S, d) the encoder-decoder keys/values; their rows
//                      are moved as sentences end (in place: the caller's are used up)
//   bias               (n, S) the additive source mask (moved the same way), or none
//   final_norm         [] or a pre-norm model's final LayerNorm [weight, bias]
//   head, head_width, head_kind   the projection: 4 tensors, its output width and kind, as
//                      one of decoder_step's products
//   vocab              the columns searched: the first `vocab` of the projection's
//   limits             (n) each sentence's maximum output length; T = the largest
//   min_len, bos, eos, forbid   EOS forbidden before min_len tokens; `forbid` a bit mask of
//                      the columns 0-3 never chosen (PAD, BOS), as mt::best_token takes it
// Returns (tokens (n, T) int64, count (n) int64, ended (n) bool, score (n) float32): sentence
// i's output is tokens[i, :count[i]], ended[i] whether EOS ended it (then counted in its
// length, not in its tokens), score[i] its summed log-probability; count -1 where no
// hypothesis survived (a score that is not finite, as the Python loop drops).

#include <ATen/ops/contiguous.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/layer_norm.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include "step.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <tuple>

namespace {

using BestFn = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&,
                                                  const std::optional<at::Tensor>&, int64_t);

c10::TypedOperatorHandle<BestFn> best_token_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mt::best_token", "").typed<BestFn>();
  return op;
}

// Row `from` of t (its first dimension) into row `to`, the first `len` entries of the third
// dimension only where `len` >= 0 (a self-attention cache's filled positions).
void move_row(const at::Tensor& t, int64_t from, int64_t to, int64_t len = -1) {
  const int64_t elem = t.element_size();
  char* base = static_cast<char*>(t.mutable_data_ptr());
  if (len < 0) {
    std::memcpy(base + to * t.stride(0) * elem, base + from * t.stride(0) * elem,
                t.stride(0) * elem);
    return;
  }
  for (int64_t h = 0; h < t.size(1); ++h) {
    const int64_t at = h * t.stride(1);
    std::memcpy(base + (to * t.stride(0) + at) * elem, base + (from * t.stride(0) + at) * elem,
                len * t.stride(2) * elem);
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> greedy_search(
    const at::Tensor& emb, const at::Tensor& pe, double scale, at::TensorList params,
    at::IntArrayRef widths, at::TensorList cross_k, at::TensorList cross_v,
    const std::optional<at::Tensor>& bias_in, int64_t heads, bool pre_norm, double eps,
    std::string_view products, at::TensorList final_norm, at::TensorList head,
    int64_t head_width, std::string_view head_kind, int64_t vocab, at::IntArrayRef limits,
    int64_t min_len, int64_t bos, int64_t eos, int64_t forbid) {
  const int64_t L = static_cast<int64_t>(cross_k.size());
  const int64_t n = static_cast<int64_t>(limits.size());
  TORCH_CHECK(emb.dim() == 2 && emb.scalar_type() == at::kFloat && pe.dim() == 2 &&
                  pe.scalar_type() == at::kFloat && pe.size(1) == emb.size(1),
              "greedy_search: emb (V, D) and pe (P, D) must be float32 of one width");
  TORCH_CHECK(L > 0 && static_cast<int64_t>(cross_v.size()) == L,
              "greedy_search: a cross-attention cache of each kind a layer");
  TORCH_CHECK(head.size() == 4 && head_width >= vocab && vocab > 0,
              "greedy_search: the head is 4 tensors giving at least ", vocab, " columns");
  TORCH_CHECK(final_norm.empty() || final_norm.size() == 2,
              "greedy_search: final_norm is [] or [weight, bias]");
  const int64_t D = emb.size(1), H = heads;
  TORCH_CHECK(H > 0 && D % H == 0, "greedy_search: ", H, " heads for D ", D);
  const int64_t d = D / H;
  int64_t T = 0;
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(limits[i] >= 1, "greedy_search: sentence ", i, "'s length limit ", limits[i]);
    T = std::max(T, limits[i]);
  }
  TORCH_CHECK(T <= pe.size(0), "greedy_search: length limit ", T, " beyond the ", pe.size(0),
              " positions encoded");
  for (int64_t l = 0; l < L; ++l) {
    TORCH_CHECK(cross_k[l].dim() == 4 && cross_k[l].size(0) == n && cross_k[l].is_contiguous() &&
                    cross_v[l].dim() == 4 && cross_v[l].size(0) == n &&
                    cross_v[l].is_contiguous(),
                "greedy_search: layer ", l, "'s encoder-decoder keys/values must be (", n,
                ", H, S, d) contiguous");
  }
  const bool biased = bias_in.has_value() && bias_in->defined();
  if (biased) {
    TORCH_CHECK(bias_in->dim() == 2 && bias_in->size(0) == n && bias_in->is_contiguous(),
                "greedy_search: bias must be (", n, ", S) contiguous");
  }

  at::Tensor tokens = at::zeros({n, T}, emb.options().dtype(at::kLong));
  at::Tensor count = at::full({n}, -1, tokens.options());
  at::Tensor ended = at::zeros({n}, emb.options().dtype(at::kBool));
  at::Tensor score = at::zeros({n}, emb.options());
  if (n == 0) return {tokens, count, ended, score};
  int64_t* tok = tokens.mutable_data_ptr<int64_t>();
  int64_t* cnt = count.mutable_data_ptr<int64_t>();
  bool* eos_ended = ended.mutable_data_ptr<bool>();
  float* out_score = score.mutable_data_ptr<float>();

  std::vector<at::Tensor> self_k, self_v;  // the search's caches, T positions
  for (int64_t l = 0; l < L; ++l) {
    self_k.push_back(at::empty({n, H, T, d}, emb.options()));
    self_v.push_back(at::empty({n, H, T, d}, emb.options()));
  }
  const mt_step::Products project{head_kind};
  const auto best = best_token_op();
  // the live rows: each one's sentence, last token and score
  std::vector<int64_t> sent(n), last(n, bos);
  std::vector<float> sum(n, 0.f);
  for (int64_t i = 0; i < n; ++i) sent[i] = i;
  int64_t B = n;

  // rows with gone[r] leave; the last kept rows fill the places of the dropped ones below
  // the new count; `filled`: the caches' positions written so far
  std::vector<char> gone;
  auto drop = [&](int64_t filled) {
    std::vector<int64_t> keep;
    for (int64_t r = 0; r < B; ++r) {
      if (!gone[r]) keep.push_back(r);
    }
    const int64_t kept = static_cast<int64_t>(keep.size());
    auto beyond = std::find_if(keep.begin(), keep.end(), [&](int64_t r) { return r >= kept; });
    for (int64_t place = 0; place < kept && beyond != keep.end(); ++place) {
      if (!gone[place]) continue;  // a kept row below the new count stays in its place
      const int64_t from = *beyond++;
      for (int64_t l = 0; l < L; ++l) {
        move_row(self_k[l], from, place, filled);
        move_row(self_v[l], from, place, filled);
        move_row(cross_k[l], from, place);
        move_row(cross_v[l], from, place);
      }
      if (biased) move_row(*bias_in, from, place);
      sent[place] = sent[from];
      last[place] = last[from];
      sum[place] = sum[from];
    }
    B = kept;
  };

  for (int64_t step = 0; B > 0; ++step) {
    // the sentences at their limit end as they are, without EOS
    gone.assign(B, 0);
    bool any = false;
    for (int64_t r = 0; r < B; ++r) {
      const int64_t s = sent[r];
      if (limits[s] > step) continue;
      if (sum[r] > -std::numeric_limits<float>::infinity()) {
        cnt[s] = step;
        out_score[s] = sum[r];
      }
      gone[r] = any = true;
    }
    if (any) drop(step);
    if (B == 0) break;

    // the step: embedding, every layer, the final LayerNorm, the projection
    at::Tensor index = at::empty({B}, tokens.options());
    std::copy(last.begin(), last.begin() + B, index.mutable_data_ptr<int64_t>());
    at::Tensor x = at::index_select(emb, 0, index).mul_(scale).add_(pe[step]);
    std::vector<at::Tensor> k, v, ck, cv;
    for (int64_t l = 0; l < L; ++l) {
      k.push_back(self_k[l].narrow(0, 0, B));
      v.push_back(self_v[l].narrow(0, 0, B));
      ck.push_back(cross_k[l].narrow(0, 0, B));
      cv.push_back(cross_v[l].narrow(0, 0, B));
    }
    const std::optional<at::Tensor> bias =
        biased ? std::optional<at::Tensor>(bias_in->narrow(0, 0, B)) : std::nullopt;
    at::Tensor h = mt_step::decoder_step(x, params, widths, k, v, step, ck, cv, bias, heads,
                                         pre_norm, eps, products);
    if (!final_norm.empty()) h = at::layer_norm(h, {D}, final_norm[0], final_norm[1], eps);
    at::Tensor logits = project(head, 0, head_width, h);
    if (head_width != vocab) logits = logits.narrow(1, 0, vocab);
    logits = logits.contiguous();
    const int64_t ban = forbid | (step < min_len ? int64_t{1} << eos : 0);
    const auto [token_t, lprob_t] = best.call(logits, std::nullopt, ban);
    const int64_t* token = token_t.const_data_ptr<int64_t>();
    const float* lprob = lprob_t.const_data_ptr<float>();

    // EOS ends a sentence (its tokens so far, EOS counted in its length); a score that is
    // not finite ends it with no hypothesis
    gone.assign(B, 0);
    any = false;
    for (int64_t r = 0; r < B; ++r) {
      const int64_t s = sent[r];
      sum[r] += lprob[r];
      if (token[r] == eos) {
        cnt[s] = step;
        eos_ended[s] = true;
        out_score[s] = sum[r];
        gone[r] = any = true;
      } else if (!std::isfinite(sum[r])) {
        gone[r] = any = true;
      } else {
        tok[s * T + step] = token[r];
        last[r] = token[r];
      }
    }
    if (any) drop(step + 1);
  }
  return {tokens, count, ended, score};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mt, m) {
  m.def("greedy_search(Tensor emb, Tensor pe, float scale, Tensor[] params, int[] widths, "
        "Tensor(a!)[] cross_k, Tensor(b!)[] cross_v, Tensor(c!)? bias, int heads, bool pre_norm, "
        "float eps, str products, Tensor[] final_norm, Tensor[] head, int head_width, "
        "str head_kind, int vocab, int[] limits, int min_len, int bos, int eos, int forbid) -> "
        "(Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(mt, CPU, m) { m.impl("greedy_search", &greedy_search); }

// oneDNN's packed weights are tensors of its own backend (as for mt::decoder_step)
TORCH_LIBRARY_IMPL(mt, MkldnnCPU, m) { m.impl("greedy_search", &greedy_search); }
