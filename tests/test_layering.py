"""The module layering of mt holds: a module imports only from layers below it.

pure pieces < model/tokenizer/data/distributed < batching/checkpoint/prepare < search
< evaluate/translate < train < cli. The model imports no I/O, no Hydra, no datasets.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

MT = Path(__file__).resolve().parents[1] / "mt"

# Lower number = lower layer. A module may import mt modules of a strictly lower layer.
LAYERS = {
    "mt": 0,
    "mt.__main__": 7.5,
    "mt.vocab": 0,
    "mt.schema": 0,
    "mt.masks": 1,
    "mt.loss": 1,
    "mt.schedule": 1,
    "mt.config": 1,
    "mt.files": 1,
    "mt.lock": 1,
    "mt.preempt": 1,
    "mt.progress": 1,
    "mt.prefetch": 1,
    "mt.attention": 2,
    "mt.model": 2.5,
    "mt.tokenizer": 2,
    "mt.data": 2,
    "mt.distributed": 2,
    "mt.report": 2,
    "mt.batching": 3,
    "mt.checkpoint": 3,
    "mt.inference": 3,
    "mt.cpu_training": 3.2,
    "mt.prepare": 3,
    "mt.cleaning": 2.5,
    "mt.metrics": 1,
    "mt.cache": 1,
    "mt.rows": 1,
    "mt.strategy": 1,
    "mt.search": 4,
    "mt.export_hf": 3,
    "mt.export_ct2": 3.5,
    "mt.export_check": 4.8,
    "mt.export": 4,
    "mt.batcher": 5.2,
    "mt.serve": 5.5,
    "mt.ensemble": 4.2,
    "mt.decoding": 4.5,
    "mt.alignment": 4.7,
    "mt.score": 5.2,
    "mt.evaluate": 5,
    "mt.translate": 5,
    "mt.metrics_log": 2,
    "mt.acceleration": 1.5,
    "mt.run_state": 5.3,
    "mt.update": 5.4,
    "mt.validation": 5.5,
    "mt.resume": 5.75,
    "mt.train": 6,
    "mt.cli": 7,
}
MODEL_FORBIDDEN = {"hydra", "omegaconf", "datasets", "sentencepiece", "sacrebleu", "os", "io"}


def _modules() -> list[str]:
    return sorted("mt" if p.stem == "__init__" else f"mt.{p.stem}" for p in MT.glob("*.py"))


def _imports(module: str) -> set[str]:
    path = MT / ("__init__.py" if module == "mt" else f"{module.split('.')[-1]}.py")
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


@pytest.mark.parametrize("module", _modules())
def test_module_imports_only_from_below(module):
    assert module in LAYERS, f"{module} is not placed in a layer (add it to LAYERS)"
    for name in _imports(module):
        if name in LAYERS and name not in ("mt", module):
            assert LAYERS[name] < LAYERS[module], f"{module} imports {name} from its layer or above"


@pytest.mark.parametrize("module", ["mt.model", "mt.attention", "mt.masks"])
def test_model_has_no_io(module):
    if not (MT / f"{module.split('.')[-1]}.py").exists():
        pytest.skip(f"{module} does not exist")
    roots = {name.split(".")[0] for name in _imports(module)}
    assert not roots & MODEL_FORBIDDEN, f"{module} imports {roots & MODEL_FORBIDDEN}"
