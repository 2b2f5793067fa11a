"""Every entry point answers a user error (a bad file, a bad line, a bad setting) with one line
naming the file, line or key and exit status 1, never a traceback; and the text edge cases
(empty splits, NUL bytes, lone carriage returns, only empty lines, line breaks inside decoded
pieces) are refused or handled the same way on every path.

The entry points run in this process (the Hydra apps with a patched ``sys.argv``), so each case
costs no interpreter start-up."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from mt import cli
from mt.config import load_config
from mt.train.recipe import train

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from fault_inject import make_corpus, overrides  # noqa: E402

ENTRY = {
    "prepare": cli.prepare_main,
    "train": cli.train_main,
    "translate": cli.translate_main,
    "evaluate": cli.evaluate_main,
}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A good corpus, damaged copies of it, a checkpoint and text files."""
    base = tmp_path_factory.mktemp("cli")
    good = make_corpus(base / "good")
    cache = base / "cache"
    run = base / "run"
    train(load_config(overrides(good, cache, run, 1)))

    def variant(name: str, split_file: str, lineno: int, raw: bytes) -> Path:
        """A copy of the good corpus with line ``lineno`` of ``split_file`` replaced."""
        d = make_corpus(base / name)
        lines = (d / split_file).read_bytes().split(b"\n")
        lines[lineno - 1] = raw
        (d / split_file).write_bytes(b"\n".join(lines))
        return d

    files = base / "files"
    files.mkdir()
    (files / "bad_utf8.txt").write_bytes(b"ein hund\nein \xff mann\n")
    (files / "nul.txt").write_bytes(b"ein hund\nfrau\nkind \x00 spielt\n")
    (files / "two.txt").write_text("a man\na dog\n")
    (files / "three.txt").write_text("a man\na dog\na bike\n")
    return {
        "good": good,
        "cache": cache,
        "ckpt": run / "checkpoints" / "last.pt",
        "files": files,
        "missing_test": _without(make_corpus(base / "missing"), "test.en"),
        "bad_utf8": variant("bad_utf8", "train.de", 2, b"ein \xc3\x28 mann"),
        "nul": variant("nul", "train.en", 1, b"a man\x00"),
        "empty_valid": _empty(make_corpus(base / "empty_valid"), "valid", b""),
        "blank_valid": _empty(make_corpus(base / "blank_valid"), "valid", b"\n" * 20),
        "blank_train": _empty(make_corpus(base / "blank_train"), "train", b"\n" * 300),
    }  # fmt: skip


def _without(directory: Path, name: str) -> Path:
    (directory / name).unlink()
    return directory


def _empty(directory: Path, split: str, content: bytes) -> Path:
    for lang in ("de", "en"):
        (directory / f"{split}.{lang}").write_bytes(content)
    return directory


def run_entry(tool: str, args: list[str], monkeypatch, capsys) -> tuple[int, str, str]:
    """Run ``mt-<tool> args`` in this process; returns (exit status, stdout, stderr)."""
    monkeypatch.setattr(sys, "argv", [f"mt-{tool}", *args])
    status = 0
    try:
        ENTRY[tool]()
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else 1
        if not isinstance(e.code, int) and e.code is not None:
            sys.stderr.write(f"{e.code}\n")
    out = capsys.readouterr()
    return status, out.out, out.err


def data_args(world, name: str, tmp_path: Path, *extra: str) -> list[str]:
    data = world[name]
    return [*overrides(data, tmp_path / "cache", tmp_path / "run", 1), *extra]


def assert_one_line_error(status: int, err: str, *expected: str) -> None:
    assert status == 1, err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if "error" in line.lower() or "mt-" in line]
    assert len(lines) == 1, err
    for text in expected:
        assert text in lines[0], lines[0]


# ---------------------------------------------------------------- mt-prepare and mt-train (data)

DATA_CASES = {
    "missing file": ("missing_test", ["missing test split file", "test.en"]),
    "invalid UTF-8": ("bad_utf8", ["train.de, line 2: not valid UTF-8"]),
    "NUL byte": ("nul", ["train.en, line 1: holds a NUL byte"]),
    "empty valid split": ("empty_valid", ["the valid split", "has no lines"]),
    "only empty lines (valid)": ("blank_valid", ["the valid split", "only empty lines"]),
    "only empty lines (train)": ("blank_train", ["no training pairs left", "empty=300"]),
}


@pytest.mark.parametrize("tool", ["prepare", "train"])
@pytest.mark.parametrize("case", sorted(DATA_CASES))
def test_data_errors(tool, case, world, tmp_path, monkeypatch, capsys):
    name, expected = DATA_CASES[case]
    status, _, err = run_entry(tool, data_args(world, name, tmp_path), monkeypatch, capsys)
    assert_one_line_error(status, err, f"mt-{tool}: error:", *expected)
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize(
    ("tool", "setting", "expected"),
    [
        ("prepare", "data.format=xml", ["data.format='xml'"]),
        ("train", "train.best_metric=accuracy", ["train.best_metric must be bleu, chrf or loss"]),
        ("train", "train.init_from=/nonexistent/x.pt", ["no checkpoint at /nonexistent/x.pt"]),
    ],
)
def test_bad_settings(tool, setting, expected, world, tmp_path, monkeypatch, capsys):
    args = data_args(world, "good", tmp_path, setting)
    status, _, err = run_entry(tool, args, monkeypatch, capsys)
    assert_one_line_error(status, err, f"mt-{tool}: error:", *expected)


@pytest.mark.parametrize("tool", list(ENTRY))
def test_a_wrong_type_names_the_key_without_a_traceback(tool, monkeypatch, capsys):
    status, _, err = run_entry(tool, ["train.max_steps=many"], monkeypatch, capsys)
    assert_one_line_error(status, err, f"mt-{tool}: error:", "train.max_steps", "'many'")
    status, _, err = run_entry(tool, ["model.d_modle=3"], monkeypatch, capsys)
    assert_one_line_error(status, err, f"mt-{tool}: error:", "Key 'd_modle' not in 'ModelConfig'")


# --------------------------------------------------------------------------------- mt-translate


def test_translate_errors(world, tmp_path, monkeypatch, capsys):
    files, ckpt = world["files"], world["ckpt"]
    cases = [
        ([f"checkpoint={tmp_path / 'no.pt'}"], ["no checkpoint at"]),
        ([f"checkpoint={ckpt}", f"input={tmp_path / 'no.txt'}"], ["no.txt", "No such file"]),
        ([f"checkpoint={ckpt}", f"input={files / 'bad_utf8.txt'}"],
         ["bad_utf8.txt, line 2: not valid UTF-8"]),
        ([f"checkpoint={ckpt}", f"input={files / 'nul.txt'}"], ["nul.txt, line 3: holds a NUL"]),
    ]  # fmt: skip
    for args, expected in cases:
        status, _, err = run_entry("translate", [*args, "train.device=cpu"], monkeypatch, capsys)
        assert_one_line_error(status, err, "mt-translate:", *expected)
    # stdin is read the same way as a file
    monkeypatch.setattr(sys, "stdin", _stdin(b"ok\nbad \xff\n"))
    status, _, err = run_entry("translate", [f"checkpoint={ckpt}"], monkeypatch, capsys)
    assert_one_line_error(status, err, "stdin, line 2: not valid UTF-8")


def _stdin(data: bytes):
    import io

    return io.TextIOWrapper(io.BytesIO(data), encoding="utf-8")


def test_translate_splits_files_and_stdin_alike(world, tmp_path, monkeypatch, capsys):
    """A lone \\r stays inside its line; \\r\\n ends a line; empty lines give empty lines;
    a file of only empty lines gives only empty lines; the output file appears complete."""
    ckpt = world["ckpt"]
    text = b"ein hund\rrennt\r\n\nfrau\n\n"
    (tmp_path / "in.de").write_bytes(text)
    args = [f"checkpoint={ckpt}", "train.device=cpu", "decode.beam_size=1", "decode.max_len_b=3"]
    status, _, _ = run_entry(
        "translate", [*args, f"input={tmp_path / 'in.de'}", f"output={tmp_path / 'o'}"],
        monkeypatch, capsys,
    )  # fmt: skip
    assert status == 0
    from_file = (tmp_path / "o").read_text(encoding="utf-8").split("\n")
    assert len(from_file) == 5 and from_file[1] == from_file[3] == from_file[4] == ""
    monkeypatch.setattr(sys, "stdin", _stdin(text))
    status, out, _ = run_entry("translate", args, monkeypatch, capsys)
    assert status == 0 and out.split("\n") == from_file
    (tmp_path / "blank.de").write_bytes(b"\n\n\n")
    status, _, _ = run_entry(
        "translate", [*args, f"input={tmp_path / 'blank.de'}", f"output={tmp_path / 'b'}"],
        monkeypatch, capsys,
    )  # fmt: skip
    assert status == 0 and (tmp_path / "b").read_text() == "\n\n\n"
    assert not [p for p in tmp_path.iterdir() if ".tmp" in p.name]


def test_decoded_line_breaks_never_split_an_output_line(world):
    """A hypothesis whose pieces decode to a line break comes out as one line (a space)."""
    from mt.decode.translate import Translator

    translator = Translator.from_checkpoint(world["ckpt"])
    sp = translator.tokenizer.model("tgt")
    text = "a\nb\r\nc\rd"
    ids = [sp.piece_to_id(p) for p in ("▁a", "▁b")]

    class Newlines:  # stands in for SentencePiece's decode of byte-fallback "\n" pieces
        def decode(self, batch):
            return [text for _ in batch]

    real = translator.tokenizer.models
    translator.tokenizer.models = [Newlines()]
    try:
        assert translator.tokenizer.decode([ids]) == ["a b c d"]
    finally:
        translator.tokenizer.models = real


# --------------------------------------------------------------------------------- mt-evaluate


def test_evaluate_errors(world, tmp_path, monkeypatch, capsys):
    files = world["files"]
    two, three = files / "two.txt", files / "three.txt"
    (tmp_path / "empty.txt").write_bytes(b"")
    cases = [
        ([f"hyp={tmp_path / 'no.txt'}", f"ref={two}"], ["no.txt", "No such file"]),
        ([f"hyp={two}", f"ref={three}"], [f"{two} has 2 lines but {three} has 3"]),
        ([f"hyp={files / 'nul.txt'}", f"ref={three}"], ["nul.txt, line 3: holds a NUL byte"]),
        ([f"hyp={tmp_path / 'empty.txt'}", f"ref={tmp_path / 'empty.txt'}"],
         ["nothing to score: 0 hypotheses"]),
        ([f"hyp={two}"], ["needs ref=FILE"]),
        (["split=train", f"run_dir={tmp_path}"], ["split must be valid or test"]),
    ]  # fmt: skip
    for args, expected in cases:
        status, _, err = run_entry("evaluate", args, monkeypatch, capsys)
        assert_one_line_error(status, err, "mt-evaluate: error:", *expected)
