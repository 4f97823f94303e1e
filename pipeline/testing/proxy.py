"""A loopback TCP proxy that can stop forwarding: a network blip as the services
show it — no answer and no reset, connections left open — which the emulators
cannot play. Test-only; production code never imports this module.

    with PausableProxy(upstream_port) as proxy:   # listens on 127.0.0.1:proxy.port
        proxy.pause(); ...; proxy.resume()

``cut()`` plays the other outage, a service that is down: every connection is
closed and new ones are closed at once (what a client sees as "connection
refused"/reset, so gRPC backs off reconnecting) until ``resume()``.
"""
from __future__ import annotations

import socket
import threading
from typing import Optional

LOOPBACK = "127.0.0.1"
CHUNK = 65536
# While paused, a pump looks again this often whether it may forward.
PAUSE_POLL_S = 0.05


class PausableProxy:
    def __init__(self, upstream_port: int, upstream_host: str = LOOPBACK) -> None:
        self._upstream = (upstream_host, upstream_port)
        self._forwarding = threading.Event()
        self._forwarding.set()
        self._closed = threading.Event()
        self._cut = threading.Event()
        self._listener = socket.create_server((LOOPBACK, 0))  # loopback only
        self.port = self._listener.getsockname()[1]
        self._sockets: list = []
        self._thread: Optional[threading.Thread] = None

    @property
    def address(self) -> str:
        return f"{LOOPBACK}:{self.port}"

    def start(self) -> "PausableProxy":
        self._thread = threading.Thread(target=self._accept, daemon=True, name="pausable-proxy")
        self._thread.start()
        return self

    def pause(self) -> None:
        """Stop forwarding (both ways, every connection, new ones too); nothing is
        closed or reset: callers see silence."""
        self._forwarding.clear()

    def resume(self) -> None:
        self._cut.clear()
        self._forwarding.set()

    def cut(self) -> None:
        """Close every connection, and each new one at once, until ``resume``."""
        self._cut.set()
        sockets, self._sockets = self._sockets, []
        for s in sockets:
            try:
                s.shutdown(socket.SHUT_RDWR)
                s.close()
            except OSError:
                pass

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._connect, args=(client,), daemon=True).start()

    def _connect(self, client: socket.socket) -> None:
        if self._cut.is_set():
            client.close()
            return
        self._wait_forwarding()
        try:
            upstream = socket.create_connection(self._upstream)
        except OSError:
            client.close()
            return
        self._sockets += [client, upstream]
        for src, dst in ((client, upstream), (upstream, client)):
            threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _wait_forwarding(self) -> None:
        while not self._forwarding.wait(PAUSE_POLL_S):
            if self._closed.is_set():
                return

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                self._wait_forwarding()
                data = src.recv(CHUNK)
                if not data:
                    break
                self._wait_forwarding()  # received during a pause: held until it ends
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._closed.set()
        self._forwarding.set()
        self._listener.close()
        for s in self._sockets:
            try:
                s.close()
            except OSError:
                pass

    def __enter__(self) -> "PausableProxy":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
