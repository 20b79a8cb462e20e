"""Secrets the trackers must never print or write: API keys, tokens, passwords.

The trackers read them from their own environment variables (WANDB_API_KEY,
MLFLOW_TRACKING_TOKEN, MLFLOW_TRACKING_PASSWORD, DATABRICKS_TOKEN, the cloud stores'
keys MLflow artifact stores use) or from a URI with credentials in it
(https://user:password@host). dflash passes them on only through the environment; every
message, fallback record, config value and stored URI goes through `redact`/`sanitize`.
"""
from __future__ import annotations

import os
import re
from urllib.parse import unquote, urlsplit

# A word of a name (config key or variable), not a substring: "max_new_tokens" is a count,
# "wandb_token" a secret.
_SECRET_KEY = re.compile(r"(?:^|[_.\-])(api_?key|token|secret|password|passwd|credentials?|access_?key)(?:$|[_.\-])",
                         re.I)
# the environments of the trackers and of the artifact stores MLflow writes to
_PREFIXES = ("WANDB_", "MLFLOW_", "DATABRICKS_", "AWS_", "AZURE_", "GOOGLE_")
_USERINFO = re.compile(r"(?P<scheme>\b[a-zA-Z][a-zA-Z0-9+.\-]*://)[^/@\s'\"]+@")


def is_secret_name(name: str) -> bool:
    return bool(_SECRET_KEY.search(str(name)))


def _uri_secrets(value: str) -> list[str]:
    """The password (and whole user:password) of a URI, raw and percent-decoded."""
    try:
        parts = urlsplit(value)
    except ValueError:
        return []
    if not parts.password:
        return []
    userinfo = parts.netloc.rsplit("@", 1)[0]
    return [s for s in {userinfo, parts.password, unquote(parts.password)} if len(s) >= 4]


def secrets() -> list[str]:
    """Every secret value the environment holds for the trackers, longest first (a key
    that contains another is replaced whole)."""
    out = set()
    for k, v in os.environ.items():
        if not v:
            continue
        if k.startswith(_PREFIXES) and is_secret_name(k) and len(v) >= 8:
            out.add(v)
        if k.startswith(_PREFIXES) and "://" in v:
            out.update(_uri_secrets(v))
    return sorted(out, key=len, reverse=True)


def redact(text: str) -> str:
    """`text` without the environment's secrets nor the credentials of any URI in it."""
    for s in secrets():
        text = text.replace(s, "***")
    return _USERINFO.sub(r"\g<scheme>***@", text)


def strip_credentials(uri: str) -> str:
    """A URI fit to store in the run dir: user and password removed."""
    return _USERINFO.sub(r"\g<scheme>", uri)


def sanitize(obj):
    """A config tree without secrets: keys that name one are dropped, values that contain
    one are redacted."""
    if isinstance(obj, dict):
        return {k: sanitize(v) for k, v in obj.items() if not is_secret_name(k)}
    if isinstance(obj, (list, tuple)):
        return [sanitize(v) for v in obj]
    if isinstance(obj, str):
        return redact(obj)
    return obj
