"""``mt-export checkpoint=PATH format=hf|ctranslate2 output=DIR``: a trained model leaves mt.

* ``hf``: a directory that Hugging Face ``transformers`` loads offline as a ``MarianMTModel``
  and a ``MarianTokenizer`` (``AutoModelForSeq2SeqLM`` / ``AutoTokenizer``), computing mt's
  function exactly (see :mod:`mt.export.hf`), with a model card (``README.md``: languages,
  parameters, data, the training command, test scores with signatures, limits;
  :mod:`mt.export.card`), ready to publish as it is.
* ``ctranslate2``: a CTranslate2 model directory built through CTranslate2's own converter API,
  with the SentencePiece model beside it (see :mod:`mt.export.ct2`).

Both need the optional extra ``pip install mt[export]``. A checkpoint that uses a setting the
target cannot express is refused with a message naming the setting.
"""

from __future__ import annotations

import logging
from pathlib import Path

from mt.checkpoint import CheckpointError, load_checkpoint, model_cfg_from, tokenizer_blobs
from mt.export.card import model_card
from mt.export.ct2 import export_ct2
from mt.export.hf import ExportError, export_hf
from mt.files import write_text
from mt.schema import Config

log = logging.getLogger(__name__)

FORMATS = ("hf", "ctranslate2")


def export(checkpoint: str | Path, fmt: str, output: str | Path) -> Path:
    """Export an mt checkpoint to ``output`` in format ``fmt`` (``hf`` or ``ctranslate2``).

    Raises:
        ExportError: an unknown format, or a setting the target cannot express.
        CheckpointError: an unreadable checkpoint.
    """
    if fmt not in FORMATS:
        raise ExportError(f"format={fmt}: expected one of {', '.join(FORMATS)}")
    ckpt = load_checkpoint(checkpoint, map_location="cpu")
    cfg = model_cfg_from(ckpt)
    blobs = tokenizer_blobs(ckpt)
    out = Path(output)
    if out.exists() and any(out.iterdir()):
        raise ExportError(f"output={out} exists and is not empty; choose a new directory")
    if fmt == "hf":
        export_hf(ckpt, cfg, blobs, out)
        write_text(out / "README.md", model_card(ckpt, cfg, checkpoint))  # ready to publish
    else:
        export_ct2(ckpt, cfg, blobs, out)
    log.info("%s (step %s) exported as %s to %s", checkpoint, ckpt.get("step"), fmt, out)
    return out


def export_main(cfg: Config) -> None:
    """``mt-export``: exits with a one-line error for a missing setting or an unexportable model."""
    args = cfg.export
    if not args.checkpoint or not args.output or not args.format:
        raise SystemExit("mt-export: checkpoint=PATH format=hf|ctranslate2 output=DIR are needed")
    try:
        out = export(args.checkpoint, args.format, args.output)
    except (ExportError, CheckpointError) as err:
        raise SystemExit(f"mt-export: {err}") from None
    print(out)
