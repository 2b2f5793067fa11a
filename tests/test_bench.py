"""scripts/bench.py: each subcommand runs at a tiny shape and prints well-formed JSON records.

No timing assertions: speed is measured by running the benchmark, never by a test. The records'
bookkeeping (token counts, FLOPs) is checked against independent computations.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "scripts" / "bench.py"
TINY = ["--d-model", "16", "--layers", "1", "--heads", "2", "--d-ff", "32", "--vocab", "64"]


def run_bench(args: list[str], tmp_path: Path) -> tuple[list[dict], str]:
    """Run bench.py in a subprocess; returns (JSON records on stdout, the whole stdout)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(BENCH), *args, "--threads", "1", "--device", "cpu"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return records, proc.stdout


def test_train_random_batches_with_baseline(tmp_path):
    out = tmp_path / "bench.jsonl"
    args = ["train", *TINY, "--batch-size", "3", "--min-len", "2", "--max-len", "5"]
    args += ["--steps", "2", "--warmup-steps", "1", "--baseline", "torch", "--output", str(out)]
    args += ["--peak-tflops", "1.0"]
    records, stdout = run_bench(args, tmp_path)
    assert [r["impl"] for r in records] == ["mt", "torch"]
    for r in records:
        assert r["bench"] == "train"
        assert (r["d_model"], r["layers"], r["heads"], r["d_ff"], r["vocab"]) == (16, 1, 2, 32, 64)
        assert r["tgt_tok_per_s"] > 0 and math.isfinite(r["tgt_tok_per_s"])
        assert r["peak_mem_mb"] > 0 and r["peak_mem_kind"] == "max_rss"
        assert r["precision"] == "fp32" and r["compile"] is False and r["threads"] == 1
        assert "flops_formula" in r and r["peak_tflops"] == 1.0
        # MFU is achieved FLOP/s over the given peak (1 TFLOP/s).
        assert r["mfu"] == pytest.approx(r["tgt_tok_per_s"] * r["flops_per_tgt_tok"] / 1e12)
        assert math.isfinite(r["first_loss"]) and r["ratio_mt_over_torch"] > 0
        # Target tokens per step: 3 pairs of 2..5 tokens, +EOS each.
        assert 3 * 3 <= r["tgt_tokens_per_step"] <= 3 * 6
    # The JSONL file holds the same records; the table closes stdout.
    assert [json.loads(line) for line in out.read_text().splitlines()] == records
    assert "tgt tok/s" in stdout.splitlines()[-1]


def test_the_compiled_benchmark_compiles_as_training_does(monkeypatch):
    """``bench train --compile`` compiles the step as ``mt.train`` does (``compile_model``:
    dynamic shapes from the first batch). With a plain ``torch.compile`` the first graph was
    specialised to the first batch's shape and recompiled at the second: 180 s of compiling
    and a mean of 10k tok/s against a median of 43k on an H200."""
    sys.path.insert(0, str(REPO / "scripts"))
    import torch
    from bench import build_parser
    from bench_train import Runner

    from mt.fast import for_training
    from mt.model.transformer import build_model
    from mt.schema import ModelConfig

    seen = []
    monkeypatch.setattr(torch, "compile", lambda model, **kw: seen.append(kw) or model)
    args = build_parser().parse_args(["train", *TINY, "--compile"])
    cfg = ModelConfig(N=1, d_model=8, d_ff=16, h=2)
    model = build_model(cfg, 40)
    step = for_training(model, torch.device("cpu"), compiled=True)
    assert step.model is model  # on a CPU, compiled: the model as written, not the kernels' copy
    Runner("mt", step, args, cfg, torch.device("cpu"))
    assert seen == [{"dynamic": True}]
    # and its batches are collated as compiled training's (one graph whatever the padding)
    import argparse

    from bench_common import random_batches

    even = {"batch_size": 3, "min_len": 5, "max_len": 5, "vocab": 40, "seed": 0}  # no padding
    (compiled,) = random_batches(argparse.Namespace(**even, compile=True), 1)
    (eager,) = random_batches(argparse.Namespace(**even, compile=False), 1)
    assert compiled.real.src.tolist() == list(range(18)) and eager.real.src is None


def test_train_flops_formula_matches_hand_count():
    """batch_flops against a hand count for a two-sentence batch of a 1-layer model."""
    sys.path.insert(0, str(REPO / "scripts"))
    import torch
    from bench_train import batch_flops, mt_stack_params

    from mt.model.transformer import build_model
    from mt.schema import ModelConfig
    from mt.vocab import EOS, PAD

    cfg = ModelConfig(N=1, d_model=8, d_ff=16, h=2)
    model = build_model(cfg, 40)
    p_enc, p_dec = mt_stack_params(model)
    # Encoder layer: qkv 8*24+24, out 8*8+8, ffn 8*16+16 + 16*8+8, 2 LayerNorms 2*16.
    assert p_enc == (8 * 24 + 24) + (64 + 8) + (128 + 16) + (128 + 8) + 2 * 16
    # Decoder layer adds cross-attention (q 72, kv 8*16+16, out 72) and a third LayerNorm.
    assert p_dec == p_enc + 72 + (128 + 16) + 72 + 16

    class B:
        src = torch.tensor([[5, 6, EOS], [7, EOS, PAD]])  # S = 3, 2
        tgt_out = torch.tensor([[5, EOS], [EOS, PAD]])  # T = 2, 1

    expected = 6 * (p_enc * 5 + (p_dec + 8 * 40) * 3)
    expected += 12 * 8 * ((9 + 4) + (4 + 2 * 3) + (1 + 1 * 2))
    assert batch_flops(B, p_enc, p_dec, cfg, 40) == pytest.approx(expected)


def test_data_synthetic(tmp_path):
    args = ["data", "--sentences", "300", "--min-len", "2", "--max-len", "9", "--vocab", "50"]
    args += ["--max-tokens", "64"]
    (r,), _ = run_bench(args, tmp_path)
    assert r["bench"] == "data" and r["pairs"] == 300 and r["batches"] > 0
    assert r["batches_per_s"] > 0 and r["tok_per_s"] > 0 and r["src_tok_per_s"] > 0
    assert 0 <= r["padding_fraction"] < 1


def test_decode_forced_length(tmp_path):
    args = ["decode", *TINY, "--batch-size", "3", "--batches", "1", "--src-len", "4"]
    args += ["--gen-len", "5", "--beam", "2", "--warmup-steps", "0", "--profile"]
    records, _ = run_bench(args, tmp_path)
    assert [(r["search"], r["beam"]) for r in records] == [("greedy", 1), ("beam", 2)]
    for r in records:
        assert r["bench"] == "decode" and r["forced_length"] is True
        assert r["mean_out_len"] == 5  # EOS suppressed until --gen-len, then the length cap
        assert r["sent_per_s"] > 0 and r["tok_per_s"] == pytest.approx(5 * r["sent_per_s"])
        prof = r["profile_ms"]  # every kind present; they add up to the profiled wall time
        assert prof["products"] > 0 and prof["vocab_softmax"] > 0 and prof["attention"] > 0
        parts = sum(v for k, v in prof.items() if k != "wall_ms")
        assert parts == pytest.approx(prof["wall_ms"], abs=0.01) or prof["python"] == 0


def _tiny_checkpoint(tmp_path: Path):
    """A tiny untrained checkpoint (m.pt) with its SentencePiece model; returns the tokenizer."""
    import random

    import torch

    from mt.checkpoint import model_state, save_checkpoint
    from mt.data.tokenizer import Tokenizer
    from mt.model.transformer import build_model
    from mt.schema import ModelConfig, TokenizerConfig

    rng = random.Random(0)
    words = "ein mann hund fährt rennt im schnee auf dem fahrrad a man dog runs in the snow".split()
    text = "".join(" ".join(rng.choices(words, k=6)) + "\n" for _ in range(200))
    (tmp_path / "t.de").write_text(text)
    (tmp_path / "t.en").write_text(text)
    cfg = TokenizerConfig(vocab_size=60, threads=1, byte_fallback=False)
    tokenizer = Tokenizer.train(tmp_path / "t.de", tmp_path / "t.en", tmp_path / "spm", cfg)
    torch.manual_seed(0)
    mcfg = ModelConfig(N=1, d_model=16, d_ff=32, h=2, max_positions=128)
    model = build_model(mcfg, tokenizer.vocab_size)
    state = model_state(model, mcfg, tokenizer, tokenizer.vocab_size)
    save_checkpoint(tmp_path / "m.pt", {**state, "step": 1, "epoch": 0})
    return tokenizer


def test_decode_checkpoint_real_sentences(tmp_path):
    """--checkpoint --input: a (tiny, untrained) checkpoint decodes real lines, lengths free."""
    tokenizer = _tiny_checkpoint(tmp_path)
    lines = ["ein mann im schnee", "der hund rennt", "", "auf dem fahrrad"]
    (tmp_path / "in.txt").write_text("".join(line + "\n" for line in lines))
    longest = max(len(ids) for ids in tokenizer.encode(lines, side="src"))
    args = ["decode", "--checkpoint", str(tmp_path / "m.pt"), "--input", str(tmp_path / "in.txt")]
    args += ["--batch-size", "2", "--batches", "2", "--beam", "2", "--warmup-steps", "0"]
    records, _ = run_bench(args, tmp_path)
    assert [r["search"] for r in records] == ["greedy", "beam"]
    for r in records:
        assert r["forced_length"] is False and r["gen_len"] is None
        assert (r["d_model"], r["layers"], r["vocab"]) == (16, 1, tokenizer.vocab_size)
        assert r["batches"] == 2 and r["sent_per_s"] > 0
        # Output length is at most max_len_a * src_len + max_len_b (DecodeConfig defaults).
        assert 0 <= r["mean_out_len"] <= 1.0 * longest + 50


def test_translate_compares_mt_and_ctranslate2_on_one_export(tmp_path):
    """translate: each setting in its own process, medians over alternating rounds, outputs
    compared with the first setting's; mt's default engine and the direct CTranslate2 call
    decode the same converted model to the same ids; the first call's conversion is timed
    on its own."""
    pytest.importorskip("ctranslate2")
    _tiny_checkpoint(tmp_path)
    import torch

    from mt.decode.shortlist import Lexicon

    V = int(torch.load(tmp_path / "m.pt", weights_only=True)["vocab_size"])
    every = Lexicon(torch.zeros(V + 1, dtype=torch.long), torch.zeros(0, dtype=torch.long),
                    torch.zeros(0), torch.arange(V))  # a shortlist of every piece  # fmt: skip
    every.save(tmp_path / "lexicon.pt")
    lines = ["ein mann im schnee", "der hund rennt", "auf dem fahrrad", "ein hund im schnee"]
    (tmp_path / "in.txt").write_text("".join(line + "\n" for line in lines * 3))
    args = ["translate", "--checkpoint", str(tmp_path / "m.pt"), "--input",
            str(tmp_path / "in.txt"), "--beams", "1", "--rounds", "2", "--batch-size", "5",
            "--max-len", "12", "--settings", "mt:torch", "mt:default", "ct2:float32+vmap",
            "--workdir", str(tmp_path / "w"),
            "--inter-threads", "2", "--shortlist", str(tmp_path / "lexicon.pt"),
            "--shortlist-frequent", str(V)]  # fmt: skip
    records, out = run_bench(args, tmp_path)
    conversions = [r for r in records if r["impl"].startswith("conversion")]
    assert [r["impl"] for r in conversions] == ["conversion float32"]
    assert conversions[0]["seconds"] > 0
    decoded = [r for r in records if not r["impl"].startswith("conversion")]
    settings = ["mt default", "mt torch", "ct2 float32+vmap"]
    assert [r["impl"] for r in decoded] == settings
    for r in decoded:
        assert r["sentences"] == 12 and len(r["seconds"]) == 2 and r["peak_rss_mb"] > 0
        median = sum(r["seconds"]) / 2
        assert r["sent_per_s"] == pytest.approx(12 / median, rel=0.01)
        assert r["inter_threads"] == 2
        # a shortlist of every piece, and CTranslate2 and torch on one model: the same ids
        assert r["identical_to_mt:default"] == 12, r["impl"]
    assert (tmp_path / "m.pt.ct2").is_dir() and "sent/s" in out


@pytest.fixture(scope="module")
def prepared_dir(tmp_path_factory) -> Path:
    """A prepared cache of a tiny local corpus (what mt-prepare writes)."""
    from mt.config import load_config
    from mt.data.build import prepare

    tmp = tmp_path_factory.mktemp("prepared")
    corpus = tmp / "corpus"
    corpus.mkdir()
    lines = {
        "de": [f"satz {i} mit {'vielen ' * (i % 7)}wörtern" for i in range(120)],
        "en": [f"sentence {i} with {'many ' * (i % 5)}words" for i in range(120)],
    }
    for split, part in (
        ("train", slice(0, 100)),
        ("valid", slice(100, 110)),
        ("test", slice(110, 120)),
    ):
        for lang, text in lines.items():
            (corpus / f"{split}.{lang}").write_text("".join(s + "\n" for s in text[part]))
    overrides = ["data=local", f"data.dir={corpus}", f"cache_dir={tmp / 'cache'}"]
    overrides += ["tokenizer.vocab_size=60", "tokenizer.threads=1", "tokenizer.byte_fallback=false"]
    return prepare(load_config(overrides)).dir


def test_data_and_train_from_prepared_split(prepared_dir, tmp_path):
    from mt.data.store import Prepared

    split = Prepared(prepared_dir).split("train")
    (r,), _ = run_bench(
        ["data", "--data", f"{prepared_dir}/train", "--max-tokens", "200"], tmp_path
    )
    assert r["pairs"] == len(split) == 100 and r["batches"] > 1
    assert r["source"] == f"{prepared_dir}/train"
    args = ["train", *TINY]  # --vocab 64 is replaced by the prepared tokenizer's
    args += ["--data", f"{prepared_dir}/train", "--max-tokens", "200", "--steps", "2"]
    args += ["--warmup-steps", "1"]
    (r,), _ = run_bench(args, tmp_path)
    assert r["bench"] == "train" and r["max_tokens"] == 200 and r["batch_size"] is None
    assert r["vocab"] == Prepared(prepared_dir).vocab_size != 64
    # Each batch holds at most max_tokens padded target tokens.
    assert 0 < r["tgt_tokens_per_step"] <= 200 and r["pad_multiple"] == 1


def test_benchmark_batches_padded_to_a_multiple(prepared_dir, tmp_path):
    """``--pad-multiple`` (gpu-check's ``base-pad8``) pads the benchmark's batches as
    ``train.pad_multiple`` pads training's: the same sentences, lengths rounded up."""
    sys.path.insert(0, str(REPO / "scripts"))
    from bench_data import load_prepared, real_batches

    _, split = load_prepared(f"{prepared_dir}/train")
    plain = real_batches(split, "x", 200, 6, seed=3)
    padded = real_batches(split, "x", 200, 6, seed=3, pad_multiple=8)
    for a, b in zip(plain, padded, strict=True):
        assert b.src.shape[1] % 8 == 0 and b.tgt_in.shape[1] % 8 == 0
        assert b.src.shape[1] - a.src.shape[1] < 8 and b.tgt_in.shape[1] - a.tgt_in.shape[1] < 8
        assert b.ntokens == a.ntokens
        width = a.src.shape[1]
        assert (b.src[:, :width] == a.src).all() and (b.src[:, width:] == 0).all()
    args = ["train", *TINY, "--data", f"{prepared_dir}/train", "--max-tokens", "200", "--steps",
            "1", "--warmup-steps", "1", "--pad-multiple", "8"]  # fmt: skip
    (r,), _ = run_bench(args, tmp_path)
    assert r["pad_multiple"] == 8 and r["tgt_tokens_per_step"] > 0


@pytest.mark.slow
def test_gpu_check_runs_its_steps_in_miniature_on_a_cpu(real_data, tmp_path):
    """`make gpu-check` stays ready for a machine with a GPU: the same steps (benchmark,
    Multi30k prepare/train/evaluate, a profiled update) run on a CPU with --quick, in the order
    ``--steps`` gives, and the summary table holds each of them."""
    env = dict(os.environ, MT_DATA_DIR=str(real_data))
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "gpu_check.py"), "--device", "cpu", "--quick",
         "--out", str(tmp_path / "out"), "--steps", "multi30k,base,profile,memory"],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = (tmp_path / "out" / "summary.md").read_text()
    order = ("multi30k_prepare", "multi30k_train", "multi30k_evaluate", "bench_small_eager",
             "profile", "memory_small")  # fmt: skip
    at = [text.index(f"| {step} | 0 |") for step in order]
    assert at == sorted(at)
    assert "Multi30k de->en test BLEU" in text and "tgt tok/s" in text
    assert "| small 64x1 fp32 | 500 | on |" in text  # the memory step's miniature, measured
    profile_text = (tmp_path / "out" / "profile.txt").read_text()
    assert profile_text.strip() and "The copies of one update by input shape" in profile_text
    profiled = json.loads((tmp_path / "out" / "profile.json").read_text())
    assert profiled["updates"] == 3 and profiled["same_shape"]["updates"] == 3
    assert len(set(profiled["same_shape"]["tokens_per_update"])) == 1
    assert profiled["products"]["default"]["new_shapes_us"] > 0
    assert profiled["products"]["default"]["seen_shape_us"] > 0


def test_gpu_check_bench_steps_name_their_variant_and_the_summary_shows_it(monkeypatch, tmp_path):
    """Each bench step's name gives its flags (``base-master-compiled``: bf16 master weights,
    compiled), and the summary's row names master weights (the miniature above runs the
    plain bench only; ``bench train --master-weights`` itself runs in the DDP test below)."""
    sys.path.insert(0, str(REPO / "scripts"))
    import gpu_check

    seen = {}
    monkeypatch.setattr(gpu_check, "run", lambda cmd, out, name, *a, **k: seen.update(
        {name: cmd}) or {"step": name, "status": 0, "seconds": 0.0})  # fmt: skip
    args = gpu_check.argparse.Namespace(device="cuda", quick=False, step_timeout=60)
    for name in gpu_check.TRAIN_BENCHES:
        preset, how = gpu_check.bench_variant(name)
        gpu_check.bench_train(args, tmp_path, {}, None, preset, **how)
    cmd = seen["bench_base_compiled_master"]
    assert "--master-weights" in cmd and "--compile" in cmd and "bf16" in cmd
    assert "--master-weights" not in seen["bench_base_compiled"]
    assert "--pad-multiple" in seen["bench_base_eager_pad8"]
    lt = seen["bench_base_eager_master_lt"]  # the same bench with cuBLASLt's products
    assert lt[lt.index("--blas") + 1] == "cublaslt" and "--master-weights" in lt
    assert "--blas" not in seen["bench_base_eager_master"]
    assert len(seen) == len(gpu_check.TRAIN_BENCHES) == 14
    # Multi30k's bf16 twin: master weights, its own run directory, the preparation not repeated
    args.multi30k_minutes = None
    prepared = {"step": "multi30k_prepare", "status": 0, "seconds": 1.0}
    steps = gpu_check.multi30k(args, tmp_path, {}, prepared, master=True)
    assert [s["step"] for s in steps] == ["multi30k_master_train", "multi30k_master_evaluate"]
    cmd = seen["multi30k_master_train"]
    assert {"train.precision=bf16", "train.master_weights=true"} <= set(cmd)
    assert f"run_dir={tmp_path / 'multi30k_master'}" in cmd
    assert f"cache_dir={tmp_path / 'cache'}" in cmd  # the corpus prepared once, for both
    record = {"bench": "train", "d_model": 512, "layers": 6, "precision": "bf16",
              "compile": False, "tgt_tok_per_s": 1.0, "master_weights": True}  # fmt: skip
    compiled = {**record, "compile": True, "compiled_graphs": 1, "step_ms_median": 40.05,
                "step_ms": [39.0, 40.1, 75970.2]}  # fmt: skip
    (tmp_path / "bench.jsonl").write_text(json.dumps(record) + "\n" + json.dumps(compiled) + "\n")
    text = gpu_check.summary(tmp_path, [], {})
    assert "| 512x6 bf16, master weights | False | 1 | - |" in text
    # compiled: the graphs Dynamo made, and a timed step that compiled again shows as the slowest
    assert "| 512x6 bf16, master weights | True (1) | 1 | 40.0 / 75,970.2 |" in text
    (tmp_path / "bench.jsonl").write_text(json.dumps({**record, "blas": "cublaslt"}) + "\n")
    assert "| 512x6 bf16, master weights, cuBLASLt | False |" in gpu_check.summary(tmp_path, [], {})


def test_gpu_check_runs_the_bucketed_steps_first_and_reports_their_figures(monkeypatch, tmp_path):
    """The shape-bucketed, wholly compiled variants lead the default order (after the tests);
    their commands ask for the buckets, and the summary formats what they measured: the
    shapes met, the seconds of the first-shape steps (compiling, capturing), the padding
    share, the GPU memory reserved, and the bucketed profile's launches and busy share."""
    sys.path.insert(0, str(REPO / "scripts"))
    import gpu_check

    assert gpu_check.STEPS[:4] == ("tests", "base-master-compiled-buckets",
                                   "big-master-compiled-buckets", "profile-buckets")  # fmt: skip
    assert gpu_check.bench_variant("big-master-compiled-buckets") == (
        "big", {"compiled": True, "pad8": False, "master": True, "lt": False, "buckets": True})
    seen = {}
    monkeypatch.setattr(gpu_check, "run", lambda cmd, out, name, *a, **k: seen.update(
        {name: cmd}) or {"step": name, "status": 0, "seconds": 0.0})  # fmt: skip
    args = gpu_check.argparse.Namespace(device="cuda", quick=False, step_timeout=60)
    gpu_check.bench_train(args, tmp_path, {}, tmp_path / "train", "base", compiled=True,
                          master=True, buckets=True)  # fmt: skip
    cmd = seen["bench_base_compiled_master_buckets"]
    assert cmd[cmd.index("--shape-buckets") + 1] == str(gpu_check.SHAPE_BUCKETS)
    assert "--compile" in cmd and "--data" in cmd
    gpu_check.profile(args, tmp_path, {}, buckets=True)
    assert {"train.compile=true", f"train.shape_buckets={gpu_check.SHAPE_BUCKETS}"} <= set(
        seen["profile-buckets"])
    assert "train.compile=true" not in (gpu_check.profile(args, tmp_path, {}) and
                                        seen["profile"])  # fmt: skip
    record = {"bench": "train", "d_model": 512, "layers": 6, "precision": "bf16",
              "compile": True, "compiled_graphs": 1, "tgt_tok_per_s": 1.0, "master_weights": True,
              "shape_buckets": 16, "shapes_met": 12, "first_shape_s": 71.25,
              "padding_share": {"src": 0.1234, "tgt": 0.0987},
              "graph_memory": {"reserved_peak_gb": 21.44}}  # fmt: skip
    (tmp_path / "bench.jsonl").write_text(json.dumps(record) + "\n")
    (tmp_path / "profile-buckets.json").write_text(json.dumps({
        "kernel_launches_per_update": 210.0, "ms_per_update": 41.04, "gpu_busy_share": 0.93,
        "same_shape": {"kernel_launches_per_update": 208.0, "ms_per_update": 40.0,
                       "gpu_busy_share": 0.95},
        "shapes": 16, "warmup_s": 80.5, "compiled_graphs": 1,
        "padding_share": {"src": 0.12, "tgt": 0.1}}))  # fmt: skip
    text = gpu_check.summary(tmp_path, [], {})
    assert "| 12 (16) | 71.2 | 12.3% / 9.9% | 21.4 |" in text
    assert ("profile-buckets: with shape buckets" in text and "210 launches per update, 41.0 ms, "
            "GPU busy 93%; one batch again: 208 launches" in text)  # fmt: skip
    assert "16 shapes met in 80.5 s (compiling and capturing), 1 compiled graph(s)" in text
    plain = {k: v for k, v in record.items() if k not in ("shape_buckets", "shapes_met",
             "first_shape_s", "padding_share", "graph_memory")}  # fmt: skip
    (tmp_path / "bench.jsonl").write_text(json.dumps(plain) + "\n")
    assert "| - (off) | - | - | - |" in gpu_check.summary(tmp_path, [], {})


def test_memory_bench_reports_the_model_and_the_measured_peak_both_ways(tmp_path):
    """``bench memory``: the memory model's peak and the measured one (on a CPU through
    torch.profiler), activation checkpointing off and on, one record each."""
    records, stdout = run_bench(["memory", *TINY, "--tokens", "200"], tmp_path)
    assert [r["activation_checkpointing"] for r in records] == [False, True]
    for r in records:
        assert r["bench"] == "memory" and r["tokens"] == 200
        assert r["measured_kind"] == "cpu_profiler_allocations"
        assert r["measured_gb"] > 0 and r["estimated_gb"] > 0
    assert "measured" in stdout.splitlines()[-1] and "ckpt on" in stdout.splitlines()[-1]


def test_gpu_check_memory_step_is_skipped_without_cuda_and_composes_with_one(monkeypatch,
                                                                             tmp_path):  # fmt: skip
    """The memory step runs ``bench memory`` for base and big in bf16 with master weights at
    the WMT batch where a GPU is; without CUDA it is listed as skipped (not a failure of the
    check), and the summary shows what the step measured."""
    sys.path.insert(0, str(REPO / "scripts"))
    import gpu_check

    assert "memory" in gpu_check.STEPS and "memory" not in gpu_check.TRAIN_BENCHES
    args = gpu_check.argparse.Namespace(device="cuda", quick=False, step_timeout=60)
    assert gpu_check.memory(args, tmp_path, {}, {"gpu": None}) == [
        {"step": "memory", "status": "skipped (no CUDA)", "seconds": 0.0}]
    seen = {}
    monkeypatch.setattr(gpu_check, "run", lambda cmd, out, name, *a, **k: seen.update(
        {name: cmd}) or {"step": name, "status": 0, "seconds": 0.0})  # fmt: skip
    steps = gpu_check.memory(args, tmp_path, {}, {"gpu": "NVIDIA H200"})
    assert [s["step"] for s in steps] == ["memory_base", "memory_big"]
    cmd = seen["memory_big"]
    assert cmd[2:5] == ["memory", "--preset", "big"] and "--estimate-only" not in cmd
    assert {"--master-weights", "bf16", "25000", "37000"} <= set(cmd)
    record = {"bench": "memory", "preset": "big", "d_model": 1024, "layers": 6, "tokens": 25000,
              "precision": "bf16", "master_weights": True, "activation_checkpointing": True,
              "estimated_gb": 7.123, "measured_gb": 7.5}  # fmt: skip
    (tmp_path / "bench.jsonl").write_text(json.dumps(record) + "\n")
    text = gpu_check.summary(tmp_path, [], {})
    assert "| big 1024x6 bf16, master weights | 25,000 | on | 7.500 | 7.123 |" in text


def test_gpu_check_without_cuda_lists_the_memory_step_as_skipped(tmp_path):
    script = str(REPO / "scripts" / "gpu_check.py")
    proc = subprocess.run([sys.executable, script, "--out", str(tmp_path / "out"), "--steps",
                           "memory", "--wheels", str(tmp_path)], capture_output=True, text=True,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "| memory | skipped (no CUDA) | 0.0 |" in (tmp_path / "out" / "summary.md").read_text()


def test_gpu_check_refuses_an_unknown_step_before_running_anything(tmp_path):
    script = str(REPO / "scripts" / "gpu_check.py")
    bad = subprocess.run([sys.executable, script, "--out", str(tmp_path / "bad"), "--steps",
                          "base,bench"], capture_output=True, text=True)  # fmt: skip
    assert bad.returncode == 2 and "unknown bench" in bad.stderr
    assert not (tmp_path / "bad").exists()


def test_train_under_ddp_reports_the_whole_job(tmp_path):
    """``--ddp 2`` runs the step as two gloo ranks under torchrun; rank 0 alone reports, with
    the tokens of both ranks (each its own batches) in the job's figures. The step trains a
    bf16 working copy with float32 master weights (``--master-weights``), so DDP all-reduces
    the copy's bf16 gradients (``tests/test_distributed.py`` holds fp32 DDP equal to one rank)."""
    args = ["train", *TINY, "--batch-size", "3", "--min-len", "2", "--max-len", "5"]
    args += ["--steps", "2", "--warmup-steps", "1", "--ddp", "2"]
    args += ["--precision", "bf16", "--master-weights"]  # DDP over a bf16 working copy
    records, stdout = run_bench(args, tmp_path)
    assert len(records) == 1 and stdout.count("tgt tok/s") == 1
    r = records[0]
    assert r["impl"] == "mt" and r["ranks"] == 2 and r["master_weights"]
    assert r["tgt_tok_per_s_per_rank"] == pytest.approx(r["tgt_tok_per_s"] / 2)
    # Two ranks x 3 pairs of 2..5 tokens, +EOS each, per step.
    assert 2 * 3 * 3 <= r["tgt_tokens_per_step"] <= 2 * 3 * 6
    assert math.isfinite(r["first_loss"]) and math.isfinite(r["last_loss"])


def test_benchmark_batches_in_shape_buckets(prepared_dir, tmp_path):
    """``--shape-buckets`` (gpu-check's ``*-buckets`` steps) gives the benchmark's batches the
    bucket shapes training gives them, and the records report the shapes met and the padding
    share (the loader's and the training bench's)."""
    sys.path.insert(0, str(REPO / "scripts"))
    from bench_data import load_prepared, real_batches

    _, split = load_prepared(f"{prepared_dir}/train")
    batches = real_batches(split, "x", 200, 8, seed=3, buckets=3)
    shapes = {(b.src.size(0), b.src.size(1), b.tgt_in.size(1)) for b in batches}
    assert 1 <= len(shapes) <= 3
    args = ["train", *TINY, "--data", f"{prepared_dir}/train", "--max-tokens", "200", "--steps",
            "2", "--warmup-steps", "1", "--shape-buckets", "3"]  # fmt: skip
    (r,), _ = run_bench(args, tmp_path)
    assert r["shape_buckets"] == 3 and 1 <= r["shapes_met"] <= 3 and r["first_shape_s"] > 0
    assert 0 < r["padding_share"]["tgt"] < 1 and 0 <= r["padding_share"]["src"] < 1
    (d,), _ = run_bench(["data", "--data", f"{prepared_dir}/train", "--max-tokens", "200",
                         "--shape-buckets", "3"], tmp_path)  # fmt: skip
    assert d["shape_buckets"] == 3 and 1 <= len(d["shapes"]) <= 3
    assert 0 < d["padding_share"]["tgt"] < 1
