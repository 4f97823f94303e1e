"""A DynamoDB Streams endpoint that has trimmed, for rehearsing `ddb2bt recover`
on the local stack (`ddb2bt local trim`, docs/recover.md "Rehearse it locally").

The local AWS emulators keep every stream record 24 hours (ministack) or for ever
(moto), so a job stopped for a minute can never find its checkpoint trimmed there.
This proxy stands in front of the emulator's DynamoDB Streams API and answers as
AWS does once records have aged out of the 24-hour retention: per shard, every
record up to a trim point (a sequence number, from ``trims.json``) is gone —

* ``GetShardIterator`` at or after a gone record raises
  ``TrimmedDataAccessException`` (what the reader and `recover` look for);
* ``TRIM_HORIZON`` starts after the trim point (the oldest record held).

Everything else is forwarded unchanged (neither moto nor ministack checks request
signatures, so a rewritten body needs none). It binds to 127.0.0.1 only. Never used against
AWS: only `ddb2bt local trim` starts it, in front of the local stack.
"""
from __future__ import annotations

import argparse
import http.client
import json
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Optional


LOOPBACK = "127.0.0.1"
TRIMS_FILE = "trims.json"  # {stream ARN: {shard id: sequence number of the last record gone}}
GET_SHARD_ITERATOR = "DynamoDBStreams_20120810.GetShardIterator"
# botocore reads the error code from "__type" after the "#" (JSON 1.0 protocol).
TRIMMED_TYPE = "com.amazonaws.dynamodb.v20120810#TrimmedDataAccessException"
UPSTREAM_TIMEOUT_S = 60  # as long as the emulator may take for one call; never reached locally
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host"}


def load_trims(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def trimmed_answer(request: dict, trims: dict) -> tuple:
    """(a rewritten GetShardIterator request or None, an error message or None)
    for the trim points ``trims``: the pure rule the proxy applies."""
    point = trims.get(request.get("StreamArn", ""), {}).get(request.get("ShardId", ""))
    if point is None:
        return None, None
    kind, seq = request.get("ShardIteratorType"), request.get("SequenceNumber")
    if kind == "TRIM_HORIZON":
        return {**request, "ShardIteratorType": "AFTER_SEQUENCE_NUMBER", "SequenceNumber": str(point)}, None
    if kind in ("AT_SEQUENCE_NUMBER", "AFTER_SEQUENCE_NUMBER") and seq is not None:
        # AFTER the last gone record is the oldest held one: still readable.
        gone = int(seq) <= int(point) if kind == "AT_SEQUENCE_NUMBER" else int(seq) < int(point)
        if gone:
            return None, (f"the requested position ({kind} {seq}) of shard {request.get('ShardId')} is beyond the "
                          f"trim horizon: records up to {point} are no longer in the stream (ddb2bt local trim)")
    return None, None


class TrimmingProxy:
    """``with TrimmingProxy(upstream_url, trims_path) as proxy: proxy.url``"""

    def __init__(self, upstream: str, trims_path: Path, port: int = 0) -> None:
        parsed = urllib.parse.urlparse(upstream)
        self.upstream = (parsed.hostname or LOOPBACK, parsed.port or 80)
        self.trims_path = Path(trims_path)
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet: the calls are the emulator's to log
                pass

            def _forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                if self.headers.get("X-Amz-Target") == GET_SHARD_ITERATOR:
                    try:
                        request = json.loads(body or b"{}")
                    except ValueError:
                        request = {}
                    rewritten, error = trimmed_answer(request, load_trims(proxy.trims_path))
                    if error:
                        self._reply(400, {"Content-Type": "application/x-amz-json-1.0"},
                                    json.dumps({"__type": TRIMMED_TYPE, "message": error}).encode())
                        return
                    if rewritten is not None:
                        body = json.dumps(rewritten).encode()
                conn = http.client.HTTPConnection(*proxy.upstream, timeout=UPSTREAM_TIMEOUT_S)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
                    headers["Content-Length"] = str(len(body))
                    conn.request(self.command, self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                    self._reply(resp.status, {k: v for k, v in resp.getheaders() if k.lower() not in HOP_BY_HOP},
                                data)
                finally:
                    conn.close()

            def _reply(self, status: int, headers: dict, data: bytes) -> None:
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = _forward

        self._server = ThreadingHTTPServer((LOOPBACK, port), Handler)  # loopback only
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread: Optional[threading.Thread] = None

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def start(self) -> "TrimmingProxy":
        self._thread = threading.Thread(target=self._server.serve_forever, name="trim-proxy", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> "TrimmingProxy":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: Optional[list] = None) -> int:
    """``python -m ddb2bt.pipeline.local.trim_proxy --upstream URL --trims PATH --port N``
    (started by `ddb2bt local trim`, stopped by `ddb2bt local down`)."""
    parser = argparse.ArgumentParser(prog="ddb2bt-trim-proxy")
    parser.add_argument("--upstream", required=True, help="the emulator's endpoint, http://127.0.0.1:PORT")
    parser.add_argument("--trims", required=True, type=Path, help="the trim points (JSON), read at every call")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    proxy = TrimmingProxy(args.upstream, args.trims, args.port)
    proxy._server.serve_forever()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
