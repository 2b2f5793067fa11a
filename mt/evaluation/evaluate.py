"""Stage 6, ``mt-evaluate``: translations scored with sacreBLEU (``mt.evaluation.metrics``).

Scores are computed on detokenized text against the raw references (sacreBLEU's defaults: BLEU
13a, chrF), each with the signature that says how it was computed.

``mt-evaluate`` has two modes:

* ``mt-evaluate hyp=FILE ref=FILE`` (``ref=[A,B]`` for several references): score a translation
  file anyone produced; prints BLEU, chrF and the signatures; ``output=FILE`` writes the JSON.
* ``mt-evaluate`` (with the usual ``experiment=``/``run_dir=``): decode ``split`` (valid | test)
  of the run's prepared data with ``checkpoint`` (default ``run_dir/checkpoints/best.pt``), write
  ``run_dir/translations/<split>.txt``, ``run_dir/results.<split>.json`` and
  ``run_dir/results.json`` (the latest split evaluated) (and ``report.md``), print
  ``BLEU = ...`` with the signature and, as the last line, the run directory.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import Any

from mt import files
from mt.evaluation.metrics import (
    METRICS,
    direction_scores,
    eval_kwargs,
    is_testset,
    score,
    testset_references,
)
from mt.schema import Config

log = logging.getLogger(__name__)


def read_lines(path: str | Path) -> list[str]:
    """The lines of a UTF-8 text file, split on ``\n`` only (a BOM or U+2028 stays in the text),
    as sacreBLEU's own command line reads them, so scores match its published ones;
    ``mt.files.TextError`` names the file and line that is not UTF-8 or holds a NUL byte."""
    with open(path, "rb") as f:
        return list(files.read_lines(f, str(path)))


def score_files(
    hyp: str | Path, ref: str | Path | list | None, langpair: str | None = None, **kwargs: Any
) -> dict[str, Any]:
    """Score a translation file against one or several reference files (:func:`score` takes
    ``kwargs``). A reference that is not a file but a sacreBLEU test-set name (``wmt14/full``)
    stands for that set's references for ``langpair`` (``de-en``) from sacreBLEU's cache."""
    refs_given = [ref] if isinstance(ref, (str, Path)) else list(ref or [])
    if not refs_given:
        raise ValueError("mt-evaluate hyp=FILE needs ref=FILE (or ref=[FILE1,FILE2])")
    ref_paths: list[str | Path] = []
    for p in refs_given:
        if not Path(p).is_file() and langpair and is_testset(str(p)):
            ref_paths.extend(testset_references(str(p), langpair))
        else:
            ref_paths.append(p)
    hyps = read_lines(hyp)
    refs = [read_lines(p) for p in ref_paths]
    for path, lines in zip(ref_paths, refs):
        if len(lines) != len(hyps):
            raise ValueError(
                f"{hyp} has {len(hyps)} lines but {path} has {len(lines)}: a translation file "
                "needs one line per reference line"
            )
    result = score(hyps, refs, **kwargs)
    result.update(hyp=str(hyp), ref=[str(p) for p in ref_paths])
    return result


def _print_scores(result: dict[str, Any]) -> None:
    out = sys.stdout
    for name, metric in result["scores"].items():
        if name == "bleu":
            out.write(f"{metric['details']}\n")
        else:
            shown = "chrF2" if name == "chrf" else METRICS[name]
            out.write(f"{shown} = {metric['score']:.2f}\n")
        out.write(f"{METRICS[name]} signature: {metric['signature']}\n")
    if "compound_split_bleu" in result:
        cs = result["compound_split_bleu"]
        out.write(f"compound-split tokenized {cs['details']} ({cs['note']})\n")
    for name, part in result.get("directions", {}).items():
        out.write(f"{name}: {_shown(part['scores'])}\n")
    out.flush()


def _shown(scores: dict[str, Any]) -> str:
    return " | ".join(f"{name} {value['score']:.2f}" for name, value in scores.items())


def evaluate_main(cfg: Config) -> dict[str, Any]:
    """``mt-evaluate``: score ``hyp=`` against ``ref=``, or decode and score a run's split;
    returns the results (what results.json / ``output=`` holds)."""
    args = cfg.eval
    if args.hyp is not None:
        langpair = f"{cfg.data.src_lang}-{cfg.data.tgt_lang}"
        result = score_files(args.hyp, args.ref, langpair, **eval_kwargs(cfg))
        _print_scores(result)
        if args.output:
            files.write_json(args.output, result)
            log.info("scores written to %s", args.output)
        return result
    return evaluate_run(cfg)


def evaluate_run(cfg: Config) -> dict[str, Any]:
    """Decode ``args.split`` with the run's checkpoint, score it and write the run's results."""
    args = cfg.eval
    import torch

    from mt.checkpoint import CheckpointError, load_model
    from mt.data.build import prepare
    from mt.decode.driver import fit_to_model, resolve_decode, translate_ids
    from mt.decode.shortlist import resolve_shortlist
    from mt.distributed import resolve_device

    if args.split not in ("valid", "test"):
        raise ValueError(f"split must be valid or test, got {args.split!r}")
    stage_start = time.perf_counter()
    run_dir = Path(cfg.run_dir)
    ckpt_path = Path(args.checkpoint) if args.checkpoint else run_dir / "checkpoints" / "best.pt"
    device = resolve_device(cfg.train.device)
    model, tokenizer, ckpt = load_model(ckpt_path, device)
    prepared = prepare(cfg)
    cfg = resolve_shortlist(cfg, tokenizer, prepared)  # decode.shortlist=train: its lexicon
    decode = resolve_decode(cfg.decode, model, device)  # decode.precision=auto: chosen here
    refs = prepared.references(args.split)
    if tokenizer.to_bytes() == prepared.tokenizer.to_bytes():
        split = prepared.split(args.split)
        src_ids = [split.src[i].tolist() for i in range(len(split))]
    else:  # the checkpoint's own vocabulary decides; the data's encoding would not fit it
        log.warning("%s has its own tokenizer, not the prepared data's: re-encoding", ckpt_path)
        src_ids = tokenizer.encode(
            [tokenizer.normalize(s) for s in prepared.sources(args.split)], side="src"
        )
    if len(src_ids) != len(refs):
        raise CheckpointError(f"{len(src_ids)} sources but {len(refs)} references")
    src_ids = fit_to_model(src_ids, model.max_positions, "truncate", what=f"{args.split} source")

    log.info(
        "decoding %d %s sentences with %s (beam %d, alpha %.2f, %s)",
        len(src_ids), args.split, ckpt_path, decode.beam_size, decode.alpha,
        decode.precision,
    )  # fmt: skip
    start = time.perf_counter()
    out_ids = translate_ids(model, src_ids, decode, device)
    seconds = time.perf_counter() - start
    hyps = tokenizer.decode(out_ids, side="tgt")

    files.write_lines(run_dir / "translations" / f"{args.split}.txt", hyps)
    kwargs = eval_kwargs(cfg)
    ranges = prepared.directions(args.split)
    if ranges:  # compound splitting is one target language's: not for a mix of them
        kwargs["compound_split_lang"] = None
    result = score(hyps, refs, **kwargs)
    if ranges:
        result["directions"] = {
            name: {"n_sentences": part["n_sentences"], "scores": part["scores"]}
            for name, part in direction_scores(hyps, refs, ranges, **kwargs).items()
        }
    shortlist = [decode.shortlist, decode.shortlist_k, decode.shortlist_frequent]
    result.update(
        split=args.split, checkpoint=str(ckpt_path), step=int(ckpt.get("step", 0)),
        beam_size=decode.beam_size, alpha=decode.alpha, max_len_a=decode.max_len_a,
        max_len_b=decode.max_len_b, precision=decode.precision,
        shortlist=decode.shortlist and shortlist, device=str(device),
        decode_seconds=round(seconds, 3), sent_per_s=round(len(src_ids) / max(seconds, 1e-9), 2),
        tgt_tok_per_s=round(sum(map(len, out_ids)) / max(seconds, 1e-9), 1),
        torch_threads=torch.get_num_threads(),
    )  # fmt: skip
    files.write_json(run_dir / f"results.{args.split}.json", result)  # each split keeps its own
    files.write_json(run_dir / "results.json", result)  # the latest evaluation (report, sweeps)
    log.info("%s on %s: %s", ckpt_path.name, args.split, _shown(result["scores"]))
    if args.report:
        from mt.evaluation.report import record_stage_time

        record_stage_time(run_dir, "evaluate", time.perf_counter() - stage_start)
        _write_report(run_dir, prepared, args.split, hyps, model, tokenizer, decode, device)
    _print_scores(result)
    sys.stdout.write(f"{run_dir}\n")
    sys.stdout.flush()
    return result


def _write_report(run_dir, prepared, split, hyps, model, tokenizer, decode_cfg, device) -> None:
    """report.md with example translations and the first sentence's attention (best effort)."""
    from mt.decode.alignment import attention_map
    from mt.evaluation.report import write_report

    sources = prepared.sources(split)
    attention = None
    try:
        if sources:
            attention = attention_map(model, tokenizer, sources[0], decode_cfg, device)
    except Exception as err:  # the report must never fail an evaluation
        log.warning("attention heatmap skipped: %s", err)
    examples = {"sources": sources, "references": prepared.references(split), "hypotheses": hyps}
    write_report(run_dir, examples=examples, attention=attention)
