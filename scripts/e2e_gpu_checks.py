"""HTTP checks of a running pdctl cluster on real vLLM, for scripts/e2e-vllm-gpu.sh.

    python3 e2e_gpu_checks.py answers PROXY PREFILL DECODE MODEL
        answers through the proxy equal to the prefill instance's own at temperature 0
        (completions, prompts longer than one KV block), a streamed completion and a
        streamed chat that end in `data: [DONE]`, and the KV handoff proven by decode's own
        counter vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}.
        Requests straight to an engine carry the engine key of PDCTL_E2E_ENGINE_KEY (the
        cluster's, `pdctl secret --engine-key`), and one without it must be refused;
        requests to the proxy carry PDCTL_API_KEY when it is set.
    python3 e2e_gpu_checks.py bench-result FILE
        reads a `pdctl bench --json` file: prints "completed failed req/s median_ttft_ms".
    python3 e2e_gpu_checks.py plan-starts PLAN_JSON
        from a `pdctl plan --json` document: each engine's GPUs, the engines it waits for
        and its --kv-cache-memory-bytes, and whether they all start together.
    python3 e2e_gpu_checks.py start-alone PLAN_JSON SERVICE TIMEOUT_S LOG
        starts that one service of the plan by itself (its command line and environment,
        without the engine key), prints the seconds until its readiness URL answered 200
        (or "none"), then stops it and everything it started.

`answers` prints one line per check, `PASS ...` or `FAIL ...`, and a last line
`FIGURES {json}`; the exit status is the number of failed checks. Standard library only:
nothing to install on an offline GPU machine.
"""

import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

EXTERNAL = ('vllm:prompt_tokens_by_source_total', 'source="external_kv_transfer"')
FINISHED = ('vllm:request_success_total', '')


def request(url, body=None, timeout=300, key=None):
    """(status, text) of a GET, or of a POST when `body` is given, with `Authorization:
    Bearer KEY` when a key is given; (None, why) when no answer."""
    data = None if body is None else json.dumps(body).encode()
    headers = {"content-type": "application/json"}
    if key:
        headers["authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode("utf-8", "replace")
    except OSError as e:
        return None, f"{type(e).__name__}: {e}"


def counter(base, name, label, key=None):
    """The sum of a metric's samples carrying `label` on an engine's /metrics page."""
    status, text = request(base + "/metrics", timeout=20, key=key)
    if status != 200:
        return None
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and label in line:
            try:
                total += float(line.rsplit(" ", 1)[1])
            except ValueError:
                pass
    return total


def counted_after(base, before, key=None, timeout_s=120):
    """An engine's external KV counter once it has finished a request more than `before`
    (its FINISHED count then): vLLM counts a prompt's tokens by source when it prefills it,
    so the request answered since is in it. A condition, bounded, not a time: None when the
    engine finished nothing more in `timeout_s`."""
    end = time.monotonic() + timeout_s
    while True:
        done = counter(base, *FINISHED, key=key)
        if done is not None and before is not None and done > before:
            return counter(base, *EXTERNAL, key=key)
        if time.monotonic() > end:
            return None
        time.sleep(0.2)


def prompt(seed, words=300):
    """A fresh prompt of a few hundred tokens: longer than one KV block, new to every cache."""
    rng = random.Random(seed)
    vocab = ("prefill decode cache block token transfer memory engine request answer model "
             "serving queue stream proxy handoff layer tensor batch schedule").split()
    return f"[{seed}] " + " ".join(rng.choice(vocab) for _ in range(words))


def completion(base, model, text, stream=False, max_tokens=24, key=None):
    body = {"model": model, "prompt": text, "max_tokens": max_tokens, "temperature": 0,
            "stream": stream}
    return request(base + "/v1/completions", body, key=key)


def answers(proxy, prefill, decode, model):
    failed = 0
    figures = {}

    def check(ok, what):
        nonlocal failed
        failed += not ok
        print(("PASS " if ok else "FAIL ") + what, flush=True)
        return ok

    engine_key = os.environ.get("PDCTL_E2E_ENGINE_KEY", "")
    proxy_key = os.environ.get("PDCTL_API_KEY") or None
    check(engine_key != "", "the engine key is given (PDCTL_E2E_ENGINE_KEY)")
    st, body = request(prefill + "/v1/models", timeout=20)
    st_k, _ = request(prefill + "/v1/models", timeout=20, key=engine_key)
    check(st == 401 and st_k == 200,
          f"prefill's /v1/models: {st} without the engine key, {st_k} with it (want 401, 200)")
    seed = random.randrange(10**9)
    equal = 0
    moved = []
    for i in range(4):
        text = prompt(f"{seed}-{i}")
        before = counter(decode, *EXTERNAL, key=engine_key)
        finished = counter(decode, *FINISHED, key=engine_key)
        st_p, via_proxy = completion(proxy, model, text, key=proxy_key)
        after = counted_after(decode, finished, key=engine_key) if st_p == 200 else None
        st_d, direct = completion(prefill, model, text, key=engine_key)
        if st_p != 200 or st_d != 200:
            check(False, f"completion {i}: proxy answered {st_p}, prefill {st_d}: "
                         f"{via_proxy[:200]} / {direct[:200]}")
            continue
        a = json.loads(via_proxy)
        b = json.loads(direct)
        same = a["choices"][0]["text"] == b["choices"][0]["text"]
        equal += same
        prompt_tokens = a["usage"]["prompt_tokens"]
        if before is not None and after is not None:
            moved.append((after - before, prompt_tokens))
    check(equal == 4, f"answers through the proxy equal prefill's own at temperature 0: {equal} of 4")
    # Decode computes the last partial KV block itself: allow one block per prompt, of
    # vLLM's largest default size (16 tokens on CUDA, 128 on the CPU build).
    handed = [m for m in moved if m[1] - 128 < m[0] <= m[1]]
    check(len(moved) == 4 and len(handed) == 4,
          "KV handoff seen in decode's external_kv_transfer counter: "
          + ", ".join(f"{int(m[0])} of {m[1]} prompt tokens" for m in moved))
    figures["handoff_tokens"] = sum(int(m[0]) for m in moved)

    st, body = completion(proxy, model, prompt(f"{seed}-stream"), stream=True, key=proxy_key)
    check(st == 200 and body.rstrip().endswith("data: [DONE]") and '"error"' not in body,
          f"streamed completion ends in [DONE] ({st})")
    chat = {"model": model, "messages": [{"role": "user", "content": prompt(f"{seed}-chat", 120)}],
            "max_tokens": 24, "temperature": 0, "stream": True}
    st, body = request(proxy + "/v1/chat/completions", chat, key=proxy_key)
    check(st == 200 and body.rstrip().endswith("data: [DONE]") and '"error"' not in body,
          f"streamed chat ends in [DONE] ({st})")
    figures["answers_equal"] = f"{equal}/4"
    print("FIGURES " + json.dumps(figures), flush=True)
    return failed


def bench_result(path):
    with open(path) as f:
        r = json.load(f)
    print(r.get("completed"), r.get("failed"),
          round(float(r.get("request_throughput", 0.0)), 1),
          round(float(r.get("median_ttft_ms", 0.0)), 1))
    return 0


def engines_of(plan):
    return [s for s in plan["services"] if s["role"] in ("prefill", "decode")]


def flag(argv, name):
    return argv[argv.index(name) + 1] if name in argv[:-1] else None


def plan_starts(path):
    """Each engine's GPUs, what it waits for among the engines, its KV cache bytes."""
    with open(path) as f:
        plan = json.load(f)
    engines = engines_of(plan)
    names = {s["name"] for s in engines}
    together = True
    for s in engines:
        waits = [d for d in s["depends_on"] if d in names]
        together &= not waits
        kv = flag(s["argv"], "--kv-cache-memory-bytes")
        util = flag(s["argv"], "--gpu-memory-utilization")
        print(f"{s['name']}: GPU {s['gpus']}, --gpu-memory-utilization {util}, "
              f"--kv-cache-memory-bytes {kv or '-'}"
              + (f" ({int(kv) / 2**30:.2f} GiB)" if kv else "")
              + (f", starts after {', '.join(waits)}" if waits else ", starts at once"))
    print("the engines start " + ("together" if together else "one after another"))
    return 0


def start_alone(path, name, timeout_s, log_path):
    """Starts one service of a plan by itself and prints the seconds until it was ready."""
    with open(path) as f:
        plan = json.load(f)
    svc = next(s for s in plan["services"] if s["name"] == name)
    for d in svc.get("dirs", []):
        os.makedirs(d, exist_ok=True)
    for g in svc.get("files", []):
        os.makedirs(os.path.dirname(g["path"]), exist_ok=True)
        with open(g["path"], "w") as f:
            f.write(g["content"])
    env = dict(os.environ)
    env.update(svc["env"])
    url = svc["probe"]["url"]
    # A SIGTERM (the caller's timeout) still stops the engine: `finally` below runs.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with open(log_path, "w") as log:
        t0 = time.monotonic()
        p = subprocess.Popen(svc["argv"], env=env, stdout=log, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, start_new_session=True)
        with open(log_path + ".pid", "w") as f:
            f.write(str(p.pid))
        ready = None
        try:
            while time.monotonic() - t0 < float(timeout_s) and p.poll() is None:
                status, _ = request(url, timeout=2)
                if status == 200:
                    ready = time.monotonic() - t0
                    break
                time.sleep(0.25)
        finally:
            for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    p.wait(timeout=wait)
                    break
                except subprocess.TimeoutExpired:
                    pass
            # What the engine forked lives on in its process group until it is empty.
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.remove(log_path + ".pid")
    print("none" if ready is None else round(ready, 1))
    return 0 if ready is not None else 1


def main(argv):
    if len(argv) == 6 and argv[1] == "answers":
        return answers(*argv[2:6])
    if len(argv) == 3 and argv[1] == "bench-result":
        return bench_result(argv[2])
    if len(argv) == 3 and argv[1] == "plan-starts":
        return plan_starts(argv[2])
    if len(argv) == 6 and argv[1] == "start-alone":
        return start_alone(*argv[2:6])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
