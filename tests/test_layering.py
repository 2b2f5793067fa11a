"""The house holds its shape: a folder imports only from its own folder or from tiers below.

The tiers, bottom to top (a unit is a folder of ``mt/`` or one shared top-level module):

    vocab, schema, files,     pure pieces: ids, the typed settings, crash-safe files, the
    allocator, device         process's malloc (jemalloc where installed), autocast and SDPA's
                              CUDA kernels
    config, distributed       Hydra composition; DDP set-up and collectives
    model                     the paper's Transformer: math only (no I/O, no Hydra, no speed code)
    data                      corpus -> cleaning -> SentencePiece -> prepared store -> batches
    checkpoint                the checkpoint file format (builds a model and its tokenizer)
    fast                      training's speed code, applied to a model from outside
    decode                    search, the decoding driver, translate, alignment, rescoring
    evaluation                sacreBLEU metrics, mt-evaluate, the run report
    train                     the training recipe, update step, validation, run state
    export, serve             leaving mt: transformers/CTranslate2, the translation server
    cli                       the mt-* commands
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

MT = Path(__file__).resolve().parents[1] / "mt"

TIERS = [
    ["mt.vocab", "mt.schema", "mt.files", "mt.allocator", "mt.device"],
    ["mt.config", "mt.distributed"],
    ["mt.model"],
    ["mt.data"],
    ["mt.checkpoint"],
    ["mt.fast"],
    ["mt.decode"],
    ["mt.evaluation"],
    ["mt.train"],
    ["mt.export", "mt.serve"],
    ["mt.cli"],
    ["mt.__main__"],
]
TIER = {unit: level for level, units in enumerate(TIERS) for unit in units}
MODEL_FORBIDDEN = {"hydra", "omegaconf", "datasets", "sentencepiece", "sacrebleu", "os", "io"}


def _name(path: Path) -> str:
    parts = path.relative_to(MT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> list[str]:
    return sorted(_name(p) for p in MT.rglob("*.py"))


def _unit(module: str) -> str:
    """The folder (``mt.model``) or shared top-level module (``mt.schema``) a module is in."""
    return ".".join(module.split(".")[:2])


def _all_imports(module: str) -> set[str]:
    """Every name a module imports, at any depth of its code (lazy imports too): modules and
    ``module.name`` for each ``from module import name``."""
    path = MT.parent / (module.replace(".", "/") + ".py")
    if not path.is_file():
        path = MT.parent / module.replace(".", "/") / "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def _imports(module: str) -> set[str]:
    """The mt modules (and names) a module imports."""
    return {name for name in _all_imports(module) if name.split(".")[0] == "mt"}


def test_every_unit_has_a_tier():
    units = {_unit(m) for m in _modules()} - {"mt"}
    assert units <= set(TIER), f"not placed in a tier: {sorted(units - set(TIER))}"
    assert len(TIERS) <= 12 and sum(map(len, TIERS)) == len(TIER)


@pytest.mark.parametrize("module", _modules())
def test_module_imports_only_from_its_folder_or_below(module):
    if module == "mt":
        return
    unit = _unit(module)
    for name in _imports(module):
        target = _unit(name)
        if target in ("mt", unit) or target not in TIER:
            continue  # its own folder (or a name imported from a module, checked as that module)
        assert TIER[target] < TIER[unit], f"{module} imports {name}: {target} is not below {unit}"


def test_no_import_cycles_inside_a_folder():
    """Within a folder the modules form a DAG too (a cycle would make the import order matter)."""
    modules = set(_modules())
    graph = {m: {n for n in _imports(m) if n in modules and n != m and _unit(n) == _unit(m)}
             for m in modules}  # fmt: skip
    done, active = set(), []

    def visit(m: str) -> None:
        if m in active:
            raise AssertionError(f"import cycle: {' -> '.join(active[active.index(m):] + [m])}")
        if m in done:
            return
        active.append(m)
        for n in graph[m]:
            visit(n)
        active.pop()
        done.add(m)

    for m in sorted(graph):
        visit(m)


@pytest.mark.parametrize("module", [m for m in _modules() if _unit(m) == "mt.model"])
def test_model_has_no_io_and_no_speed_code(module):
    roots = {name.split(".")[0] for name in _all_imports(module)}
    assert not roots & MODEL_FORBIDDEN, f"{module} imports {roots & MODEL_FORBIDDEN}"
    assert not any(_unit(n) == "mt.fast" for n in _imports(module)), f"{module} imports mt.fast"


def test_only_the_training_recipe_imports_mt_fast():
    """mt.fast is training's: outside it, one module imports it (mt.train.recipe, through the
    package's own names); decoding, serving, evaluation and export run the model as written."""
    importers = {m for m in _modules() if _unit(m) != "mt.fast"
                 and any(_unit(n) == "mt.fast" for n in _imports(m))}  # fmt: skip
    assert importers == {"mt.train.recipe"}
    import mt.fast

    public = {"mt.fast", *(f"mt.fast.{name}" for name in mt.fast.__all__)}
    assert {n for n in _imports("mt.train.recipe") if _unit(n) == "mt.fast"} <= public


def test_no_two_modules_told_apart_by_a_suffix():
    """``batching``/``batcher``, ``metrics``/``metrics_log``: a name must not be another's prefix
    plus a suffix anywhere in the package (package __init__ files aside)."""
    stems = sorted({p.stem for p in MT.rglob("*.py") if p.stem != "__init__"})
    clashes = [
        (a, b) for a in stems for b in stems
        if a != b and (b.startswith(a + "_") or b.startswith(a) and len(b) - len(a) <= 3)
    ]  # fmt: skip
    assert not clashes, f"look-alike module names: {clashes}"
