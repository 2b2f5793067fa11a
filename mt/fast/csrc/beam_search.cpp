// mt::beam_search: a batch's whole beam search in one call (mt/fast/native.py builds it;
// mt/fast/step.py's FusedStep.beam calls it, mt/decode/search.py's generate through it).
//
// The search loop of mt/decode/search.py with mt.decode.strategies.Beam, step by step the same:
// the sentences at their length limit end first (their live hypotheses finished without EOS);
// the rest are embedded, stepped (mt_step::decoder_step), normed, projected (the copy's head)
// and searched: each row's 2K best tokens (mt::top_tokens), a sentence's 2K best candidates
// among its K rows' (Beam.step_top), those ending in EOS within the top K finished, the K best
// others (EOS ones last) continuing; a sentence ends with K finished hypotheses, when none of
// its live ones can enter its n-best list any more (`settle`, the loop's _settled), or when
// none is alive. Each new hypothesis takes a row of its sentence as mt.decode.rows.rows_for
// gives it (a parent's first child its parent's row), so only the rows of the others copy
// their parent's caches; ended sentences leave as in mt.decode.rows.fill_from_the_end. The
// products see the rows the Python loop gives them, and the hypotheses are the loop's bit for
// bit. Among candidates of exactly equal score the lower index (row, then rank within it) comes
// first; torch's top-k leaves that order unspecified, so there alone (which of two equally
// scored candidates is kept) the two may part.
//
//   emb, pe, scale ... head_kind, vocab, limits   as mt::greedy_search's (greedy_search.cpp);
//                      the self-attention caches are the search's own, K rows a sentence
//   K, nbest, alpha, settle, min_len, bos, eos, forbid   the search's settings
//   vocab_bias, vocab_ids   a vocabulary shortlist, or none, as mt::greedy_search's
// Returns mt_search::pack's tensors (search.h): each sentence's hypotheses, best first, at most
// nbest, each with its summed log-probability and score, logprob / length ** alpha,
// length counting EOS where the hypothesis ended with it.

#include <torch/library.h>

#include "search.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <numeric>
#include <tuple>
#include <vector>

namespace {

using TopFn = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&,
                                                 const std::optional<at::Tensor>&, int64_t,
                                                 int64_t, int64_t);

c10::TypedOperatorHandle<TopFn> top_tokens_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mt::top_tokens", "").typed<TopFn>();
  return op;
}

// torch's order for top-k: the larger first, NaN above every number
inline bool above(float a, float b) { return a > b || (std::isnan(a) && !std::isnan(b)); }

using mt_search::Hyp;
using mt_search::length_penalty;

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> beam_search(
    const at::Tensor& emb, const at::Tensor& pe, double scale, at::TensorList params,
    at::IntArrayRef widths, at::TensorList cross_k, at::TensorList cross_v,
    const std::optional<at::Tensor>& bias, int64_t heads, bool pre_norm, double eps,
    std::string_view products, at::TensorList final_norm, at::TensorList head,
    int64_t head_width, std::string_view head_kind, int64_t vocab, at::IntArrayRef limits,
    int64_t K, int64_t nbest, double alpha, bool settle, int64_t min_len, int64_t bos,
    int64_t eos, int64_t forbid, const std::optional<at::Tensor>& vocab_bias,
    const std::optional<at::Tensor>& vocab_ids) {
  TORCH_CHECK(K >= 1 && nbest >= 1 && nbest <= K, "beam_search: nbest ", nbest,
              " must be between 1 and K ", K);
  mt_search::Decoder model("beam_search", emb, pe, scale, params, widths, cross_k, cross_v,
                           bias, heads, pre_norm, eps, products, final_norm, head, head_width,
                           head_kind, vocab, limits, K, vocab_bias, vocab_ids);
  const int64_t n = model.sentences();
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<std::vector<Hyp>> finished(n), out(n);
  const auto top = top_tokens_op();
  // the live sentences: each one's sentence, its K hypotheses' scores and tokens (row i K + k),
  // and the decoder's input rows (`width` a sentence: 1 at the first step, K after)
  std::vector<int64_t> sent(n);
  std::iota(sent.begin(), sent.end(), 0);
  std::vector<float> scores(n * K, -inf);
  for (int64_t i = 0; i < n; ++i) scores[i * K] = 0.f;
  std::vector<std::vector<int64_t>> tokens(n * K);
  std::vector<int64_t> last(n * K, bos);
  int64_t live = n, width = 1;

  auto finish_sentence = [&](int64_t i) {  // out[s]: its finished ones, best first, nbest
    std::vector<Hyp>& f = finished[sent[i]];
    std::stable_sort(f.begin(), f.end(),
                     [](const Hyp& a, const Hyp& b) { return -a.score < -b.score; });
    if (static_cast<int64_t>(f.size()) > nbest) f.resize(nbest);
    out[sent[i]] = std::move(f);
  };
  // sentences with gone[i] leave; the last kept take the places of the dropped ones below the
  // new count; `filled`: the caches' positions written so far
  std::vector<char> gone;
  auto drop = [&](int64_t filled) {
    std::vector<int64_t> keep;
    for (int64_t i = 0; i < live; ++i) {
      if (gone[i]) {
        finish_sentence(i);
      } else {
        keep.push_back(i);
      }
    }
    mt_search::fill_from_the_end(keep, gone, [&](int64_t from, int64_t place) {
      model.move_sentence(from, place, width, filled);
      sent[place] = sent[from];
      for (int64_t k = 0; k < K; ++k) {
        scores[place * K + k] = scores[from * K + k];
        tokens[place * K + k] = std::move(tokens[from * K + k]);
      }
      for (int64_t w = 0; w < width; ++w) last[place * width + w] = last[from * width + w];
    });
    live = static_cast<int64_t>(keep.size());
  };

  std::vector<float> cand;
  std::vector<int64_t> order;
  for (int64_t step = 0; live > 0; ++step) {
    // the sentences at their limit: their live hypotheses finished as they are, without EOS
    gone.assign(live, 0);
    bool any = false;
    for (int64_t i = 0; i < live; ++i) {
      if (limits[sent[i]] > step) continue;
      for (int64_t k = 0; k < K; ++k) {
        const float s = scores[i * K + k];
        if (s > -inf) {
          finished[sent[i]].push_back({tokens[i * K + k], s / length_penalty(step, alpha), s});
        }
      }
      gone[i] = any = true;
    }
    if (any) drop(step);
    if (live == 0) break;

    // the step: embedding, every layer, the final LayerNorm, the projection
    const int64_t B = live * width;
    const at::Tensor logits = model.logits(last.data(), B, live, step);
    const int64_t ban = forbid | (step < min_len ? int64_t{1} << eos : 0);
    // each row's 2K best, or as many as the columns allow (the loop's count of them)
    const int64_t kk = std::min(2 * K, vocab - __builtin_popcountll(static_cast<uint64_t>(ban)));
    const auto [lprob_t, token_t] = top.call(logits, model.vocab_bias(live), width, ban, kk);
    const float* lprob = lprob_t.const_data_ptr<float>();
    const int64_t* token = token_t.const_data_ptr<int64_t>();

    // each sentence's 2K best candidates (Beam.step_top, then Beam._choose)
    const int64_t C = K * kk, best = std::min(2 * K, C);
    std::vector<int64_t> parent(live * K), next(live * K);
    std::vector<float> score(live * K);
    std::vector<std::tuple<int64_t, int64_t, float>> done;  // (sentence, parent, score)
    for (int64_t i = 0; i < live; ++i) {
      cand.resize(C);
      for (int64_t r = 0; r < K; ++r) {
        const int64_t row = i * width + (width == 1 ? 0 : r);
        for (int64_t j = 0; j < kk; ++j) {
          cand[r * kk + j] = scores[i * K + r] + lprob[row * kk + j];
        }
      }
      order.resize(C);
      std::iota(order.begin(), order.end(), 0);
      std::partial_sort(order.begin(), order.begin() + best, order.end(),
                        [&](int64_t a, int64_t b) {
                          if (above(cand[a], cand[b])) return true;
                          if (above(cand[b], cand[a])) return false;
                          return a < b;
                        });
      auto tok_of = [&](int64_t c) {
        const int64_t r = c / kk, row = i * width + (width == 1 ? 0 : r);
        return model.piece(token[row * kk + c % kk]);
      };
      // finished: EOS within the top K, finite
      for (int64_t j = 0; j < std::min(best, K); ++j) {
        const int64_t c = order[j];
        if (tok_of(c) == eos && std::isfinite(cand[c])) done.emplace_back(i, c / kk, cand[c]);
      }
      // continuing: the K best not ending in EOS, then EOS ones (stable)
      int64_t filled = 0;
      for (int pass = 0; pass < 2 && filled < K; ++pass) {
        for (int64_t j = 0; j < best && filled < K; ++j) {
          const int64_t c = order[j];
          if ((tok_of(c) == eos) != (pass == 1)) continue;
          parent[i * K + filled] = c / kk;
          next[i * K + filled] = tok_of(c);
          score[i * K + filled] = cand[c];
          ++filled;
        }
      }
      TORCH_CHECK(filled == K, "beam_search: ", best, " candidates for ", K, " hypotheses");
    }
    const int64_t t = step + 1;  // tokens out, EOS counted
    for (const auto& [i, k, s] : done) {
      finished[sent[i]].push_back({tokens[i * K + k], s / length_penalty(t, alpha), s});
    }

    // which sentences end: K finished; none alive; settled (none of its live ones can enter
    // its n-best list: its nbest-th finished score >= the best live score / lp(limit))
    gone.assign(live, 0);
    any = false;
    for (int64_t i = 0; i < live; ++i) {
      const auto& f = finished[sent[i]];
      const int64_t count = static_cast<int64_t>(f.size());
      bool alive = false;
      float top_live = -inf;
      for (int64_t k = 0; k < K; ++k) {
        const float s = score[i * K + k];
        alive |= std::isfinite(s);
        top_live = (k == 0 || above(s, top_live)) ? s : top_live;
      }
      bool end = count >= K || !alive;
      if (!end && settle && K > 1 && count >= nbest) {
        std::vector<double> ranked;
        for (const Hyp& hyp : f) ranked.push_back(hyp.score);
        std::sort(ranked.begin(), ranked.end(), std::greater<double>());
        end = ranked[nbest - 1] >= top_live / length_penalty(limits[sent[i]], alpha);
      }
      gone[i] = end;
      any |= end;
    }

    // the new hypotheses take rows (mt.decode.rows.Rows.advance): the first step's one row a
    // sentence becomes K; after, a parent's first child keeps its row, the others take the
    // rows of childless hypotheses in order, copying their parent's caches
    std::vector<std::vector<int64_t>> new_tokens(live * K);
    std::vector<float> new_scores(live * K);
    std::vector<int64_t> new_last(live * K);
    if (width == 1) {
      for (int64_t i = live - 1; i >= 0; --i) {  // row i -> rows i K .. i K + K - 1
        for (int64_t k = K - 1; k >= 0; --k) model.move_row(i, i * K + k, t);
      }
      for (int64_t i = 0; i < live; ++i) {
        for (int64_t k = 0; k < K; ++k) {
          const int64_t row = i * K + k;
          new_tokens[row] = tokens[i * K + parent[row]];
          new_tokens[row].push_back(next[row]);
          new_scores[row] = score[row];
          new_last[row] = next[row];
        }
      }
      width = K;
    } else {
      std::vector<int64_t> place(K);
      for (int64_t i = 0; i < live; ++i) {
        const int64_t* beam = parent.data() + i * K;
        std::vector<int64_t> childless;  // rows no new hypothesis descends from, in order
        for (int64_t r = 0; r < K; ++r) {
          if (std::find(beam, beam + K, r) == beam + K) childless.push_back(r);
        }
        int64_t later = 0;
        for (int64_t j = 0; j < K; ++j) {  // a parent's first child keeps its row
          const bool first = std::find(beam, beam + j, beam[j]) == beam + j;
          place[j] = first ? beam[j] : childless[later++];
        }
        for (int64_t j = 0; j < K; ++j) {
          const int64_t row = i * K + place[j];
          if (place[j] != beam[j]) model.move_row(i * K + beam[j], row, t);
          new_tokens[row] = tokens[i * K + beam[j]];
          new_tokens[row].push_back(next[i * K + j]);
          new_scores[row] = score[i * K + j];
          new_last[row] = next[i * K + j];
        }
      }
    }
    for (int64_t r = 0; r < live * K; ++r) {
      tokens[r] = std::move(new_tokens[r]);
      scores[r] = new_scores[r];
      last[r] = new_last[r];
    }
    if (any) drop(t);
  }

  return mt_search::pack(out, emb.options());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mt, m) {
  m.def("beam_search(" MT_SEARCH_MODEL_ARGS
        "int K, int nbest, float alpha, bool settle, int min_len, int bos, int eos, "
        "int forbid" MT_SEARCH_SHORTLIST_ARGS);
}

TORCH_LIBRARY_IMPL(mt, CPU, m) { m.impl("beam_search", &beam_search); }

// oneDNN's packed weights are tensors of its own backend (as for mt::decoder_step)
TORCH_LIBRARY_IMPL(mt, MkldnnCPU, m) { m.impl("beam_search", &beam_search); }
