"""Which exporters the standard OTEL_* variables select. No SDK import: the training
process reads this too (to know whether its shutdown bound applies; see otel.transport)."""
from __future__ import annotations

import os

LOCAL_EXPORTERS = frozenset({"file", "console"})


def env(*names, default=None):
    for n in names:
        v = os.environ.get(n)
        if v:
            return v.strip()
    return default


def selected_exporters(signal: str, file_dir) -> list[str]:
    """OTEL_TRACES_EXPORTER / OTEL_METRICS_EXPORTER; unset: otlp when an endpoint is configured
    (for traces the file sink as well when a directory was given: a collector that is down
    loses no span the run's own files keep, and `dflash stalls RUN` reads them; metrics, which
    write every series each second, go to the collector alone), else the file sink when a
    directory was given, else nothing."""
    names = env(f"OTEL_{signal.upper()}_EXPORTER")
    if names:
        chosen = dict.fromkeys(n.strip().lower() for n in names.split(",") if n.strip())  # each once
        return [n for n in chosen if n != "none"]
    local = ["file"] if file_dir else []
    if env("OTEL_EXPORTER_OTLP_ENDPOINT", f"OTEL_EXPORTER_OTLP_{signal.upper()}_ENDPOINT"):
        return ["otlp"] + (local if signal == "traces" else [])
    return local


def spans_drained_whole(file_dir) -> bool:
    """True when some span exporter writes locally: the shutdown then waits for it to take
    every span (the network exporters beside it keep their bound, in their own lanes)."""
    return bool(set(selected_exporters("traces", file_dir)) & LOCAL_EXPORTERS)


def shown_endpoint(value: str) -> str:
    """An endpoint as a message may print it: its user info (a password, or a token given as
    the user) and its query (where tokens go) replaced by ***, cut to 200 characters; also
    when the value does not parse as a URL."""
    from urllib.parse import urlsplit, urlunsplit

    try:
        u = urlsplit(value)
        netloc = u.netloc
        if "@" in netloc:  # user:password@ or a token as the user (https://KEY@host): neither shown
            netloc = "***@" + netloc.rpartition("@")[2]
        value = urlunsplit((u.scheme, netloc, u.path, "***" if u.query else "", u.fragment))
    except ValueError:  # not a URL at all (the case a check reports): hide whatever could be credentials
        head, sep, rest = value.partition("://")
        if sep and "@" in rest:
            value = f"{head}://***@{rest.rpartition('@')[2]}"
        value = value.split("?", 1)[0] + ("?***" if "?" in value else "")
    return repr(value[:200])


def endpoint_env(signal: str) -> tuple[str, str] | None:
    """(variable, value) of the OTLP endpoint the SDK uses for ``signal``: the signal's own
    variable first, else OTEL_EXPORTER_OTLP_ENDPOINT; None when neither is set."""
    for name in (f"OTEL_EXPORTER_OTLP_{signal.upper()}_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"):
        v = os.environ.get(name, "").strip()
        if v:
            return name, v
    return None


def endpoint_env_error(signal: str, protocol: str) -> str | None:
    """One line naming the OTLP endpoint variable the SDK would use for ``signal`` and what is
    wrong with it, or None. The base variable takes no query: the SDK appends /v1/traces to it,
    after the query (a token belongs in OTEL_EXPORTER_OTLP_HEADERS)."""
    found = endpoint_env(signal)
    if found is None:
        return None
    name, value = found
    err = endpoint_error(value, protocol)
    if err is None and name == "OTEL_EXPORTER_OTLP_ENDPOINT" and protocol != "grpc" and "?" in value:
        err = (f"a query in the base endpoint: the SDK appends /v1/{signal} after it (a token goes in "
               "OTEL_EXPORTER_OTLP_HEADERS)")
    return f"{name}={shown_endpoint(value)}: {err}" if err else None


def endpoint_error(value: str, protocol: str = "grpc") -> str | None:
    """Why ``value`` cannot be an OTLP traces endpoint, or None. http/protobuf takes a URL
    (http or https, a host, a port if any in 1..65535); gRPC takes that, a bare ``host:port``
    or a unix:// socket (what its channel dials). Checked by whoever hands an endpoint to a child
    (`dflash serve` to vLLM), so a typo is one line before the child starts rather than the
    child's own failure after it loaded a model."""
    from urllib.parse import urlsplit

    if not value or any(c.isspace() or not c.isprintable() for c in value):
        return "expected a URL such as http://127.0.0.1:4317 (it is empty or holds spaces or control characters)"
    bare = "://" not in value
    if bare and protocol == "grpc":  # host:port, as gRPC dials it
        value = "grpc-bare://" + value
    try:
        u = urlsplit(value)
        port = u.port
    except ValueError as e:
        return f"not a URL ({e})"
    if bare and protocol != "grpc":
        return f"expected an http:// or https:// URL (OTLP over {protocol})"
    if not bare and protocol == "grpc" and u.scheme == "unix":  # a socket path, as gRPC dials it
        return None if (u.path or u.netloc) else "unix:// without a socket path"
    if not bare and u.scheme not in ("http", "https"):
        return f"scheme {u.scheme!r}: expected http or https" + (" (or unix, over gRPC)" if protocol == "grpc" else "")
    if not u.hostname:
        return "no host in it"
    if bare and (port is None or u.path or u.query or u.fragment):
        return "expected host:port or an http:// URL"
    if port == 0:
        return "port 0: expected a port in 1..65535"
    return None
