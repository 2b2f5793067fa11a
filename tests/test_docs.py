"""The documents stay true: every mt command line in README.md and docs/ composes with the real
configuration, and every relative link resolves.

Commands: in each fenced shell block (```bash, ```sh, ```console or a block without a language),
a command line (backslash continuations joined, ``#`` comments and a ``$`` prompt dropped) that
runs ``mt-<stage>``, ``.venv/bin/mt-<stage>``, ``python -m mt <stage>``, ``torchrun ... -m mt
<stage>`` (or ``torchrun ... .venv/bin/mt-<stage>``) or ``make <target>`` with a target that runs
a stage (read from the Makefile) has its overrides composed as the command would compose them
(:mod:`mt.config`: the conf/ tree, the typed schema, a command's own keys as users type them).
A misspelt key, a value of the wrong type, a missing experiment or preset, a value outside the
choices the schema lists for a setting, or a make target that does not exist fails the test
with the document's file and line. Multirun lines (``-m``) compose once per value of each sweep.
Placeholders a user replaces pass as strings (``run_dir=/path/to/run``, ``data.dir=PATH``,
``<key>`` in lower case, an ``...`` argument, ``$VARIABLE``).

The records under docs/benchmarks/ are left out of the command check: each command there is what
ran for its figures at the commit it names, and stays as it ran when a setting is renamed later.
Their links are checked like every document's.

Links: every ``[text](target)``, ``![alt](target)`` and ``[label]: target`` outside code whose
target is not a URL resolves to a file or folder of the repository; ``#anchor`` (alone or after
a Markdown file) names a heading of that file under GitHub's slug rules.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import re
import shlex
import typing
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
RECORDS = ROOT / "docs" / "benchmarks"
COMMAND_DOCS = [p for p in DOCS if RECORDS not in p.parents]
SHELL_BLOCKS = {"", "bash", "sh", "shell", "console", "zsh"}


def _ids(paths: list[Path]) -> list[str]:
    return [str(p.relative_to(ROOT)) for p in paths]


# ---- fenced code blocks ----------------------------------------------------------------------

_FENCE = re.compile(r"^\s*(```+|~~~+)\s*([\w+-]*)")


def code_blocks(text: str) -> list[tuple[str, list[tuple[int, str]]]]:
    """The fenced blocks of a Markdown text: (language, [(line number, line), ...])."""
    blocks, current, fence, lang = [], None, "", ""
    for number, line in enumerate(text.splitlines(), 1):
        m = _FENCE.match(line)
        if current is None:
            if m:
                current, fence, lang = [], m.group(1), m.group(2).lower()
        elif m and m.group(1).startswith(fence[0]) and len(m.group(1)) >= len(fence) \
                and not m.group(2):  # fmt: skip
            blocks.append((lang, current))
            current = None
        else:
            current.append((number, line))
    return blocks


def _strip_comment(line: str) -> str:
    """The line without a shell comment: ``#`` at the start of a word, outside quotes."""
    quote, escaped = "", False
    for i, ch in enumerate(line):
        if escaped:
            escaped = False
        elif ch == "\\" and quote != "'":
            escaped = True
        elif quote:
            if ch == quote:
                quote = ""
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def shell_lines(text: str) -> list[tuple[int, str]]:
    """Command lines of the shell blocks: continuations joined, comments and prompts removed;
    each with the number of its first line."""
    out = []
    for lang, lines in code_blocks(text):
        if lang not in SHELL_BLOCKS:
            continue
        pending, start = "", 0
        for number, raw in lines:
            line = _strip_comment(raw).rstrip()
            if not pending:
                start = number
                line = re.sub(r"^\s*\$\s+", "", line)
            if line.endswith("\\"):
                pending += line[:-1] + " "
                continue
            pending += line
            if pending.strip():
                out.append((start, pending.strip()))
            pending = ""
        if pending.strip():
            out.append((start, pending.strip()))
    return out


# ---- from a command line to the stages it runs -----------------------------------------------

# What a shell would put in place of $VARIABLE / ${VARIABLE}: a path-like string. ${hydra:...}
# (Hydra's own interpolation, quoted in the documents) has a colon and is left alone.
_SHELL_VAR = re.compile(r"\$(?:\{([A-Za-z_]\w*)\}|([A-Za-z_]\w*))")
_PLACEHOLDER = re.compile(r"<[a-z][a-z0-9_ -]*>")  # <key>, <time>: a user's own value
_STAGE_WORD = re.compile(r"[a-z]+")
_COMMANDISH = re.compile(
    r"(^|[\s|;&(])((\S*/)?mt-[a-z]+\s+\S+=|make\s+[a-z]|-m\s+mt\s+[a-z]+\s+\S+=)"
)


def stages() -> tuple[str, ...]:
    from mt.__main__ import STAGES

    return tuple(STAGES)


def make_targets() -> dict[str, list[tuple[str, list[str]]] | None]:
    """Each Makefile target: the mt stages its recipe runs with ``$(ARGS)`` and the overrides
    put before them (``smoke``: ``experiment=smoke``); None for a target that runs no stage."""
    text = (ROOT / "Makefile").read_text()
    recipes: dict[str, list[str]] = {}
    target = None
    for line in text.splitlines():
        m = re.match(r"^([a-z][a-z0-9-]*):", line)
        if m and not line.startswith("\t"):
            target = m.group(1)
            recipes.setdefault(target, [])
        elif line.startswith("\t") and target:
            recipes[target].append(line)
    runs: dict[str, list[tuple[str, list[str]]] | None] = {}

    def resolve(name: str, seen: tuple[str, ...] = ()) -> list[tuple[str, list[str]]]:
        found = []
        for line in recipes.get(name, []):
            m = re.search(r"(?:-m mt|\$\(LAUNCH\)) ([a-z]+) \$\(ARGS\)", line)
            if m:
                found.append((m.group(1), []))
                continue
            m = re.search(r"\$\(MAKE\).* ([a-z][a-z0-9-]*) ARGS=\"([^\"]*)\$\(ARGS\)\"", line)
            if m and m.group(1) not in seen:
                prefix = shlex.split(m.group(2))
                found += [(s, prefix + p) for s, p in resolve(m.group(1), (*seen, name))]
        return found

    for name in recipes:
        runs[name] = resolve(name) or None
    return runs


@dataclasses.dataclass
class Invocation:
    """One stage a documented command runs: its command and the overrides it is given."""

    stage: str
    args: list[str]
    how: str  # e.g. "make train" or "mt-train"


def invocations(line: str) -> list[Invocation]:
    """The mt stages one command line runs (a pipeline or ``&&`` list: each part)."""
    line = _SHELL_VAR.sub(lambda m: f"/{(m.group(1) or m.group(2)).lower()}", line)
    words = shlex.split(line)
    parts, part = [], []
    for w in words:
        if w in ("|", "||", "&&", ";", "&"):
            parts.append(part)
            part = []
        else:
            part.append(w)
    parts.append(part)
    out = []
    for words in parts:
        out += _part_invocations(words)
    return out


def _part_invocations(words: list[str]) -> list[Invocation]:
    known = stages()
    for i, w in enumerate(words):
        base = w.rsplit("/", 1)[-1]
        if base.startswith("mt-") and _STAGE_WORD.fullmatch(base[3:]):
            if base[3:] not in known:
                raise DocError(f"{base}: no such command (mt's commands: mt-{', mt-'.join(known)})")
            return [Invocation(base[3:], words[i + 1 :], base)]
        if w == "-m" and words[i + 1 : i + 2] == ["mt"] and len(words) > i + 2:
            stage = words[i + 2]
            if stage in known:
                return [Invocation(stage, words[i + 3 :], f"python -m mt {stage}")]
            if _STAGE_WORD.fullmatch(stage):
                raise DocError(f"python -m mt {stage}: no such stage ({', '.join(known)})")
            return []  # a placeholder: python -m mt STAGE
        if base == "make" and (i == 0 or "=" in words[i - 1]):
            return _make_invocations(words[i + 1 :])
    return []


def _make_invocations(words: list[str]) -> list[Invocation]:
    targets = make_targets()
    names, variables = [], {}
    for w in words:
        m = re.fullmatch(r"([A-Za-z_]\w*)=(.*)", w, re.S)
        if m:
            variables[m.group(1)] = m.group(2)
        elif not w.startswith("-"):
            names.append(w)
    # make puts $(ARGS) into the recipe's shell line: that shell splits it and removes quotes
    args = shlex.split(variables.get("ARGS", ""))
    out = []
    for name in names or ["help"]:
        if name not in targets:
            raise DocError(f"make {name}: no such target (make help lists them)")
        for stage, prefix in targets[name] or []:
            out.append(Invocation(stage, prefix + args, f"make {name}"))
    return out


class DocError(Exception):
    """A documented command that would fail: the reason."""


# ---- composing the configuration -------------------------------------------------------------

# Hydra's own command-line options: with a value (as the next word or after "=") or alone.
_HYDRA_VALUE_FLAGS = {"--cfg", "-c", "--package", "-p", "--config-path", "-cp", "--config-name",
                      "-cn", "--config-dir", "-cd", "--experimental-rerun"}  # fmt: skip
_HYDRA_FLAGS = {"--help", "-h", "--hydra-help", "--info", "-i", "--resolve", "--version",
                "--run", "-r", "--shell-completion", "-sc"}  # fmt: skip


def split_hydra_args(args: list[str]) -> tuple[list[str], bool]:
    """The overrides of a Hydra command line and whether it is a multirun (``-m``)."""
    overrides, multirun, skip = [], False, False
    for arg in args:
        if skip:
            skip = False
        elif arg in ("-m", "--multirun"):
            multirun = True
        elif arg in _HYDRA_VALUE_FLAGS:
            skip = True
        elif arg.split("=", 1)[0] in _HYDRA_VALUE_FLAGS or arg in _HYDRA_FLAGS:
            pass
        elif arg in ("...", "\u2026") or re.fullmatch(r"\[[a-z][a-z ._-]*\]", arg):
            pass  # "the rest as before", "[setting]": an optional argument of the user's
        elif arg.startswith("-"):
            raise DocError(f"{arg}: not an option of mt's Hydra commands")
        else:
            overrides.append(_PLACEHOLDER.sub("X", arg))
    return overrides, multirun


def trials(overrides: list[str], multirun: bool) -> list[list[str]]:
    """The override lists a command composes: one, or for a multirun the first value of every
    sweep and then each other value of each sweep in turn (an interval: both ends)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import IntervalSweep, OverrideType, ValueType

    if not multirun:
        return [overrides]
    parsed = OverridesParser.create().parse_overrides(overrides)
    base, sweeps = [], []
    for index, o in enumerate(parsed):
        if not o.is_sweep_override():
            base.append(o.input_line)
            continue
        prefix = {OverrideType.ADD: "+", OverrideType.FORCE_ADD: "++"}.get(o.type, "")
        key = f"{prefix}{o.get_key_element()}"
        if o.value_type == ValueType.INTERVAL_SWEEP:
            value = o.value()
            assert isinstance(value, IntervalSweep)
            values = [repr(float(value.start)), repr(float(value.end))]
        else:
            values = list(o.sweep_string_iterator())
        sweeps.append((index, key, values))
        base.append(f"{key}={values[0]}")
    out = [base]
    for index, key, values in sweeps:
        for value in values[1:]:
            trial = list(base)
            trial[index] = f"{key}={value}"
            out.append(trial)
    return out


@functools.cache
def composed(overrides: tuple[str, ...], command: str | None):
    """:func:`compose`, once per distinct command line (the documents repeat many)."""
    return compose(list(overrides), command)


def compose(overrides: list[str], command: str | None):
    """The typed configuration a command composes from ``overrides`` (mt.config.load_config's
    steps, with Hydra's own node kept while resolving, so that ``hydra.*`` overrides and
    ``${hydra:...}`` interpolations compose as on the command line)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    from mt.config import command_overrides, conf_dir, register_schema, to_config

    register_schema()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        cfg = hydra_compose(
            config_name="config",
            overrides=command_overrides(command, overrides),
            return_hydra_config=True,
        )
    HydraConfig.instance().set_config(cfg)
    with open_dict(cfg):
        del cfg["hydra"]
    return to_config(cfg)


_CHOICES = re.compile(r'^\s+(\w+): str = "(\w+)"\s+# (.+)$')


def schema_choices() -> dict[str, tuple[str, ...]]:
    """The settings whose schema comment lists their values (``norm: str = "post"  # post (the
    paper) | pre (...)``), by dotted key: the values each may take. A comment whose parts do
    not each start with a lower-case word, or that does not list the default, is no list."""
    from mt import schema

    found: dict[str, tuple[str, ...]] = {}

    def walk(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(hints[f.name]):
                walk(hints[f.name], f"{prefix}{f.name}.")
        for line in inspect.getsource(cls).splitlines():
            m = _CHOICES.match(line)
            if not m or " | " not in m.group(3):
                continue
            values = []
            parts = m.group(3).split(" | ")
            for i, part in enumerate(parts):
                # a word, then nothing, a colon and a space, or a parenthesis ("cuda:N": no)
                word = re.match(r"([a-z0-9_]+)(?=$|: |,| \()", part.strip())
                if word is None and i == 0:  # "the split decoded and scored: valid"
                    word = re.match(r"([a-z0-9_]+)$", part.rsplit(": ", 1)[-1])
                if word is None:
                    values = []
                    break
                values.append(word.group(1))
            if m.group(2) in values:
                found[prefix + m.group(1)] = tuple(values)

    walk(schema.Config, "")
    # the settings whose values mt checks against a list of its own
    from mt.export import FORMATS
    from mt.fast.precision import PRECISIONS

    found["train.precision"] = PRECISIONS
    found["export.format"] = FORMATS
    return found


def check_choices(cfg, choices: dict[str, tuple[str, ...]]) -> None:
    for key, allowed in choices.items():
        value = cfg
        for part in key.split("."):
            value = getattr(value, part)
        if value is not None and value not in allowed:
            raise DocError(f"{key}={value}: expected one of {' | '.join(allowed)}")


def command_problems(path: Path, root: Path = ROOT) -> list[str]:
    """What is wrong with the document's commands, one line each (file:line: ...)."""
    from mt.schema import COMMANDS

    choices = schema_choices()
    problems = []
    for number, line in shell_lines(path.read_text(encoding="utf-8")):
        where = f"{path.relative_to(root)}:{number}"
        try:
            runs = invocations(line)
        except DocError as err:
            problems.append(f"{where}: {err} in: {line}")
            continue
        except ValueError as err:  # shlex: unbalanced quotes; in prose (a folder tree) no matter
            if _COMMANDISH.search(line):
                problems.append(f"{where}: {err} in: {line}")
            continue
        done = set()  # make train's prepare and train compose the same: once
        for run in runs:
            command = run.stage if run.stage in COMMANDS else None
            try:
                overrides, multirun = split_hydra_args(run.args)
                for trial in trials(overrides, multirun):
                    if (command, tuple(trial)) not in done:
                        done.add((command, tuple(trial)))
                        check_choices(composed(tuple(trial), command), choices)
            except Exception as err:  # Hydra's and OmegaConf's errors name the override
                message = " ".join(str(err).split())[:400]
                problems.append(f"{where}: {run.how}: {type(err).__name__}: {message}")
                break  # one line, one problem: the stages after it would repeat it
    return problems


@pytest.mark.parametrize("path", COMMAND_DOCS, ids=_ids(COMMAND_DOCS))
def test_documented_commands_compose(path):
    problems = command_problems(path)
    assert not problems, "\n".join(problems)


# ---- links ---------------------------------------------------------------------------------

_INLINE_LINK = re.compile(
    r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)"
)
_REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$")
_URL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)


def prose_lines(text: str) -> list[tuple[int, str]]:
    """The lines outside fenced blocks, inline code removed."""
    inside = {n for _, lines in code_blocks(text) for n, _ in lines}
    fences = {n for n, line in enumerate(text.splitlines(), 1) if _FENCE.match(line)}
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        if number not in inside and number not in fences:
            out.append((number, re.sub(r"(`+).*?\1", "", line)))
    return out


def github_slug(heading: str) -> str:
    """GitHub's anchor of a heading: markup dropped, lower case, punctuation but ``-`` and
    ``_`` removed, spaces as hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a Markdown file's headings (repeated ones numbered as GitHub does)."""
    seen: dict[str, int] = {}
    out = set()
    for _, line in prose_lines(path.read_text(encoding="utf-8")):
        m = re.match(r"^\s{0,3}#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = github_slug(m.group(1))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        out.add(slug if count == 0 else f"{slug}-{count}")
    out |= {m for _, line in prose_lines(path.read_text(encoding="utf-8"))
            for m in re.findall(r"<a\s+(?:name|id)=\"([^\"]+)\"", line)}  # fmt: skip
    return out


def link_problems(path: Path, root: Path = ROOT) -> list[str]:
    problems = []
    for number, line in prose_lines(path.read_text(encoding="utf-8")):
        targets = [m.group(1) for m in _INLINE_LINK.finditer(line)]
        m = _REFERENCE.match(line)
        if m:
            targets.append(m.group(1))
        for target in targets:
            if not target or _URL.match(target) or target.startswith("//"):
                continue
            where = f"{path.relative_to(root)}:{number}: ({target})"
            file_part, _, anchor = target.partition("#")
            file_part = file_part.split("?", 1)[0]
            if file_part.startswith("/"):
                resolved = root / file_part.lstrip("/")
            else:
                resolved = (path.parent / file_part) if file_part else path
            if not resolved.exists():
                full, top = resolved.resolve(), root.resolve()
                inside = top in full.parents
                problems.append(f"{where}: no such file {full.relative_to(top)}"
                                if inside else f"{where}: outside the repository")  # fmt: skip
                continue
            if anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                name = resolved.resolve().relative_to(root.resolve())
                problems.append(f"{where}: no heading #{anchor} in {name}")
    return problems


@pytest.mark.parametrize("path", DOCS, ids=_ids(DOCS))
def test_relative_links_resolve(path):
    problems = link_problems(path)
    assert not problems, "\n".join(problems)


# ---- the checks themselves -------------------------------------------------------------------


def test_the_command_check_finds_what_a_user_types(tmp_path):
    """The parser sees through make, torchrun, srun, pipes, comments and continuations, and
    composes what each stage would compose."""
    doc = (
        "```bash\n"
        'make train ARGS="model=base train.max_tokens=8192"   # a comment\n'
        'GPUS=8 make train ARGS="experiment=wmt14_en_de_base"\n'
        "torchrun --nnodes=2 --nproc_per_node=8 \\\n"
        "  .venv/bin/mt-train experiment=wmt14_en_de_big run_dir=/path/to/run\n"
        "echo 'Ein Mann.' | mt-translate checkpoint=best.pt decode.shortlist=.cache/mt/<key>/x\n"
        "python -m mt evaluate split=valid data.dir=... run_dir=/path/to/run\n"
        "make smoke\n"
        "```\n"
    )
    lines = shell_lines(doc)
    assert [n for n, _ in lines] == [2, 3, 4, 6, 7, 8]
    runs = [r for _, line in lines for r in invocations(line)]
    assert [(r.how, r.stage) for r in runs] == [
        ("make train", "prepare"), ("make train", "train"), ("make train", "evaluate"),
        ("make train", "prepare"), ("make train", "train"), ("make train", "evaluate"),
        ("mt-train", "train"), ("mt-translate", "translate"), ("python -m mt evaluate", "evaluate"),
        ("make smoke", "prepare"), ("make smoke", "train"), ("make smoke", "evaluate"),
    ]  # fmt: skip
    assert runs[-1].args == ["experiment=smoke"]
    path = tmp_path / "good.md"
    path.write_text(doc)
    assert _problems_of(path) == []
    assert compose(["model=base"], None).model.d_model == 512


def _problems_of(path: Path) -> list[str]:
    return command_problems(path, path.parent) + link_problems(path, path.parent)


@pytest.mark.parametrize(
    "command, expected",
    [
        ('make train ARGS="train.max_stepz=10"', "train.max_stepz"),  # a misspelt key
        ('make train ARGS="train.max_steps=ten"', "train.max_steps=ten"),  # a wrong type
        ("mt-train experiment=multi30k", "experiment/multi30k"),  # a missing experiment
        ("mt-train model=huge", "model/huge"),  # a missing preset
        ("mt-train model.norm=sideways", "model.norm=sideways: expected one of post | pre"),
        ("mt-train -m model.dropout=0.1,abc", "model.dropout=abc"),  # a sweep's second value
        ("mt-train model.dropout=0.1,0.3", "sweep"),  # a sweep without -m
        ("make trian", "make trian: no such target"),
        ("mt-trian experiment=smoke", "mt-trian: no such command"),
        ("mt-translate checkpoint=best.pt beam=5", "beam"),  # not one of translate's keys
        ("mt-train --epochs 3", "--epochs: not an option"),
    ],
)
def test_the_command_check_fails_a_wrong_command(tmp_path, command, expected):
    path = tmp_path / "bad.md"
    path.write_text(f"Intro.\n\n```bash\nmake train\n{command}\n```\n")
    problems = _problems_of(path)
    assert len(problems) == 1 and problems[0].startswith("bad.md:5: "), problems
    assert expected in problems[0], problems


def test_the_schema_lists_choices():
    choices = schema_choices()
    assert choices["model.norm"] == ("post", "pre")
    assert choices["train.best_metric"] == ("bleu", "chrf", "loss")
    assert choices["tokenizer.type"] == ("bpe", "unigram")
    assert choices["eval.split"] == ("valid", "test")
    assert choices["data.format"] == ("text", "tsv")
    assert "eval.bleu_tokenize" not in choices  # "13a | intl | zh | char | ...": open-ended
    assert "train.device" not in choices  # "auto | cpu | cuda | cuda:N": a pattern


def test_the_link_check_fails_a_broken_link(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "guide.md").write_text("# Training on many GPUs\n\n## Resume\n")
    path = tmp_path / "README.md"
    path.write_text(
        "# mt\n\n## Quick start (CPU)\n\n"
        "[guide](docs/guide.md) [many](docs/guide.md#training-on-many-gpus)\n"
        "[up](#quick-start-cpu) [folder](docs)\n"
        "[web](https://example.org/x.md) `[code](not/checked.md)`\n"
        "[gone](docs/missing.md) [anchor](docs/guide.md#resuming) [self](#nowhere)\n"
        "```\n[in a block](not/checked.md)\n```\n"
    )
    problems = link_problems(path, tmp_path)
    assert [p.split(": (")[0] for p in problems] == ["README.md:8"] * 3, problems
    assert "no such file docs/missing.md" in problems[0]
    assert "no heading #resuming" in problems[1] and "no heading #nowhere" in problems[2]


def test_github_slugs():
    assert (
        github_slug("Training on many GPUs (DDP, `torchrun`)")
        == "training-on-many-gpus-ddp-torchrun"
    )
    assert github_slug("de→en: 2,048 tokens & dropout_0.05") == "deen-2048-tokens--dropout_005"
    assert github_slug("[Link](x.md) text") == "link-text"


def test_every_document_is_seen():
    assert (ROOT / "README.md") in DOCS and len(DOCS) > 1
    assert os.path.commonpath([str(p) for p in DOCS]) == str(ROOT)
