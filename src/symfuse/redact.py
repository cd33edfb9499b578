"""No credential in any log, at any level: botocore's DEBUG logs print request headers and canonical requests.

:func:`install_log_redaction` (idempotent; every :class:`~symfuse.store.ArtifactStore` calls it, the CLI calls it
right after configuring logging) rewrites log records whose text holds

- the value of ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_SECURITY_TOKEN`` or ``AWS_ACCESS_KEY_ID``
  (read from the environment when the record is made, so later changes count) or of a credential passed in store
  options (:func:`register_secret`);
- the ``user:password@`` part of a URL (``s3://KEY:SECRET@bucket``),
- ``X-Amz-Security-Token: ...``, ``Authorization: AWS4-HMAC-SHA256 Credential=..., Signature=...``,
  ``X-Amz-Credential=`` / ``X-Amz-Signature=`` query parameters, ``aws_session_token=...``-style assignments,

replacing the secret with ``[REDACTED]``. It works at two places: a :class:`RedactSecrets` filter on the loggers
of botocore, boto3, s3transfer, aiobotocore, s3fs, fsspec, urllib3 and aiohttp and on the root logger's handlers,
and a log-record factory, because a logger's filter does not see records of its child loggers
(``botocore.endpoint``) and handlers added later (pytest's, Prefect's API handler) carry no filter.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import traceback

MASK = "[REDACTED]"
ENV_SECRETS = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_ACCESS_KEY_ID")
LOGGERS = ("botocore", "boto3", "s3transfer", "aiobotocore", "s3fs", "fsspec", "urllib3", "aiohttp")
MIN_SECRET_LEN = 8  # shorter values ("test", "k") would mask ordinary words; real AWS keys are 16+ characters

_QUOTE = r"""['"]?"""
_VALUE = r"""[^'"\s,&;}\]>)]+"""
_SEP = r"""\s*[:=]\s*(?!b?['"]?\[REDACTED\])b?['"]?"""  # `: b'`, `=`, ... not before what is masked already
_PATTERNS = (
    # a credential inside a URL: s3://KEY:SECRET@bucket, http://user:password@host (the whole user part)
    re.compile(r"(?i)(\b[a-z][a-z0-9+.-]*://)(?!\[REDACTED\]@)([^/\s@'\"]+)(?=@)"),
    # headers, canonical requests, dict reprs: X-Amz-Security-Token: v / 'X-Amz-Security-Token': b'v'
    re.compile(rf"(?i)(x-amz-security-token{_QUOTE}{_SEP})({_VALUE})"),
    # Authorization: AWS4-HMAC-SHA256 Credential=AKIA.../..., SignedHeaders=..., Signature=...; presigned URLs
    re.compile(rf"(?i)((?:x-amz-)?credential=(?!\[REDACTED\]))({_VALUE})"),
    re.compile(rf"(?i)((?:x-amz-)?signature=(?!\[REDACTED\]))({_VALUE})"),
    # aws_session_token=..., "aws_secret_access_key": "...", secret_key=..., 'token': '...'
    re.compile(
        rf"(?i)(\b(?:aws_)?(?:session_token|security_token|secret_access_key|access_key_id|secret_key|secret|token)\b"
        rf"{_QUOTE}{_SEP})({_VALUE})"
    ),
)

_lock = threading.Lock()
_state: dict = {"installed": False, "secrets": frozenset()}  # replaced whole under the lock, read without it


def register_secret(*values: str | None) -> None:
    """Also mask these values (credentials from store options) in every log record from now on."""
    with _lock:
        _state["secrets"] = _state["secrets"] | {v for v in values if v and len(v) >= MIN_SECRET_LEN}


def _current_secrets() -> list[str]:
    env = (os.environ.get(name) for name in ENV_SECRETS)
    values = _state["secrets"] | {v for v in env if v and len(v) >= MIN_SECRET_LEN}
    return sorted(values, key=len, reverse=True)  # longest first: a secret holding another is masked whole


def redact(text: str) -> str:
    """``text`` with every known credential value and credential-looking assignment replaced by ``[REDACTED]``."""
    for secret in _current_secrets():
        if secret in text:
            text = text.replace(secret, MASK)
    for pattern in _PATTERNS:
        text = pattern.sub(lambda m: m.group(1) + MASK, text)
    return text


def redact_record(record: logging.LogRecord) -> None:
    """Rewrite a record in place: message (args merged in), rendered traceback and stack, if they hold secrets."""
    try:
        message = record.getMessage()
    except Exception:  # a broken format string: the handler reports it, there is nothing to mask yet
        return
    clean = redact(message)
    if clean != message:
        record.msg, record.args = clean, None
    if record.exc_info and record.exc_info[0] is not None and not record.exc_text:
        text = "".join(traceback.format_exception(*record.exc_info)).rstrip("\n")
        if redact(text) != text:  # only then take the rendering over from the formatter
            record.exc_text = redact(text)
    elif record.exc_text:
        record.exc_text = redact(record.exc_text)
    if record.stack_info:
        record.stack_info = redact(record.stack_info)


class RedactSecrets(logging.Filter):
    """A logging filter that masks credentials in each record it sees (never drops one)."""

    def filter(self, record: logging.LogRecord) -> bool:
        """Mask the record's secrets; always keep it."""
        redact_record(record)
        return True


_FILTER = RedactSecrets()


def _add_filter(target: logging.Filterer) -> None:
    if not any(isinstance(f, RedactSecrets) for f in target.filters):
        target.addFilter(_FILTER)


def install_log_redaction(*extra_secrets: str | None) -> None:
    """Mask credentials in every log record of this process (idempotent, thread-safe).

    Installs the record factory once, and the :class:`RedactSecrets` filter on the AWS/fsspec loggers (and
    their existing children) and on the root logger's current handlers. Call it again after adding handlers.

    Args:
        extra_secrets: Credential values not in the environment (e.g. from store options) to mask too.
    """
    register_secret(*extra_secrets)
    with _lock:
        if not _state["installed"]:
            previous = logging.getLogRecordFactory()

            def factory(*args, **kwargs) -> logging.LogRecord:
                record = previous(*args, **kwargs)
                redact_record(record)
                return record

            logging.setLogRecordFactory(factory)
            _state["installed"] = True
    names = list(LOGGERS) + [n for n in list(logging.Logger.manager.loggerDict) if n.split(".")[0] in LOGGERS]
    for name in names:
        _add_filter(logging.getLogger(name))
    for handler in logging.getLogger().handlers:
        _add_filter(handler)
