"""How often do the exported models decode exactly like mt? Counts over a test file.

    python scripts/check_export.py --checkpoint runs/x/checkpoints/best.pt \\
        --input $MT_DATA_DIR/multi30k/test_2016_flickr.de --lines 1000

Exports the checkpoint to Hugging Face and CTranslate2 (into --workdir), then decodes the lines
with mt, ``transformers`` ``generate`` and CTranslate2 ``translate_batch``: greedy and beam 4
without length penalty (expected: all equal, ties aside), and beam 4 with each library's own
length penalty at ``--alpha`` (mt: GNMT ((5+|Y|)/6)^alpha; transformers and CTranslate2:
|Y|^alpha), whose agreement is only reported. Prints one JSON object per comparison.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--input", required=True, help="source sentences, one per line")
    p.add_argument("--lines", type=int, default=1000)
    p.add_argument("--alpha", type=float, default=1.0, help="length penalty of the last rows")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--workdir", help="where the exports go (default: a temporary directory)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)

    import export_check as ec
    from transformers import AutoModelForSeq2SeqLM
    from transformers.utils import logging as hf_logging

    from mt.checkpoint import load_model
    from mt.export import export
    from mt.schema import DecodeConfig

    hf_logging.set_verbosity_error()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="mt-export-"))
    hf_dir = export(args.checkpoint, "hf", work / "hf")
    ct2_dir = export(args.checkpoint, "ctranslate2", work / "ct2")
    model, tok, _ = load_model(args.checkpoint)
    hf = AutoModelForSeq2SeqLM.from_pretrained(hf_dir).eval()
    ct2 = ec.load_ct2(ct2_dir, args.threads)
    lines = Path(args.input).read_text(encoding="utf-8").splitlines()[: args.lines]
    src = tok.encode([tok.normalize(s) for s in lines], side="src")
    sp = tok.model("src")
    vocab = {sp.id_to_piece(i): i for i in range(sp.vocab_size())}
    pieces = [[sp.id_to_piece(i) for i in ids] for ids in src]
    for beam, alpha in ((1, 0.0), (4, 0.0), (4, args.alpha)):
        cfg = DecodeConfig(beam_size=beam, alpha=alpha)
        lims = ec.limits(model, src, cfg)
        t0 = time.perf_counter()
        expected = ec.mt_ids(model, src, cfg)
        t1 = time.perf_counter()
        hf_out = ec.hf_ids(hf, src, lims, beam, alpha)
        t2 = time.perf_counter()
        ct2_out = ec.ct2_ids(ct2, pieces, lims, beam, alpha, vocab)
        t3 = time.perf_counter()
        runs = (("transformers", hf_out, t2 - t1), ("ctranslate2", ct2_out, t3 - t2))
        for name, got, secs in runs:
            agree = ec.agreement(expected, got)
            record = {"library": name, "beam": beam, "length_penalty": alpha, "same": agree.same,
                      "total": agree.total, "first_difference": agree.first_difference,
                      "seconds": round(secs, 1), "mt_seconds": round(t1 - t0, 1)}  # fmt: skip
            print(json.dumps(record), flush=True)


if __name__ == "__main__":
    sys.exit(main())
