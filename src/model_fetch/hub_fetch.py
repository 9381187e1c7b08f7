# pdctl's model fetch, run with the engines' own Python (vLLM depends on huggingface_hub).
#
#   python -c SCRIPT list  REPO REVISION [--config]
#   python -c SCRIPT fetch REPO REVISION CACHE_DIR TIMEOUT_S
#
# huggingface_hub gives the endpoint (HF_ENDPOINT), the token (HF_TOKEN), the headers, the
# file list and, where the list names no blob (a mirror that lists sizes only), the file's
# ETag from its HEAD: blobs are named as hf_hub_download names them (file_download.py of
# huggingface_hub 2.4.0: `blobs/<etag>`, the etag from get_hf_file_metadata, X-Linked-Etag
# or ETag normalized). The bytes are fetched here, not by hf_hub_download: 2.4.0 writes each
# download to a fresh `<etag>.<random>.incomplete` opened "wb" (_download_to_tmp_and_move),
# so a killed try starts over and its progress is not in the file pdctl watches; here a
# partial blobs/<etag>.incomplete is resumed with a Range request, even after this process
# was killed. Each line printed is one JSON event; pdctl reads the bytes done from the files
# themselves. An unexpected exception is one `internal` error event, never a traceback.
import json
import os
import shutil
import sys
import urllib.error
import urllib.parse
import urllib.request


def out(**kw):
    print(json.dumps(kw), flush=True)


def fail(kind, message, status=None):
    out(event="error", kind=kind, message=message, status=status)
    sys.exit(3)


try:
    import huggingface_hub
    from huggingface_hub import HfApi, get_hf_file_metadata, hf_hub_url
    from huggingface_hub.utils import (
        EntryNotFoundError,
        GatedRepoError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
        build_hf_headers,
    )
except Exception as e:  # noqa: BLE001 - any import failure means: no usable huggingface_hub
    fail("no-hub", f"{type(e).__name__}: {e}")

# What vLLM loads of a model repository: its weights (safetensors, else PyTorch .bin, never
# both), config, tokenizer and generation config.
SMALL = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
    "params.json",
)


def chosen(names):
    top = [n for n in names if "/" not in n]
    safetensors = [n for n in top if n.endswith(".safetensors")]
    if safetensors:
        plain = [n for n in safetensors if not n.startswith("consolidated")]
        weights = (plain or safetensors) + [n for n in top if n == "model.safetensors.index.json"]
    else:
        weights = [n for n in top if n.endswith(".bin") and n != "training_args.bin"]
        weights += [n for n in top if n == "pytorch_model.bin.index.json"]
    return sorted(set(weights + [n for n in top if n in SMALL]))


def status_of(e):
    r = getattr(e, "response", None)
    return getattr(r, "status_code", None)


def hub_failure(e):
    """Ends with the error event for an exception huggingface_hub raised asking the hub."""
    status = status_of(e)
    first = str(e).splitlines()[0] if str(e) else ""
    if isinstance(e, GatedRepoError):
        fail("gated", first, status)
    if isinstance(e, RevisionNotFoundError):
        fail("revision-not-found", first, status)
    if isinstance(e, (RepositoryNotFoundError, EntryNotFoundError)):
        fail("unauthorized" if status in (401, 403) else "not-found", first, status)
    if type(e).__name__ == "OfflineModeIsEnabled":
        fail("offline", str(e))
    if status in (401, 403):
        fail("unauthorized", first, status)
    fail("network" if status is None else "http", f"{type(e).__name__}: {first}", status)


def head_of(repo, name, commit):
    """The blob name (normalized ETag) and size huggingface_hub reads from the file's HEAD."""
    try:
        meta = get_hf_file_metadata(hf_hub_url(repo, name, revision=commit))
    except Exception as e:  # noqa: BLE001
        hub_failure(e)
    if not meta.etag:
        fail(
            "hub-answer",
            f"{name}: the hub lists no blob id for it and its HEAD answers no ETag, so it cannot be named in the cache as huggingface_hub names it",
        )
    return meta.etag, meta.size


def listing(repo, revision):
    api = HfApi()
    try:
        info = api.model_info(repo, revision=revision, files_metadata=True)
    except Exception as e:  # noqa: BLE001
        hub_failure(e)
    by_name = {s.rfilename: s for s in (info.siblings or [])}
    files = []
    for name in chosen(list(by_name)):
        s = by_name[name]
        lfs = getattr(s, "lfs", None)
        blob = (getattr(lfs, "sha256", None) if lfs is not None else None) or s.blob_id
        size = s.size if s.size is not None else (getattr(lfs, "size", None) if lfs is not None else None)
        if not blob:
            blob, head_size = head_of(repo, name, info.sha)
            size = size if size is not None else head_size
        files.append({"name": name, "size": size or 0, "blob": blob})
    return info.sha, files


def open_url(url, headers, timeout):
    """GET `url`, following redirects; the token goes to the hub's own host only."""
    host = urllib.parse.urlsplit(url).netloc
    for _ in range(10):
        h = dict(headers)
        if urllib.parse.urlsplit(url).netloc != host:
            h.pop("authorization", None)
            h.pop("Authorization", None)
        req = urllib.request.Request(url, headers=h)
        opener = urllib.request.build_opener(NoRedirect)
        try:
            return opener.open(req, timeout=timeout)
        except urllib.error.HTTPError as e:
            if e.code in (301, 302, 303, 307, 308) and e.headers.get("Location"):
                url = urllib.parse.urljoin(url, e.headers["Location"])
                continue
            raise
    raise RuntimeError(f"too many redirects from {url}")


class NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None


def http_failure(e, repo):
    code = e.code
    error_code = e.headers.get("X-Error-Code") if e.headers else None
    if error_code == "GatedRepo":
        fail("gated", f"{code}: access to {repo} is restricted", code)
    if code in (401, 403):
        fail("unauthorized", f"{code}: {e.reason}", code)
    if code == 404:
        fail("not-found", f"{code}: {e.reason}", code)
    fail("http", f"{code}: {e.reason}", code)


def fetch(repo, revision, cache, timeout):
    commit, files = listing(repo, revision)
    storage = os.path.join(cache, "models--" + repo.replace("/", "--"))
    blobs = os.path.join(storage, "blobs")
    snapshot = os.path.join(storage, "snapshots", commit)
    os.makedirs(blobs, exist_ok=True)
    os.makedirs(snapshot, exist_ok=True)
    headers = build_hf_headers()
    headers["Accept-Encoding"] = "identity"
    need = 0
    for f in files:
        blob = os.path.join(blobs, f["blob"])
        if not os.path.exists(blob):
            partial = blob + ".incomplete"
            need += max(f["size"] - (os.path.getsize(partial) if os.path.exists(partial) else 0), 0)
    out(event="files", commit=commit, files=files, present=sum(f["size"] for f in files) - need)
    free = shutil.disk_usage(blobs).free
    if need > free:
        out(event="error", kind="no-room", message="not enough disk", need=need, free=free, dir=blobs)
        sys.exit(3)
    for f in files:
        blob = os.path.join(blobs, f["blob"])
        if not os.path.exists(blob):
            partial = blob + ".incomplete"
            have = os.path.getsize(partial) if os.path.exists(partial) else 0
            if f["size"] and have > f["size"]:
                have = 0
            url = hf_hub_url(repo, f["name"], revision=commit)
            h = dict(headers)
            if have:
                h["Range"] = f"bytes={have}-"
            try:
                resp = open_url(url, h, timeout)
            except urllib.error.HTTPError as e:
                if e.code == 416 and have == f["size"]:
                    resp = None
                else:
                    http_failure(e, repo)
            except Exception as e:  # noqa: BLE001
                fail("network", f"{type(e).__name__}: {e}")
            if resp is not None:
                mode = "ab" if have and resp.status == 206 else "wb"
                try:
                    # Unbuffered, each piece as it comes: the bytes on disk are the progress.
                    read = getattr(resp, "read1", resp.read)
                    with open(partial, mode, buffering=0) as w:
                        while True:
                            chunk = read(1 << 20)
                            if not chunk:
                                break
                            w.write(chunk)
                except OSError as e:
                    if getattr(e, "errno", None) == 28:
                        fail("no-room", f"{e}")
                    fail("network", f"{type(e).__name__}: {e}")
                except Exception as e:  # noqa: BLE001
                    fail("network", f"{type(e).__name__}: {e}")
            got = os.path.getsize(partial)
            if f["size"] and got != f["size"]:
                fail("network", f"{f['name']}: the connection ended after {got} of {f['size']} bytes")
            os.replace(partial, blob)
        link = os.path.join(snapshot, f["name"])
        os.makedirs(os.path.dirname(link), exist_ok=True)
        if not os.path.lexists(link):
            os.symlink(os.path.relpath(blob, os.path.dirname(link)), link)
        out(event="file-done", name=f["name"])
    if revision != commit:
        os.makedirs(os.path.join(storage, "refs"), exist_ok=True)
        with open(os.path.join(storage, "refs", revision), "w") as w:
            w.write(commit)
    out(event="done", commit=commit, snapshot=snapshot)


def config_of(repo, commit):
    url = hf_hub_url(repo, "config.json", revision=commit)
    try:
        with open_url(url, build_hf_headers(), 30) as r:
            return json.loads(r.read())
    except Exception:  # noqa: BLE001 - the sizes are still known without it
        return None


def run():
    mode, repo, revision = sys.argv[1], sys.argv[2], sys.argv[3]
    if mode == "list":
        commit, files = listing(repo, revision)
        config = config_of(repo, commit) if "--config" in sys.argv[4:] else None
        out(event="files", commit=commit, files=files, config=config, hub=huggingface_hub.__version__)
    elif mode == "fetch":
        fetch(repo, revision, sys.argv[4], float(sys.argv[5]))
    else:
        fail("usage", f"unknown mode {mode}")


def main():
    try:
        run()
    except SystemExit:
        raise
    except Exception as e:  # noqa: BLE001 - said as one event, never as a traceback
        first = str(e).splitlines()[0] if str(e) else ""
        fail("internal", f"pdctl's fetch script stopped on {type(e).__name__}: {first} (a bug in pdctl: please report it, with the hub that answered)")


main()
