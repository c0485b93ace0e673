"""A small Hugging Face hub on 127.0.0.1 for the download tests: the part of the hub's HTTP API that
huggingface_hub (2.4) uses to download a model, served from real files on disk. Point ``HF_ENDPOINT`` at
``server.url``. Not a test file: a utility.

What huggingface_hub asks, and what this answers (read from its file_download.py, _snapshot_download.py,
hf_api.py and utils/_http.py):

* ``GET /api/models/{repo}/revision/{rev}``: the model info JSON (``id``, ``sha``, ``siblings``).
* ``GET /api/models/{repo}/tree/{rev}?recursive=True``: the file list (``type``, ``path``, ``size``,
  ``oid``; ``lfs`` {``oid`` sha256, ``size``, ``pointerSize``} for weights), one page (no ``Link`` header).
* ``HEAD`` / ``GET /{repo}/resolve/{rev}/{path}``: the file, with ``X-Repo-Commit``, ``ETag`` (the git blob
  id; for LFS files ``X-Linked-Etag`` = sha256 and ``X-Linked-Size``) and ``Content-Length``; a ``Range:
  bytes=N-`` GET (a resumed download) gets ``206`` and the rest.
* Errors are keyed on ``X-Error-Code`` (``RepoNotFound``, ``GatedRepo``, ``RevisionNotFound``,
  ``EntryNotFound``), not on the status code. No ``X-Xet-*`` headers, so no Xet transfer is attempted.

Test switches on the server: ``gated`` repos answer files only to ``Authorization: Bearer <token>``;
``drop_after[(repo, path)] = n`` sends the headers of that file, ``n`` bytes, then closes the connection
(an interrupted download); ``requests`` records every (method, path) asked.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

LFS_MIN_BYTES = 1 << 20  # files this large (and every *.safetensors) are LFS files, as on the hub


@dataclass
class HubFile:
    path: str  # inside the repo
    source: Path  # on disk
    size: int
    git_oid: str
    sha256: str | None  # LFS files only

    @classmethod
    def from_disk(cls, path: str, source: Path) -> "HubFile":
        data = source.read_bytes()
        git_oid = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        lfs = path.endswith(".safetensors") or len(data) >= LFS_MIN_BYTES
        return cls(path, source, len(data), git_oid, hashlib.sha256(data).hexdigest() if lfs else None)

    def tree_entry(self) -> dict:
        entry = {"type": "file", "path": self.path, "size": self.size, "oid": self.git_oid}
        if self.sha256:
            entry["lfs"] = {"oid": self.sha256, "size": self.size, "pointerSize": 134}
        return entry


@dataclass
class HubRepo:
    repo_id: str
    files: dict[str, HubFile]
    sha: str
    gated_token: str | None = None  # set: a gated repo, files only with this token


@dataclass
class LocalHub:
    """``with LocalHub() as hub: hub.add_repo("org/name", directory)``; ``hub.url`` is the endpoint."""

    repos: dict[str, HubRepo] = field(default_factory=dict)
    drop_after: dict[tuple[str, str], int] = field(default_factory=dict)
    requests: list[tuple[str, str]] = field(default_factory=list)

    def add_repo(self, repo_id: str, directory: Path, extra: dict[str, bytes] | None = None,
                 gated_token: str | None = None) -> HubRepo:
        """Serve every file under ``directory`` (and ``extra`` files, written next to them) as ``repo_id``."""
        directory = Path(directory)
        for name, data in (extra or {}).items():
            (directory / name).write_bytes(data)
        files = {p.relative_to(directory).as_posix(): HubFile.from_disk(p.relative_to(directory).as_posix(), p)
                 for p in sorted(directory.rglob("*")) if p.is_file()}
        sha = hashlib.sha1(json.dumps(sorted((f.path, f.git_oid) for f in files.values())).encode()).hexdigest()
        repo = HubRepo(repo_id, files, sha, gated_token)
        self.repos[repo_id] = repo
        return repo

    # -- server lifecycle ------------------------------------------------------------------------
    def start(self) -> "LocalHub":
        hub = self

        class Handler(_HubHandler):
            pass

        Handler.hub = hub
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    def __enter__(self) -> "LocalHub":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class _HubHandler(BaseHTTPRequestHandler):
    hub: LocalHub
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # quiet: the tests read hub.requests instead
        pass

    def do_GET(self) -> None:
        self._route(head=False)

    def do_HEAD(self) -> None:
        self._route(head=True)

    # -- routing ---------------------------------------------------------------------------------
    def _route(self, head: bool) -> None:
        path = unquote(urlsplit(self.path).path)
        self.hub.requests.append(("HEAD" if head else "GET", path))
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] in ("revision", "tree"):
            repo = self._repo("/".join(parts[2:4]), api=True)
            if repo and self._revision_ok(repo, parts[5]):
                if parts[4] == "revision":
                    self._json({"id": repo.repo_id, "modelId": repo.repo_id, "sha": repo.sha, "private": False,
                                "gated": "manual" if repo.gated_token else False,
                                "siblings": [{"rfilename": name} for name in repo.files]})
                else:
                    self._json([f.tree_entry() for f in repo.files.values()])
            return
        if len(parts) >= 5 and parts[2] == "resolve":
            repo = self._repo("/".join(parts[:2]), api=False)
            if repo and self._revision_ok(repo, parts[3]):
                self._file(repo, "/".join(parts[4:]), head)
            return
        self._error(404, "EntryNotFound", "no such route")

    def _repo(self, repo_id: str, api: bool) -> HubRepo | None:
        repo = self.hub.repos.get(repo_id)
        if repo is None:
            # The hub answers 401 for a repo that does not exist (it cannot tell it from a private one).
            self._error(401, "RepoNotFound", "Repository not found")
            return None
        if repo.gated_token and not api:
            if self.headers.get("Authorization") != f"Bearer {repo.gated_token}":
                self._error(401 if self.headers.get("Authorization") is None else 403, "GatedRepo",
                            "Access to model is restricted. You must have access to it and be authenticated.")
                return None
        return repo

    def _revision_ok(self, repo: HubRepo, revision: str) -> bool:
        if revision in ("main", repo.sha):
            return True
        self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        return False

    # -- answers ---------------------------------------------------------------------------------
    def _file(self, repo: HubRepo, name: str, head: bool) -> None:
        entry = repo.files.get(name)
        if entry is None:
            self._error(404, "EntryNotFound", f"{name} does not exist on \"main\"")
            return
        start = 0
        want = self.headers.get("Range")
        if want and want.startswith("bytes=") and want[6:].endswith("-"):
            start = int(want[6:-1])
        self.send_response(206 if start else 200)
        self.send_header("X-Repo-Commit", repo.sha)
        self.send_header("ETag", f'"{entry.git_oid}"')
        if entry.sha256:
            self.send_header("X-Linked-Etag", f'"{entry.sha256}"')
            self.send_header("X-Linked-Size", str(entry.size))
        if start:
            self.send_header("Content-Range", f"bytes {start}-{entry.size - 1}/{entry.size}")
        self.send_header("Content-Length", str(entry.size - start))
        self.send_header("Accept-Ranges", "bytes")
        self.end_headers()
        if head:
            return
        drop = self.hub.drop_after.get((repo.repo_id, name))
        with entry.source.open("rb") as fh:
            fh.seek(start)
            remaining = entry.size - start if drop is None else min(drop, entry.size - start - 1)
            while remaining > 0:
                chunk = fh.read(min(remaining, 1 << 20))
                if not chunk:
                    break
                self.wfile.write(chunk)
                remaining -= len(chunk)
        if drop is not None:  # the connection dies mid-file
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(2)

    def _json(self, body) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, code: str, message: str) -> None:
        data = json.dumps({"error": message}).encode()
        self.send_response(status)
        self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)
