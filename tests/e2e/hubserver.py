"""A Hugging Face-compatible file server on loopback, for `HF_ENDPOINT`: one model
repository served from a local directory, with the endpoints huggingface_hub's
`snapshot_download` calls (huggingface_hub 2.x: hf_api.py repo_info and list_repo_tree,
file_download.py get_hf_file_metadata and the download itself):

    GET  /api/models/<repo>/revision/<rev>           repo_info: the commit sha
    GET  /api/models/<repo>/tree/<rev>?recursive=..  list_repo_tree: files, sizes, ids
    HEAD /<repo>/resolve/<rev>/<path>                X-Repo-Commit, ETag, Content-Length
    GET  /<repo>/resolve/<rev>/<path>                the file

Every request is logged (`requests`), so a test can count what was downloaded.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    status: int


class HubServer:
    def __init__(self, repo_id: str, root: Path):
        self.repo_id, self.root = repo_id, root
        self.files = {str(p.relative_to(root)): p for p in sorted(root.rglob("*")) if p.is_file()}
        self.ids = {name: hashlib.sha256(p.read_bytes()).hexdigest() for name, p in self.files.items()}
        self.commit = hashlib.sha1(json.dumps(self.ids, sort_keys=True).encode()).hexdigest()
        self.requests: list[Request] = []
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> HubServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        """The hub unreachable: the port closes."""
        self._server.shutdown()
        self._server.server_close()

    def downloads(self) -> list[str]:
        """The files whose contents were sent (GETs of /resolve/), in order."""
        marker = f"/{self.repo_id}/resolve/"
        return [r.path.split(marker, 1)[1].split("/", 1)[1] for r in self.requests
                if r.method == "GET" and marker in r.path and r.status == 200]  # fmt: skip

    def _log(self, method: str, path: str, status: int) -> None:
        with self._lock:
            self.requests.append(Request(method, path, status))

    def _answer(self, method: str, raw_path: str) -> tuple[int, dict[str, str], bytes]:
        path = unquote(urlsplit(raw_path).path)
        api = f"/api/models/{self.repo_id}/"
        resolve = f"/{self.repo_id}/resolve/"
        if path.startswith(api + "revision/"):
            siblings = [{"rfilename": name} for name in self.files]
            body = {"id": self.repo_id, "modelId": self.repo_id, "sha": self.commit, "siblings": siblings}
            return 200, {"Content-Type": "application/json"}, json.dumps(body).encode()
        if path.startswith(api + "tree/"):
            entries = [
                {"type": "file", "path": name, "size": p.stat().st_size, "oid": self.ids[name]}
                for name, p in self.files.items()
            ]
            return 200, {"Content-Type": "application/json"}, json.dumps(entries).encode()
        if path.startswith(resolve):
            name = path[len(resolve) :].split("/", 1)[1]
            if name in self.files:
                data = self.files[name].read_bytes()
                headers = {
                    "X-Repo-Commit": self.commit,
                    "ETag": f'"{self.ids[name]}"',
                    "Content-Length": str(len(data)),
                    "Content-Type": "application/octet-stream",
                }
                return 200, headers, data if method == "GET" else b""
        body = json.dumps({"error": "Entry not found"}).encode()
        return 404, {"X-Error-Code": "EntryNotFound", "Content-Type": "application/json"}, body

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def _serve(self, method: str) -> None:
                status, headers, body = hub._answer(method, self.path)
                hub._log(method, self.path, status)
                self.send_response(status)
                for key, value in headers.items():
                    self.send_header(key, value)
                if "Content-Length" not in headers:
                    self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if method == "GET":
                    self.wfile.write(body)

            def do_GET(self) -> None:
                self._serve("GET")

            def do_HEAD(self) -> None:
                self._serve("HEAD")

            def log_message(self, format: str, *args: object) -> None:
                pass  # kept in `requests`

        return Handler
