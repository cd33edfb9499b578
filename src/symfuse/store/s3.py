"""s3fs options: endpoint from the environment, bounded timeouts and attempts, no listing cache.

An endpoint that accepts connections and never answers must fail fast: every request gets a connect and a read
timeout of ``SYMFUSE_S3_TIMEOUT`` seconds (default 8) and at most ``SYMFUSE_S3_ATTEMPTS`` attempts in all
(default 2, botocore's ``total_max_attempts``); s3fs's own retry loop is switched off (``retries = 1``) so the two
do not multiply. A black-hole endpoint thus fails after about ``timeout * attempts`` seconds (about 17 s by default).
Explicit ``config_kwargs`` in the store options win over these defaults.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

TIMEOUT_ENV = "SYMFUSE_S3_TIMEOUT"
ATTEMPTS_ENV = "SYMFUSE_S3_ATTEMPTS"
DEFAULT_TIMEOUT_S = 8.0
DEFAULT_ATTEMPTS = 2
# Store options that hold credentials (s3fs names and the botocore names s3fs passes on).
SECRET_OPTIONS = ("key", "secret", "token", "aws_access_key_id", "aws_secret_access_key", "aws_session_token")


@dataclass(frozen=True)
class S3Limits:
    """Per-request timeout and total attempts of every S3 call of a store."""

    timeout_s: float
    attempts: int

    def hint(self, endpoint: str | None) -> str:
        """The fix part of the one-line error for an endpoint that did not answer."""
        where = endpoint or "the default AWS endpoint"
        return (
            f"{where} did not answer within {self.timeout_s:g} s x {self.attempts} attempts: check AWS_ENDPOINT_URL "
            f"and the network, or raise {TIMEOUT_ENV} / {ATTEMPTS_ENV}"
        )


def _env_number(name: str, default: float, kind: type) -> Any:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return kind(default)
    try:
        value = kind(raw)
    except ValueError:
        value = None
    if value is None or not math.isfinite(value) or value <= 0:
        raise ValueError(
            f"{name}={raw!r} is not a positive {'integer' if kind is int else 'number'}; set e.g. {name}={default:g}"
        )
    return value


def s3_limits() -> S3Limits:
    """Timeout and attempts from ``SYMFUSE_S3_TIMEOUT`` / ``SYMFUSE_S3_ATTEMPTS`` (or the defaults).

    Raises:
        ValueError: if a variable is set to something other than a positive number (one line naming it).
    """
    timeout = _env_number(TIMEOUT_ENV, DEFAULT_TIMEOUT_S, float)
    return S3Limits(timeout, _env_number(ATTEMPTS_ENV, DEFAULT_ATTEMPTS, int))


def s3_options(storage_options: dict[str, Any]) -> tuple[dict[str, Any], S3Limits, str | None]:
    """s3fs options with symfuse's defaults, the limits in force and the endpoint URL (``None``: AWS's own).

    Defaults: endpoint from ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``, no listing cache (other processes
    write too), ``connect_timeout`` / ``read_timeout`` / ``retries`` in ``config_kwargs`` from :func:`s3_limits`.
    """
    opts = dict(storage_options)
    opts.setdefault("use_listings_cache", False)
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    client_kwargs = dict(opts.get("client_kwargs") or {})
    if endpoint and "endpoint_url" not in client_kwargs and "endpoint_url" not in opts:
        client_kwargs["endpoint_url"] = endpoint
    if client_kwargs:
        opts["client_kwargs"] = client_kwargs
    limits = s3_limits()
    config = dict(opts.get("config_kwargs") or {})
    config.setdefault("connect_timeout", limits.timeout_s)
    config.setdefault("read_timeout", limits.timeout_s)
    config.setdefault("retries", {"total_max_attempts": limits.attempts, "mode": "standard"})
    opts["config_kwargs"] = config
    retries = config["retries"]
    attempts = retries.get("total_max_attempts") or (retries.get("max_attempts", limits.attempts - 1) + 1)
    limits = S3Limits(float(config.get("read_timeout") or limits.timeout_s), int(attempts))
    return opts, limits, client_kwargs.get("endpoint_url") or opts.get("endpoint_url")


def option_secrets(storage_options: dict[str, Any]) -> list[str]:
    """The credential values among store options (top level and ``client_kwargs``), for log redaction."""
    found = []
    for scope in (storage_options, storage_options.get("client_kwargs") or {}):
        found += [str(scope[name]) for name in SECRET_OPTIONS if scope.get(name)]
    return found
