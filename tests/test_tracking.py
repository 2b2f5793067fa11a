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


def test_mlflow_holds_the_config_each_validation_at_its_step_and_the_test_scores(tmp_path):
    """train.tracking=[tensorboard,mlflow]: the run's file store (run_dir/mlruns) read back with
    MLflow's own client: the resolved configuration as params, each record's figures at its
    update, the machine as tags, and mt-evaluate's test scores at best.pt's update."""
    pytest.importorskip("mlflow", reason="mlflow not installed (pip install 'mt[track]')")
    from mlflow.tracking import MlflowClient

    from mt.cli import _evaluate

    run = tmp_path / "run"
    cfg = load_config([*TINY, f"run_dir={run}", "train.max_steps=4", "train.eval_every=2",
                       "train.eval_bleu=true", "train.tracking=[tensorboard,mlflow]",
                       "eval.report=false"])  # fmt: skip
    train(cfg)
    _evaluate(cfg)
    known = json.loads((run / "mlflow.json").read_text())
    assert known["tracking_uri"] == (run / "mlruns").resolve().as_uri()
    client = MlflowClient(known["tracking_uri"])
    got = client.get_run(known["run_id"])
    assert got.info.status == "FINISHED"
    assert client.get_experiment(got.info.experiment_id).name == "smoke"
    params = got.data.params
    assert params["train.lr"] == "0.003" and params["model.d_model"] == "32"
    assert params["train.tracking"] == "['tensorboard', 'mlflow']" and len(params) > 100
    assert got.data.tags["machine.torch"] == torch_version() and got.data.tags["machine.cpu"]
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]

    def history(key):
        return {m.step: m.value for m in client.get_metric_history(known["run_id"], key)}

    assert history("loss") == pytest.approx({r["step"]: r["loss"] for r in records if "loss" in r})
    assert sorted(history("loss")) == [1, 2, 3, 4]
    bleus = {r["step"]: r["valid_bleu"] for r in records if "valid_bleu" in r}
    assert sorted(bleus) == [2, 4] and history("valid_bleu") == pytest.approx(bleus)
    results = json.loads((run / "results.json").read_text())
    assert results["split"] == "test"
    assert history("test_bleu") == pytest.approx({results["step"]: results["bleu"]})
    assert history("test_chrf") == pytest.approx({results["step"]: results["chrf"]})


def torch_version() -> str:
    import torch

    return torch.__version__


def test_a_missing_mlflow_is_one_warning_saying_how_to_install_it(tmp_path, monkeypatch, caplog):
    for name in ("mlflow", "mlflow.entities", "mlflow.tracking"):
        monkeypatch.setitem(sys.modules, name, None)  # import fails
    run = tmp_path / "run"
    with caplog.at_level(logging.INFO):
        train(load_config([*TINY, f"run_dir={run}", "train.max_steps=2", "train.eval_every=0",
                           "train.eval_bleu=false", "train.tracking=[mlflow]"]))  # fmt: skip
    said = [r for r in caplog.records if "MLflow" in r.getMessage()]
    assert len(said) == 1 and said[0].levelname == "WARNING", [r.getMessage() for r in said]
    assert "pip install mlflow-skinny" in said[0].getMessage()
    assert "`track` or `all` extra" in said[0].getMessage()
    assert not (run / "mlflow.json").exists() and not (run / "mlruns").exists()
    assert not (run / "tensorboard").exists()  # not asked for
    assert [json.loads(x).get("step") for x in (run / "metrics.jsonl").read_text().splitlines()
            if "loss" in json.loads(x)] == [1, 2]  # fmt: skip


def test_an_unknown_tracker_is_refused_naming_the_setting(tmp_path):
    with pytest.raises(ValueError, match=r"train.tracking: unknown wandb \(known: tensorboard"):
        train(load_config([*TINY, f"run_dir={tmp_path / 'run'}", "train.max_steps=1",
                           "train.tracking=[wandb]"]))  # fmt: skip


def test_only_rank_0_tracks(tmp_path):
    from mt.train.tracking import MetricsLog

    cfg = load_config([*TINY, "train.tracking=[tensorboard,mlflow]"])
    other = MetricsLog(tmp_path, 0, enabled=False, cfg=cfg)  # a rank other than 0
    other.write({"step": 1, "loss": 2.0})
    other.close()
    assert other.mlflow is None and other.tb is None and not list(tmp_path.iterdir())
