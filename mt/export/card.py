"""The model card of an exported model (``README.md`` in a Hugging Face directory): what a user
of the hub expects to read before using a model, written from what mt knows of the run.

From the checkpoint: the shape, parameters, vocabulary, step, and the data it was trained on
(``data_summary``, the prepared data's ``meta.json`` in brief: corpora, their sizes, the splits;
for a checkpoint written before it carried one, that ``meta.json`` found in the run's cache).
From its run directory (the checkpoint's ``checkpoints/`` parent, when it is there): the
command that trained it (``config.yaml``'s settings against the defaults), the budget, how
training stopped and the machine (``metrics.jsonl``'s end-of-training record) and the test
scores with their sacreBLEU signatures (``results.test.json``, or ``results.json``).

The hub's YAML header carries ``language``, ``license`` (``export.license``), ``datasets`` (hub
datasets only), ``metrics`` and a ``model-index`` with the scores (and a hub dataset's revision,
as the card's text names it), the fields the hub reads.
Whatever is missing is said to be unknown rather than guessed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mt.config import flatten_keys
from mt.evaluation.metrics import METRICS
from mt.evaluation.report import load_metrics, train_end
from mt.files import read_json
from mt.schema import ModelConfig

HUB_IDS = {"chrf++": "chrf"}  # the hub's metric id where it is not sacreBLEU's name


def _run_facts(checkpoint: Path) -> tuple[dict, dict, dict]:
    """The run's config.yaml, its test results and its end-of-training record ({} when
    absent)."""
    run_dir = checkpoint.resolve().parent.parent
    config: dict = {}
    try:
        import yaml

        config = yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8")) or {}
    except (OSError, ValueError):
        pass
    results = read_json(run_dir / "results.test.json") or read_json(run_dir / "results.json")
    # the last start's end-of-training record (a resumed run: over all its starts)
    trained = train_end(load_metrics(run_dir / "metrics.jsonl"))
    return config, results, dict(trained)


def _data(ckpt: dict, config: dict) -> dict:
    """The checkpoint's ``data_summary``; for an older checkpoint, one made from the
    ``meta.json`` of the prepared data its run's config.yaml names (same data and tokenizer
    settings) when that is still in the cache; {} when neither is there."""
    if ckpt.get("data_summary"):
        return dict(ckpt["data_summary"])
    data, cache = config.get("data") or {}, config.get("cache_dir")
    if not data or not cache:
        return {}
    from types import SimpleNamespace

    from mt.train.state import data_summary

    for path in sorted(Path(cache).glob(f"{data.get('name')}-*/meta.json")):
        meta = read_json(path)
        if meta.get("data") == data and meta.get("tokenizer") == config.get("tokenizer"):
            return data_summary(SimpleNamespace(meta=meta))
    return {}


def _command(config: dict) -> str:
    """``mt-train experiment=NAME`` plus the settings that differ from that experiment."""
    if not config:
        return "unknown (no config.yaml beside the checkpoint)"
    from dataclasses import asdict

    from mt.config import load_config

    name, experiment = config.get("name", ""), True
    try:
        base = asdict(load_config([f"experiment={name}"]))
    except Exception:  # not an experiment of this installation: against the defaults
        base, experiment = asdict(load_config([])), False

    now, then = flatten_keys(config), flatten_keys(base)
    skip = ("run_dir", "cache_dir", "data.dir") + (("name",) if experiment else ())
    diff = [f"{k}={now[k]}" for k in sorted(now)
            if k not in skip and not k.startswith(("translate.", "score.", "export.", "serve."))
            and then.get(k, object()) != now[k]]  # fmt: skip
    return " ".join(["mt-train", *([f"experiment={name}"] if experiment else []), *diff])


def _corpus_name(data: dict) -> str:
    """The data as a reader knows it: the hub dataset (and config) or the local folder."""
    if data.get("hf_path"):
        return data["hf_path"] + (f" ({data['hf_name']})" if data.get("hf_name") else "")
    if data.get("local_dir"):
        return f"{data.get('name')} (local files, folder {data['local_dir']})"
    return str(data.get("name") or "unknown")


def _is_multi30k(data: dict) -> bool:
    names = (data.get("name"), data.get("hf_path"), data.get("local_dir"))
    return any("multi30k" in str(n).lower() for n in names if n)


def _header(data: dict, langs: list[str], results: dict, name: str, license: str) -> str:
    """The hub's YAML metadata block."""
    import yaml

    meta: dict[str, Any] = {"language": langs or None, "license": license or "unknown",
                            "library_name": "transformers", "pipeline_tag": "translation",
                            "tags": ["translation", "marian", "mt"]}  # fmt: skip
    if data.get("hf_path"):  # a hub dataset id; local files have none
        meta["datasets"] = [data["hf_path"]]
    scores = {m: s for m, s in (results.get("scores") or {}).items()
              if isinstance(s, dict) and s.get("score") is not None}  # fmt: skip
    if scores:
        meta["metrics"] = list(dict.fromkeys(HUB_IDS.get(m, m) for m in scores))
        split = results.get("split", "test")
        pair = "-".join(langs)
        dataset = {"type": data.get("hf_path") or str(data.get("name") or "unknown"),
                   "name": f"{data.get('name') or 'unknown'} {split} split "
                           f"({(data.get('splits') or {}).get(split, split)})",
                   "split": split}  # fmt: skip
        extra = {"args": pair, "config": data.get("hf_name"), "revision": data.get("revision")}
        dataset.update({k: v for k, v in extra.items() if v})
        metrics = [{"type": HUB_IDS.get(m, m), "value": round(float(s["score"]), 2),
                    "name": METRICS.get(m, m),
                    "args": {"signature": str(s.get("signature"))}}
                   for m, s in scores.items()]  # fmt: skip
        task = {"type": "translation", "name": f"Translation {pair}" if pair else "Translation"}
        meta["model-index"] = [{"name": name, "results": [
            {"task": task, "dataset": dataset, "metrics": metrics}]}]  # fmt: skip
    meta = {k: v for k, v in meta.items() if v is not None}
    text = yaml.safe_dump(meta, sort_keys=False, allow_unicode=True, default_flow_style=False)
    return f"---\n{text}---\n"


def _data_lines(data: dict) -> list[str]:
    if not data:
        return ["Unknown: the checkpoint carries no summary of its data and its run's prepared "
                "data was not found."]  # fmt: skip
    pairs, splits = data.get("pairs") or {}, data.get("splits") or {}

    def count(n) -> str:
        return f"{int(n):,}" if isinstance(n, (int, float)) else "unknown"

    revision = f" at revision {data['revision']}" if data.get("revision") else ""
    lines = [f"From {_corpus_name(data)}{revision}, {data.get('src_lang')}→{data.get('tgt_lang')}.",
             "",
             "| part | pairs |", "|---|---|"]  # fmt: skip
    for corpus in data.get("corpora") or []:
        lines.append(f"| train: {corpus['name']} | {count(corpus['pairs'])} |")
    if not data.get("corpora"):
        lines.append(f"| train | {count(pairs.get('train'))} |")
    for role in ("valid", "test"):
        lines.append(f"| {role}: {splits.get(role, '?')} | {count(pairs.get(role))} |")
    notes = []
    if data.get("read") is not None and pairs.get("train") is not None:
        notes.append(f"{count(data['read'])} training pairs read, {count(pairs['train'])} kept "
                     "after cleaning")  # fmt: skip
    if data.get("max_train_pairs"):
        notes.append(f"at most the first {count(data['max_train_pairs'])} pairs of each "
                     "training corpus (data.max_train_pairs)")  # fmt: skip
    if notes:
        lines += ["", "; ".join(notes).capitalize() + "."]
    return lines


def _training_lines(config: dict, trained: dict, step) -> list[str]:
    lines = ["```", _command(config), "```", ""]
    if not trained:
        return lines + [f"Training step {step}; its budget and machine are unknown (no "
                        "metrics.jsonl beside the checkpoint)."]  # fmt: skip
    budget = ", ".join(f"{k}={v}" for k, v in (trained.get("budget") or {}).items() if v)
    machine = trained.get("machine") or {}
    where = ", ".join(str(x) for x in (machine.get("gpu"), machine.get("cpu")) if x)
    threads = machine.get("threads")
    lines.append(
        f"{trained.get('step')} updates in {float(trained.get('seconds') or 0) / 60:.1f} minutes "
        f"of training (stopped by {trained.get('stop')}; budget: {budget or 'none'}), precision "
        f"{trained.get('precision')}, on {machine.get('device', 'an unknown device')}"
        + (f" ({where})" if where else "")
        + (f", {threads} threads" if threads else "")
        + "."
    )
    return lines


def model_card(
    ckpt: dict, cfg: ModelConfig, checkpoint: str | Path, license: str = "unknown"
) -> str:
    """The Markdown model card (with the hub's YAML header) of checkpoint ``ckpt``;
    ``license``: the hub's license id for the header (``export.license``)."""
    config, results, trained = _run_facts(Path(checkpoint))
    data = _data(ckpt, config)
    conf_data = config.get("data", {})
    src = data.get("src_lang") or conf_data.get("src_lang")
    tgt = data.get("tgt_lang") or conf_data.get("tgt_lang")
    params = sum(v.numel() for k, v in ckpt["model"].items() if hasattr(v, "numel"))
    langs = [x for x in (src, tgt) if x]
    name = str(config.get("name") or "mt model")
    pair = f"{src}→{tgt}" if langs else "translation"
    lines = [
        f"# {name} ({pair})",
        "",
        'A Transformer of "Attention Is All You Need" trained with mt and exported as a '
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
        f"| data | {_corpus_name(data) if data else 'unknown'} |",
        f"| license | {license or 'unknown'} |",
        "",
        "## Data",
        "",
        *_data_lines(data),
        "",
        "## How it was trained",
        "",
        *_training_lines(config, trained, ckpt.get("step", "unknown")),
        "",
        "## Evaluation",
        "",
    ]
    scores = results.get("scores") or {}
    if scores:
        split = results.get("split", "test")
        named = (data.get("splits") or {}).get(split)
        lines += [f"On the `{split}` split{f' ({named})' if named else ''}, beam "
                  f"{results.get('beam_size')}, alpha {results.get('alpha')} (checkpoint step "
                  f"{results.get('step')}):", "",
                  "| metric | score | sacreBLEU signature |", "|---|---|---|"]  # fmt: skip
        lines += [f"| {m} | {s['score']:.2f} | `{s['signature']}` |" for m, s in scores.items()
                  if isinstance(s, dict) and s.get("score") is not None]  # fmt: skip
    else:
        lines += ["No results.json beside the checkpoint: not evaluated (run `mt-evaluate`)."]
    lines += ["", "## Use", "", "```python",
              "from transformers import AutoModelForSeq2SeqLM, AutoTokenizer",
              "tok = AutoTokenizer.from_pretrained(PATH)",
              "model = AutoModelForSeq2SeqLM.from_pretrained(PATH)",
              'out = model.generate(**tok(["..."], return_tensors="pt"), num_beams=5)',
              "print(tok.batch_decode(out, skip_special_tokens=True))", "```", "",
              "## Limits", ""]  # fmt: skip
    lines += [f"- {x}" for x in _limits(data)]
    return _header(data, langs, results, name, license) + "\n" + "\n".join(lines) + "\n"


def _limits(data: dict) -> list[str]:
    domain = f"Trained on {_corpus_name(data)}" if data else "Trained on the data named above"
    if _is_multi30k(data):
        domain += " (Multi30k is image captions: short, descriptive sentences)"
    return [
        f"{domain}: expect lower quality on other domains and registers.",
        "Inputs longer than the model's `max positions` tokens are cut (or refused by "
        "mt-translate).",
        "Scores are corpus BLEU/chrF with sacreBLEU on the test split named above; they are "
        "comparable only with scores of the same signature.",
    ]
