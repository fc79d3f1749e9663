"""Load test of `pinfer serve`: 16 concurrent streaming clients x 4 requests each.

    python benchmarks/serve_load.py MODEL.pinf [--clients 16] [--requests 4] [--max-tokens 32]

Starts the server on a free loopback port, checks every stream's framing (each event a JSON
chunk, a finish_reason, then `data: [DONE]`), and prints the server's memory when idle before,
at its peak, and idle after."""

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import time

import httpx


def rss_mb(pid, key="VmRSS"):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


async def one_stream(client, url, i, max_tokens):
    body = {"model": "m", "messages": [{"role": "user", "content": f"Tell me fact number {i} about the sea."}],
            "max_tokens": max_tokens, "stream": True, "temperature": 0.7, "seed": i,
            "stream_options": {"include_usage": True}}
    chunks, done, reason, usage = 0, False, None, None
    async with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            return False, f"HTTP {r.status_code}", 0
        async for line in r.aiter_lines():
            if not line:
                continue
            if not line.startswith("data: ") or done:
                return False, f"bad framing: {line[:60]!r}", 0
            payload = line[6:]
            if payload == "[DONE]":
                done = True
                continue
            c = json.loads(payload)
            if c.get("usage"):
                usage = c["usage"]
            elif c["choices"][0].get("finish_reason"):
                reason = c["choices"][0]["finish_reason"]
            chunks += 1
    ok = done and reason in ("stop", "length") and usage is not None
    return ok, "" if ok else f"done={done} reason={reason} usage={usage}", (usage or {}).get("completion_tokens", 0)


async def client_loop(url, i, n, max_tokens, results):
    async with httpx.AsyncClient(timeout=600) as client:
        for k in range(n):
            results.append(await one_stream(client, url, i * 100 + k, max_tokens))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "pinfer", "serve", a.model, "--port", str(port), "-t",
                             str(a.threads), "-c", "1024"], stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        while True:
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                sys.exit("the server exited during start-up")
            time.sleep(0.2)
        # one request to settle lazy allocations, then the idle level
        asyncio.run(client_loop(base + "/v1/chat/completions", 99, 1, a.max_tokens, []))
        idle = rss_mb(proc.pid)
        results = []
        t0 = time.perf_counter()

        async def run_all():
            await asyncio.gather(*(client_loop(base + "/v1/chat/completions", i, a.requests, a.max_tokens, results)
                                   for i in range(a.clients)))
        asyncio.run(run_all())
        wall = time.perf_counter() - t0
        time.sleep(1.0)
        after, peak = rss_mb(proc.pid), rss_mb(proc.pid, "VmHWM")
    finally:
        proc.terminate()
        proc.wait(10)
    ok = sum(1 for r in results if r[0])
    tokens = sum(r[2] for r in results)
    print(f"\n{a.clients} clients x {a.requests} streaming chat requests, max_tokens {a.max_tokens}\n")
    print("| requests | complete, well framed | failed | tokens | wall s | tok/s | RSS idle MB | peak MB | after MB |")
    print("|---|---|---|---|---|---|---|---|---|")
    print(f"| {len(results)} | {ok} | {len(results) - ok} | {tokens} | {wall:.1f} | {tokens / wall:.1f} | "
          f"{idle:.0f} | {peak:.0f} | {after:.0f} |")
    for r in results:
        if not r[0]:
            print("failure:", r[1])
    return 0 if ok == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
