"""A stand-in for the Hugging Face hub, for tests without the internet.

Serves the files of local directories as model repositories the way the hub does, for
huggingface_hub pointed at it with HF_ENDPOINT:

  GET  /api/models/ORG/NAME[/revision/REV][?blobs=true]   model info with its files (siblings)
  GET  /api/models/ORG/NAME/tree/REV                      the file tree
  HEAD/GET /ORG/NAME/resolve/REV/FILE                     a file (Range: bytes=N- answered 206)

with the headers huggingface_hub reads (X-Repo-Commit, ETag, X-Linked-Etag, X-Linked-Size).
A repository unknown here is answered like the hub answers an anonymous caller: 401 with
X-Error-Code RepoNotFound (404 when a token is sent).

  python3 hub_server.py --port-file F --log L --repo ORG/NAME=DIR [...]
      [--gated TOKEN]    files need `Authorization: Bearer TOKEN` (401 GatedRepo without it)
      [--cut-once]       the first GET of each file over 64 KiB sends half, then closes
      [--stall-once]     the first GET of each file over 64 KiB sends half, then hangs
      [--rate BYTES_S]   file bodies are sent at about this rate
      [--no-blob-ids]    file lists carry names and sizes only (no blobId, no lfs), as
                         some mirrors answer; a file's ETag then names it, as on the hub

Each request is logged to L as one JSON line: method, path, range, authorized.
"""

import argparse
import hashlib
import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

REPOS = {}
ARGS = None
LOCK = threading.Lock()
CUT_DONE = set()


def git_blob_id(data):
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def load_repo(repo, path):
    files = {}
    for root, _, names in os.walk(path):
        for n in sorted(names):
            full = os.path.join(root, n)
            rel = os.path.relpath(full, path)
            with open(full, "rb") as f:
                data = f.read()
            lfs = len(data) > 64 * 1024 or rel.endswith((".safetensors", ".bin"))
            files[rel] = {
                "data": data,
                "blob": git_blob_id(data),
                "sha256": hashlib.sha256(data).hexdigest() if lfs else None,
            }
    commit = hashlib.sha1(
        "".join(f"{n}:{f['blob']}\n" for n, f in sorted(files.items())).encode()
    ).hexdigest()
    REPOS[repo] = {"files": files, "commit": commit}


def sibling(name, f):
    if ARGS.no_blob_ids:
        return {"rfilename": name, "size": len(f["data"])}
    s = {"rfilename": name, "size": len(f["data"]), "blobId": f["blob"]}
    if f["sha256"]:
        s["lfs"] = {"sha256": f["sha256"], "size": len(f["data"]), "pointerSize": 134}
    return s


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def log(self, extra=None):
        entry = {
            "method": self.command,
            "path": self.path,
            "range": self.headers.get("Range"),
            "authorized": self.authorized(),
        }
        entry.update(extra or {})
        with LOCK, open(ARGS.log, "a") as f:
            f.write(json.dumps(entry) + "\n")

    def authorized(self):
        return ARGS.gated is not None and self.headers.get("Authorization") == f"Bearer {ARGS.gated}"

    def reply(self, code, body=b"", headers=None, send_body=True):
        self.send_response(code)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if send_body:
            self.wfile.write(body)

    def error(self, code, error_code, message):
        self.reply(code, json.dumps({"error": message}).encode(),
                   {"X-Error-Code": error_code, "X-Error-Message": message,
                    "Content-Type": "application/json"}, self.command != "HEAD")

    def repo_of(self, parts):
        repo = "/".join(parts[:2])
        if repo not in REPOS:
            if self.headers.get("Authorization"):
                self.error(404, "RepoNotFound", "Repository not found")
            else:
                self.error(401, "RepoNotFound", "Invalid username or password.")
            return None
        return repo

    def do_HEAD(self):
        self.handle_any()

    def do_GET(self):
        self.handle_any()

    def handle_any(self):
        self.log()
        path = self.path.split("?", 1)[0]
        parts = [p for p in path.split("/") if p]
        if parts[:2] == ["api", "models"] and len(parts) >= 4:
            repo = self.repo_of(parts[2:])
            if repo is None:
                return
            r = REPOS[repo]
            rest = parts[4:]
            if rest[:1] == ["tree"]:
                tree = []
                for n, f in sorted(r["files"].items()):
                    e = {"type": "file", "path": n, "size": len(f["data"])}
                    if not ARGS.no_blob_ids:
                        e["oid"] = f["blob"]
                    if f["sha256"] and not ARGS.no_blob_ids:
                        e["lfs"] = {"oid": f["sha256"], "size": len(f["data"]), "pointerSize": 134}
                    tree.append(e)
                return self.reply(200, json.dumps(tree).encode(), {"Content-Type": "application/json"})
            info = {
                "id": repo,
                "modelId": repo,
                "sha": r["commit"],
                "private": False,
                "gated": "manual" if ARGS.gated else False,
                "siblings": [sibling(n, f) for n, f in sorted(r["files"].items())],
            }
            return self.reply(200, json.dumps(info).encode(), {"Content-Type": "application/json"})
        if len(parts) >= 5 and parts[2] == "resolve":
            repo = self.repo_of(parts)
            if repo is None:
                return
            r = REPOS[repo]
            rev = parts[3]
            name = "/".join(parts[4:])
            if rev not in ("main", r["commit"]):
                return self.error(404, "RevisionNotFound", "Invalid rev id")
            f = r["files"].get(name)
            if f is None:
                return self.error(404, "EntryNotFound", f"{name} does not exist")
            if ARGS.gated is not None and not self.authorized():
                return self.error(401, "GatedRepo",
                                  f"Access to model {repo} is restricted. You must have access to it and be authenticated to access it. Please log in.")
            return self.send_file(r, name, f)
        self.error(404, "NotFound", "not found")

    def send_file(self, r, name, f):
        data = f["data"]
        etag = f["sha256"] or f["blob"]
        headers = {
            "X-Repo-Commit": r["commit"],
            "ETag": f'"{etag}"',
            "Accept-Ranges": "bytes",
            "Content-Type": "application/octet-stream",
        }
        if f["sha256"]:
            headers["X-Linked-Etag"] = f'"{etag}"'
            headers["X-Linked-Size"] = str(len(data))
        start = 0
        rng = self.headers.get("Range")
        if rng and rng.startswith("bytes="):
            start = int(rng[6:].split("-")[0] or 0)
            if start >= len(data):
                headers["Content-Range"] = f"bytes */{len(data)}"
                return self.reply(416, b"", headers)
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        code = 206 if rng else 200
        if self.command == "HEAD":
            self.send_response(code)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(data) - start))
            self.end_headers()
            return
        body = data[start:]
        cut = None
        key = (r["commit"], name)
        if (ARGS.cut_once or ARGS.stall_once) and len(data) > 64 * 1024 and start == 0:
            with LOCK:
                if key not in CUT_DONE:
                    CUT_DONE.add(key)
                    cut = len(body) // 2
        self.send_response(code)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        sent = 0
        step = 64 * 1024
        while sent < len(body):
            if cut is not None and sent >= cut:
                self.log({"event": "cut" if ARGS.cut_once else "stall", "at": sent})
                if ARGS.stall_once:
                    time.sleep(3600)
                self.close_connection = True
                self.wfile.flush()
                self.connection.shutdown(2)
                return
            end = min(sent + step, len(body) if cut is None else max(cut, sent + 1))
            end = min(end, len(body))
            self.wfile.write(body[sent:end])
            sent = end
            if ARGS.rate:
                time.sleep(step / ARGS.rate)


def main():
    global ARGS
    p = argparse.ArgumentParser()
    p.add_argument("--port-file", required=True)
    p.add_argument("--log", required=True)
    p.add_argument("--repo", action="append", default=[])
    p.add_argument("--gated")
    p.add_argument("--cut-once", action="store_true")
    p.add_argument("--stall-once", action="store_true")
    p.add_argument("--rate", type=float)
    p.add_argument("--no-blob-ids", action="store_true")
    ARGS = p.parse_args()
    for spec in ARGS.repo:
        repo, path = spec.split("=", 1)
        load_repo(repo, path)
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    tmp = ARGS.port_file + ".tmp"
    with open(tmp, "w") as f:
        f.write(str(server.server_address[1]))
    os.replace(tmp, ARGS.port_file)
    server.serve_forever()


main()
