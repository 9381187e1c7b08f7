"""HTTP checks of a running pdctl cluster on real vLLM, for scripts/e2e-vllm-gpu.sh.

    python3 e2e_gpu_checks.py answers PROXY PREFILL DECODE MODEL
        answers through the proxy equal to the prefill instance's own at temperature 0
        (completions, prompts longer than one KV block), a streamed completion and a
        streamed chat that end in `data: [DONE]`, and the KV handoff proven by decode's own
        counter vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}.
    python3 e2e_gpu_checks.py bench-result FILE
        reads a `pdctl bench --json` file: prints "completed failed req/s median_ttft_ms".

Prints one line per check, `PASS ...` or `FAIL ...`, and a last line `FIGURES {json}`;
the exit status is the number of failed checks. Standard library only: nothing to install
on an offline GPU machine.
"""

import json
import random
import sys
import urllib.error
import urllib.request

EXTERNAL = ('vllm:prompt_tokens_by_source_total', 'source="external_kv_transfer"')


def request(url, body=None, timeout=300):
    """(status, text) of a GET, or of a POST when `body` is given; (None, why) when no answer."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode("utf-8", "replace")
    except OSError as e:
        return None, f"{type(e).__name__}: {e}"


def counter(base, name, label):
    """The sum of a metric's samples carrying `label` on an engine's /metrics page."""
    status, text = request(base + "/metrics", timeout=20)
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


def prompt(seed, words=300):
    """A fresh prompt of a few hundred tokens: longer than one KV block, new to every cache."""
    rng = random.Random(seed)
    vocab = ("prefill decode cache block token transfer memory engine request answer model "
             "serving queue stream proxy handoff layer tensor batch schedule").split()
    return f"[{seed}] " + " ".join(rng.choice(vocab) for _ in range(words))


def completion(base, model, text, stream=False, max_tokens=24):
    body = {"model": model, "prompt": text, "max_tokens": max_tokens, "temperature": 0,
            "stream": stream}
    return request(base + "/v1/completions", body)


def answers(proxy, prefill, decode, model):
    failed = 0
    figures = {}

    def check(ok, what):
        nonlocal failed
        failed += not ok
        print(("PASS " if ok else "FAIL ") + what, flush=True)
        return ok

    seed = random.randrange(10**9)
    equal = 0
    moved = []
    for i in range(4):
        text = prompt(f"{seed}-{i}")
        before = counter(decode, *EXTERNAL)
        st_p, via_proxy = completion(proxy, model, text)
        after = counter(decode, *EXTERNAL)
        st_d, direct = completion(prefill, model, text)
        if st_p != 200 or st_d != 200:
            check(False, f"completion {i}: proxy answered {st_p}, prefill {st_d}: {via_proxy[:300]}")
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

    st, body = completion(proxy, model, prompt(f"{seed}-stream"), stream=True)
    check(st == 200 and body.rstrip().endswith("data: [DONE]") and '"error"' not in body,
          f"streamed completion ends in [DONE] ({st})")
    chat = {"model": model, "messages": [{"role": "user", "content": prompt(f"{seed}-chat", 120)}],
            "max_tokens": 24, "temperature": 0, "stream": True}
    st, body = request(proxy + "/v1/chat/completions", chat)
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


def main(argv):
    if len(argv) == 6 and argv[1] == "answers":
        return answers(*argv[2:6])
    if len(argv) == 3 and argv[1] == "bench-result":
        return bench_result(argv[2])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
