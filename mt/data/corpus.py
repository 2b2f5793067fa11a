"""Stage 1: parallel text in, aligned sentence pairs out, one pair at a time (cleaning them is
``mt.data.cleaning``'s).

Three sources share one interface (:class:`Corpus`): a local directory of ``<split>.<lang>`` files
(the layout of shared/data/multi30k), a local ``<split>.tsv`` (``src<TAB>tgt``), and Hugging Face
``datasets.load_dataset`` (the hub, or local parquet/JSON files through ``data.hf_data_files``)
with either schema: a ``translation`` column of ``{lang: text}`` or one column per language.

Everything streams: a corpus yields raw lines pair by pair and :class:`Cleaner` filters them
pair by pair, so a 40M-pair corpus is never held in memory. Lines split on ``"\\n"`` alone; U+2028,
U+0085 and friends stay inside their sentence (``str.splitlines`` would split them).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mt import files
from mt.data.mixing import corpus_specs, directions
from mt.data.tokenizer import lang_tag
from mt.schema import DataConfig

log = logging.getLogger(__name__)

ROLES = ("train", "valid", "test")


class DataError(ValueError):
    """Bad or missing input data; the message says what was found and what to do."""


def split_names(value: Any) -> list[str]:
    """A split value as a list of names (one prefix, or a list of prefixes and
    ``{name, weight}`` corpora, :func:`mt.data.mixing.corpus_specs`)."""
    return [spec.name for spec in corpus_specs(value)]


def count_lines(path: Path) -> int:
    """Lines of a file as :func:`read_lines` sees them (a last line without newline counts)."""
    n, last = 0, b"\n"
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            n += block.count(b"\n")
            last = block[-1:]
    return n + (last != b"\n")


def read_lines(path: Path, errors: str = "strict") -> Iterator[str]:
    """Yield the lines of a UTF-8 file without their terminator, splitting on ``"\\n"`` only.

    On bytes that are not UTF-8, ``errors="strict"`` raises :class:`DataError` naming the file
    and 1-based line; ``"replace"`` substitutes U+FFFD and logs one warning with the number of
    lines affected.
    """
    replaced = 0
    try:
        with open(path, "rb") as f:  # binary iteration splits on b"\n" alone
            for lineno, raw in enumerate(f, 1):
                raw = files.strip_line_end(raw)
                try:
                    line = files.decode_line(raw, str(path), lineno)
                except files.TextError as err:
                    if b"\x00" in raw:
                        raise DataError(str(err)) from None
                    if errors != "replace":
                        raise DataError(f"{err}; fix the file or set data.errors=replace") from None
                    replaced += 1
                    line = raw.decode("utf-8", errors="replace")
                yield line
    finally:  # also when the reader stops early (data.max_train_pairs)
        if replaced:
            log.warning("%s: replaced invalid UTF-8 bytes on %d line(s)", path, replaced)


class Corpus:
    """A parallel corpus: ``pairs(role)`` yields (source, target) raw lines in file order, part
    after part (the names a split value lists, each a corpus of its own)."""

    def num_parts(self, role: str) -> int:
        """How many corpora the split of ``role`` names."""
        raise NotImplementedError

    def part_pairs(self, role: str, part: int) -> Iterator[tuple[str, str]]:
        """The (source, target) lines of one corpus of ``role``'s split."""
        raise NotImplementedError

    def pairs(self, role: str) -> Iterator[tuple[str, str]]:
        for part in range(self.num_parts(role)):
            yield from self.part_pairs(role, part)

    def identity(self) -> Any:
        """A JSON-able description of the exact input (for the prepared-data cache key)."""
        raise NotImplementedError

    def part_direction(self, role: str, part: int) -> str | None:
        """The direction (``de-en``) of one corpus of ``role``; None: the corpus has one."""
        return None


def direction_configs(cfg: DataConfig) -> list[tuple[str, DataConfig]]:
    """``(name, config)`` of each of ``data.directions``: ``cfg`` with that pair's languages."""
    out = []
    for spec in directions(cfg):
        src, tgt = spec.name.split("-")
        sub = dataclasses.replace(cfg, src_lang=src, tgt_lang=tgt, directions=[])
        out.append((spec.name, sub))
    return out


class DirectionsCorpus(Corpus):
    """Several directions as one corpus (``data.directions``): direction after direction, each
    with every corpus of the split, each non-blank source line behind its target language's
    :func:`lang_tag`. The tag is a source token (the encoder learns which language is asked
    for), so the decoder, the exporters and CTranslate2 see an ordinary model."""

    def __init__(self, corpora: list[tuple[str, Corpus]]):
        self.corpora = corpora

    def _locate(self, role: str, part: int) -> tuple[str, Corpus, int]:
        for name, corpus in self.corpora:
            if part < corpus.num_parts(role):
                return name, corpus, part
            part -= corpus.num_parts(role)
        raise IndexError(f"{role} has no corpus {part}")

    def num_parts(self, role: str) -> int:
        return sum(corpus.num_parts(role) for _, corpus in self.corpora)

    def part_direction(self, role: str, part: int) -> str | None:
        return self._locate(role, part)[0]

    def part_pairs(self, role: str, part: int) -> Iterator[tuple[str, str]]:
        name, corpus, part = self._locate(role, part)
        tag = lang_tag(name.split("-")[1]) + " "
        for src, tgt in corpus.part_pairs(role, part):
            yield (tag + src if src.strip() else src), tgt

    def identity(self) -> Any:
        return {name: corpus.identity() for name, corpus in self.corpora}


def _stat(path: Path) -> list:
    try:
        st = path.stat()
    except OSError as err:
        raise DataError(f"data file {path} cannot be read: {err}") from None
    return [str(path.resolve()), st.st_size, st.st_mtime_ns]


class TextCorpus(Corpus):
    """``<dir>/<prefix>.<lang>`` files (format ``text``) or ``<dir>/<prefix>.tsv`` (``tsv``)."""

    def __init__(self, cfg: DataConfig):
        self.cfg = cfg
        self.dir = Path(cfg.dir)
        if cfg.format not in ("text", "tsv"):
            raise DataError(f"data.format={cfg.format!r}: expected text or tsv")
        self.files = {role: self._files(role) for role in ROLES}

    def check(self) -> None:
        """Raise :class:`DataError` when the two sides of a text split differ in line count."""
        if self.cfg.format != "text":
            return
        for role in ROLES:
            for src, tgt in self.files[role]:
                ns, nt = count_lines(src), count_lines(tgt)
                if ns != nt:
                    raise DataError(
                        f"line counts differ: {src} has {ns} lines, {tgt} has {nt} lines"
                    )

    def _found(self) -> str:
        names = sorted(p.name for p in self.dir.iterdir() if p.is_file() and "." in p.name)
        prefixes = sorted({n.rsplit(".", 1)[0] for n in names})
        exts = sorted({n.rsplit(".", 1)[1] for n in names})
        return f"found in {self.dir}: splits {prefixes or 'none'}; languages/extensions {exts}"

    def _files(self, role: str) -> list[tuple[Path, ...]]:
        cfg = self.cfg
        names = split_names(getattr(cfg.splits, role))
        if not names:
            raise DataError(f"data.splits.{role} is empty; {self._found()}")
        out = []
        for name in names:
            if cfg.format == "tsv":
                paths: tuple[Path, ...] = (self.dir / f"{name}.tsv",)
            else:
                paths = tuple(self.dir / f"{name}.{lang}" for lang in (cfg.src_lang, cfg.tgt_lang))
            for path in paths:
                if not path.is_file():
                    raise DataError(
                        f"missing {role} split file {path} (data.splits.{role}={name}, "
                        f"src_lang={cfg.src_lang}, tgt_lang={cfg.tgt_lang}); "
                        f"{self._found()}"
                    )
            out.append(paths)
        return out

    def num_parts(self, role: str) -> int:
        return len(self.files[role])

    def part_pairs(self, role: str, part: int) -> Iterator[tuple[str, str]]:
        errors, paths = self.cfg.errors, self.files[role][part]
        if self.cfg.format == "tsv":
            yield from _tsv_pairs(paths[0], errors)
        else:
            src, tgt = read_lines(paths[0], errors), read_lines(paths[1], errors)
            yield from zip(src, tgt)
            for _ in itertools.chain(src, tgt):  # equal counts: finishes both readers
                pass

    def identity(self) -> Any:
        return {r: [[_stat(p) for p in ps] for ps in self.files[r]] for r in ROLES}


def _tsv_pairs(path: Path, errors: str) -> Iterator[tuple[str, str]]:
    for lineno, line in enumerate(read_lines(path, errors), 1):
        cols = line.split("\t")
        if len(cols) != 2:
            raise DataError(
                f"{path}, line {lineno}: expected 2 tab-separated columns (src<TAB>tgt), "
                f"found {len(cols)}"
            )
        yield cols[0], cols[1]


class HFCorpus(Corpus):
    """A ``datasets.load_dataset`` corpus; ``datasets`` is imported only here.

    With ``hf_path: parquet`` (or ``json``) and ``hf_data_files: {split: file(s)}`` the same code
    reads local files, which is how this path is tested without the hub.
    """

    def __init__(self, cfg: DataConfig, cache_dir: str | None = None, builder: Any = None):
        self.cfg = cfg
        builder = builder if builder is not None else hf_builder(cfg, cache_dir)
        builder.download_and_prepare()  # what datasets.load_dataset does with the builder
        self.ds = builder.as_dataset()
        self.revision = builder_revision(cfg, builder)
        hf_splits = cfg.hf_splits or cfg.splits
        self.names = {role: split_names(getattr(hf_splits, role)) for role in ROLES}
        langs = (cfg.src_lang, cfg.tgt_lang)
        for role, names in self.names.items():
            for name in names:
                if name not in self.ds:
                    raise DataError(
                        f"{cfg.hf_path}: no split {name!r} for {role}; found splits "
                        f"{sorted(self.ds)} (set data.hf_splits.{role} or data.splits.{role})"
                    )
                cols = self.ds[name].column_names
                if cfg.hf_schema == "translation":
                    if "translation" not in cols:
                        raise DataError(
                            f"{cfg.hf_path}/{name}: no 'translation' column; found "
                            f"{cols} (set data.hf_schema=columns?)"
                        )
                    empty = len(self.ds[name]) == 0
                    found = sorted(langs if empty else self.ds[name][0]["translation"])
                elif cfg.hf_schema == "columns":
                    found = cols
                else:
                    raise DataError(f"data.hf_schema={cfg.hf_schema!r}: translation|columns")
                missing = [lang for lang in langs if lang not in found]
                if missing:
                    raise DataError(
                        f"{cfg.hf_path}/{name}: no language {missing} (schema "
                        f"{cfg.hf_schema}); found {found}"
                    )

    def num_parts(self, role: str) -> int:
        return len(self.names[role])

    def part_pairs(self, role: str, part: int) -> Iterator[tuple[str, str]]:
        src, tgt = self.cfg.src_lang, self.cfg.tgt_lang
        ds = self.ds[self.names[role][part]]
        if self.cfg.hf_schema == "translation":
            for batch in ds.select_columns(["translation"]).iter(batch_size=1000):
                for row in batch["translation"]:
                    yield _one_line(row[src]), _one_line(row[tgt])
        else:
            for batch in ds.select_columns([src, tgt]).iter(batch_size=1000):
                yield from zip(map(_one_line, batch[src]), map(_one_line, batch[tgt]))

    def identity(self) -> Any:
        return hf_identity(self.cfg, self.revision)


SCRIPT_ONLY = "Dataset scripts are no longer supported"  # datasets >= 4 on a loading script
# Parquet copies of the hub's script-only datasets (the hub's own export, as its layout was).
PARQUET_ALTERNATIVES = {
    "iwslt2017": "data.hf_path=IWSLT/iwslt2017 data.revision=refs/convert/parquet "
    "data.hf_name=null data.hf_data_dir=<its config, e.g. iwslt2017-de-en>",
}


def hf_builder(cfg: DataConfig, cache_dir: str | None = None) -> Any:
    """``datasets.load_dataset_builder`` for the configured dataset (no data read yet: the hub
    dataset's card and file list, or the cached copy offline); ``datasets`` is imported here.
    A loading-script dataset (datasets >= 4 runs none) is a one-line DataError naming a parquet
    alternative.
    """
    import datasets

    try:
        return datasets.load_dataset_builder(
            cfg.hf_path, cfg.hf_name, data_dir=cfg.hf_data_dir,
            data_files=_plain(cfg.hf_data_files), cache_dir=cache_dir, revision=cfg.revision,
        )  # fmt: skip
    except RuntimeError as err:
        if SCRIPT_ONLY not in str(err):
            raise
        name = str(cfg.hf_path).rsplit("/", 1)[-1]
        alternative = PARQUET_ALTERNATIVES.get(
            name, "its parquet export: data.revision=refs/convert/parquet (and "
            "data.hf_data_dir=<config> when it has several), or a parquet copy with "
            "data.hf_path=parquet data.hf_data_files={train: ..., validation: ..., test: ...}",
        )  # fmt: skip
        raise DataError(
            f"data.hf_path={cfg.hf_path} is a loading-script dataset, which datasets "
            f"{datasets.__version__} does not run; load {alternative}"
        ) from None


def builder_revision(cfg: DataConfig, builder: Any) -> str | None:
    """The revision a builder reads: for a hub dataset the commit ``datasets`` resolved
    (online) or the cached copy's it reads (offline); None for a local folder or local data
    files (their paths, sizes and times identify them, :func:`hf_identity`)."""
    import datasets.packaged_modules as packaged

    if cfg.hf_path in packaged._PACKAGED_DATASETS_MODULES or Path(cfg.hf_path).is_dir():
        return None
    return str(builder.hash) if getattr(builder, "hash", None) else None


def _one_line(text: str | None) -> str:
    """A dataset field as one line: a newline inside a field would break line alignment."""
    return "" if text is None else text.replace("\r\n", " ").replace("\n", " ")


def _plain(value: Any) -> Any:
    """OmegaConf-free copy of a config value (dicts and lists)."""
    if isinstance(value, dict) or hasattr(value, "items"):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _stat_file(path: str) -> Any:
    """A data file's identity: a local one's path, size and time; a URL (``hf://``, ``https://``)
    as written (its revision, when it names one, is in it)."""
    return path if "://" in path else _stat(Path(path))


def hf_identity(cfg: DataConfig, revision: str | None = None) -> Any:
    """The HF source's identity (local data files: path, size, mtime) and ``revision``, the one
    the dataset resolved to (:func:`builder_revision`; absent when None)."""
    files = _plain(cfg.hf_data_files)
    if isinstance(files, dict):
        files = {k: [_stat_file(p) for p in split_names(v)] for k, v in files.items()}
    elif files is not None:
        files = [_stat_file(p) for p in split_names(files)]
    out = {"hf_path": cfg.hf_path, "hf_name": cfg.hf_name, "data_files": files}
    if cfg.hf_path and Path(cfg.hf_path).is_dir():  # a local copy of a dataset repository
        folder = Path(cfg.hf_path, cfg.hf_data_dir or "")
        out["folder"] = [_stat(p) for p in sorted(folder.rglob("*")) if p.is_file()]
    if cfg.hf_data_dir is not None:
        out["data_dir"] = cfg.hf_data_dir
    if revision is not None:
        out["revision"] = revision
    return out


def open_corpus(cfg: DataConfig, hf_cache_dir: str | None = None, builder: Any = None) -> Corpus:
    """The corpus that ``data.source`` names, checked up front (splits, languages, line counts).

    ``auto`` takes the local directory when it exists, else the hub; when neither works the error
    says what to set or download. There is never a silent fallback to a different corpus.
    Missing files, splits or languages, or unequal line counts raise DataError.
    """
    if cfg.source not in ("auto", "local", "hf"):
        raise DataError(f"data.source={cfg.source!r}: expected auto, local or hf")
    if cfg.directions:
        return DirectionsCorpus([(name, open_corpus(sub, hf_cache_dir, builder))
                                 for name, sub in direction_configs(cfg)])  # fmt: skip
    has_dir = cfg.dir is not None and Path(cfg.dir).is_dir()
    if cfg.source == "local" or (cfg.source == "auto" and has_dir):
        if not has_dir:
            raise DataError(
                f"data.dir={cfg.dir!r} is not a directory: set data.dir=PATH (or MT_DATA_DIR "
                f"for the shipped data configs) to a folder of <split>.<lang> files"
            )
        corpus = TextCorpus(cfg)
        corpus.check()
        return corpus
    if cfg.source == "hf":
        return HFCorpus(cfg, hf_cache_dir, builder)
    if not cfg.hf_path:
        raise DataError(
            f"no corpus for data={cfg.name}: local directory {cfg.dir!r} does not exist and no "
            f"hub dataset is configured; set MT_DATA_DIR (or data.dir=PATH) to the corpus folder"
        )
    try:
        return HFCorpus(cfg, hf_cache_dir, builder)
    except DataError:
        raise
    except Exception as err:  # no network, unknown dataset, ...
        raise _no_corpus(cfg, err) from err


def resolve_hf(cfg: DataConfig, hf_cache_dir: str | None = None) -> Any:
    """The builder of the HF dataset ``data.source`` takes (None: local files, or no dataset
    configured), errors as :func:`open_corpus` reports them."""
    if not uses_hf(cfg) or not cfg.hf_path:
        return None
    try:
        return hf_builder(cfg, hf_cache_dir)
    except DataError:
        raise
    except Exception as err:
        if cfg.source == "hf":
            raise
        raise _no_corpus(cfg, err) from err


def _no_corpus(cfg: DataConfig, err: Exception) -> DataError:
    return DataError(
        f"no corpus for data={cfg.name}: local directory {cfg.dir!r} does not exist and the "
        f"hub dataset {cfg.hf_path!r} could not be loaded ({type(err).__name__}: {err}). Set "
        f"MT_DATA_DIR (or data.dir=PATH) to a folder of <split>.<lang> files, or download "
        f"the dataset with network access (datasets.load_dataset({cfg.hf_path!r}"
        f"{', ' + repr(cfg.hf_name) if cfg.hf_name else ''})) first"
    )


def uses_hf(cfg: DataConfig) -> bool:
    """Whether ``data.source`` takes the Hugging Face dataset (else the local files)."""
    has_dir = cfg.dir is not None and Path(cfg.dir).is_dir()
    return not (cfg.source == "local" or (cfg.source == "auto" and has_dir))


def corpus_identity(cfg: DataConfig, revision: str | None = None) -> Any:
    """What identifies the input for the cache key, without reading a HF dataset's rows
    (``revision``: the one its builder resolved, :func:`builder_revision`)."""
    if cfg.directions:
        return {name: corpus_identity(sub, revision) for name, sub in direction_configs(cfg)}
    if not uses_hf(cfg):
        return TextCorpus(cfg).identity()
    return hf_identity(cfg, revision)
