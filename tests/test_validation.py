"""Validation shared by the ranks of a DDP job equals validation in one process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_distributed import _free_port
from test_train import TINY

from mt.config import load_config
from mt.data.build import prepare
from mt.model.transformer import build_model
from mt.train.validation import valid_hypotheses, validate

ROOT = Path(__file__).resolve().parents[1]
OVERRIDES = [*TINY, "train.eval_bleu=true", "train.eval_max_sentences=25", "train.max_tokens=200"]
# Each rank: the same seeded model, validated with the work shared over the ranks.
RANK_SCRIPT = """
import json, sys
import torch
from mt import distributed
from mt.config import load_config
from mt.data.build import prepare
from test_validation import model_for
from mt.train.validation import valid_hypotheses, validate

torch.set_num_threads(1)
cfg = load_config(sys.argv[2:])
info = distributed.setup("cpu")
prepared = prepare(cfg)
model = model_for(cfg, prepared.vocab_size)
out = {
    "result": validate(model, prepared, cfg, info.device, info.rank, info.world_size),
    "hyps": valid_hypotheses(model, prepared, cfg, info.device, info.rank, info.world_size),
}
with open(f"{sys.argv[1]}/rank{info.rank}.json", "w") as f:
    json.dump(out, f)
distributed.cleanup()
"""


def model_for(cfg, vocab_size: int) -> torch.nn.Module:
    """A seeded random model with sharp distributions (varied greedy outputs, some short)."""
    torch.manual_seed(0)
    model = build_model(cfg.model, vocab_size)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(2.0)
    return model


@pytest.mark.slow
def test_two_ranks_validate_like_one(real_data, tmp_path, monkeypatch):
    """2 gloo ranks (each loss over half of the batches, one zero-weight filler when the count
    is odd; each decoding every other sentence) give the single-process loss, NLL, the same
    translations in the same order and the same BLEU."""
    monkeypatch.setenv("MT_DATA_DIR", str(real_data))
    cfg = load_config([*OVERRIDES, f"run_dir={tmp_path / 'run'}"])
    prepared = prepare(cfg)  # builds the cache the ranks then read
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = model_for(cfg, prepared.vocab_size)
        single = validate(model, prepared, cfg, torch.device("cpu"))
        hyps = valid_hypotheses(model, prepared, cfg, torch.device("cpu"))
    finally:
        torch.set_num_threads(threads)
    assert len(hyps) == 25 and len(set(hyps)) > 5  # varied output: the order is checked

    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'tests'}")
    launch = ["--nproc_per_node=2", f"--master_port={_free_port()}"]
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", *launch, str(script), str(tmp_path),
         *OVERRIDES, f"run_dir={tmp_path / 'run'}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["hyps"] == hyps
        assert got["result"]["valid_bleu"] == single["valid_bleu"]
        for key in ("valid_loss", "valid_nll", "valid_ppl"):
            assert got["result"][key] == pytest.approx(single[key], rel=1e-12), key


def test_valid_bleu_uses_the_configured_bleu_tokenizer(real_data, tmp_path, monkeypatch):
    """train.eval_bleu scores as mt-evaluate would: with eval.bleu_tokenize (here 'char',
    computed again by sacreBLEU itself), not always with 13a."""
    import sacrebleu

    from mt.train.validation import valid_scores

    monkeypatch.setenv("MT_DATA_DIR", str(real_data))
    cfg = load_config([*OVERRIDES, f"run_dir={tmp_path / 'run'}", "eval.bleu_tokenize=char"])
    prepared = prepare(cfg)
    model = model_for(cfg, prepared.vocab_size)
    hyps = valid_hypotheses(model, prepared, cfg, torch.device("cpu"))
    refs = prepared.references("valid")[: len(hyps)]
    got = valid_scores(model, prepared, cfg, torch.device("cpu"))["valid_bleu"]
    assert got == pytest.approx(sacrebleu.corpus_bleu(hyps, [refs], tokenize="char").score)
    assert got != pytest.approx(sacrebleu.corpus_bleu(hyps, [refs]).score)


def test_validation_decodes_in_the_training_thread(real_data, tmp_path, monkeypatch):
    """Validation decodes one batch at a time in the calling thread whatever decode.workers
    says: worker threads would hold freed memory of their own in a training process."""
    import threading

    import mt.decode.driver

    monkeypatch.setenv("MT_DATA_DIR", str(real_data))
    cfg = load_config([*OVERRIDES, f"run_dir={tmp_path / 'run'}", "decode.workers=2",
                       "decode.batch_size=2"])  # fmt: skip
    prepared = prepare(cfg)
    model = model_for(cfg, prepared.vocab_size)
    threads, real = set(), mt.decode.driver.search

    def spy(*args, **kwargs):
        threads.add(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(mt.decode.driver, "search", spy)
    assert valid_hypotheses(model, prepared, cfg, torch.device("cpu"))
    assert threads == {threading.current_thread().name}


def test_validation_leaves_the_training_random_stream_alone(real_data, tmp_path, monkeypatch):
    """Validating draws nothing from torch's global generator, also the first time in a process
    (when oneDNN's one-off check runs): the dropout masks after a validation are the same
    whether that check ran earlier or here, so a run's result does not depend on what its
    machine had cached."""
    from mt.fast import onednn, probe

    monkeypatch.setenv("MT_DATA_DIR", str(real_data))
    cfg = load_config([*OVERRIDES, f"run_dir={tmp_path / 'run'}"])
    prepared = prepare(cfg)
    model = model_for(cfg, prepared.vocab_size)
    monkeypatch.setenv("MT_CACHE_DIR", str(tmp_path / "probes"))  # the probes run here
    monkeypatch.setattr(probe, "_DECIDED", {})
    onednn.onednn_available.cache_clear()
    torch.manual_seed(123)
    before = torch.get_rng_state()
    validate(model, prepared, cfg, torch.device("cpu"))
    assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_validation_decodes_the_model_as_written(real_data, tmp_path, monkeypatch, precision):
    """Validation on a CPU greedily decodes the model as written, in decode.precision, and
    measures nothing (no speed probe): its translations are those of greedy search on the
    model itself, batch by batch as the driver forms them."""
    from mt.data.batches import make_src
    from mt.decode.driver import make_batches
    from mt.decode.search import greedy_search
    from mt.fast import probe

    monkeypatch.setenv("MT_DATA_DIR", str(real_data))
    cfg = load_config([*OVERRIDES, f"run_dir={tmp_path / 'run'}", "train.eval_max_sentences=25",
                       f"decode.precision={precision}"])  # fmt: skip
    prepared = prepare(cfg)
    model = model_for(cfg, prepared.vocab_size).eval()
    split = prepared.split("valid")
    src = [split.src[i].tolist() for i in range(25)]
    want: list = [None] * len(src)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    for batch in make_batches([len(s) for s in src], cfg.decode.batch_size, cfg.decode.max_tokens):
        with torch.autocast("cpu", dtype=dtype, enabled=precision == "bf16"):
            hyps = greedy_search(model, make_src([src[i] for i in batch]), cfg.decode.max_len_a,
                                 cfg.decode.max_len_b)  # fmt: skip
        for i, h in zip(batch, hyps):
            want[i] = h.tokens

    def refuse(*args, **kwargs):
        raise AssertionError("a speed probe in validation")

    monkeypatch.setattr(probe, "choose", refuse)
    got = valid_hypotheses(model, prepared, cfg, torch.device("cpu"))
    assert got == prepared.tokenizer.decode(want, side="tgt")
