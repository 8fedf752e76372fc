"""`kvtrans serve` under a client: the time to first token of a request that moves a
conversation to the other model, through translation and, on the same server started with
--no-translate, through re-reading, side by side at 1K-8K tokens of history; and, first on the
translating server, requests/s and p50 / p95 latency as 1-8 clients share the same requests
(batched decoding). Writes
benchmarks/results/serve.{json,md}.

Each server is `kvtrans serve` in its own process (the zoo pair kimi-linear / kimi-vl, shipped
translators), talked to over loopback HTTP; every conversation carries its own conversation id,
so none reuses another's cache. A switch: kimi-linear reads the history (a long user turn) and
replies; the next turn, the history plus that reply plus a question, goes to kimi-vl, streamed
with max_tokens 1. Its time to first token is measured by the client (the response headers
come with the first token) and reported by the server (`kvtrans.ttft_seconds`).

On the translating server, two cases users meet every day: a switch made `--idle` seconds
after the previous answer (the server translates ahead meanwhile) beside a same-model
follow-up made as long after, and a user who edits their last turn on the hybrid (the share of
the prompt reported as cached tokens).

    python benchmarks/serve.py [--lengths 1024,2048,4096,8192] [--repeats 3] [--rounds 5]
                               [--idle 3]
                               [--clients 1,2,4,8] [--conversations 8] [--turns 4] [--reply 32]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import mlx_kvtrans as kv  # first: fast BLAS

from mlx_kvtrans.backend.blas import blas_report

OUT = Path(__file__).resolve().parent / "results"
FILLER = Path(kv.__file__).parent / "evaluation" / "needle_filler.txt"
SOURCE, TARGET = "kimi-linear", "kimi-vl"


@contextmanager
def served(translate: bool):
    """`kvtrans serve` on a free port, until SIGTERM; yields the port."""
    probe = socket.create_server(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    command = [sys.executable, "-m", "mlx_kvtrans.cli", "serve", "--port", str(port),
               "--model", SOURCE, "--model", TARGET, "--cache-bytes", "16GiB"]
    proc = subprocess.Popen(command + ([] if translate else ["--no-translate"]),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health")
                break
            except OSError:
                if proc.poll() is not None:
                    raise SystemExit(f"kvtrans serve did not start: {proc.stderr.read()}")
                time.sleep(0.1)
        yield port
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)


def chat(port: int, model: str, messages: list, max_tokens: int, conversation: str,
         stream: bool = False) -> tuple[float, float, dict]:
    """One request: (seconds to the response headers, seconds to its end, the body's
    `kvtrans` report and reply)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    body = json.dumps({"model": model, "messages": messages, "max_tokens": max_tokens,
                       "temperature": 0, "stream": stream})
    started = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body,
                 {"content-type": "application/json", "x-kvtrans-conversation": conversation})
    response = conn.getresponse()
    headers = time.perf_counter() - started
    text = response.read().decode()
    done = time.perf_counter() - started
    conn.close()
    if response.status != 200:
        raise SystemExit(f"{model}: HTTP {response.status}: {text[:300]}")
    if stream:
        chunks = [json.loads(line[6:]) for line in text.splitlines()
                  if line.startswith("data: {")]
        return headers, done, {"kvtrans": chunks[-1]["kvtrans"], "content": ""}
    answer = json.loads(text)
    return headers, done, {"kvtrans": answer["kvtrans"], "usage": answer["usage"],
                           "content": answer["choices"][0]["message"]["content"]}


def history_text(tokenizer, length: int) -> str:
    ids = tokenizer.encode(FILLER.read_text())
    ids = (ids * (length // len(ids) + 1))[:length]
    return tokenizer.decode(ids)


def switch(port: int, history: str, conversation: str) -> dict:
    messages = [{"role": "user", "content": history}]
    _, _, first = chat(port, SOURCE, messages, 8, conversation)
    messages += [{"role": "assistant", "content": first["content"]},
                 {"role": "user", "content": "What did the text say?"}]
    ttft, _, second = chat(port, TARGET, messages, 1, conversation, stream=True)
    r = second["kvtrans"]
    s = r["switch"] or {}
    return {"client_ttft_ms": ttft * 1000, "server_ttft_ms": r["ttft_seconds"] * 1000,
            "translate_ms": s.get("translate_seconds", 0.0) * 1000, "status": r["status"],
            "tokens_translated": s.get("tokens_translated", 0),
            "tokens_reread": s.get("tokens_reread", 0)}


def after_idle(port: int, history: str, conversation: str, model: str, idle: float) -> dict:
    """The source answers; `idle` seconds later the next turn goes to `model` (the target: a
    switch the server translated ahead; the source: a same-model follow-up)."""
    messages = [{"role": "user", "content": history}]
    _, _, first = chat(port, SOURCE, messages, 8, conversation)
    time.sleep(idle)
    messages += [{"role": "assistant", "content": first["content"]},
                 {"role": "user", "content": "What did the text say?"}]
    ttft, _, second = chat(port, model, messages, 1, conversation, stream=True)
    r = second["kvtrans"]
    return {"client_ttft_ms": ttft * 1000, "server_ttft_ms": r["ttft_seconds"] * 1000,
            "status": r["status"],
            "tokens_translated_ahead": (r["switch"] or {}).get("tokens_translated_ahead", 0)}


def edited_turn(port: int, history: str, conversation: str) -> dict:
    """On the hybrid: a turn, then the user's next turn, then that turn edited."""
    messages = [{"role": "user", "content": history}]
    _, _, first = chat(port, SOURCE, messages, 8, conversation)
    messages.append({"role": "assistant", "content": first["content"]})
    chat(port, SOURCE, messages + [{"role": "user", "content": "What did the text say?"}], 8,
         conversation)
    _, _, edited = chat(port, SOURCE, messages + [{"role": "user", "content": "Say it again."}],
                        8, conversation)
    usage = edited["usage"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    return {"prompt_tokens": usage["prompt_tokens"], "cached_tokens": cached,
            "cached_share": cached / usage["prompt_tokens"], "status": edited["kvtrans"]["status"]}


def median_row(rows: list[dict]) -> dict:
    out = {k: round(statistics.median(r[k] for r in rows), 2) for k in rows[0]
           if isinstance(rows[0][k], (int, float))}
    out["status"] = sorted({r["status"] for r in rows})
    return out


def load(port: int, clients: int, conversations: int, turns: int, reply: int,
         tag: str) -> dict:
    """`conversations` conversations of `turns` turns each (alternating models, `reply`
    tokens a reply), shared among `clients` clients that send at once, each its
    conversations one after another: the same requests whatever the number of clients."""
    latencies, lock = [], threading.Lock()

    def client(index: int):
        for number in range(index, conversations, clients):
            messages = []
            for turn in range(turns):
                messages.append({"role": "user", "content": f"Conversation {number}, turn "
                                                            f"{turn}: the number for copper?"})
                _, seconds, answer = chat(port, (SOURCE, TARGET)[turn % 2], messages, reply,
                                          f"{tag}-{number}")
                messages.append({"role": "assistant", "content": answer["content"]})
                with lock:
                    latencies.append(seconds)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    ordered = sorted(latencies)
    return {"clients": clients, "requests": len(ordered), "seconds": round(wall, 2),
            "requests_per_second": round(len(ordered) / wall, 2),
            "p50_ms": round(ordered[len(ordered) // 2] * 1000, 1),
            "p95_ms": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.95))] * 1000, 1)}


def batching(port: int, clients: list[int], rounds: int, conversations: int, turns: int,
             reply: int) -> list[dict]:
    """Per number of clients, the median of `rounds` rounds, each on new conversations; the
    rounds interleave the numbers of clients, so that none runs on a store the others left
    fuller."""
    runs = {k: [] for k in clients}
    for r in range(rounds):
        for k in clients:
            runs[k].append(load(port, k, conversations, turns, reply, f"load-{k}-{r}"))
    rows = []
    for k in clients:
        row = sorted(runs[k], key=lambda row: row["seconds"])[rounds // 2]
        row["seconds_range"] = [min(r["seconds"] for r in runs[k]),
                                max(r["seconds"] for r in runs[k])]
        row["speedup"] = round(rows[0]["seconds"] / row["seconds"], 2) if rows else 1.0
        rows.append(row)
        print(f"{k} clients: {row}", flush=True)
    return rows


def measure(translate: bool, lengths: list[int], repeats: int, rounds: int, clients: list[int],
            conversations: int, turns: int, reply: int, tokenizer, idle: float) -> dict:
    mode = "translate" if translate else "reread"
    result = {}
    with served(translate) as port:
        switch(port, history_text(tokenizer, 256), f"{mode}-warmup")
        if translate:  # batching, at the default flags, before the sections below leave work
            result["load"] = batching(port, clients, rounds, conversations, turns, reply)
        rows = {}
        for length in lengths:
            history = history_text(tokenizer, length)
            rows[length] = median_row([switch(port, history, f"{mode}-{length}-{r}")
                                       for r in range(repeats)])
            print(f"{mode:9s} {length:5d} tokens: first token {rows[length]['client_ttft_ms']:.1f}"
                  f" ms ({', '.join(rows[length]['status'])})", flush=True)
        if translate:
            result["after_idle"], result["edited"] = {}, {}
            for length in lengths:
                history = history_text(tokenizer, length)
                pair = {who: median_row([after_idle(port, history, f"idle-{who}-{length}-{r}",
                                                    model, idle) for r in range(repeats)])
                        for who, model in (("switch", TARGET), ("follow_up", SOURCE))}
                pair["ratio"] = round(pair["switch"]["client_ttft_ms"]
                                      / pair["follow_up"]["client_ttft_ms"], 2)
                result["after_idle"][length] = pair
                result["edited"][length] = median_row([edited_turn(
                    port, history, f"edit-{length}-{r}") for r in range(repeats)])
                print(f"after {idle:g} s idle, {length} tokens: switch / follow-up "
                      f"{pair['ratio']}; edited turn cached "
                      f"{result['edited'][length]['cached_share']:.2f}", flush=True)
    return {"switch": rows, **result}


def write_markdown(results: dict) -> None:
    t, r = results["translate"], results["reread"]
    lines = ["# kvtrans serve\n",
             f"Time to first token of a request that moves a conversation from {SOURCE} to "
             f"{TARGET} through `kvtrans serve`, translating the cache, beside the same server "
             "started with `--no-translate` (the target re-reads the history); medians of "
             f"{results['repeats']} conversations per length, measured by the client over "
             "loopback (the server's own figure in brackets). Regenerate with "
             "`python benchmarks/serve.py`.\n",
             f"BLAS: {results['blas']}; {results['cores']} cores, load average "
             f"{results['load_average']} when it started.\n",
             "| history tokens | translated: first token ms | status | re-read: first token ms "
             "| status | speed-up |", "|---|---|---|---|---|---|"]
    for length in results["lengths"]:
        a, b = t["switch"][str(length)], r["switch"][str(length)]
        lines.append(f"| {length} | {a['client_ttft_ms']:.1f} ({a['server_ttft_ms']:.1f}) | "
                     f"{', '.join(a['status'])} | {b['client_ttft_ms']:.1f} "
                     f"({b['server_ttft_ms']:.1f}) | {', '.join(b['status'])} | "
                     f"{b['client_ttft_ms'] / a['client_ttft_ms']:.1f}x |")
    lines += ["", f"A turn {results['idle']:g} s after the previous answer, on the translating "
              "server: the switch (to the target, translated ahead in the idle time) beside a "
              "same-model follow-up (the source again), first token in ms by the client; and "
              "an edited last user turn on the hybrid (a turn, the next turn, that turn "
              "edited): the share of its prompt reported cached.\n",
              "| history tokens | switch ms | follow-up ms | switch / follow-up | switch "
              "status | edited turn: cached share |", "|---|---|---|---|---|---|"]
    for length in results["lengths"]:
        pair, edit = t["after_idle"][str(length)], t["edited"][str(length)]
        lines.append(f"| {length} | {pair['switch']['client_ttft_ms']:.1f} | "
                     f"{pair['follow_up']['client_ttft_ms']:.1f} | {pair['ratio']:.2f} | "
                     f"{', '.join(pair['switch']['status'])} | {edit['cached_share']:.2f} |")
    lines += ["", f"Batching, on the translating server as it starts (before the sections "
              "above, whose long conversations leave re-reads for its idle time): "
              f"{results['conversations']} "
              f"conversations of {results['turns']} turns (alternating models, "
              f"{results['reply']}-token replies), shared among the clients, each sending its "
              "conversations one after another; the same requests in every row, sent "
              f"{results['rounds']} times on new conversations (the rounds interleaving the "
              "numbers of clients), the median round shown with the fastest and slowest. "
              "**Speed-up**: the one-client time over this row's.\n",
              "| clients | requests | seconds | fastest - slowest round | requests/s | p50 ms "
              "| p95 ms | speed-up |", "|---|---|---|---|---|---|---|---|"]
    for row in t["load"]:
        fastest, slowest = row["seconds_range"]
        lines.append(f"| {row['clients']} | {row['requests']} | {row['seconds']} | "
                     f"{fastest} - {slowest} | {row['requests_per_second']} | {row['p50_ms']} "
                     f"| {row['p95_ms']} | {row['speedup']:.2f}x |")
    (OUT / "serve.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="1024,2048,4096,8192")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=5, help="of the batching section")
    parser.add_argument("--clients", default="1,2,4,8")
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4, help="per conversation")
    parser.add_argument("--reply", type=int, default=32, help="tokens a reply")
    parser.add_argument("--idle", type=float, default=3.0,
                        help="seconds between an answer and the next turn")
    args = parser.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    tokenizer = kv.load(TARGET).tokenizer
    busy = os.getloadavg()[0]  # other work on the machine slows the re-reads most
    started = time.perf_counter()
    clients = [int(x) for x in args.clients.split(",")]
    results = {mode: measure(mode == "translate", lengths, args.repeats, args.rounds, clients,
                             args.conversations, args.turns, args.reply, tokenizer, args.idle)
               for mode in ("translate", "reread")}
    report = blas_report()
    results = json.loads(json.dumps(results))  # lengths become the JSON's string keys
    results.update(blas=str(report),
                   lengths=lengths, repeats=args.repeats, rounds=args.rounds, clients=clients,
                   idle=args.idle,
                   conversations=args.conversations, turns=args.turns, reply=args.reply,
                   models=[SOURCE, TARGET], cores=os.cpu_count(),
                   load_average=round(busy, 1),
                   minutes=round((time.perf_counter() - started) / 60, 1))
    OUT.mkdir(exist_ok=True)
    (OUT / "serve.json").write_text(json.dumps(results, indent=2) + "\n")
    write_markdown(results)
    print(f"wrote {OUT / 'serve.json'} and {OUT / 'serve.md'}")


if __name__ == "__main__":
    main()
