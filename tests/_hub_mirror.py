"""A tiny stand-in for the Hub's file API on 127.0.0.1 (what ``huggingface_hub.hf_hub_download``
requests through ``HF_ENDPOINT``): ``HEAD``/``GET /{org}/{name}/resolve/{revision}/{file}``, with
the headers the client reads (``X-Repo-Commit``, ``ETag``, ``Content-Length``) and the error codes
it maps to typed errors (``X-Error-Code: RepoNotFound | GatedRepo | EntryNotFound |
RevisionNotFound``). Every request path is recorded in ``server.requests``."""

from __future__ import annotations

import hashlib
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse


def start_mirror(repos: dict[str, dict[str, bytes]], *, gated: set[str] = frozenset(), token: str | None = None):
    """Serve ``repos`` ({"org/name": {"config.json": b"…"}}); ``gated`` repos answer 401/403 unless
    the request carries ``Authorization: Bearer TOKEN``. Returns the server (``.url``, ``.requests``,
    ``.shutdown()``)."""
    requests: list[tuple[str, str]] = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):  # quiet
            pass

        def _answer(self, body: bool) -> None:
            path = unquote(urlparse(self.path).path)
            requests.append((self.command, path))
            parts = path.strip("/").split("/")
            if len(parts) < 5 or parts[2] != "resolve":
                return self._error(404, "RepoNotFound")
            repo, revision, fname = "/".join(parts[:2]), parts[3], "/".join(parts[4:])
            if repo not in repos:
                return self._error(401, "RepoNotFound")
            if repo in gated and self.headers.get("Authorization") != f"Bearer {token}":
                return self._error(403, "GatedRepo")
            if revision not in ("main", "v1"):
                return self._error(404, "RevisionNotFound")
            files = repos[repo]
            if fname not in files:
                return self._error(404, "EntryNotFound")
            data = files[fname]
            commit = hashlib.sha1(f"{repo}@{revision}".encode()).hexdigest()
            self.send_response(200)
            self.send_header("X-Repo-Commit", commit)
            self.send_header("ETag", f'"{hashlib.sha1(data).hexdigest()}"')
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            if body:
                self.wfile.write(data)

        def _error(self, code: int, error_code: str) -> None:
            self.send_response(code)
            self.send_header("X-Error-Code", error_code)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def do_HEAD(self):
            self._answer(False)

        def do_GET(self):
            self._answer(True)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    server.requests = requests
    server.url = f"http://127.0.0.1:{server.server_address[1]}"
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server
