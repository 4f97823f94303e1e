"""Injected Bigtable faults at the gRPC layer, against the real emulator: call
failures, ambiguous per-entry failures, latency. A gRPC client interceptor that
callers pass explicitly (``BigtableSpec.interceptors``); production code never
imports this module.
"""
from __future__ import annotations

import random as _random
import threading
import time as _time
from typing import Optional

import grpc as _grpc


_CALL_FAULTS = {"unavailable": _grpc.StatusCode.UNAVAILABLE, "deadline_exceeded": _grpc.StatusCode.DEADLINE_EXCEEDED,
                "resource_exhausted": _grpc.StatusCode.RESOURCE_EXHAUSTED}
INJECTED: dict = {}  # kind -> count, for tests and the soak report


# Requests of one batch run on several threads (the sink's concurrent MutateRows).
_COUNT_LOCK = threading.Lock()


def _mutate_rows_response():
    from ddb2bt.pipeline.clients.bigtable.wire import mutate_rows_types  # inside: a test double's import

    return mutate_rows_types()[1]


def _count(kind: str, log_path: Optional[str]) -> None:
    with _COUNT_LOCK:
        INJECTED[kind] = INJECTED.get(kind, 0) + 1
    if log_path:
        with open(log_path, "a") as fh:  # appended and closed at once: a killed process loses nothing
            fh.write(kind + "\n")


class _InjectedRpcError(_grpc.RpcError):
    def __init__(self, code) -> None:
        super().__init__(f"injected {code.name}")
        self._code = code

    def code(self):
        return self._code

    def details(self):
        return f"injected {self._code.name}"


class _FailingStream:
    def __init__(self, code) -> None:
        self._code = code

    def __iter__(self):
        raise _InjectedRpcError(self._code)


class FaultInterceptor(_grpc.UnaryStreamClientInterceptor, _grpc.UnaryUnaryClientInterceptor):
    """Injects call failures (UNAVAILABLE, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED),
    per-entry UNAVAILABLE statuses inside MutateRows responses (the entry *was*
    applied: an ambiguous failure, exactly what retries must survive) and latency.

    Spec: "unavailable=0.1,deadline_exceeded=0.05,resource_exhausted=0.05,
    entry_unavailable=0.1,latency_ms=20,seed=1". Passed explicitly, e.g.
    ``BigtableSpec(..., interceptors=(FaultInterceptor.from_spec(spec),))`` or
    ``cli.main(argv, bigtable_interceptors=[...])``; picklable, so it travels to
    Beam workers inside the sink. ``log_path``: a file that gets one line per
    injected fault (survives SIGKILL, for the soak's report).
    """

    def __init__(self, rates: dict, latency_ms: float = 0.0, seed: Optional[int] = None,
                 log_path: Optional[str] = None) -> None:
        self._rates = rates
        self._latency = latency_ms / 1000
        self._seed = seed
        self._log_path = log_path
        self._rng = _random.Random(seed)
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        return {"rates": self._rates, "latency_ms": self._latency * 1000, "seed": self._seed,
                "log_path": self._log_path}

    def __setstate__(self, state: dict) -> None:
        self.__init__(**state)

    @classmethod
    def from_spec(cls, spec: str, log_path: Optional[str] = None) -> "FaultInterceptor":
        values = dict(part.split("=", 1) for part in spec.split(",") if part.strip())
        latency = float(values.pop("latency_ms", 0))
        seed = values.pop("seed", None)
        unknown = set(values) - set(_CALL_FAULTS) - {"entry_unavailable"}
        if unknown:
            raise ValueError(f"fault spec: unknown fault kinds {sorted(unknown)}")
        return cls({k: float(v) for k, v in values.items()}, latency, int(seed) if seed else None, log_path)

    def _draw(self) -> Optional[str]:
        with self._lock:
            roll = self._rng.random()
        edge = 0.0
        for kind, code in _CALL_FAULTS.items():
            edge += self._rates.get(kind, 0.0)
            if roll < edge:
                _count(kind, self._log_path)
                return kind
        return None

    def intercept_unary_stream(self, continuation, details, request):
        if self._latency:
            _time.sleep(self._latency)
        kind = self._draw()
        if kind is not None:
            return _FailingStream(_CALL_FAULTS[kind])
        responses = continuation(details, request)
        rate = self._rates.get("entry_unavailable", 0.0)
        if not rate or not details.method.endswith("/MutateRows"):
            return responses
        return self._mangle(responses, rate)

    def _mangle(self, responses, rate):
        for response in responses:
            raw = type(response) is bytes  # the sink's answers are left serialized (writer.py)
            if raw:
                response = _mutate_rows_response().FromString(response)
            for entry in response.entries:
                with self._lock:
                    hit = self._rng.random() < rate
                if hit and entry.status.code == 0:
                    entry.status.code = _grpc.StatusCode.UNAVAILABLE.value[0]
                    entry.status.message = "injected per-entry UNAVAILABLE"
                    _count("entry_unavailable", self._log_path)
            yield response.SerializeToString() if raw else response

    def intercept_unary_unary(self, continuation, details, request):
        if self._latency:
            _time.sleep(self._latency)
        kind = self._draw()
        if kind is not None:
            raise _InjectedRpcError(_CALL_FAULTS[kind])
        return continuation(details, request)


class RowFilterLimit(_grpc.UnaryStreamClientInterceptor, _grpc.UnaryUnaryClientInterceptor):
    """Bigtable's row-filter size limit, which the emulator does not enforce: a
    CheckAndMutateRow predicate or a ReadRows filter over ``limit`` serialized
    bytes fails with INVALID_ARGUMENT, as the service answers
    (googleapis/java-bigtable-hbase#2192). ``rejected`` counts them."""

    LIMIT = 20_480  # bytes, the service's

    def __init__(self, limit: int = LIMIT) -> None:
        self._limit = limit
        self.rejected = 0
        self.largest = 0  # the largest filter seen, in bytes

    def __getstate__(self) -> dict:
        return {"limit": self._limit}

    def __setstate__(self, state: dict) -> None:
        self.__init__(**state)

    def _too_large(self, request, method: str) -> bool:
        if isinstance(request, bytes):  # sent serialized (the sink's MutateRows, the guard's swaps)
            if not method.endswith("/CheckAndMutateRow"):
                return False  # MutateRows carries no filter
            from google.cloud.bigtable_v2.types import bigtable as bigtable_types  # inside: a test double's import

            request = bigtable_types.CheckAndMutateRowRequest.pb().FromString(request)
        row_filter = (getattr(request, "predicate_filter", None) if hasattr(request, "predicate_filter")
                      else getattr(request, "filter", None))
        size = row_filter.ByteSize() if row_filter is not None else 0
        self.largest = max(self.largest, size)
        if size > self._limit:
            self.rejected += 1
            return True
        return False

    def intercept_unary_stream(self, continuation, details, request):
        if self._too_large(request, details.method):
            return _FailingStream(_grpc.StatusCode.INVALID_ARGUMENT)
        return continuation(details, request)

    def intercept_unary_unary(self, continuation, details, request):
        if self._too_large(request, details.method):
            raise _InjectedRpcError(_grpc.StatusCode.INVALID_ARGUMENT)
        return continuation(details, request)


class WriteLog(_grpc.UnaryStreamClientInterceptor, _grpc.UnaryUnaryClientInterceptor):
    """Appends ``<unix time> <method>`` to a file for every write RPC as it is
    sent (MutateRows, CheckAndMutateRow): lets a test see which process wrote
    when (the lease tests). Picklable: travels inside the sink."""

    def __init__(self, path: str) -> None:
        self._path = path

    def __getstate__(self) -> dict:
        return {"path": self._path}

    def __setstate__(self, state: dict) -> None:
        self.__init__(**state)

    def _record(self, method: str) -> None:
        name = method.rsplit("/", 1)[-1]
        if name in ("MutateRows", "CheckAndMutateRow"):
            with open(self._path, "a") as fh:  # appended and closed at once: survives SIGKILL
                fh.write(f"{_time.time():.6f} {name}\n")

    def intercept_unary_stream(self, continuation, details, request):
        self._record(details.method)
        return continuation(details, request)

    def intercept_unary_unary(self, continuation, details, request):
        self._record(details.method)
        return continuation(details, request)


def main(argv: Optional[list] = None) -> int:
    """``python -m ddb2bt.pipeline.testing.faults SPEC [--log FILE] -- <ddb2bt args>``:
    the ddb2bt command with injected Bigtable faults (the soak runs jobs this way)."""
    import argparse
    import sys

    from ddb2bt.pipeline.app.cli import main as cli_main

    argv = list(sys.argv[1:] if argv is None else argv)
    # Everything after "--" is the ddb2bt command line, untouched (argparse's
    # catch-all would otherwise take options such as --log for itself).
    ours, rest = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(prog="python -m ddb2bt.pipeline.testing.faults",
                                     usage="%(prog)s SPEC [--log FILE] -- <ddb2bt arguments>")
    parser.add_argument("spec", help="e.g. unavailable=0.1,entry_unavailable=0.1,seed=1 ('' for none)")
    parser.add_argument("--log", help="append one line per injected fault to this file")
    parser.add_argument("--log-writes", metavar="FILE", help="append '<unix time> <method>' per write RPC sent")
    opts = parser.parse_args(ours)
    interceptors = (FaultInterceptor.from_spec(opts.spec, opts.log),) if opts.spec else ()
    if opts.log_writes:
        interceptors += (WriteLog(opts.log_writes),)
    return cli_main(rest, bigtable_interceptors=interceptors)


if __name__ == "__main__":
    raise SystemExit(main())
