"""`bench.py serve`: throughput and latency of mt-serve for 1 and for N concurrent clients.

Starts ``python -m mt serve`` on a free loopback port (127.0.0.1 only) in a subprocess, waits
for ``/health``, then for each client count sends ``--requests`` POST /translate requests (one
sentence each by default, taken in turn from ``--input`` or a built-in list), each client
sending its next request when its previous one is answered, bounded by ``--seconds``. One
client is one-at-a-time decoding; N clients let the server's queue form batches. Records:
sentences/s, p50/p99 latency, the mean batch the queue formed, and the N-client/1-client
throughput ratio over ``--rounds`` rounds that alternate the client counts.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

log = logging.getLogger("bench")

SENTENCES = [
    "Ein Mann fährt Fahrrad.",
    "Zwei Hunde rennen durch den Schnee.",
    "Eine Frau mit einem roten Hut liest ein Buch im Park.",
    "Kinder spielen am Strand.",
    "Ein Mann in einem blauen Hemd steht vor einem Gebäude.",
    "Eine Gruppe von Menschen sitzt an einem Tisch und isst.",
    "Ein kleines Mädchen klettert auf einen Baum.",
    "Ein Arbeiter repariert eine Straße.",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, port: int) -> subprocess.Popen:
    """``python -m mt serve`` on 127.0.0.1:port; returns once /health answers."""
    cmd = [sys.executable, "-m", "mt", "serve", f"checkpoint={args.checkpoint}",
           "host=127.0.0.1", f"port={port}", f"decode.beam_size={args.beam}",
           f"serve.batch_sentences={args.batch_sentences}",
           f"serve.batch_wait_ms={args.batch_wait_ms}", "train.device=cpu"]  # fmt: skip
    if args.threads:
        cmd.append(f"train.threads={args.threads}")
    repo = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen(cmd, cwd=repo, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"mt serve exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return proc
        except OSError:
            time.sleep(0.3)
    proc.kill()
    raise SystemExit("mt serve did not answer /health within 120 s")


def run_clients(port: int, n_clients: int, texts: list[list[str]], seconds: float, beam: int):
    """``texts`` split among ``n_clients`` threads; returns (latencies, sentences, wall)."""
    latencies: list[float] = []
    done = [0]
    lock = threading.Lock()
    stop_at = time.monotonic() + seconds
    barrier = threading.Barrier(n_clients)

    def client(mine: list[list[str]]) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        barrier.wait()
        for text in mine:
            if time.monotonic() > stop_at:
                break
            body = json.dumps({"text": text, "beam_size": beam})
            t0 = time.perf_counter()
            conn.request("POST", "/translate", body, {"Content-Type": "application/json"})
            response = conn.getresponse()
            payload = response.read()
            if response.status != 200:
                raise RuntimeError(f"HTTP {response.status}: {payload[:200]!r}")
            with lock:
                latencies.append(time.perf_counter() - t0)
                done[0] += len(text)

    threads = [threading.Thread(target=client, args=(texts[i::n_clients],))
               for i in range(n_clients)]  # fmt: skip
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return latencies, done[0], time.perf_counter() - start


def decoded(port: int) -> tuple[int, int]:
    """(batches, sentences) the server's queue has decoded so far (from /info)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/info")
    d = json.loads(conn.getresponse().read())["decoded"]
    return d["batches"], d["sentences"]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def run_serve(args, rec) -> None:
    if not args.checkpoint:
        raise SystemExit("bench serve: --checkpoint is needed")
    lines = SENTENCES
    if args.input:
        lines = [s for s in Path(args.input).read_text(encoding="utf-8").splitlines() if s]
    per = args.sentences_per_request
    requests = [[lines[(i * per + j) % len(lines)] for j in range(per)]
                for i in range(args.requests)]  # fmt: skip
    port = free_port()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads or 2))
    proc = start_server(args, port)
    totals: dict[int, list[float]] = {n: [0, 0.0] for n in args.clients}  # sentences, wall
    results = {}
    try:
        run_clients(port, 1, requests[: max(2, args.requests // 16)], args.seconds, args.beam)
        # Rounds alternate the client counts, so a busy spell of a shared machine hits both.
        for round_ in range(args.rounds):
            for n in args.clients:
                b0, s0 = decoded(port)
                lat, sents, wall = run_clients(port, n, requests, args.seconds, args.beam)
                b1, s1 = decoded(port)
                totals[n][0] += sents
                totals[n][1] += wall
                record = {
                    "bench": "serve", "impl": f"{n} client{'s' if n > 1 else ''}",
                    "round": round_, "clients": n, "requests": len(lat), "sentences": sents,
                    "sent_per_s": sents / wall, "p50_ms": 1000 * statistics.median(lat),
                    "p99_ms": 1000 * percentile(lat, 99), "beam": args.beam,
                    "mean_batch": (s1 - s0) / max(1, b1 - b0),
                    "batch_wait_ms": args.batch_wait_ms, "threads": args.threads,
                }  # fmt: skip
                results[n] = record
                rec.emit(record)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    if 1 in results and len(results) > 1:
        top = max(results)
        ratio = (totals[top][0] / totals[top][1]) / (totals[1][0] / totals[1][1])
        rec.emit({"bench": "serve", "impl": f"{top}/1 ratio", "ratio": ratio,
                  "rounds": args.rounds})  # fmt: skip
    for r in rec.rows:
        if r.get("bench") == "serve" and "p50_ms" in r:
            print(f"serve  round {r['round']} {r['clients']:>3} client(s): "
                  f"{r['sent_per_s']:8.1f} sentences/s  "
                  f"p50 {r['p50_ms']:7.1f} ms  p99 {r['p99_ms']:7.1f} ms  "
                  f"mean batch {r['mean_batch']:.1f} sentences")  # fmt: skip
        elif r.get("bench") == "serve":
            print(f"serve  throughput {r['impl']} (all rounds): {r['ratio']:.2f}x")
