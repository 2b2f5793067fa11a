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
//                      search's own (mt_search::Decoder's), grown by doubling as steps need
//   cross_k, cross_v   a layer each: (n, H, S, d) the encoder-decoder keys/values; their rows
//                      are moved as sentences end (in place: the caller's are used up)
//   bias               (n, S) the additive source mask (moved the same way), or none
//   final_norm         [] or a pre-norm model's final LayerNorm [weight, bias]
//   head, head_width, head_kind   the projection: 4 tensors, its output width and kind, as
//                      one of decoder_step's products
//   vocab              the columns searched: the first `vocab` of the projection's
//   limits             (n) each sentence's maximum output length
//   min_len, alpha     EOS forbidden before min_len tokens; the length penalty's exponent
//   bos, eos, forbid   `forbid` a bit mask of the columns 0-3 never chosen (PAD, BOS), as
//                      mt::best_token takes it
//   vocab_bias, vocab_ids   a vocabulary shortlist (mt/decode/shortlist.py), or none: the
//                      projection's columns are the pieces vocab_ids (the special ones first,
//                      as themselves), each sentence's bias row (n, vocab) added to its logits
//                      (moved with it, in place) and the chosen columns mapped to their pieces
// Returns mt_search::pack's tensors (search.h): each sentence's one hypothesis, or none where
// its score stopped being finite (as the Python loop drops it).

#include <torch/library.h>

#include "search.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>

namespace {

using BestFn = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&,
                                                  const std::optional<at::Tensor>&, int64_t);

c10::TypedOperatorHandle<BestFn> best_token_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mt::best_token", "").typed<BestFn>();
  return op;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> greedy_search(
    const at::Tensor& emb, const at::Tensor& pe, double scale, at::TensorList params,
    at::IntArrayRef widths, at::TensorList cross_k, at::TensorList cross_v,
    const std::optional<at::Tensor>& bias, int64_t heads, bool pre_norm, double eps,
    std::string_view products, at::TensorList final_norm, at::TensorList head,
    int64_t head_width, std::string_view head_kind, int64_t vocab, at::IntArrayRef limits,
    int64_t min_len, double alpha, int64_t bos, int64_t eos, int64_t forbid,
    const std::optional<at::Tensor>& vocab_bias, const std::optional<at::Tensor>& vocab_ids) {
  mt_search::Decoder model("greedy_search", emb, pe, scale, params, widths, cross_k, cross_v,
                           bias, heads, pre_norm, eps, products, final_norm, head, head_width,
                           head_kind, vocab, limits, 1, vocab_bias, vocab_ids);
  const int64_t n = model.sentences();
  std::vector<std::vector<mt_search::Hyp>> out(n);
  const auto best = best_token_op();
  // the live rows: each one's sentence, tokens, last token and score
  std::vector<int64_t> sent(n), last(n, bos);
  std::vector<std::vector<int64_t>> tokens(n);
  std::vector<float> sum(n, 0.f);
  // row r's sentence ends with its hypothesis, `length` counting EOS where it has one
  auto finish = [&](int64_t r, int64_t length) {
    const double score = sum[r] / mt_search::length_penalty(length, alpha);
    out[sent[r]].push_back({std::move(tokens[r]), score, sum[r]});
  };
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
    mt_search::fill_from_the_end(keep, gone, [&](int64_t from, int64_t place) {
      model.move_sentence(from, place, 1, filled);
      sent[place] = sent[from];
      tokens[place] = std::move(tokens[from]);
      last[place] = last[from];
      sum[place] = sum[from];
    });
    B = static_cast<int64_t>(keep.size());
  };

  for (int64_t step = 0; B > 0; ++step) {
    // the sentences at their limit end as they are, without EOS
    gone.assign(B, 0);
    bool any = false;
    for (int64_t r = 0; r < B; ++r) {
      if (limits[sent[r]] > step) continue;
      if (sum[r] > -std::numeric_limits<float>::infinity()) finish(r, step);
      gone[r] = any = true;
    }
    if (any) drop(step);
    if (B == 0) break;

    // the step: embedding, every layer, the final LayerNorm, the projection
    const at::Tensor logits = model.logits(last.data(), B, B, step);
    const int64_t ban = forbid | (step < min_len ? int64_t{1} << eos : 0);
    const auto [token_t, lprob_t] = best.call(logits, model.vocab_bias(B), ban);
    const int64_t* token = token_t.const_data_ptr<int64_t>();
    const float* lprob = lprob_t.const_data_ptr<float>();

    // EOS ends a sentence (its tokens so far, EOS counted in its length); a score that is
    // not finite ends it with no hypothesis
    gone.assign(B, 0);
    any = false;
    for (int64_t r = 0; r < B; ++r) {
      sum[r] += lprob[r];
      const int64_t piece = model.piece(token[r]);
      if (piece == eos) {
        finish(r, step + 1);
        gone[r] = any = true;
      } else if (!std::isfinite(sum[r])) {
        gone[r] = any = true;
      } else {
        tokens[r].push_back(piece);
        last[r] = piece;
      }
    }
    if (any) drop(step + 1);
  }
  return mt_search::pack(out, emb.options());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mt, m) {
  m.def("greedy_search(" MT_SEARCH_MODEL_ARGS
        "int min_len, float alpha, int bos, int eos, int forbid" MT_SEARCH_SHORTLIST_ARGS);
}

TORCH_LIBRARY_IMPL(mt, CPU, m) { m.impl("greedy_search", &greedy_search); }

// oneDNN's packed weights are tensors of its own backend (as for mt::decoder_step)
TORCH_LIBRARY_IMPL(mt, MkldnnCPU, m) { m.impl("greedy_search", &greedy_search); }
