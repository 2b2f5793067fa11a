// What mt's whole searches in one call share (greedy_search.cpp, beam_search.cpp): their model
// inputs, checked; the search's own self-attention caches; one step's logits; and the row
// moves that follow hypotheses as they change places and sentences as they end.

#pragma once

#include <ATen/ops/empty.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/layer_norm.h>
#include <ATen/ops/zeros.h>

#include "step.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <tuple>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

// Both operators' schemas: the model's inputs first (what Decoder takes), their own settings
// between, a shortlist last.
#define MT_SEARCH_MODEL_ARGS                                                                  \
  "Tensor emb, Tensor pe, float scale, Tensor[] params, int[] widths, Tensor(a!)[] cross_k, " \
  "Tensor(b!)[] cross_v, Tensor(c!)? bias, int heads, bool pre_norm, float eps, "            \
  "str products, Tensor[] final_norm, Tensor[] head, int head_width, str head_kind, "        \
  "int vocab, int[] limits, "
#define MT_SEARCH_SHORTLIST_ARGS                                \
  ", Tensor(d!)? vocab_bias=None, Tensor? vocab_ids=None) -> " \
  "(Tensor, Tensor, Tensor, Tensor, Tensor)"

namespace mt_search {

// One finished hypothesis: its tokens (without BOS and EOS), score and summed log-probability.
struct Hyp {
  std::vector<int64_t> tokens;
  double score;
  float logprob;
};

// mt.decode.search.length_penalty: length ** alpha, length counting EOS.
inline double length_penalty(int64_t length, double alpha) {
  return std::pow(static_cast<double>(length), alpha);
}

// Both searches' results: (tokens (h, T) int64, count (h) int64, logprob (h) float32, score
// (h) float64, per (n) int64), the h hypotheses of `out` sentence by sentence, per[i] of them
// for sentence i, each tokens[j, :count[j]].
inline std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> pack(
    const std::vector<std::vector<Hyp>>& out, const at::TensorOptions& floats) {
  int64_t total = 0, longest = 0;
  for (const auto& o : out) {
    total += static_cast<int64_t>(o.size());
    for (const Hyp& hyp : o) longest = std::max<int64_t>(longest, hyp.tokens.size());
  }
  const auto longs = floats.dtype(at::kLong);
  at::Tensor tokens = at::zeros({total, longest}, longs);
  at::Tensor count = at::empty({total}, longs), per = at::empty({int64_t(out.size())}, longs);
  at::Tensor logprob = at::empty({total}, floats.dtype(at::kFloat));
  at::Tensor score = at::empty({total}, floats.dtype(at::kDouble));
  int64_t j = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    per.mutable_data_ptr<int64_t>()[i] = static_cast<int64_t>(out[i].size());
    for (const Hyp& hyp : out[i]) {
      std::copy(hyp.tokens.begin(), hyp.tokens.end(),
                tokens.mutable_data_ptr<int64_t>() + j * longest);
      count.mutable_data_ptr<int64_t>()[j] = static_cast<int64_t>(hyp.tokens.size());
      logprob.mutable_data_ptr<float>()[j] = hyp.logprob;
      score.mutable_data_ptr<double>()[j] = hyp.score;
      ++j;
    }
  }
  return {tokens, count, logprob, score, per};
}

// Rows [from, from + count) of t (its first dimension) into [to, to + count), the first `len`
// entries of the third dimension only where len >= 0 (a cache's filled positions).
inline void move_rows(const at::Tensor& t, int64_t from, int64_t to, int64_t count,
                      int64_t len = -1) {
  if (from == to) return;
  const int64_t elem = t.element_size();
  char* base = static_cast<char*>(t.mutable_data_ptr());
  for (int64_t c = 0; c < count; ++c) {
    const int64_t src = (from + c) * t.stride(0), dst = (to + c) * t.stride(0);
    if (len < 0) {
      std::memcpy(base + dst * elem, base + src * elem, t.stride(0) * elem);
      continue;
    }
    for (int64_t h = 0; h < t.size(1); ++h) {
      std::memcpy(base + (dst + h * t.stride(1)) * elem, base + (src + h * t.stride(1)) * elem,
                  len * t.stride(2) * elem);
    }
  }
}

// A decoding copy as a search steps it. The arguments are the operators' (greedy_search.cpp's
// header says what they are); `rows` self-attention cache rows a sentence (1: greedy, K: beam).
class Decoder {
 public:
  Decoder(std::string_view name, const at::Tensor& emb, const at::Tensor& pe, double scale,
          at::TensorList params, at::IntArrayRef widths, at::TensorList cross_k,
          at::TensorList cross_v, const std::optional<at::Tensor>& bias, int64_t heads,
          bool pre_norm, double eps, std::string_view products, at::TensorList final_norm,
          at::TensorList head, int64_t head_width, std::string_view head_kind, int64_t vocab,
          at::IntArrayRef limits, int64_t rows, const std::optional<at::Tensor>& vocab_bias,
          const std::optional<at::Tensor>& vocab_ids)
      : emb_(emb), pe_(pe), scale_(scale), params_(params), widths_(widths),
        cross_k_(cross_k), cross_v_(cross_v), heads_(heads), pre_norm_(pre_norm), eps_(eps),
        products_(products), final_norm_(final_norm), head_(head), head_width_(head_width),
        project_(head_kind), vocab_(vocab), n_(static_cast<int64_t>(limits.size())) {
    const int64_t L = static_cast<int64_t>(cross_k.size());
    TORCH_CHECK(emb.dim() == 2 && emb.scalar_type() == at::kFloat && pe.dim() == 2 &&
                    pe.scalar_type() == at::kFloat && pe.size(1) == emb.size(1),
                name, ": emb (V, D) and pe (P, D) must be float32 of one width");
    TORCH_CHECK(L > 0 && static_cast<int64_t>(cross_v.size()) == L,
                name, ": a cross-attention cache of each kind a layer");
    TORCH_CHECK(head.size() == 4 && head_width >= vocab && vocab > 0,
                name, ": the head is 4 tensors giving at least ", vocab, " columns");
    TORCH_CHECK(final_norm.empty() || final_norm.size() == 2,
                name, ": final_norm is [] or [weight, bias]");
    D_ = emb.size(1);
    TORCH_CHECK(heads > 0 && D_ % heads == 0, name, ": ", heads, " heads for D ", D_);
    for (int64_t i = 0; i < n_; ++i) {
      TORCH_CHECK(limits[i] >= 1, name, ": sentence ", i, "'s length limit ", limits[i]);
      T_ = std::max(T_, limits[i]);
    }
    TORCH_CHECK(T_ <= pe.size(0), name, ": length limit ", T_, " beyond the ", pe.size(0),
                " positions encoded");
    for (int64_t l = 0; l < L; ++l) {
      TORCH_CHECK(cross_k[l].dim() == 4 && cross_k[l].size(0) == n_ &&
                      cross_k[l].is_contiguous() && cross_v[l].dim() == 4 &&
                      cross_v[l].size(0) == n_ && cross_v[l].is_contiguous(),
                  name, ": layer ", l, "'s encoder-decoder keys/values must be (", n_,
                  ", H, S, d) contiguous");
    }
    if (bias.has_value() && bias->defined()) {
      TORCH_CHECK(bias->dim() == 2 && bias->size(0) == n_ && bias->is_contiguous(),
                  name, ": bias must be (", n_, ", S) contiguous");
      bias_ = *bias;
    }
    // a shortlist: the columns' pieces, each sentence's bias over them (moved as it moves)
    if (vocab_ids.has_value() && vocab_ids->defined()) {
      TORCH_CHECK(vocab_ids->dim() == 1 && vocab_ids->size(0) == vocab &&
                      vocab_ids->scalar_type() == at::kLong && vocab_ids->is_contiguous(),
                  name, ": vocab_ids must be int64 (", vocab, ")");
      ids_ = vocab_ids->const_data_ptr<int64_t>();
    }
    if (vocab_bias.has_value() && vocab_bias->defined()) {
      TORCH_CHECK(vocab_bias->dim() == 2 && vocab_bias->size(0) == n_ &&
                      vocab_bias->size(1) == vocab && vocab_bias->is_contiguous() &&
                      vocab_bias->scalar_type() == at::kFloat,
                  name, ": vocab_bias must be float32 (", n_, ", ", vocab, ") contiguous");
      vocab_bias_ = *vocab_bias;
    }
    // the search's caches: 16 positions, doubled as the steps need (SelfAttentionCache's rule)
    capacity_ = std::min<int64_t>(T_, 16);
    for (int64_t l = 0; l < L; ++l) {
      self_k_.push_back(at::empty({n_ * rows, heads, capacity_, D_ / heads}, emb.options()));
      self_v_.push_back(at::empty({n_ * rows, heads, capacity_, D_ / heads}, emb.options()));
    }
  }

  int64_t sentences() const { return n_; }

  // The piece of logits column `c`: itself, or the shortlist's c-th piece.
  int64_t piece(int64_t c) const { return ids_ ? ids_[c] : c; }

  // The shortlist's bias rows of the first `sents` sentences (the kernels' `bias`), or none.
  std::optional<at::Tensor> vocab_bias(int64_t sents) const {
    if (!vocab_bias_.defined()) return std::nullopt;
    return vocab_bias_.narrow(0, 0, sents);
  }

  // The logits (B, vocab), float32 and contiguous, of the tokens last[0 .. B) at position
  // `step`: the first `sents` sentences' B / sents rows each, the caches' rows 0 .. B.
  at::Tensor logits(const int64_t* last, int64_t B, int64_t sents, int64_t step) {
    if (step >= capacity_) grow(step, B);
    at::Tensor index = at::empty({B}, emb_.options().dtype(at::kLong));
    std::copy(last, last + B, index.mutable_data_ptr<int64_t>());
    // _embed's formula: Embedding(tokens) * sqrt(D) + PE[position]
    at::Tensor x = at::index_select(emb_, 0, index).mul_(scale_).add_(pe_[step]);
    std::vector<at::Tensor> k, v, ck, cv;
    for (size_t l = 0; l < self_k_.size(); ++l) {
      k.push_back(self_k_[l].narrow(0, 0, B));
      v.push_back(self_v_[l].narrow(0, 0, B));
      ck.push_back(cross_k_[l].narrow(0, 0, sents));
      cv.push_back(cross_v_[l].narrow(0, 0, sents));
    }
    const std::optional<at::Tensor> bias =
        bias_.defined() ? std::optional<at::Tensor>(bias_.narrow(0, 0, sents)) : std::nullopt;
    at::Tensor h = mt_step::decoder_step(x, params_, widths_, k, v, step, ck, cv, bias, heads_,
                                         pre_norm_, eps_, products_);
    if (!final_norm_.empty()) {
      h = at::layer_norm(h, {D_}, final_norm_[0], final_norm_[1], eps_);
    }
    at::Tensor out = project_(head_, 0, head_width_, h);
    if (head_width_ != vocab_) out = out.narrow(1, 0, vocab_);
    return out.contiguous();
  }

  // Cache row `from` into row `to`, their first `filled` positions.
  void move_row(int64_t from, int64_t to, int64_t filled) {
    for (size_t l = 0; l < self_k_.size(); ++l) {
      move_rows(self_k_[l], from, to, 1, filled);
      move_rows(self_v_[l], from, to, 1, filled);
    }
  }

  // Sentence `from` into place `to`: its `width` cache rows (`filled` positions), its
  // encoder-decoder keys/values and source mask.
  void move_sentence(int64_t from, int64_t to, int64_t width, int64_t filled) {
    for (size_t l = 0; l < self_k_.size(); ++l) {
      move_rows(self_k_[l], from * width, to * width, width, filled);
      move_rows(self_v_[l], from * width, to * width, width, filled);
      move_rows(cross_k_[l], from, to, 1);
      move_rows(cross_v_[l], from, to, 1);
    }
    if (bias_.defined()) move_rows(bias_, from, to, 1);
    if (vocab_bias_.defined()) move_rows(vocab_bias_, from, to, 1);
  }

 private:
  // Room for position `step`: caches of max(step + 1, twice as many) positions (at most the
  // longest limit), the first `filled` positions of the first B rows copied over.
  void grow(int64_t filled, int64_t B) {
    capacity_ = std::min(T_, std::max(filled + 1, 2 * capacity_));
    for (auto* caches : {&self_k_, &self_v_}) {
      for (at::Tensor& c : *caches) {
        at::Tensor bigger = at::empty({c.size(0), c.size(1), capacity_, c.size(3)}, c.options());
        bigger.narrow(0, 0, B).narrow(2, 0, filled)
            .copy_(c.narrow(0, 0, B).narrow(2, 0, filled));
        c = bigger;
      }
    }
  }

  at::Tensor emb_, pe_, bias_, vocab_bias_;
  const int64_t* ids_ = nullptr;
  double scale_;
  at::TensorList params_;
  at::IntArrayRef widths_;
  at::TensorList cross_k_, cross_v_;
  int64_t heads_;
  bool pre_norm_;
  double eps_;
  std::string_view products_;
  at::TensorList final_norm_, head_;
  int64_t head_width_;
  mt_step::Products project_;
  int64_t vocab_, n_, D_ = 0, T_ = 0, capacity_ = 0;
  std::vector<at::Tensor> self_k_, self_v_;
};

// An order of the kept places `keep` (ascending) in which each below keep.size() stays and
// those beyond take, in turn, the places of the dropped ones (mt.decode.rows.fill_from_the_end):
// f(from, to) for each move.
template <typename F>
void fill_from_the_end(const std::vector<int64_t>& keep, const std::vector<char>& gone, F&& f) {
  const int64_t kept = static_cast<int64_t>(keep.size());
  auto beyond = std::find_if(keep.begin(), keep.end(), [&](int64_t i) { return i >= kept; });
  for (int64_t place = 0; place < kept && beyond != keep.end(); ++place) {
    if (gone[place]) f(*beyond++, place);
  }
}

}  // namespace mt_search
