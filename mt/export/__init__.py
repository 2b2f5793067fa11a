"""``mt-export checkpoint=PATH format=hf|ctranslate2 output=DIR``: a trained model leaves mt.

* ``hf``: a directory that Hugging Face ``transformers`` loads offline as a ``MarianMTModel``
  and a ``MarianTokenizer``, computing mt's function exactly (:mod:`mt.export.hf`), with a
  model card ready to publish (``README.md``, :mod:`mt.export.card`).
* ``ctranslate2``: a CTranslate2 model directory with the SentencePiece model beside it
  (:mod:`mt.export.ct2`); with ``export.shortlist=LEXICON`` also CTranslate2's vocabulary map,
  the lists of ``decode.shortlist`` (:mod:`mt.decode.shortlist`).

Both need the optional extra ``pip install mt[export]``. A checkpoint that uses a setting the
target cannot express is refused with a message naming the setting.
"""

from __future__ import annotations

import logging
from functools import partial
from pathlib import Path

from mt.checkpoint import CheckpointError, load_checkpoint, model_cfg_from, tokenizer_blobs
from mt.decode.shortlist import load_lexicon, vocabulary_map
from mt.export.card import model_card
from mt.export.ct2 import export_ct2
from mt.export.hf import ExportError, export_hf
from mt.files import write_text
from mt.schema import Config, DecodeConfig

log = logging.getLogger(__name__)

FORMATS = ("hf", "ctranslate2")


def export(
    checkpoint: str | Path,
    fmt: str,
    output: str | Path,
    shortlist: str | Path | None = None,
    shortlist_k: int = DecodeConfig.shortlist_k,
    shortlist_frequent: int = DecodeConfig.shortlist_frequent,
    license: str = "unknown",
) -> Path:
    """Export an mt checkpoint to ``output`` in format ``fmt`` (``hf`` or ``ctranslate2``);
    ``shortlist`` (a lexicon file, ``mt.decode.shortlist``): CTranslate2's vocabulary map too;
    ``license``: the hub license id of the ``hf`` model card (``export.license``).
    ExportError: an unknown format, a setting the target cannot express, a shortlist for ``hf``
    or one that does not fit the model; CheckpointError: an unreadable checkpoint.
    """
    if fmt not in FORMATS:
        raise ExportError(f"format={fmt}: expected one of {', '.join(FORMATS)}")
    if shortlist is not None and fmt != "ctranslate2":
        raise ExportError(f"export.shortlist={shortlist}: only format=ctranslate2 has a "
                          "vocabulary map")  # fmt: skip
    ckpt = load_checkpoint(checkpoint, map_location="cpu")
    cfg = model_cfg_from(ckpt)
    blobs = tokenizer_blobs(ckpt)
    out = Path(output)
    if out.exists() and any(out.iterdir()):
        raise ExportError(f"output={out} exists and is not empty; choose a new directory")
    if fmt == "hf":
        export_hf(ckpt, cfg, blobs, out)
        write_text(out / "README.md", model_card(ckpt, cfg, checkpoint, license))  # to publish
    else:
        vmap = None
        if shortlist is not None:
            try:
                lexicon = load_lexicon(shortlist, int(ckpt["vocab_size"]))
            except ValueError as err:
                message = str(err).replace("decode.shortlist", "export.shortlist")
                raise ExportError(message) from None
            vmap = partial(vocabulary_map, lexicon, k=shortlist_k, frequent=shortlist_frequent)
        export_ct2(ckpt, cfg, blobs, out, vmap)
    log.info("%s (step %s) exported as %s to %s", checkpoint, ckpt.get("step"), fmt, out)
    return out


def export_main(cfg: Config) -> None:
    """``mt-export``: exits with a one-line error for a missing setting or an unexportable model."""
    args = cfg.export
    if not args.checkpoint or not args.output or not args.format:
        raise SystemExit("mt-export: checkpoint=PATH format=hf|ctranslate2 output=DIR are needed")
    try:
        out = export(args.checkpoint, args.format, args.output, args.shortlist,
                     cfg.decode.shortlist_k, cfg.decode.shortlist_frequent,
                     args.license)  # fmt: skip
    except (ExportError, CheckpointError) as err:
        raise SystemExit(f"mt-export: {err}") from None
    print(out)
