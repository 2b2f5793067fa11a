"""The model card of an exported model (``README.md`` in a Hugging Face directory): what a user
of the hub expects to read before using a model, written from what mt knows of the run.

From the checkpoint: the shape, parameters, vocabulary, step. From its run directory (the
checkpoint's ``checkpoints/`` parent, when it is there): the languages, the data, the command
that trained it (``config.yaml``'s settings against the defaults) and the latest test scores with
their sacreBLEU signatures (``results.json``). Whatever is missing is said to be unknown rather
than guessed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mt.schema import ModelConfig

LIMITS = (
    "Trained on one corpus: expect lower quality on other domains and registers (Multi30k is "
    "image captions: short, descriptive sentences).",
    "Inputs longer than the model's `max_positions` tokens are cut (or refused by mt-translate).",
    "Scores are corpus BLEU/chrF with sacreBLEU on the test split named below; they are not "
    "comparable with scores computed with other tokenizations.",
)


def _run_facts(checkpoint: Path) -> tuple[dict, dict]:
    """The run's config.yaml and results.json as dicts ({} when absent)."""
    run_dir = checkpoint.resolve().parent.parent
    config, results = {}, {}
    try:
        import yaml

        config = yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8")) or {}
    except (OSError, ValueError):
        pass
    try:
        results = json.loads((run_dir / "results.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        pass
    return config, results


def _command(config: dict) -> str:
    """``mt-train experiment=NAME`` plus the settings that differ from that experiment."""
    if not config:
        return "unknown (no config.yaml beside the checkpoint)"
    from dataclasses import asdict

    from mt.config import load_config

    name = config.get("name", "")
    try:
        base = asdict(load_config([f"experiment={name}"]))
    except Exception:  # an experiment this installation does not have
        base = {}

    def flat(d: Any, prefix: str = "") -> dict:
        if not isinstance(d, dict):
            return {prefix[:-1]: d}
        out: dict = {}
        for k, v in d.items():
            out.update(flat(v, f"{prefix}{k}."))
        return out

    now, then = flat(config), flat(base)
    skip = ("run_dir", "cache_dir", "name", "data.dir")
    diff = [f"{k}={now[k]}" for k in sorted(now)
            if k not in skip and not k.startswith(("translate.", "score.", "export.", "serve."))
            and then.get(k, object()) != now[k]]  # fmt: skip
    return " ".join([f"mt-train experiment={name}", *diff]) if name else " ".join(diff)


def model_card(ckpt: dict, cfg: ModelConfig, checkpoint: str | Path) -> str:
    """The Markdown model card (with the hub's YAML header) of checkpoint ``ckpt``."""
    config, results = _run_facts(Path(checkpoint))
    data = config.get("data", {})
    src, tgt = data.get("src_lang"), data.get("tgt_lang")
    params = sum(v.numel() for k, v in ckpt["model"].items() if hasattr(v, "numel"))
    langs = [x for x in (src, tgt) if x]
    header = ["---", "library_name: transformers", "pipeline_tag: translation", "tags:",
              "- translation", "- marian", "- mt"]  # fmt: skip
    if langs:
        header += ["language:"] + [f"- {x}" for x in langs]
    header += ["---", ""]
    pair = f"{src}→{tgt}" if langs else "translation"
    splits = data.get("splits", {})
    lines = [
        f"# {config.get('name', 'mt model')} ({pair})",
        "",
        "A Transformer of \"Attention Is All You Need\" trained with mt and exported as a "
        "`MarianMTModel` that computes mt's logits exactly (token-identical greedy and beam "
        "outputs).",
        "",
        "| | |",
        "|---|---|",
        f"| languages | {', '.join(langs) or 'unknown'} |",
        f"| parameters | {params:,} |",
        f"| shape | N={cfg.N}, d_model={cfg.d_model}, d_ff={cfg.d_ff}, h={cfg.h}, "
        f"{cfg.norm}-LN, shared embeddings={cfg.share_embeddings} |",
        f"| vocabulary | {int(ckpt['vocab_size']):,} joint SentencePiece pieces |",
        f"| max positions | {cfg.max_positions} |",
        f"| training step | {ckpt.get('step', 'unknown')} |",
        f"| data | {data.get('name', 'unknown')} (train: {splits.get('train', '?')}, valid: "
        f"{splits.get('valid', '?')}, test: {splits.get('test', '?')}) |",
        "",
        "## How it was trained",
        "",
        "```",
        _command(config),
        "```",
        "",
        "## Evaluation",
        "",
    ]
    scores = results.get("scores") or {}
    if scores:
        lines += [f"On the `{results.get('split', 'test')}` split, beam {results.get('beam_size')}"
                  f", alpha {results.get('alpha')} (checkpoint step {results.get('step')}):", "",
                  "| metric | score | sacreBLEU signature |", "|---|---|---|"]  # fmt: skip
        lines += [f"| {m} | {s['score']:.2f} | `{s['signature']}` |" for m, s in scores.items()]
    else:
        lines += ["No results.json beside the checkpoint: not evaluated (run `mt-evaluate`)."]
    lines += ["", "## Use", "", "```python",
              "from transformers import AutoModelForSeq2SeqLM, AutoTokenizer",
              "tok = AutoTokenizer.from_pretrained(PATH)",
              "model = AutoModelForSeq2SeqLM.from_pretrained(PATH)",
              'out = model.generate(**tok(["..."], return_tensors="pt"), num_beams=5)',
              "print(tok.batch_decode(out, skip_special_tokens=True))", "```", "",
              "## Limits", ""]  # fmt: skip
    lines += [f"- {x}" for x in LIMITS]
    return "\n".join(header + lines) + "\n"
