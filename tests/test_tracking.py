"""TensorBoard (mt.train.tracking): a short run's event file read back with TensorBoard's own
reader, and one warning that says how to install it when it is missing."""

from __future__ import annotations

import json
import logging
import sys

import pytest

from mt.config import load_config
from mt.train.recipe import train

TINY = [
    "experiment=smoke", "data.max_train_pairs=500", "tokenizer.vocab_size=500", "model.N=1",
    "model.d_model=32", "model.d_ff=64", "model.h=2", "train.max_tokens=400", "train.threads=1",
    "train.warmup=10", "train.lr=3e-3", "train.log_every=1", "train.save_every=0",
    "train.eval_max_sentences=10", "decode.max_len_b=5",
]  # fmt: skip


@pytest.fixture(autouse=True)
def _data_env(real_data, monkeypatch):
    monkeypatch.setenv("MT_DATA_DIR", str(real_data))


def test_the_event_file_holds_loss_rate_and_valid_bleu_at_their_steps(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    train(load_config([*TINY, f"run_dir={run}", "train.max_steps=4", "train.eval_every=2",
                       "train.eval_bleu=true"]))  # fmt: skip
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert {"loss", "lr", "valid_bleu", "valid_loss"} <= set(tags)
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    losses = {r["step"]: r["loss"] for r in records if "loss" in r}
    bleus = {r["step"]: r["valid_bleu"] for r in records if "valid_bleu" in r}

    def scalars(tag):
        return {e.step: e.value for e in events.Scalars(tag)}

    assert sorted(scalars("loss")) == [1, 2, 3, 4]
    assert scalars("loss") == pytest.approx(losses, rel=1e-6)  # stored as float32
    # update s runs at the Noam rate lr * min(sqrt(warmup / s), s / warmup): s / 10 of 3e-3
    assert scalars("lr") == pytest.approx({s: 3e-3 * s / 10 for s in (1, 2, 3, 4)}, rel=1e-6)
    assert sorted(scalars("valid_bleu")) == [2, 4]  # each validation, at its update
    assert scalars("valid_bleu") == pytest.approx(bleus, rel=1e-6, abs=1e-6)


def test_a_missing_tensorboard_is_one_warning_saying_how_to_install_it(tmp_path, monkeypatch,
                                                                       caplog):  # fmt: skip
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails
    run = tmp_path / "run"
    with caplog.at_level(logging.INFO):
        train(load_config([*TINY, f"run_dir={run}", "train.max_steps=2", "train.eval_every=0",
                           "train.eval_bleu=false"]))  # fmt: skip
    said = [r for r in caplog.records if "TensorBoard" in r.getMessage()]
    assert len(said) == 1 and said[0].levelname == "WARNING", [r.getMessage() for r in said]
    assert "pip install tensorboard" in said[0].getMessage()
    assert "`all` extra" in said[0].getMessage()
    assert not (run / "tensorboard").exists()
    assert [json.loads(x).get("step") for x in (run / "metrics.jsonl").read_text().splitlines()
            if "loss" in json.loads(x)] == [1, 2]  # fmt: skip
