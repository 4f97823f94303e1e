"""A change-stream server for tests and local rehearsals: a gRPC front for
cbtemulator (which has no change streams) that forwards every call to it and
serves the mutations it forwarded as a Bigtable change stream.

    with ChangeStreamServer("127.0.0.1:8086") as front:   # the emulator's address
        os.environ["BIGTABLE_EMULATOR_HOST"] = front.address
        ...; front.split(table_name, b"m")                  # a partition split

or as a process (what ``ddb2bt local up --change-streams`` starts)::

    python -m ddb2bt.pipeline.testing.change_stream_server --upstream 127.0.0.1:8086 --port 8087

What it does, as the service documents it: a table's stream starts when
CreateTable or UpdateTable sets its ``change_stream_config`` (the front records
it and shows it in GetTable: the emulator ignores it); every MutateRow,
MutateRows entry, CheckAndMutateRow and ReadModifyWriteRow the emulator applied
becomes one change with a commit time the front assigns (strictly increasing;
server-assigned cell timestamps become its millisecond; DeleteFromRow shows as
one DeleteFromFamily per family). GenerateInitialChangeStreamPartitions gives
the partitions (the key space cut at every split so far); ReadChangeStream
serves a partition from a start time or continuation tokens, with heartbeats
(token and low watermark), values over ``chunk_bytes`` in chunks, CloseStream
with the two halves after a split, CloseStream OK past ``end_time``, and
OUT_OF_RANGE for a start or token older than the retention. A split and a
garbage collection (GARBAGE_COLLECTION changes) are played on request. Loopback only.
"""
from __future__ import annotations

import argparse
import json
import logging
import signal
import threading
import time
import uuid
from concurrent import futures
from typing import Callable, Optional

import grpc

from ddb2bt.pipeline.testing import change_stream_wire as wire
from ddb2bt.pipeline.testing.change_log import ChangeLog, Expired, TokenError
from ddb2bt.pipeline.testing.change_stream_reads import serve_partition
from ddb2bt.pipeline.testing.change_stream_tables import TableAdminFront

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
DATA = "/google.bigtable.v2.Bigtable/"
CONTROL = "/ddb2bt.testing.ChangeStreamControl/"
# The data API's streaming methods; every other method forwarded is unary.
STREAMING = {"ReadRows", "SampleRowKeys", "MutateRows", "ExecuteQuery", "GenerateInitialChangeStreamPartitions",
             "ReadChangeStream"}
FORWARDED_HEADERS = ("x-goog-", "google-cloud-resource-prefix")
WORKERS = 64


def _pb(cls):
    return cls.pb()


class ChangeStreamServer(grpc.GenericRpcHandler):
    """The front: ``upstream`` is cbtemulator's host:port; ``port`` 0 picks one."""

    def __init__(self, upstream: str, port: int = 0, clock: Callable[[], float] = time.time,
                 chunk_bytes: int = wire.DEFAULT_CHUNK_BYTES) -> None:
        from google.cloud.bigtable_v2.types import bigtable as bt

        self.log = ChangeLog(clock, uuid.uuid4().hex[:12])
        self.chunk_bytes = chunk_bytes
        self._channel = grpc.insecure_channel(upstream)
        self._tables = TableAdminFront(self._channel, self.log, self._forward_unary)
        self._write_lock = threading.Lock()
        self._pending = threading.local()
        self._types = {"MutateRow": (_pb(bt.MutateRowRequest), _pb(bt.MutateRowResponse)),
                       "MutateRows": (_pb(bt.MutateRowsRequest), _pb(bt.MutateRowsResponse)),
                       "CheckAndMutateRow": (_pb(bt.CheckAndMutateRowRequest), _pb(bt.CheckAndMutateRowResponse)),
                       "ReadModifyWriteRow": (_pb(bt.ReadModifyWriteRowRequest), _pb(bt.ReadModifyWriteRowResponse))}
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="cs-front"),
                                   handlers=[self], options=[("grpc.max_receive_message_length", 256 << 20),
                                                             ("grpc.max_send_message_length", 256 << 20)])
        self.port = self._server.add_insecure_port(f"{LOOPBACK}:{port}")
        self._stopping = threading.Event()

    @property
    def address(self) -> str:
        return f"{LOOPBACK}:{self.port}"

    def start(self) -> "ChangeStreamServer":
        self._server.start()
        return self

    def stop(self, grace_s: float = 0.5) -> None:
        self._stopping.set()
        with self.log.cond:
            self.log.cond.notify_all()
        self._server.stop(grace_s).wait()
        self._channel.close()

    def __enter__(self) -> "ChangeStreamServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def split(self, table_name: str, key: bytes) -> None:
        """Split the partition of ``table_name`` holding ``key`` at ``key``."""
        self.log.split(table_name, key)

    def garbage_collect(self, table_name: str, row_key: bytes, family: str, qualifier: bytes, before_us: int) -> None:
        """What a GC policy does: delete the column's cells older than
        ``before_us`` in the emulator, shown in the stream as a GARBAGE_COLLECTION change."""
        req_type, _ = self._types["MutateRow"]
        req = req_type(table_name=table_name, row_key=row_key)
        cells = req.mutations.add().delete_from_column
        cells.family_name, cells.column_qualifier = family, qualifier
        cells.time_range.end_timestamp_micros = before_us
        with self._write_lock:
            commit_us = self._begin()
            try:
                self._channel.unary_unary(DATA + "MutateRow")(req.SerializeToString(), timeout=10.0)
                if self.log.enabled(table_name):
                    with self.log.cond:
                        self.log.append(table_name, commit_us, row_key, wire.as_logged(req.mutations, ()), gc=True)
            finally:
                self._end()

    # --- dispatch ----------------------------------------------------------------
    def service(self, details):
        method = details.method
        name = method.rsplit("/", 1)[-1]
        if method.startswith(DATA) and name == "GenerateInitialChangeStreamPartitions":
            return grpc.unary_stream_rpc_method_handler(self._initial_partitions)
        if method.startswith(DATA) and name == "ReadChangeStream":
            return grpc.unary_stream_rpc_method_handler(self._read_change_stream)
        if method.startswith(DATA) and name in ("MutateRow", "CheckAndMutateRow", "ReadModifyWriteRow"):
            return grpc.unary_unary_rpc_method_handler(lambda req, ctx: self._write(name, req, ctx))
        if method.startswith(DATA) and name == "MutateRows":
            return grpc.unary_stream_rpc_method_handler(self._mutate_rows)
        if method.startswith(CONTROL):
            return grpc.unary_unary_rpc_method_handler(lambda req, ctx: self._control(name, req, ctx))
        admin = self._tables.handler(method)
        if admin is not None:
            return grpc.unary_unary_rpc_method_handler(admin)
        if method.startswith(DATA) and name in STREAMING:
            return grpc.unary_stream_rpc_method_handler(lambda req, ctx: self._forward_stream(method, req, ctx))
        return grpc.unary_unary_rpc_method_handler(lambda req, ctx: self._forward_unary(method, req, ctx))

    # --- forwarding ----------------------------------------------------------------
    @staticmethod
    def _call_args(ctx) -> dict:
        metadata = [(k, v) for k, v in ctx.invocation_metadata() if k.startswith(FORWARDED_HEADERS)]
        remaining = ctx.time_remaining()
        return {"metadata": metadata, "timeout": remaining if remaining is not None and remaining < 1e6 else None}

    def _forward_unary(self, method: str, request: bytes, ctx) -> bytes:
        try:
            return self._channel.unary_unary(method)(request, **self._call_args(ctx))
        except grpc.RpcError as exc:
            ctx.abort(exc.code(), exc.details() or "")

    def _forward_stream(self, method: str, request: bytes, ctx):
        try:
            yield from self._channel.unary_stream(method)(request, **self._call_args(ctx))
        except grpc.RpcError as exc:
            ctx.abort(exc.code(), exc.details() or "")

    # --- writes: forwarded and logged, one at a time ------------------------------------
    def _write(self, name: str, request: bytes, ctx) -> bytes:
        req_type, resp_type = self._types[name]
        req = req_type.FromString(request)
        table = req.table_name
        with self._write_lock:
            commit_us = self._begin()
            try:
                if name == "MutateRow":
                    wire.stamp(req.mutations, commit_us)
                elif name == "CheckAndMutateRow":
                    wire.stamp(req.true_mutations, commit_us)
                    wire.stamp(req.false_mutations, commit_us)
                raw = self._forward_unary(DATA + name, req.SerializeToString(), ctx)
                resp = resp_type.FromString(raw)
                if name == "MutateRow":
                    applied = req.mutations
                elif name == "CheckAndMutateRow":
                    applied = req.true_mutations if resp.predicate_matched else req.false_mutations
                else:
                    applied = wire.read_modify_write_cells(resp.row)
                self._commit(table, commit_us, [(req.row_key, applied)])
                return raw
            finally:
                self._end()

    def _mutate_rows(self, request: bytes, ctx):
        req_type, resp_type = self._types["MutateRows"]
        req = req_type.FromString(request)
        with self._write_lock:
            commit_us = self._begin()
            try:
                for entry in req.entries:
                    wire.stamp(entry.mutations, commit_us)
                responses = []
                try:
                    for raw in self._channel.unary_stream(DATA + "MutateRows")(req.SerializeToString(),
                                                                               **self._call_args(ctx)):
                        responses.append(raw)
                except grpc.RpcError as exc:
                    ctx.abort(exc.code(), exc.details() or "")
                ok = [e.index for raw in responses for e in resp_type.FromString(raw).entries if e.status.code == 0]
                self._commit(req.table_name, commit_us,
                             [(req.entries[i].row_key, req.entries[i].mutations) for i in sorted(ok)])
            finally:
                self._end()
        yield from responses

    def _begin(self) -> int:
        with self.log.cond:
            commit_us = self.log.next_commit_us()
            self.log.pending_us = commit_us
            return commit_us

    def _end(self) -> None:
        with self.log.cond:
            self.log.pending_us = None
            self.log.cond.notify_all()

    def _commit(self, table: str, commit_us: int, rows: list) -> None:
        if not self.log.enabled(table):
            return
        needs_families = any(m.WhichOneof("mutation") == "delete_from_row" for _, ms in rows for m in ms)
        families = self._tables.families(table) if needs_families else ()
        with self.log.cond:
            for i, (row_key, mutations) in enumerate(rows):
                # the entries of one MutateRows commit one after the other, in order
                self.log.append(table, self.log.next_commit_us() if i else commit_us, row_key,
                                wire.as_logged(mutations, families))

    # --- the change stream ------------------------------------------------------------
    def _initial_partitions(self, request: bytes, ctx):
        req = wire.InitialRequest.FromString(request)
        if not self.log.enabled(req.table_name):
            ctx.abort(grpc.StatusCode.FAILED_PRECONDITION, f"change stream is not enabled on {req.table_name}")
        for rng in self.log.partitions(req.table_name):
            msg = wire.InitialResponse()
            msg.partition.CopyFrom(wire.partition_pb(rng))
            yield msg.SerializeToString()

    def _read_change_stream(self, request: bytes, ctx):
        req = wire.Request.FromString(request)
        if not self.log.enabled(req.table_name):
            ctx.abort(grpc.StatusCode.FAILED_PRECONDITION, f"change stream is not enabled on {req.table_name}")
        try:
            for msg in serve_partition(self.log, req, self.chunk_bytes, lambda: ctx.is_active()
                                       and not self._stopping.is_set()):
                yield msg.SerializeToString()
        except (TokenError, ValueError) as exc:
            code = grpc.StatusCode.OUT_OF_RANGE if isinstance(exc, Expired) else grpc.StatusCode.INVALID_ARGUMENT
            ctx.abort(code, str(exc))
        except KeyError:
            ctx.abort(grpc.StatusCode.NOT_FOUND, f"change stream of {req.table_name} is gone")

    # --- control (tests and rehearsals) ------------------------------------------------------
    def _control(self, name: str, request: bytes, ctx) -> bytes:
        args = json.loads(request or b"{}")
        try:
            if name == "Split":
                self.split(args["table"], bytes.fromhex(args["key"]))
            elif name == "Trim":
                self.log.trim(args["table"])
            elif name == "GarbageCollect":
                self.garbage_collect(args["table"], bytes.fromhex(args["row"]), args["family"],
                                     bytes.fromhex(args["qualifier"]), int(args["before_us"]))
            else:
                ctx.abort(grpc.StatusCode.UNIMPLEMENTED, f"no control {name}")
        except (KeyError, ValueError) as exc:
            ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{name}: {exc}")
        return b"{}"


def _control_call(address: str, name: str, args: dict, timeout_s: float) -> None:
    with grpc.insecure_channel(address) as channel:
        channel.unary_unary(CONTROL + name)(json.dumps(args).encode(), timeout=timeout_s)


def request_split(address: str, table_name: str, key: bytes, timeout_s: float = 10.0) -> None:
    """Ask a running change-stream server (host:port) to split ``table_name`` at ``key``."""
    _control_call(address, "Split", {"table": table_name, "key": key.hex()}, timeout_s)


def request_garbage_collection(address: str, table_name: str, row_key: bytes, family: str, qualifier: bytes,
                               before_us: int, timeout_s: float = 10.0) -> None:
    """Ask a running change-stream server to garbage-collect a column's cells
    older than ``before_us`` (``ChangeStreamServer.garbage_collect``)."""
    _control_call(address, "GarbageCollect", {"table": table_name, "row": row_key.hex(), "family": family,
                                              "qualifier": qualifier.hex(), "before_us": before_us}, timeout_s)


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(description="A change-stream front for cbtemulator (tests and rehearsals).")
    parser.add_argument("--upstream", required=True, help="cbtemulator's host:port")
    parser.add_argument("--port", type=int, default=0, help="the port to listen on, on 127.0.0.1 (0: any)")
    parser.add_argument("--chunk-bytes", type=int, default=wire.DEFAULT_CHUNK_BYTES,
                        help="values longer than this are streamed in chunks")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    server = ChangeStreamServer(args.upstream, args.port, chunk_bytes=args.chunk_bytes).start()
    print(f"change-stream server on {server.address} in front of {args.upstream}", flush=True)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    done.wait()
    server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
