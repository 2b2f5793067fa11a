"""The web page of mt-serve in a real headless browser (Debian's Chromium).

The server runs on a free loopback port (uvicorn in a thread); Chromium is driven through the
Chrome DevTools protocol: load ``/``, type a sentence into the text box, press Translate, and
wait for the translation (equal to the Translator's) and the attention heat map (one cell per
output piece x source piece). Skips with the reason when no Chromium is installed (``make
install`` installs it where apt is available).
"""

from __future__ import annotations

import itertools
import json
import shutil
import socket
import subprocess
import threading
import time
import urllib.request

import pytest

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
websocket = pytest.importorskip("websocket")

from test_serve import FAST, LIMITS  # noqa: E402
from test_translate import make_tokenizer, write_checkpoint  # noqa: E402

from mt.decode.translate import Translator  # noqa: E402
from mt.schema import DecodeConfig  # noqa: E402
from mt.serve.server import create_app, run_info  # noqa: E402

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "chrome")


def _browser() -> str:
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    pytest.skip("no Chromium found (apt-get install chromium; `make install` does it as root)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(base URL, translator) of a server on 127.0.0.1."""
    tmp = tmp_path_factory.mktemp("page")
    ckpt = write_checkpoint(tmp / "best.pt", make_tokenizer(tmp, 60), max_positions=64)
    translator = Translator.from_checkpoint(ckpt, decode_cfg=DecodeConfig(**FAST))
    app = create_app(translator, LIMITS, run_info(ckpt, translator))
    port = _free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started and time.monotonic() < deadline:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", translator
    srv.should_exit = True
    thread.join(timeout=10)


class DevTools:
    """A minimal Chrome DevTools protocol client over one page's websocket."""

    def __init__(self, ws_url: str) -> None:
        self.ws = websocket.create_connection(ws_url, timeout=30, suppress_origin=True)
        self.ids = itertools.count(1)

    def call(self, method: str, **params):
        msg_id = next(self.ids)
        self.ws.send(json.dumps({"id": msg_id, "method": method, "params": params}))
        while True:
            reply = json.loads(self.ws.recv())
            if reply.get("id") == msg_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})

    def js(self, expression: str):
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return result.get("result", {}).get("value")

    def wait_for(self, expression: str, timeout: float = 30.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = self.js(expression)
            if value:
                return value
            time.sleep(0.1)
        raise AssertionError(f"timed out waiting for {expression}")


@pytest.fixture
def browser(tmp_path):
    exe = _browser()
    profile = tmp_path / "profile"
    proc = subprocess.Popen(
        [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run",
         "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--remote-debugging-port=0",
         "--remote-debugging-address=127.0.0.1", "about:blank"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not (port_file.is_file() and port_file.read_text().strip()):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail("Chromium did not start its DevTools endpoint")
            time.sleep(0.1)
        port = port_file.read_text().split()[0]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as r:
            pages = [t for t in json.load(r) if t["type"] == "page"]
        tools = DevTools(pages[0]["webSocketDebuggerUrl"])
        yield tools
        tools.ws.close()
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.mark.slow
def test_page_translates_a_typed_sentence_and_draws_the_heat_map(server, browser):
    url, translator = server
    sentence = "ein mann fährt im park"
    browser.call("Page.enable")
    browser.call("Page.navigate", url=url + "/")
    browser.wait_for("document.readyState === 'complete' && !!document.getElementById('go')")
    browser.js("document.getElementById('source').focus()")
    browser.call("Input.insertText", text=sentence)  # typed, as from the keyboard
    assert browser.js("document.getElementById('source').value") == sentence
    browser.js("document.getElementById('beam').value = '2'; "
               "document.getElementById('nbest').value = '2';")  # fmt: skip
    browser.js("document.getElementById('go').click()")
    shown = browser.wait_for("document.querySelector('.translation')?.textContent ?? ''")
    assert shown == translator.translate([sentence], beam_size=2)[0]
    n_best = browser.wait_for("document.querySelectorAll('.nbest li').length")
    assert n_best == 2
    src, tgt, _ = translator.attention(sentence, beam_size=2)
    cells = browser.wait_for("document.querySelectorAll('#heatmap td.cell').length")
    assert cells == len(src) * len(tgt)
    assert browser.js("document.getElementById('error').textContent") == ""
