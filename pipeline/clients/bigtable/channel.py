"""Where Bigtable calls go and how a connection is made, checked and closed: the
endpoint (the emulator's or the service's), a gRPC channel with its interceptors,
the reachability probe commands run first, and a close that never hangs a
teardown."""
from __future__ import annotations

import logging
import os
from typing import Optional, Sequence

import grpc

from ddb2bt.pipeline.clients.bigtable.errors import BigtableUnreachable
from ddb2bt.pipeline.clients.retry import READ_ONLY_DEADLINE_S

log = logging.getLogger(__name__)


EMULATOR_ENV = "BIGTABLE_EMULATOR_HOST"
DEFAULT_ENDPOINT = "bigtable.googleapis.com:443"
DATA_SCOPES = ("https://www.googleapis.com/auth/bigtable.data",)


# gRPC's default 4 MiB receive limit is too small for wide rows read back by verify.
MAX_MESSAGE_BYTES = 256 * 1024 * 1024


def bigtable_endpoint() -> str:
    """Where Bigtable calls go, for messages: the emulator's host:port or the service."""
    emulator = os.environ.get(EMULATOR_ENV)
    return f"emulator {emulator}" if emulator else DEFAULT_ENDPOINT


# Closing a channel cancels its calls, but after an interrupted call it has been
# seen to block for minutes (issue 17): teardown never waits longer than this.
CLOSE_WAIT_S = 2.0


def close_bounded(close, what: str, wait_s: float = CLOSE_WAIT_S) -> None:
    """Run ``close()`` on a daemon thread and wait at most ``wait_s``: a teardown
    must never hang on a channel or client that will not close."""
    import threading

    def run() -> None:
        try:
            close()
        except Exception as exc:  # closing is best effort; the process may be ending
            log.debug("closing %s failed: %s", what, exc)

    t = threading.Thread(target=run, name=f"close-{what}", daemon=True)
    t.start()
    t.join(wait_s)
    if t.is_alive():
        log.warning("closing %s did not finish within %.0fs; leaving it to the process exit", what, wait_s)


_REACHABLE: set = set()
PROBE_STEP_S = 2.0


def probe_bigtable(deadline_s: Optional[float] = None, channel_factory=None, clock=None) -> None:
    """Wait until a connection to Bigtable is up, saying so at WARNING every few
    seconds, or raise BigtableUnreachable naming the endpoint after ``deadline_s``.
    Admin calls go through a client whose own retries are silent and long, so a
    command checks this first (once per endpoint and process)."""
    import time

    deadline_s = READ_ONLY_DEADLINE_S if deadline_s is None else deadline_s
    endpoint = bigtable_endpoint()
    if endpoint in _REACHABLE:
        return
    clock = clock or time.monotonic
    channel = (channel_factory or make_channel)()
    start = clock()
    next_log = 0.0
    try:
        while True:
            left = deadline_s - (clock() - start)
            try:
                grpc.channel_ready_future(channel).result(timeout=max(0.05, min(PROBE_STEP_S, left)))
                _REACHABLE.add(endpoint)
                return
            except grpc.FutureTimeoutError:
                pass
            elapsed = clock() - start
            if elapsed >= deadline_s:
                hint = (" (is the emulator running, and BIGTABLE_EMULATOR_HOST right? ddb2bt local up starts one)"
                        if os.environ.get(EMULATOR_ENV) else " (network, firewall or proxy?)")
                raise BigtableUnreachable(f"Bigtable ({endpoint}) is unreachable: no connection within "
                                          f"{deadline_s:.0f}s{hint}")
            if elapsed >= next_log:
                log.warning("Bigtable (%s): no connection for %.0fs; retrying, giving up in %.0fs", endpoint,
                            elapsed, deadline_s - elapsed)
                next_log = min(max(1.0, 2 * elapsed), elapsed + 30.0)
    finally:
        close_bounded(channel.close, "probe channel", 0.5)


# gRPC's default reconnect back-off grows to 120 s: after an outage of Bigtable
# (or of the network to it) a channel would stay idle for up to two minutes after
# the service is back. Reconnect within seconds instead: the first retry after
# 1 s, never more than RECONNECT_MAX_MS apart (docs/operations.md, "After an outage").
RECONNECT_MAX_MS = 5_000
RECONNECT_OPTIONS = (("grpc.initial_reconnect_backoff_ms", 1_000), ("grpc.min_reconnect_backoff_ms", 1_000),
                     ("grpc.max_reconnect_backoff_ms", RECONNECT_MAX_MS))


def make_channel(endpoint: Optional[str] = None, interceptors: Sequence = ()) -> grpc.Channel:
    """A channel to the emulator (BIGTABLE_EMULATOR_HOST, insecure, loopback) or to
    the service with Application Default Credentials.

    ``interceptors`` are gRPC client interceptors wrapped around the channel, in
    order (tracing, or the fault injector of ``ddb2bt.pipeline.testing``): the
    caller passes them explicitly; nothing here reads them from the environment.
    """
    options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
               ("grpc.max_send_message_length", MAX_MESSAGE_BYTES), *RECONNECT_OPTIONS]
    emulator = os.environ.get(EMULATOR_ENV)
    if emulator and not endpoint:
        channel = grpc.insecure_channel(emulator, options=options)
    else:
        from google.api_core import grpc_helpers  # imported late: only the cloud path needs auth

        channel = grpc_helpers.create_channel(
            endpoint or DEFAULT_ENDPOINT, scopes=DATA_SCOPES, default_host=DEFAULT_ENDPOINT, options=options
        )
    return grpc.intercept_channel(channel, *interceptors) if interceptors else channel
