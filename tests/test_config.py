"""The configuration tree composes against the typed schema, and errors name the key."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf.errors import OmegaConfBaseException

from mt.config import conf_dir, load_config, to_yaml
from mt.schema import Config
from mt.train.state import _changed_keys

CONF = conf_dir()
GROUPS = ["data", "tokenizer", "model", "train", "decode", "experiment"]


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def test_default_is_multi30k_de_en():
    cfg = load_config()
    assert isinstance(cfg, Config)
    assert cfg.name == "multi30k_de_en"
    assert (cfg.data.src_lang, cfg.data.tgt_lang) == ("de", "en")
    assert cfg.run_dir == "runs/multi30k_de_en"


@pytest.mark.parametrize(
    "override", [f"{g}={o}" for g in GROUPS for o in _options(g) if g != "data" or o != "local"]
)
def test_every_yaml_composes(override):
    cfg = load_config([override])
    assert isinstance(cfg, Config)


def test_local_data_needs_dir():
    cfg = load_config(["data=local", "data.dir=/tmp/x"])
    assert cfg.data.dir == "/tmp/x" and cfg.data.source == "local"


def test_experiments_set_paper_values():
    base = load_config(["experiment=wmt14_en_de_base"])
    assert (base.model.N, base.model.d_model, base.model.d_ff, base.model.h) == (6, 512, 2048, 8)
    assert base.tokenizer.vocab_size == 37000 and base.data.hf_path == "wmt/wmt14"
    big = load_config(["experiment=wmt14_en_de_big"])
    assert (big.model.d_model, big.model.d_ff, big.model.h, big.model.dropout) == (
        1024,
        4096,
        16,
        0.3,
    )
    en_de = load_config(["experiment=multi30k_en_de"])
    assert (en_de.data.src_lang, en_de.data.tgt_lang) == ("en", "de")
    assert en_de.train == load_config().train  # one recipe for both directions


def test_a_model_preset_brings_its_own_dropout():
    # the default experiment sets no model values of its own, so `model=big` is the paper's big
    assert load_config(["model=big"]).model.dropout == 0.3
    assert load_config(["model=base"]).model.dropout == 0.1
    assert load_config().model.dropout == 0.05  # small: chosen on Multi30k val


def test_overrides_apply():
    cfg = load_config(["model=base", "train.max_tokens=8192", "model.dropout=0.3"])
    assert cfg.model.d_model == 512 and cfg.train.max_tokens == 8192 and cfg.model.dropout == 0.3


@pytest.mark.parametrize("bad", ["model.d_modle=3", "train.max_tokens=lots", "nosuchkey=1"])
def test_bad_override_names_the_key(bad):
    with pytest.raises((ConfigCompositionException, OmegaConfBaseException)) as err:
        load_config([bad])
    text = str(err.value) + str(err.value.__cause__ or "")
    assert bad.split("=")[0].split(".")[-1] in text


def test_cli_misspelt_key_exits_nonzero():
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "from mt.cli import prepare_main; prepare_main()",
            "model.d_modle=3",
        ],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
        timeout=120,
    )
    assert proc.returncode != 0
    assert "d_modle" in proc.stderr + proc.stdout


def test_python_dash_m_mt_runs_a_stage_and_names_a_bad_key():
    root = Path(__file__).resolve().parents[1]
    bad = subprocess.run(
        [sys.executable, "-m", "mt", "prepare", "model.d_modle=3"],
        capture_output=True, text=True, cwd=root, timeout=120,
    )  # fmt: skip
    assert bad.returncode != 0 and "d_modle" in bad.stderr + bad.stdout
    usage = subprocess.run(
        [sys.executable, "-m", "mt", "fly"], capture_output=True, text=True, cwd=root, timeout=60
    )
    assert usage.returncode != 0 and "prepare,train,translate,evaluate" in usage.stderr


def _decode_file(choice: str) -> dict:
    """The values a decode group file sets, its parents in the group merged first (read with
    plain YAML, independently of Hydra's composition)."""
    import yaml

    text = yaml.safe_load((CONF / "decode" / f"{choice}.yaml").read_text(encoding="utf-8"))
    values: dict = {}
    for parent in text.pop("defaults", []):
        if parent != "_self_":
            values.update(_decode_file(parent))
    values.update(text)
    return values


@pytest.mark.parametrize("experiment", _options("experiment"))
@pytest.mark.parametrize("choice", _options("decode"))
def test_command_line_decode_choice_wins_over_every_experiment(experiment, choice):
    # The bug: experiments set `decode: {beam_size: ..}` as plain values, merged after the
    # group that the command line picked, so `decode=greedy` still ran beam search.
    cfg = load_config([f"experiment={experiment}", f"decode={choice}"])
    expected = _decode_file(choice)
    assert expected, choice
    for key, value in expected.items():
        assert getattr(cfg.decode, key) == value, (experiment, choice, key)


def test_experiments_choose_their_decode_group():
    assert load_config().decode.beam_size == 5  # Multi30k: beam 5, alpha 1.0 chosen on val
    assert load_config().decode.alpha == 1.0
    assert load_config(["experiment=multi30k_de_en_15min"]).decode.alpha == 1.0
    assert load_config(["experiment=smoke"]).decode.max_len_b == 20
    assert load_config(["experiment=wmt14_en_de_base"]).decode.beam_size == 4
    assert load_config(["decode=greedy", "decode.max_len_b=7"]).decode.max_len_b == 7


def test_the_15_minute_experiment_is_the_default_recipe_in_a_third_of_the_time():
    default, short = load_config(), load_config(["experiment=multi30k_de_en_15min"])
    assert (default.train.max_tokens, default.model.dropout, default.train.clip_norm) == (
        2048,
        0.05,
        1.0,
    )
    assert (short.train.max_minutes, default.train.max_minutes) == (15, 42)
    changes = _changed_keys(to_yaml(default), to_yaml(short))  # what a resume would log
    assert [c.split(":")[0] for c in changes] == [
        "name",
        "run_dir",
        "train.eval_every",
        "train.max_minutes",
        "train.warmup",
    ]  # model, decode and data are the default's
    assert (short.train.warmup, default.train.warmup) == (400, 800)  # each as measured


def test_the_default_recipe_is_stated_in_updates_with_time_as_a_cap():
    """The same command gives the same model on any machine: the budget is updates; minutes
    only cap it (and the cool-down spans whichever of the two comes first)."""
    for experiment in ("multi30k_de_en", "multi30k_en_de", "multi30k_de_en_15min"):
        tc = load_config([f"experiment={experiment}"]).train
        assert tc.max_steps == 4000 and tc.cooldown == 0.3 and tc.max_minutes in (42, 15)
        assert tc.eval_every * tc.patience < tc.max_steps  # patience can stop a run early
        # regularised with weight decay decoupled from Adam's step, as chosen on val
        assert tc.weight_decay == 0.2 and tc.decoupled_weight_decay is True
        assert tc.label_smoothing == 0.2  # smoothed more than the paper's 0.1, chosen on val
