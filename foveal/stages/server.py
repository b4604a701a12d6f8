"""One stage as its own HTTP service (stdlib `http.server`, JSON bodies).

    GET  /health                 200 {"stage", "status": "ok", "workers", "queue_depth"}
    GET  /metrics                200 {"foveal:stage_...": value}
    POST /v1/stages/NAME/run     {"item": ...} -> 200 {"result": ...}
                                 or {"error": {"type", "message"}} with
                                 400 (bad item), 503 (queue full), 500 (stage failure)

Behind it is an ordinary `StagePools` (local worker pool + cache), so a
remote stage behaves exactly like a local one; `foveal stage serve` runs it.
"""
from __future__ import annotations

import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from foveal.errors import FovealError, InvalidRequestError, StageOverloadedError
from foveal.stages import codec
from foveal.stages.remote import run_path
from foveal.stages.service import StagePools

MAX_BODY_BYTES = 512 * 2**20


class StageHTTPServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], stage: str, pools: StagePools) -> None:
        super().__init__(address, _StageHandler)
        self.stage, self.pools = stage, pools
        self.backend = pools.backend(stage)  # builds the stage: bad options fail before serving
        pools.warm_up(stage)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"


class _StageHandler(BaseHTTPRequestHandler):
    server: StageHTTPServer

    def do_GET(self) -> None:
        if self.path == "/health":
            backend = self.server.backend
            self._reply(200, {"stage": self.server.stage, "status": "ok",
                              "workers": backend.num_workers, "queue_depth": backend.queue_depth()})
        elif self.path == "/metrics":
            self._reply(200, self.server.pools.get_metrics())
        else:
            self._reply(404, {"error": {"type": "StageError", "message": f"no route GET {self.path}"}})

    def do_POST(self) -> None:
        if self.path != run_path(self.server.stage):
            self._reply(404, {"error": {"type": "StageError",
                                        "message": f"this server runs stage {self.server.stage!r}, "
                                                   f"not {self.path!r}"}})
            return
        try:
            item = self._read_item()
            result = self.server.pools.run_sync(self.server.stage, item)
        except FovealError as error:
            self._reply(_status(error), {"error": codec.encode_error(error)})
            return
        self._reply(200, {"result": codec.encode(result)})

    def _read_item(self):
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY_BYTES:
            raise InvalidRequestError(f"request body is {length} bytes; the limit is {MAX_BODY_BYTES}")
        item_type = self.server.pools.stage(self.server.stage).item_type
        try:
            return codec.decode(item_type, json.loads(self.rfile.read(length))["item"])
        except (ValueError, KeyError, TypeError) as exc:
            raise InvalidRequestError(
                f"body is not {{\"item\": <{item_type.__name__}>}} ({type(exc).__name__}: {exc})") from exc

    def _reply(self, status: int, body: dict) -> None:
        payload = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, format: str, *args) -> None:  # quiet: metrics carry the numbers
        pass


def _status(error: FovealError) -> int:
    if isinstance(error, StageOverloadedError):
        return 503
    if isinstance(error, InvalidRequestError):
        return 400
    return 500
