"""mt-serve: the JSON API through FastAPI's test client, the decoding queue, and bad input.

A tiny random-weight checkpoint (no corpora needed). Every bad input listed in the issue gets a
4xx with a JSON error, and the server answers correctly afterwards; concurrent requests are
decoded together and each gets its own sentences back, in its order.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from fastapi.testclient import TestClient  # noqa: E402
from test_translate import make_tokenizer, sentences, write_checkpoint  # noqa: E402

from mt.decode.translate import Translator  # noqa: E402
from mt.schema import DecodeConfig, ServeConfig  # noqa: E402
from mt.serve.request_queue import Batcher, Job  # noqa: E402
from mt.serve.server import create_app, run_info  # noqa: E402

FAST = dict(beam_size=2, max_len_a=0.0, max_len_b=5, batch_size=64)
LIMITS = ServeConfig(max_body_bytes=2000, max_sentences=8, max_chars=400, max_beam=4,
                     batch_sentences=32, batch_wait_ms=30.0)  # fmt: skip


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    return write_checkpoint(tmp / "best.pt", make_tokenizer(tmp, 60), max_positions=64)


@pytest.fixture(scope="module")
def translator(ckpt):
    return Translator.from_checkpoint(ckpt, device="cpu", decode_cfg=DecodeConfig(**FAST))


@pytest.fixture(scope="module")
def client(ckpt, translator):
    app = create_app(translator, LIMITS, run_info(ckpt, translator))
    with TestClient(app) as c:
        yield c


def test_translate_matches_the_translator(client, translator):
    text = sentences(5)
    r = client.post("/translate", json={"text": text, "beam_size": 3, "nbest": 2})
    assert r.status_code == 200
    got = r.json()["translations"]
    expected = translator.translate_nbest(text, beam_size=3, nbest=2)
    assert [[(h["text"], h["score"]) for h in t["nbest"]] for t in got] == [
        [(a, pytest.approx(b, abs=1e-5)) for a, b in hyps] for hyps in expected
    ]
    assert [t["text"] for t in got] == translator.translate(text, beam_size=3)
    assert all(len(t["nbest"]) == 2 for t in got)
    # Without beam_size the server's own (2 here) bounds nbest.
    r = client.post("/translate", json={"text": text[:1], "nbest": 2})
    assert r.status_code == 200 and len(r.json()["translations"][0]["nbest"]) == 2


def test_sampling_matches_the_translator_and_is_reproducible(client, translator):
    text = sentences(4)
    body = {"text": text, "sample": True, "top_k": 5, "temperature": 1.5, "seed": 3}
    first = client.post("/translate", json=body)
    assert first.status_code == 200, first.text
    got = [t["text"] for t in first.json()["translations"]]
    expected = translator.translate_nbest(text, sample=True, top_k=5, temperature=1.5, seed=3,
                                          nbest=1)  # fmt: skip
    assert got == [hyps[0][0] for hyps in expected]
    # Sent together with other requests, a sampled request still gets the same draws.
    with ThreadPoolExecutor(4) as pool:
        others = [pool.submit(client.post, "/translate", json={"text": text[::-1]})
                  for _ in range(3)]  # fmt: skip
        again = client.post("/translate", json=body)
        assert all(f.result().status_code == 200 for f in others)
    assert [t["text"] for t in again.json()["translations"]] == got
    other_seed = client.post("/translate", json={**body, "seed": 4}).json()["translations"]
    assert len(other_seed) == len(text)


def test_health_info_and_page(client):
    assert client.get("/health").json() == {"status": "ok"}
    info = client.get("/info").json()
    assert info["step"] == 7 and info["parameters"] > 0 and info["limits"]["max_sentences"] == 8
    page = client.get("/")
    assert page.status_code == 200 and 'id="heatmap"' in page.text


def test_attention_endpoint(client, translator):
    r = client.post("/attention", json={"text": "ein mann fährt"})
    assert r.status_code == 200
    data = r.json()
    src, tgt, matrix = translator.attention("ein mann fährt")
    assert data["source"] == src and data["target"] == tgt
    assert len(data["weights"]) == len(tgt) and len(data["weights"][0]) == len(src)
    assert all(abs(sum(row) - 1) < 1e-2 for row in data["weights"])


def _body(text: list[str]) -> bytes:
    return json.dumps({"text": text}).encode()


BAD = [
    ("empty body", b"", 400, "empty"),
    ("not JSON", b"{text: 1", 400, "not valid JSON"),
    ("invalid UTF-8", b'{"text": ["\xff\xfe"]}', 400, "UTF-8"),
    ("lone surrogate", b'{"text": ["a\\ud800"]}', 400, "text[0] is not valid Unicode"),
    ("not an object", b'["a"]', 422, "JSON object"),
    ("no text", b'{"beam_size": 2}', 422, "'text' is missing"),
    ("text a string", b'{"text": "ein mann"}', 422, "must be a list"),
    ("text empty", b'{"text": []}', 422, "empty"),
    ("sentence a number", b'{"text": ["ein", 5]}', 422, "text[1] must be a string"),
    ("beam a string", b'{"text": ["ein"], "beam_size": "4"}', 422, "'beam_size' must be an"),
    ("beam a bool", b'{"text": ["ein"], "beam_size": true}', 422, "'beam_size' must be an"),
    ("beam too large", b'{"text": ["ein"], "beam_size": 50}', 422, "serve.max_beam=4"),
    ("nbest > beam", b'{"text": ["ein"], "beam_size": 2, "nbest": 3}', 422, "'nbest'"),
    ("unknown option", b'{"text": ["ein"], "temprature": 1}', 422, "unknown option"),
    ("sampling without sample", b'{"text": ["ein"], "top_k": 5}', 422, "only apply with"),
    ("sample a string", b'{"text": ["ein"], "sample": "yes"}', 422, "true or false"),
    ("sample with nbest", b'{"text": ["ein"], "sample": true, "nbest": 2}', 422, "one translation"),
    ("top_p zero", b'{"text": ["ein"], "sample": true, "top_p": 0}', 422, "'top_p' must be"),
    ("negative temperature", b'{"text": ["ein"], "sample": true, "temperature": -1}', 422,
     "'temperature' must be"),
    ("a path", b'{"text": ["ein"], "checkpoint": "/etc/passwd"}', 422, "unknown option"),
    ("too many", _body(["ein"] * 9), 413, "max_sentences=8"),
    ("too long", _body(["a" * 401]), 422, "serve.max_chars=400"),
    ("too many tokens", _body([" ".join(["mann"] * 70)]), 422, "max_positions"),
    ("body too large", _body([" " * 3000]), 413, "max_body_bytes=2000"),
]  # fmt: skip


@pytest.mark.parametrize("name,body,status,message", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_a_clear_4xx_and_the_server_keeps_working(client, name, body, status,
                                                               message):  # fmt: skip
    r = client.post("/translate", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    assert message in r.json()["error"]
    ok = client.post("/translate", json={"text": ["ein hund"]})
    assert ok.status_code == 200 and len(ok.json()["translations"]) == 1


def test_body_over_the_limit_without_content_length(client):
    def chunks():
        for _ in range(5):
            yield b" " * 1000

    r = client.post("/translate", content=chunks())  # chunked: no Content-Length header
    assert r.status_code == 413 and "max_body_bytes" in r.json()["error"]


def test_unknown_path_and_method_are_json_errors(client):
    r = client.get("/etc/passwd")
    assert r.status_code == 404 and "error" in r.json()
    assert client.get("/translate").status_code == 405


def test_concurrent_requests_are_batched_and_answered_in_order(client, translator):
    """16 clients at once: each gets its own sentences' translations, in its order, and the
    queue decoded them in fewer calls than requests."""
    requests = [sentences(1 + i % 3, seed=100 + i) for i in range(16)]
    expected = [translator.translate(text, beam_size=2) for text in requests]
    batcher = client.app.state.batcher
    before = batcher.batches
    barrier = threading.Barrier(16)

    def one(text):
        barrier.wait()
        r = client.post("/translate", json={"text": text, "beam_size": 2})
        return [t["text"] for t in r.json()["translations"]]

    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(one, requests))
    assert got == expected
    assert batcher.batches - before < 16


class _Recorder:
    """A stub translator recording each call's sentences (sentence -> its reversal)."""

    def __init__(self):
        self.calls = []

    def translate_nbest(self, sentences, first_line=1, **options):
        self.calls.append((list(sentences), options))
        if "bad" in sentences:
            raise ValueError("line 1 is bad")
        time.sleep(0.01)
        return [[(s[::-1], -1.0)] for s in sentences]


def test_batcher_groups_by_options_and_isolates_failures():
    stub = _Recorder()
    batcher = Batcher(stub, max_sentences=100, wait_ms=200)
    jobs = [Job(["ab", "cd"], {"beam_size": 2}), Job(["ef"], {"beam_size": 2}),
            Job(["gh"], {"beam_size": 4}), Job(["bad"], {"beam_size": 2})]  # fmt: skip
    futures = [batcher.submit(job) for job in jobs]
    assert futures[0].result(5) == [[("ba", -1.0)], [("dc", -1.0)]]
    assert futures[1].result(5) == [[("fe", -1.0)]]
    assert futures[2].result(5) == [[("hg", -1.0)]]
    with pytest.raises(ValueError, match="bad"):
        futures[3].result(5)
    first = stub.calls[0]
    assert first == (["ab", "cd", "ef", "bad"], {"beam_size": 2})  # one call for beam 2
    assert (["gh"], {"beam_size": 4}) in stub.calls
    batcher.close()


def test_queue_limit_is_a_503(translator):
    app = create_app(translator, ServeConfig(queue_size=0), {})
    with TestClient(app) as c:
        r = c.post("/translate", json={"text": ["ein"]})
        assert r.status_code == 503 and "serve.queue_size=0" in r.json()["error"]
        assert c.get("/health").status_code == 200


@pytest.mark.slow
def test_bench_serve_runs_the_server_command(ckpt, tmp_path):
    """`bench.py serve` starts `python -m mt serve` on loopback and reports both client counts."""
    import subprocess
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[1] / "scripts" / "bench.py"
    proc = subprocess.run(
        [sys.executable, str(bench), "serve", "--checkpoint", str(ckpt), "--requests", "8",
         "--clients", "1", "4", "--beam", "2", "--threads", "1", "--seconds", "60",
         "--rounds", "1"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    by_clients = {r["clients"]: r for r in records if "clients" in r}
    assert set(by_clients) == {1, 4}
    for r in by_clients.values():
        assert r["requests"] == 8 and r["sentences"] == 8
        assert r["sent_per_s"] > 0 and 0 < r["p50_ms"] <= r["p99_ms"]
    assert any("ratio" in r for r in records)


def test_info_reads_languages_and_bleu_of_the_run(tmp_path, ckpt, translator):
    """A checkpoint inside a run directory: /info reports its languages and test BLEU."""
    import shutil

    from mt.config import load_config, to_yaml

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copy(ckpt, run / "checkpoints" / "best.pt")
    (run / "config.yaml").write_text(to_yaml(load_config(["experiment=multi30k_en_de"])))
    results = {"bleu": 38.1, "signature": "nrefs:1", "split": "test"}
    (run / "results.json").write_text(json.dumps(results))
    info = run_info(run / "checkpoints" / "best.pt", translator)
    assert (info["source_lang"], info["target_lang"]) == ("en", "de")
    assert info["bleu"] == results
    assert run_info(ckpt, translator)["bleu"] is None
