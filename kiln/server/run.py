"""Running the app under uvicorn, with a graceful drain on SIGTERM / SIGINT.

On the signal: the DataPlane starts refusing new requests (503) and /health
turns 503; uvicorn closes its listening socket, lets in-flight requests
finish for up to `shutdown_timeout` seconds, then runs the lifespan shutdown,
which stops gRPC and unloads every model (engine processes included). The
process then exits 0.
"""

from __future__ import annotations

import logging
import signal

import uvicorn

from kiln.dataplane.dataplane import DataPlane
from kiln.errors import KilnError
from kiln.server.app import build_app
from kiln.server.http_protocol import HttpLimits, protocol_class

log = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, dataplane: DataPlane):
        super().__init__(config)
        self.dataplane = dataplane
        self.fatal: str | None = None

    def handle_exit(self, sig: int, frame) -> None:
        if not self.dataplane.draining:
            log.info(
                "signal %d: draining (up to %ss for in-flight requests)", sig, self.config.timeout_graceful_shutdown
            )
        self.dataplane.draining = True
        super().handle_exit(sig, frame)

    def stop_fatally(self, message: str) -> None:
        self.fatal = message
        self.should_exit = True


def serve(dataplane: DataPlane) -> int:
    """Blocks until the server stops; returns the process exit code."""
    settings = dataplane.config
    config = uvicorn.Config(
        build_app(dataplane, on_fatal=lambda message: server.stop_fatally(message)),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        timeout_graceful_shutdown=settings.shutdown_timeout,
        timeout_keep_alive=settings.timeout_keep_alive_s,
        http=protocol_class(HttpLimits.of(settings)),
        ssl_certfile=settings.ssl_certfile,
        ssl_keyfile=settings.ssl_keyfile,
        access_log=False,
    )
    server = DrainingServer(config, dataplane)
    # uvicorn re-raises the caught signal after its shutdown; with a handler
    # in place that is a no-op, so a drained server exits 0, not by SIGTERM.
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if server.fatal is not None:  # `kiln: error: ...`, exit 2, as for a model that fails before the server starts
        raise KilnError(f"server stopped: {server.fatal}")
    return 0
