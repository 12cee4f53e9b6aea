"""A small Hub-compatible HTTP server on loopback, for driving the real huggingface_hub and datasets clients.

Reads (huggingface_hub 2.x, datasets 5.x): repo info (`/api/{models,datasets}/{id}[/revision/{rev}]`), file
trees (`/api/.../tree/{rev}[/{path}]`, recursive, paginated), `paths-info`, `refs`, and `resolve`
(`/{id}/resolve/{rev}/{path}`, `/datasets/{id}/resolve/{rev}/{path}`) with HEAD, GET and byte ranges. As on the
real Hub, a file stored in LFS (by its suffix, or over 10 MiB) resolves with a 302 to a "CDN" on another origin
(`localhost` instead of `127.0.0.1`, same port), carrying `X-Linked-Etag`/`X-Linked-Size`; a small file is
served in place with its git blob id as ETag. Every answer about a revision carries `X-Repo-Commit`. Errors
carry the `X-Error-Code` the clients map to exception types (RepoNotFound, RevisionNotFound, EntryNotFound).
A renamed repo answers every request with a 307 to its new id, with a relative Location (the clients follow it).

Revisions: branches, tags, commit shas and special refs (`refs/convert/parquet`, `refs/pr/1`), URL-encoded
in one path segment as the clients send them (`refs%2Fconvert%2Fparquet`).

Uploads: `create_repo`, `create_branch`, `preupload` and `create_commit` (`upload_folder`): every file is
declared "regular" at preupload, so the contents arrive base64-encoded inside the NDJSON commit (no LFS/Xet).

Repos are keyed by their URL path: `owner/name` for a model, `datasets/owner/name` for a dataset, and hold
ref -> {path: bytes}. Every request is recorded (`requests`: method, path, status, Range, body bytes written,
and the repo file it was about), unknown routes are listed in `unknown` (a test should assert it is empty),
and faults can be switched on: `fail_next` (answer a 5xx) and `drop_next` (close the connection mid-body).
"""
from __future__ import annotations

import base64
import fnmatch
import functools
import hashlib
import json
import os
import re
import socket
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Mapping
from urllib.parse import parse_qs, quote, unquote, urlsplit

import yaml

FileSource = bytes | str | os.PathLike  # bytes as they are, str as UTF-8 text, a path read when declared
# Suffixes the Hub's default .gitattributes sends to LFS; bigger files go there too (the Hub refuses >10 MiB in git).
LFS_SUFFIXES = (".safetensors", ".bin", ".parquet", ".arrow", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".onnx",
                ".npy", ".npz", ".pkl", ".gz", ".zst", ".tar", ".zip", ".model")
LFS_MIN_SIZE = 10 * 1024 * 1024
CHUNK = 64 * 1024  # bytes written per send, so a drop can land inside a body
DATE = "2024-01-01T00:00:00.000Z"
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


@dataclass
class Request:
    method: str
    path: str  # as sent, still URL-encoded, without the query
    headers: dict[str, str]  # names lower-cased (HTTP header names are case-insensitive)
    query: str = ""
    status: int = 0
    range: str | None = None  # the Range header, if any
    bytes_sent: int = 0  # body bytes written to the socket (0 for HEAD)
    repo: str | None = None  # repo key ("owner/name", "datasets/owner/name") of a resolve or CDN request
    file: str | None = None  # the file in that repo
    fault: str | None = None  # "status" or "drop" when a switched-on fault answered


@dataclass
class _Fault:
    kind: str  # "status": answer `status` instead; "drop": close the connection after `after_bytes` of the body
    remaining: int
    status: int = 500
    after_bytes: int | None = None  # None: half the body
    method: str | None = None
    path: str | None = None  # fnmatch pattern on the decoded URL path
    repo: str | None = None  # fnmatch pattern on the repo key of a resolve/CDN request
    file: str | None = None  # fnmatch pattern on the repo file of a resolve/CDN request

    def matches(self, req: Request) -> bool:
        def fits(pattern: str | None, value: str | None) -> bool:
            return pattern is None or (value is not None and fnmatch.fnmatchcase(value, pattern))
        return (fits(self.method, req.method) and fits(self.path, unquote(req.path)) and fits(self.repo, req.repo)
                and fits(self.file, req.file))


@dataclass
class _Answer:
    status: int
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""


@dataclass
class FakeHub:
    """Start with `with FakeHub() as hub:`; `hub.url` is the endpoint to give the client (`client_env`)."""

    deny_status: int | None = None  # answer every write with this status (e.g. 403) while set
    repos: dict[str, dict[str, dict[str, bytes]]] = field(default_factory=dict)  # repo key -> ref -> files
    private: dict[str, bool] = field(default_factory=dict)
    tags: dict[str, dict[str, str]] = field(default_factory=dict)  # repo key -> tag -> commit sha
    renamed: dict[str, str] = field(default_factory=dict)  # old repo key -> new repo key
    requests: list[Request] = field(default_factory=list)
    unknown: list[str] = field(default_factory=list)
    commits: list[dict[str, Any]] = field(default_factory=list)  # the upload commits received, in order
    tree_page_size: int = 1000  # entries per tree page, as the Hub; lower it to exercise the clients' paging

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._snapshots: dict[str, dict[str, dict[str, bytes]]] = {}  # repo key -> commit sha -> files
        self._faults: list[_Fault] = []
        self._blobs: dict[str, bytes] = {}  # sha256 -> LFS file content, for the CDN

    # --- lifecycle -------------------------------------------------------------------------
    def __enter__(self) -> "FakeHub":
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _make_handler(self))
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.shutdown()
        self._server.server_close()

    @property
    def url(self) -> str:
        assert self._server is not None, "start the server first (with FakeHub() as hub)"
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    @property
    def cdn_url(self) -> str:
        """Where LFS files are served from: another origin for the clients (no Authorization header follows)."""
        return self.url.replace("127.0.0.1", "localhost")

    def client_env(self, hf_home: str | os.PathLike) -> dict[str, str]:
        """Environment for a client process: this endpoint, online, an HF_HOME of its own, quiet progress bars.

        huggingface_hub and datasets read these once, at import: give them to a new process."""
        return {"HF_ENDPOINT": self.url, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "0", "HF_DATASETS_OFFLINE": "0",
                "TRANSFORMERS_OFFLINE": "0", "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
                "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}

    # --- declaring repos -------------------------------------------------------------------
    def add_repo(self, repo_id: str, files: Mapping[str, FileSource] | os.PathLike, *, repo_type: str = "model",
                 revisions: Mapping[str, Mapping[str, FileSource] | os.PathLike] | None = None,
                 tags: Mapping[str, str] | None = None, private: bool = False) -> str:
        """Declare a repo whose `main` holds `files` ({path in repo: source}, or a folder to take whole).

        `revisions` gives other refs their own files: branch names, or special refs such as
        "refs/convert/parquet" and "refs/pr/1". `tags` points a tag at a ref declared here or at a commit sha.
        Returns main's commit sha."""
        key = _key(repo_id, repo_type)
        self.repos[key] = {"main": _read_files(files)}
        for ref, ref_files in (revisions or {}).items():
            self.repos[key][ref] = _read_files(ref_files)
        self.private[key] = private
        for tag, target in (tags or {}).items():
            self.tags.setdefault(key, {})[tag] = self.commit_sha(repo_id, target, repo_type=repo_type)
        return self.commit_sha(repo_id, repo_type=repo_type)

    def add_model(self, repo_id: str, files: Mapping[str, FileSource] | os.PathLike, **kwargs: Any) -> str:
        return self.add_repo(repo_id, files, repo_type="model", **kwargs)

    def add_dataset(self, repo_id: str, files: Mapping[str, FileSource] | os.PathLike, **kwargs: Any) -> str:
        return self.add_repo(repo_id, files, repo_type="dataset", **kwargs)

    def rename(self, old_id: str, new_id: str, repo_type: str = "model") -> None:
        """`old_id` now lives at `new_id`: every request naming it gets a 307 there, as on the real Hub."""
        self.renamed[_key(old_id, repo_type)] = _key(new_id, repo_type)

    def commit_sha(self, repo_id: str, revision: str = "main", repo_type: str = "model") -> str:
        resolved = self._resolve(_key(repo_id, repo_type), revision)
        if resolved is None:
            raise KeyError(f"{repo_type} {repo_id} has no revision {revision!r}")
        return resolved[0]

    # --- faults ----------------------------------------------------------------------------
    def fail_next(self, n: int = 1, status: int = 500, *, method: str | None = None, path: str | None = None,
                  repo: str | None = None, file: str | None = None) -> None:
        """Answer the next `n` matching requests with `status` (a JSON error body, no X-Error-Code).

        Matching: `method`, and fnmatch patterns on the decoded URL `path`, the `repo` key and the `file` in
        it (the last two are known for resolve and CDN requests only). A read is matched once routed, so
        `repo` and `file` work for it; a write is failed before it changes anything."""
        with self._lock:
            self._faults.append(_Fault("status", n, status=status, method=method, path=path, repo=repo, file=file))

    def drop_next(self, n: int = 1, *, after_bytes: int | None = None, method: str | None = "GET",
                  path: str | None = None, repo: str | None = None, file: str | None = None) -> None:
        """Close the connection of the next `n` matching file bodies (200/206) after `after_bytes` of them
        (default: half), having announced the full Content-Length. Shorter bodies are left alone."""
        with self._lock:
            self._faults.append(_Fault("drop", n, after_bytes=after_bytes, method=method, path=path, repo=repo,
                                       file=file))

    def clear_faults(self) -> None:
        with self._lock:
            self._faults.clear()

    # --- what was asked and served ---------------------------------------------------------
    def files(self, repo_id: str, revision: str = "main", repo_type: str = "model") -> dict[str, bytes]:
        return dict(self.repos[_key(repo_id, repo_type)][revision])

    def write_to(self, folder: Path, repo_id: str, revision: str = "main", repo_type: str = "model") -> Path:
        """Write a ref's files into `folder`, as a download of the repo would lay them out."""
        for name, data in self.files(repo_id, revision, repo_type).items():
            target = folder / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
        return folder

    def served(self, repo_id: str, file: str | None = None, repo_type: str = "model") -> list[Request]:
        """The resolve and CDN requests about a repo (its new id if renamed), or about one of its files."""
        key = self.renamed.get(_key(repo_id, repo_type), _key(repo_id, repo_type))
        return [r for r in list(self.requests) if r.repo == key and (file is None or r.file == file)]

    def bytes_served(self, repo_id: str, file: str | None = None, repo_type: str = "model") -> int:
        """File bytes the server wrote for a repo (200 and 206 bodies): what a client got from here, not a cache."""
        return sum(r.bytes_sent for r in self.served(repo_id, file, repo_type) if r.status in (200, 206))

    # --- revisions -------------------------------------------------------------------------
    def _snapshot(self, key: str, files: dict[str, bytes]) -> str:
        """The commit sha of a ref's content; every sha handed out stays resolvable, as on the Hub."""
        digest = hashlib.sha1(key.encode())
        for name in sorted(files):
            digest.update(b"\0" + name.encode() + b"\0" + _sha256(files[name]).encode())
        sha = digest.hexdigest()
        self._snapshots.setdefault(key, {}).setdefault(sha, dict(files))
        return sha

    def _resolve(self, key: str, revision: str) -> tuple[str, dict[str, bytes]] | None:
        refs = self.repos[key]
        branch = revision.removeprefix("refs/heads/")
        if branch in refs:
            return self._snapshot(key, refs[branch]), refs[branch]
        sha = self.tags.get(key, {}).get(revision.removeprefix("refs/tags/"))
        if sha is None and _COMMIT.match(revision):
            for files in refs.values():  # make sure the current content of every ref has its sha stored
                self._snapshot(key, files)
            sha = revision
        if sha is not None and sha in self._snapshots.get(key, {}):
            return sha, self._snapshots[key][sha]
        return None

    # --- request handling (called from the server threads, under the lock) ----------------
    def handle(self, req: Request, body: bytes) -> _Answer:
        # A write fails before it changes anything; a read is routed first, so that a fault can name its file.
        if req.method not in ("GET", "HEAD") and (fault := self._take_fault(req)) is not None:
            return fault
        answer = self._route(req, body)
        if req.method in ("GET", "HEAD") and (fault := self._take_fault(req)) is not None:
            return fault
        return answer

    def _take_fault(self, req: Request) -> _Answer | None:
        for fault in self._faults:
            if fault.kind == "status" and fault.remaining > 0 and fault.matches(req):
                fault.remaining -= 1
                req.fault = "status"
                return _json(fault.status, {"error": "fake hub: fault switched on"})
        return None

    def _route(self, req: Request, body: bytes) -> _Answer:
        method, segs = req.method, [unquote(s) for s in req.path.strip("/").split("/")]
        raw = req.path.strip("/").split("/")
        if method == "GET" and req.path == "/api/agent-harnesses":
            # Client telemetry, fetched once per process. Declined on purpose: an answer would be
            # cached in the user's HF_HOME as the real registry for a day.
            return _error(404, "not served by the fake hub")
        if method == "POST" and req.path == "/api/validate-yaml":
            return _json(200, {"errors": [], "warnings": []})
        if method == "POST" and req.path == "/api/repos/create":
            return self._create_repo(json.loads(body))
        if segs[0] == "cdn" and len(segs) == 2 and method in ("GET", "HEAD"):
            return self._cdn(req, segs[1])
        if segs[0] == "api" and len(segs) >= 3 and segs[1] in ("models", "datasets"):
            prefix = "" if segs[1] == "models" else "datasets/"
            n = self._id_length(prefix, segs[2:], ("revision", "tree", "paths-info", "refs", "preupload", "commit",
                                                   "branch"))
            key, op = prefix + "/".join(segs[2:2 + n]), segs[2 + n:]
            if key in self.renamed:
                return self._redirect(req, raw[:2], raw[2 + n:], self.renamed[key])
            return self._api(req, key, op, body)
        prefix, rest, rest_raw = ("datasets/", segs[1:], raw[1:]) if segs[0] == "datasets" else ("", segs, raw)
        n = self._id_length(prefix, rest, ("resolve",))
        if method in ("GET", "HEAD") and len(rest) > n + 2 and rest[n] == "resolve":
            key = prefix + "/".join(rest[:n])
            if key in self.renamed:
                return self._redirect(req, raw[:len(raw) - len(rest_raw)], rest_raw[n:], self.renamed[key])
            return self._resolve_file(req, key, rest[n + 1], "/".join(rest[n + 2:]))
        self.unknown.append(f"{method} {req.path}")
        return _error(404, f"fake hub: no route for {method} {req.path}")

    def _id_length(self, prefix: str, segs: list[str], ops: tuple[str, ...]) -> int:
        """How many path segments the repo id takes: 2 (owner/name) unless only a 1-segment id (`gpt2`) fits."""
        known = self.repos.keys() | self.renamed.keys()
        if len(segs) >= 2 and prefix + "/".join(segs[:2]) in known:
            return 2
        if prefix + segs[0] in known or (len(segs) >= 2 and segs[1] in ops):
            return 1
        return 2

    def _redirect(self, req: Request, before: list[str], after: list[str], new_key: str) -> _Answer:
        new_id = new_key.removeprefix("datasets/")
        location = "/" + "/".join(before + [quote(s) for s in new_id.split("/")] + after)
        location += f"?{req.query}" if req.query else ""
        # A path-only Location, as the Hub sends for renamed repos: the clients stay on the same origin.
        return _Answer(307, {"Location": location, "Content-Type": "text/plain"}, b"Temporary Redirect")

    def _not_found(self, req: Request, key: str) -> _Answer | None:
        """RepoNotFound for a missing repo, or a private one asked without a token (401 without one, as the Hub)."""
        if key in self.repos and not (self.private.get(key) and "authorization" not in req.headers):
            return None
        return _error(404 if "authorization" in req.headers else 401, "Repository not found", "RepoNotFound")

    def _api(self, req: Request, key: str, op: list[str], body: bytes) -> _Answer:
        method = req.method
        if (missing := self._not_found(req, key)) is not None:
            return missing
        if method == "GET" and op[:1] in ([], ["revision"]):
            return self._repo_info(req, key, "/".join(op[1:]) or "main")
        if method == "GET" and op == ["refs"]:
            return self._refs(key)
        if method == "GET" and op[:1] == ["tree"] and len(op) >= 2:
            return self._tree(req, key, op[1], "/".join(op[2:]))
        if method == "POST" and op[:1] == ["paths-info"] and len(op) >= 2:
            return self._paths_info(req, key, "/".join(op[1:]), body)
        if method == "POST" and op[:1] in (["preupload"], ["commit"], ["branch"]) and len(op) >= 2:
            rev = "/".join(op[1:])
            if op[0] == "branch":
                return self._create_branch(key, rev, json.loads(body or b"{}"))
            if rev not in self.repos[key]:
                return _no_revision(rev)
            if op[0] == "preupload":
                files = json.loads(body)["files"]
                return _json(200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                             for f in files]})
            return self._commit(key, rev, body)
        self.unknown.append(f"{method} {req.path}")
        return _error(404, f"fake hub: no route for {method} {req.path}")

    # --- reads -----------------------------------------------------------------------------
    def _repo_info(self, req: Request, key: str, revision: str) -> _Answer:
        resolved = self._resolve(key, revision)
        if resolved is None:
            return _no_revision(revision)
        sha, files = resolved
        repo_id = key.removeprefix("datasets/")
        info: dict[str, Any] = {
            "_id": hashlib.sha1(key.encode()).hexdigest()[:24], "id": repo_id, "author": repo_id.split("/")[0],
            "sha": sha, "lastModified": DATE, "createdAt": DATE, "private": self.private.get(key, False),
            "gated": False, "disabled": False, "downloads": 0, "likes": 0, "tags": [],
            "siblings": [{"rfilename": name} for name in sorted(files)],
        }
        card = _front_matter(files.get("README.md", b""))
        if key.startswith("datasets/"):
            info.update(cardData=card, description="")
        else:
            info.update(modelId=repo_id, cardData=card)
        return _json(200, info)

    def _refs(self, key: str) -> _Answer:
        refs: dict[str, list[dict[str, str]]] = {"branches": [], "converts": [], "tags": [], "pullRequests": []}
        for name, files in self.repos[key].items():
            sha = self._snapshot(key, files)
            if name.startswith("refs/convert/"):
                refs["converts"].append({"name": name.removeprefix("refs/convert/"), "ref": name, "targetCommit": sha})
            elif name.startswith("refs/pr/"):
                refs["pullRequests"].append({"name": name.removeprefix("refs/"), "ref": name, "targetCommit": sha})
            else:
                refs["branches"].append({"name": name, "ref": f"refs/heads/{name}", "targetCommit": sha})
        for tag, sha in self.tags.get(key, {}).items():
            refs["tags"].append({"name": tag, "ref": f"refs/tags/{tag}", "targetCommit": sha})
        return _json(200, refs)

    def _tree(self, req: Request, key: str, revision: str, path: str) -> _Answer:
        resolved = self._resolve(key, revision)
        if resolved is None:
            return _no_revision(revision)
        files = resolved[1]
        query = parse_qs(req.query)
        recursive = query.get("recursive", ["false"])[0].lower() in ("1", "true")
        if path and path not in _folders(files):
            return _error(404, f"{path} does not exist on \"{revision}\"", "EntryNotFound")
        entries = [_entry(p, files) for p in sorted(_folders(files) | files.keys())
                   if p and _is_under(p, path, recursive)]
        cursor = int(query.get("cursor", ["0"])[0])
        page = entries[cursor:cursor + self.tree_page_size]
        headers = {}
        if cursor + self.tree_page_size < len(entries):  # the GitHub-style Link header the client follows
            kept = [f"{k}={quote(v[0])}" for k, v in query.items() if k != "cursor"]
            next_query = "&".join(kept + [f"cursor={cursor + len(page)}"])
            headers["Link"] = f'<{self.url}{req.path}?{next_query}>; rel="next"'
        return _json(200, page, headers)

    def _paths_info(self, req: Request, key: str, revision: str, body: bytes) -> _Answer:
        resolved = self._resolve(key, revision)
        if resolved is None:
            return _no_revision(revision)
        files = resolved[1]
        known = _folders(files) | files.keys()
        form = parse_qs(body.decode())
        return _json(200, [_entry(p, files) for p in form.get("paths", []) if p in known])

    def _resolve_file(self, req: Request, key: str, revision: str, path: str) -> _Answer:
        req.repo, req.file = key, path
        if (missing := self._not_found(req, key)) is not None:
            return missing
        resolved = self._resolve(key, revision)
        if resolved is None:
            return _no_revision(revision)
        sha, files = resolved
        if path not in files:
            answer = _error(404, "Entry not found", "EntryNotFound")
            answer.headers["X-Repo-Commit"] = sha  # the client caches the miss under this commit
            return answer
        data = files[path]
        if _is_lfs(path, data):
            # As the Hub: the metadata on the redirect itself, the bytes from another origin.
            oid = _sha256(data)
            self._blobs[oid] = data
            location = f"{self.cdn_url}/cdn/{oid}?repo={quote(key, safe='')}&file={quote(path, safe='')}"
            return _Answer(302, {"Location": location, "X-Repo-Commit": sha, "ETag": f'"{oid}"',
                                 "X-Linked-Etag": f'"{oid}"', "X-Linked-Size": str(len(data)),
                                 "Content-Type": "text/plain"}, b"Found. Redirecting")
        answer = _ranged(req, data)
        answer.headers.update({"X-Repo-Commit": sha, "ETag": f'"{_git_oid(data)}"',
                               "Content-Disposition": f'inline; filename="{path.rsplit("/", 1)[-1]}"'})
        return answer

    def _cdn(self, req: Request, oid: str) -> _Answer:
        query = parse_qs(req.query)
        req.repo, req.file = query.get("repo", [None])[0], query.get("file", [None])[0]
        if oid not in self._blobs:
            return _error(404, "blob not found")
        answer = _ranged(req, self._blobs[oid])
        answer.headers["ETag"] = f'"{oid}"'
        return answer

    # --- uploads ---------------------------------------------------------------------------
    def _create_repo(self, payload: dict[str, Any]) -> _Answer:
        repo = f"{payload['organization']}/{payload['name']}" if payload.get("organization") else payload["name"]
        key = _key(repo, payload.get("type") or "model")
        prefix = "datasets/" if key.startswith("datasets/") else ""
        if key in self.repos:
            # The real Hub's 409 carries the url too: create_repo(exist_ok=True) reads it.
            return _json(409, {"error": "You already created this model repo", "url": f"{self.url}/{key}"})
        # Like the real Hub, a new repo starts with one commit holding .gitattributes.
        self.repos[key] = {"main": {".gitattributes": b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"}}
        self.private[key] = payload.get("visibility") == "private"
        return _json(200, {"url": f"{self.url}/{prefix}{repo}", "name": repo})

    def _create_branch(self, key: str, branch: str, payload: dict[str, Any]) -> _Answer:
        if branch in self.repos[key]:
            return _error(409, f"Reference already exists: refs/heads/{branch}")
        resolved = self._resolve(key, payload.get("startingPoint") or "main")
        if resolved is None:
            return _no_revision(payload["startingPoint"])
        self.repos[key][branch] = dict(resolved[1])
        return _json(200, {})

    def _commit(self, key: str, rev: str, body: bytes) -> _Answer:
        lines = [json.loads(line) for line in body.splitlines() if line.strip()]
        header = next(line["value"] for line in lines if line["key"] == "header")
        files = self.repos[key][rev]
        for line in lines:
            if line["key"] == "file":
                value = line["value"]
                assert value["encoding"] == "base64", value["encoding"]
                files[value["path"]] = base64.b64decode(value["content"])
            elif line["key"] == "deletedFile":
                files.pop(line["value"]["path"], None)
            elif line["key"] != "header":
                return _error(400, f"fake hub: unsupported commit operation {line['key']}")
        self.commits.append({"repo": key, "revision": rev, "summary": header["summary"]})
        oid = self._snapshot(key, files)
        return _json(200, {"commitUrl": f"{self.url}/{key}/commit/{oid}", "commitOid": oid, "pullRequestUrl": None})


# --- pure helpers ------------------------------------------------------------------------------
def _key(repo_id: str, repo_type: str) -> str:
    assert repo_type in ("model", "dataset"), repo_type
    return repo_id if repo_type == "model" else f"datasets/{repo_id}"


def _read_files(files: Mapping[str, FileSource] | os.PathLike) -> dict[str, bytes]:
    if isinstance(files, os.PathLike):
        root = Path(files)
        return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}
    return {name: (data if isinstance(data, bytes) else data.encode() if isinstance(data, str)
                   else Path(data).read_bytes()) for name, data in files.items()}


def _is_lfs(path: str, data: bytes) -> bool:
    return path.endswith(LFS_SUFFIXES) or len(data) > LFS_MIN_SIZE


@functools.lru_cache(maxsize=None)
def _sha256(data: bytes) -> str:
    """Cached: every request about a revision hashes its files (Python caches a bytes object's own hash)."""
    return hashlib.sha256(data).hexdigest()


@functools.lru_cache(maxsize=None)
def _git_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _folders(files: dict[str, bytes]) -> set[str]:
    return {name.rsplit("/", i)[0] for name in files for i in range(1, name.count("/") + 1)}


def _is_under(path: str, folder: str, recursive: bool) -> bool:
    if folder and not path.startswith(folder + "/"):
        return False
    rest = path[len(folder) + 1:] if folder else path
    return recursive or "/" not in rest


def _entry(path: str, files: dict[str, bytes]) -> dict[str, Any]:
    """A tree / paths-info entry, as the Hub lists it."""
    if path not in files:
        return {"type": "directory", "oid": hashlib.sha1(path.encode()).hexdigest(), "size": 0, "path": path}
    data = files[path]
    entry: dict[str, Any] = {"type": "file", "oid": _git_oid(data), "size": len(data), "path": path}
    if _is_lfs(path, data):
        entry["lfs"] = {"oid": _sha256(data), "size": len(data), "pointerSize": 134}
    return entry


def _front_matter(readme: bytes) -> dict[str, Any] | None:
    text = readme.decode("utf-8", "replace")
    if not text.startswith("---\n") or "\n---" not in text[4:]:
        return None
    return yaml.safe_load(text[4:text.index("\n---", 4)])


def _ranged(req: Request, data: bytes) -> _Answer:
    """200 with the whole file, or 206 with the asked byte range (one range: what the clients send)."""
    headers = {"Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"}
    spec = req.range
    match = re.fullmatch(r"bytes=(\d*)-(\d*)", spec.strip()) if spec else None
    if match is None or match.groups() == ("", ""):
        return _Answer(200, headers, data)
    first, last = match.groups()
    start, end = (len(data) - int(last), len(data) - 1) if first == "" else \
        (int(first), min(int(last), len(data) - 1) if last else len(data) - 1)
    if start >= len(data) or start > end:
        return _Answer(416, {**headers, "Content-Range": f"bytes */{len(data)}"}, b"")
    start = max(start, 0)
    headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
    return _Answer(206, headers, data[start:end + 1])


def _no_revision(revision: str) -> _Answer:
    return _error(404, f"Invalid rev id: {revision}", "RevisionNotFound")


def _json(status: int, payload: Any, headers: dict[str, str] | None = None) -> _Answer:
    return _Answer(status, {"Content-Type": "application/json", **(headers or {})}, json.dumps(payload).encode())


def _error(status: int, message: str, code: str | None = None) -> _Answer:
    answer = _json(status, {"error": message})
    if code:
        answer.headers.update({"X-Error-Code": code, "X-Error-Message": message})
    return answer


def _make_handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as httpx expects; every answer has a length

        def _answer(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            url = urlsplit(self.path)
            req = Request(self.command, url.path, {k.lower(): v for k, v in self.headers.items()}, url.query,
                          range=self.headers.get("Range"))
            drop_after = None
            with hub._lock:
                hub.requests.append(req)
                write = self.command == "POST" and url.path != "/api/validate-yaml" and "paths-info" not in url.path
                if write and not self.headers.get("Authorization"):
                    answer = _error(401, "Invalid username or password.")
                elif write and hub.deny_status is not None:
                    answer = _error(hub.deny_status, "You don't have the rights to create a model here")
                else:
                    answer = hub.handle(req, body)
                req.status = answer.status
                body_out = answer.body if self.command != "HEAD" else b""
                for fault in hub._faults:  # only a file's body is cut (200/206), not a redirect or an error
                    if fault.kind == "drop" and fault.remaining > 0 and answer.status in (200, 206) \
                            and fault.matches(req):
                        cut = len(body_out) // 2 if fault.after_bytes is None else fault.after_bytes
                        if cut < len(body_out):
                            fault.remaining -= 1
                            req.fault, drop_after = "drop", cut
                            break
                # Counted before sending: a client may have read the answer before this thread gets to count it.
                end = req.bytes_sent = len(body_out) if drop_after is None else drop_after
            self.send_response(answer.status)
            for name, value in answer.headers.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(answer.body)))
            self.end_headers()
            for offset in range(0, end, CHUNK):
                try:
                    self.wfile.write(body_out[offset:min(offset + CHUNK, end)])
                except OSError:  # the client went away: count only what was written
                    req.bytes_sent, self.close_connection = offset, True
                    return
            if drop_after is not None:  # the body stops short of its Content-Length: the peer sees a cut
                self.wfile.flush()
                self.connection.shutdown(socket.SHUT_RDWR)
                self.close_connection = True

        do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = _answer

        def log_message(self, format: str, *args: Any) -> None:  # keep test output clean
            pass

    return Handler
