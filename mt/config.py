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

from pathlib import Path

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from mt.schema import Config


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


def load_config(overrides: list[str] | None = None) -> Config:
    """Compose the configuration with command-line style overrides, schema checks included.

    Args:
        overrides: e.g. ``["experiment=smoke", "train.max_steps=10"]``.

    Returns:
        The typed configuration.

    Raises:
        hydra.errors.ConfigCompositionException or omegaconf errors naming the offending key.
    """
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_schema()
    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        cfg = compose(config_name="config", overrides=list(overrides or []))
    return to_config(cfg)


def to_yaml(cfg: Config) -> str:
    """The configuration as YAML text (what a run directory's config.yaml holds)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
