"""``mt-serve checkpoint=PATH [host=127.0.0.1 port=8000]``: a translation server and a web page.

Built on FastAPI (Starlette) and uvicorn (``pip install mt[serve]``):

* ``POST /translate`` ``{"text": [sentences], "beam_size": 4, "nbest": 1, "alpha": 1.0}`` ->
  ``{"translations": [{"text": best, "score": s, "nbest": [{"text", "score"}, ...]}, ...]}``,
  one entry per sentence in request order;
* ``POST /attention`` ``{"text": sentence, ...options}`` -> the source and output pieces and the
  last decoder layer's cross-attention (one row per output piece), for the page's heat map;
* ``GET /health``, ``GET /info`` (languages, parameters, checkpoint step, BLEU of its run if
  known), and ``GET /`` the page (type sentences, see translations, n-best, heat map).

Requests go through :class:`mt.serve.request_queue.Batcher`: those arriving together are decoded
together. Every bad input is a 4xx with ``{"error": message}`` naming what was wrong and the
limit (the ``serve.*`` settings); the server keeps running. It binds 127.0.0.1 unless told
otherwise and never reads a path from a request: the only file it serves is its own page.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse
from starlette.exceptions import HTTPException

from mt.checkpoint import load_checkpoint
from mt.decode.translate import Translator, load_translator
from mt.schema import Config, ServeConfig
from mt.serve.request_queue import Batcher, Job, QueueFull

log = logging.getLogger(__name__)

PAGE = Path(__file__).resolve().parent / "static" / "index.html"
# Per-request decoding options: search, and sampling (decode=sample) with its settings.
OPTIONS = {
    "beam_size": int, "nbest": int, "alpha": float,
    "sample": bool, "temperature": float, "top_k": int, "top_p": float, "seed": int,
}  # fmt: skip
SAMPLING = {"temperature": (0.0, 100.0), "top_k": (0, 1 << 20), "top_p": (1e-9, 1.0),
            "seed": (0, (1 << 63) - 1)}  # fmt: skip


class BadRequest(ValueError):
    """A request the server refuses; ``status`` is the HTTP code (4xx)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _number(name: str, value: Any, kind: type) -> int | float | bool:
    """``value`` as ``kind`` (JSON booleans are not numbers; 3.0 is not an int)."""
    if kind is bool:
        if not isinstance(value, bool):
            raise BadRequest(422, f"'{name}' must be true or false, got {json.dumps(value)}")
        return value
    ok = isinstance(value, int) if kind is int else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok:
        raise BadRequest(422, f"'{name}' must be {'an integer' if kind is int else 'a number'}, "
                              f"got {json.dumps(value)}")  # fmt: skip
    return kind(value)


def parse_options(
    body: dict, limits: ServeConfig, allowed: set[str], default_beam: int = 1
) -> dict[str, Any]:
    """Check the options of a request body (everything but ``text``) against the limits;
    ``default_beam`` is the server's beam size (the bound of ``nbest`` when none is given)."""
    unknown = sorted(set(body) - allowed - {"text"})
    if unknown:
        raise BadRequest(422, f"unknown option(s) {unknown}; allowed: {sorted(allowed)}")
    options = {k: _number(k, body[k], OPTIONS[k]) for k in allowed if k in body}
    beam = options.get("beam_size")
    if beam is not None and not 1 <= beam <= limits.max_beam:
        raise BadRequest(422, f"'beam_size' must be between 1 and serve.max_beam="
                              f"{limits.max_beam}, got {beam}")  # fmt: skip
    beam = beam or default_beam
    if "nbest" in options and not 1 <= options["nbest"] <= beam:
        raise BadRequest(422, f"'nbest' must be between 1 and beam_size={beam}, got "
                              f"{options['nbest']}")  # fmt: skip
    if "alpha" in options and not 0.0 <= options["alpha"] <= 10.0:
        raise BadRequest(422, f"'alpha' must be between 0 and 10, got {options['alpha']}")
    _check_sampling(options)
    return options


def _check_sampling(options: dict[str, Any]) -> None:
    """Sampling settings are in range and come with ``"sample": true``; a sample is one draw,
    so ``nbest`` stays 1 and ``beam_size`` is not given."""
    given = [k for k in SAMPLING if k in options]
    if not options.get("sample"):
        if given:
            raise BadRequest(422, f'{given} only apply with "sample": true')
        return
    if options.get("nbest", 1) != 1 or "beam_size" in options:
        raise BadRequest(422, "'sample' draws one translation: no 'beam_size', 'nbest' 1")
    for key in given:
        low, high = SAMPLING[key]
        if not low <= options[key] <= high:
            raise BadRequest(422, f"'{key}' must be between {low} and {high}, got {options[key]}")


def check_sentence(text: Any, where: str, limits: ServeConfig, translator: Translator) -> str:
    """One sentence: a string within ``serve.max_chars`` and the model's ``max_positions``."""
    if not isinstance(text, str):
        raise BadRequest(422, f"{where} must be a string, got {json.dumps(text)[:60]}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:  # a lone surrogate, from a JSON \\ud800-style escape
        raise BadRequest(400, f"{where} is not valid Unicode (character {err.start} is a lone "
                              f"surrogate)") from None  # fmt: skip
    if len(text) > limits.max_chars:
        raise BadRequest(422, f"{where} has {len(text)} characters, more than serve.max_chars="
                              f"{limits.max_chars}")  # fmt: skip
    tok = translator.tokenizer
    (ids,) = tok.encode([tok.normalize(text)], side="src")
    limit = translator.max_positions
    if limit is not None and len(ids) + 1 > limit:
        raise BadRequest(422, f"{where} has {len(ids)} tokens, more than the model's "
                              f"max_positions - 1 = {limit - 1}")  # fmt: skip
    return text


def parse_translate(body: Any, limits: ServeConfig, translator: Translator):
    """``(sentences, options)`` of a /translate body, or BadRequest."""
    if not isinstance(body, dict):
        raise BadRequest(422, 'the body must be a JSON object like {"text": ["..."]}')
    if "text" not in body:
        raise BadRequest(422, "'text' is missing: a list of sentences")
    text = body["text"]
    if not isinstance(text, list):
        raise BadRequest(422, f"'text' must be a list of strings, got {type(text).__name__}")
    if not text:
        raise BadRequest(422, "'text' is empty: give at least one sentence")
    if len(text) > limits.max_sentences:
        raise BadRequest(413, f"{len(text)} sentences, more than serve.max_sentences="
                              f"{limits.max_sentences}")  # fmt: skip
    sentences = [check_sentence(s, f"text[{i}]", limits, translator) for i, s in enumerate(text)]
    return sentences, parse_options(body, limits, set(OPTIONS), translator.decode_cfg.beam_size)


async def read_json(request, limits: ServeConfig) -> Any:
    """The request body as JSON: size-limited (also without Content-Length), strict UTF-8."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limits.max_body_bytes:
        raise BadRequest(413, f"the body has {declared} bytes, more than serve.max_body_bytes="
                              f"{limits.max_body_bytes}")  # fmt: skip
    data = bytearray()
    async for chunk in request.stream():
        data += chunk
        if len(data) > limits.max_body_bytes:
            raise BadRequest(413, f"the body exceeds serve.max_body_bytes={limits.max_body_bytes}")
    if not data.strip():
        raise BadRequest(400, 'the body is empty: send JSON like {"text": ["..."]}')
    try:
        text = bytes(data).decode("utf-8")
    except UnicodeDecodeError as err:
        raise BadRequest(400, f"the body is not valid UTF-8 (byte {err.start})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise BadRequest(400, f"the body is not valid JSON: {err}") from None


def run_info(checkpoint: str | Path, translator: Translator) -> dict[str, Any]:
    """What /info reports: checkpoint step, model shape and size, languages and BLEU of its run
    (``config.yaml`` and ``results.json`` beside ``checkpoints/``) when present."""
    ckpt = load_checkpoint(checkpoint)
    info: dict[str, Any] = {
        "checkpoint": Path(checkpoint).name,
        "step": ckpt.get("step"),
        "parameters": sum(p.numel() for p in translator.model.parameters()),
        "model": dict(ckpt["model_cfg"]),
        "vocab_size": int(ckpt["vocab_size"]),
        "decode": {"beam_size": translator.decode_cfg.beam_size,
                   "alpha": translator.decode_cfg.alpha},  # fmt: skip
        "source_lang": None, "target_lang": None, "bleu": None,
    }  # fmt: skip
    run_dir = Path(checkpoint).resolve().parent.parent
    with contextlib.suppress(Exception):  # no run directory beside the checkpoint: unknown
        from omegaconf import OmegaConf

        data = OmegaConf.load(run_dir / "config.yaml").data
        info["source_lang"], info["target_lang"] = data.src_lang, data.tgt_lang
    with contextlib.suppress(OSError, ValueError):
        results = json.loads((run_dir / "results.json").read_text())
        info["bleu"] = {k: results.get(k) for k in ("bleu", "signature", "split")}
    return info


def create_app(translator: Translator, limits: ServeConfig, info: dict[str, Any] | None = None):
    """The FastAPI application over one translator (its batcher starts with it)."""
    batcher = Batcher(translator, limits.batch_sentences, limits.batch_wait_ms, limits.queue_size)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        batcher.close()

    app = FastAPI(title="mt", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.batcher = batcher
    info = dict(info or {})

    def error(status: int, message: str) -> JSONResponse:
        return JSONResponse({"error": message}, status_code=status)

    @app.exception_handler(BadRequest)
    async def _bad(_: Request, err: BadRequest):
        return error(err.status, str(err))

    @app.exception_handler(HTTPException)
    async def _http(_: Request, err: HTTPException):
        return error(err.status_code, str(err.detail))

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, err: RequestValidationError):
        return error(422, str(err))

    @app.exception_handler(Exception)
    async def _crash(_: Request, err: Exception):  # a bug: logged, answered, server stays up
        log.exception("request failed")
        return error(500, f"internal error: {type(err).__name__}")

    async def run(job: Job):
        try:
            future = batcher.submit(job)
        except QueueFull as err:
            raise BadRequest(503, str(err)) from None
        try:
            return await asyncio.wrap_future(future)
        except ValueError as err:  # the model refused an input (e.g. too long)
            raise BadRequest(422, str(err)) from None

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/info")
    async def get_info():
        return {
            **info,
            "limits": {k: getattr(limits, k) for k in limits.__dataclass_fields__},
            "decoded": {"batches": batcher.batches, "sentences": batcher.sentences},
        }

    @app.get("/", response_class=HTMLResponse)
    async def page():
        return HTMLResponse(PAGE.read_text(encoding="utf-8"))

    @app.post("/translate")
    async def translate(request: Request):
        sentences, options = parse_translate(await read_json(request, limits), limits, translator)
        options["nbest"] = options.get("nbest", 1)
        results = await run(Job(sentences, options))
        out = [
            {"text": hyps[0][0], "score": hyps[0][1],
             "nbest": [{"text": t, "score": s} for t, s in hyps]}
            for hyps in results
        ]  # fmt: skip
        return {"translations": out}

    @app.post("/attention")
    async def attention(request: Request):
        body = await read_json(request, limits)
        if not isinstance(body, dict) or "text" not in body:
            raise BadRequest(422, 'the body must be a JSON object like {"text": "..."}')
        sentence = check_sentence(body["text"], "'text'", limits, translator)
        if not translator.tokenizer.normalize(sentence):
            raise BadRequest(422, "'text' is empty")
        options = parse_options(body, limits, {"beam_size", "alpha"})
        job = Job([sentence], options, call=lambda: translator.attention(sentence, **options))
        src, tgt, matrix = await run(job)
        return {"source": src, "target": tgt, "weights": [[round(float(w), 4) for w in row]
                                                          for row in matrix]}  # fmt: skip

    return app


def serve_main(cfg: Config, exporter: Any = None) -> None:
    """``mt-serve``: load the checkpoint, then serve on ``host:port`` until interrupted
    (``exporter``: see mt.decode.translate.Translator)."""
    import uvicorn

    translator = load_translator(cfg, "serve", exporter)
    args = cfg.serve
    path = args.checkpoint or Path(cfg.run_dir) / "checkpoints/best.pt"
    app = create_app(translator, args, run_info(path, translator))
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("mt-serve listens on %s: reachable from other machines", args.host)
    log.info("serving %s on http://%s:%d/", path, args.host, args.port)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
