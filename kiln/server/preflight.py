"""`kiln serve`'s own settings checked before anything starts: a repository
path that is not a directory, TLS files that are not a PEM pair, an address
that cannot be listened on are each one line and exit 2, not a server that
stays unready forever or a traceback from uvicorn's or gRPC's start."""
from __future__ import annotations

import importlib.util
import socket
import ssl
from pathlib import Path

from kiln.config import ServerConfig
from kiln.errors import ConfigError


def check_server_config(config: ServerConfig, listens: bool = True, http_only: bool = False) -> None:
    """`listens`: this process binds config.host's ports; `http_only`: only the HTTP one is
    bound here (Ray Serve's proxy on a local cluster: a port in use was a Ray traceback ~30 s in)."""
    check_repository(config.model_repository)
    check_tls(config.ssl_certfile, config.ssl_keyfile)
    if listens or http_only:
        check_listen(config.host, config.port, "port")
    if listens:
        if config.port > 0 and config.port == config.grpc_port_resolved:  # both bind fine alone: the second fails late
            raise ConfigError(f"port and grpc_port are both {config.port}; HTTP and gRPC need a port each",
                              param="grpc_port")
        check_listen(config.host, config.grpc_port_resolved, "grpc_port")


def check_ray_installed() -> None:
    if importlib.util.find_spec("ray") is None or importlib.util.find_spec("ray.serve") is None:
        raise ConfigError("--ray needs Ray Serve: pip install 'ray[serve]'", param="ray")


def check_ray_address(address: str | None, timeout_s: float = 5.0) -> None:
    """A cluster address that answers no TCP connection is one line here; Ray itself
    retries it for minutes before its own traceback. 'auto' and 'local' are Ray's to resolve."""
    if address is None or address in ("auto", "local"):
        return
    host, port = _ray_endpoint(address)
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            pass
    except OSError as e:
        raise ConfigError(f"cannot reach the Ray cluster at {address!r} ({host}:{port}: {e.strerror or e}); "
                          "start it with `ray start --head`, or leave --ray-address out for a local one",
                          param="ray_address") from None


def _ray_endpoint(address: str) -> tuple[str, int]:
    """host and port of 'host:port' (the cluster's GCS) or 'ray://host[:port]' (Ray Client, port 10001)."""
    client = address.startswith("ray://")
    rest = address.removeprefix("ray://").rstrip("/")
    host, sep, port = rest.rpartition(":")
    if not sep:
        host, port = rest, "10001" if client else ""
    if not host or not port.isascii() or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"ray_address {address!r} is not host:port, ray://host[:port], 'auto' or 'local'",
                          param="ray_address")
    return host.strip("[]"), int(port)


def check_repository(path: str | None) -> None:
    if path is not None and not Path(path).is_dir():
        raise ConfigError(f"model_repository {path!r} is not a directory", param="model_repository")


def check_tls(certfile: str | None, keyfile: str | None) -> None:
    if certfile is None or keyfile is None:
        return  # both or neither: ServerConfig says so
    for name, path in (("ssl_certfile", certfile), ("ssl_keyfile", keyfile)):
        if not Path(path).is_file():
            raise ConfigError(f"{name} {path!r} is not a file", param=name)
    try:
        # An empty password: an encrypted key is an error here, never a prompt on the terminal.
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(certfile, keyfile, password=b"")
    except ssl.SSLError as e:
        raise ConfigError(
            f"ssl_certfile {certfile!r} and ssl_keyfile {keyfile!r} are not a PEM certificate and its "
            f"unencrypted private key ({e.reason or e})", param="ssl_certfile") from None


def check_listen(host: str, port: int, name: str) -> None:
    """Bind host:port once (as the server will, SO_REUSEADDR) and let go; port 0
    (any free port) checks the host alone, -1 (off) nothing."""
    if port < 0:
        return
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(address)
    except OSError as e:
        raise ConfigError(f"cannot listen on {host}:{port} ({name}): {e.strerror or e}", param=name) from None
