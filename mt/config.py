"""Composing the configuration: the conf/ tree of YAML files checked against ``mt.schema``.

The command-line tools (``mt-prepare``, ``mt-train``, ...) are Hydra apps over this tree;
:func:`load_config` composes exactly the same configuration for notebooks, tests and scripts.

Example:
    >>> from mt.config import load_config
    >>> cfg = load_config(["experiment=smoke", "model.d_model=32"])
    >>> cfg.model.d_model
    32
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from mt import schema
from mt.schema import Config


def flatten_keys(tree: dict, prefix: str = "") -> dict:
    """A nested mapping as one level of dotted keys (``{"train": {"lr": 1}}`` ->
    ``{"train.lr": 1}``): how settings are named on the command line."""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(flatten_keys(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def conf_dir() -> Path:
    """The directory holding config.yaml: ``mt/conf`` in an installed wheel, else the repo's."""
    packaged = Path(__file__).resolve().parent / "conf"
    if (packaged / "config.yaml").is_file():
        return packaged
    return Path(__file__).resolve().parent.parent / "conf"


def register_schema() -> None:
    """Register the typed schema under the name ``schema`` (the first default of config.yaml)."""
    ConfigStore.instance().store(name="schema", node=Config)


def to_config(cfg: DictConfig) -> Config:
    """Turn a composed DictConfig into the typed :class:`mt.schema.Config` (resolving ${...})."""
    return OmegaConf.to_object(cfg)  # type: ignore[return-value]


_OVERRIDE = re.compile(r"^([+~]*)([A-Za-z_][A-Za-z0-9_]*)(?=[=@]|$)")


def command_overrides(command: str | None, overrides: list[str]) -> list[str]:
    """Overrides with a command's own settings written as users type them: for ``translate``,
    ``input=x`` is ``translate.input=x`` (its node in :data:`mt.schema.COMMANDS`). A key that
    is not one of the command's settings, or that is a top-level key, is left as it is.

    Example:
        >>> command_overrides("evaluate", ["hyp=out.txt", "data.tgt_lang=de"])
        ['eval.hyp=out.txt', 'data.tgt_lang=de']
    """
    node = schema.COMMANDS.get(command or "")
    if node is None:
        return list(overrides)
    own = {f.name for f in dataclasses.fields(type(getattr(Config(), node)))}
    top = {f.name for f in dataclasses.fields(Config)}
    out = []
    for item in overrides:
        m = _OVERRIDE.match(item)
        if m and m.group(2) in own and m.group(2) not in top:
            item = f"{m.group(1)}{node}.{item[len(m.group(1)) :]}"
        out.append(item)
    return out


def load_config(overrides: list[str] | None = None, command: str | None = None) -> Config:
    """The typed configuration composed with command-line style ``overrides`` (e.g.
    ``["experiment=smoke", "train.max_steps=10"]``), schema checks included: Hydra's or
    OmegaConf's errors name the offending key. With a ``command`` (``translate``, ``evaluate``,
    ...) its own settings may be given without their node (:func:`command_overrides`)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_schema()
    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        cfg = compose(
            config_name="config", overrides=command_overrides(command, list(overrides or []))
        )
    return to_config(cfg)


def to_yaml(cfg: Config) -> str:
    """The configuration as YAML text (what a run directory's config.yaml holds)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
