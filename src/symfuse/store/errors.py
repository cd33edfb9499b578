"""Store errors: builtins where they fit, so callers (and retry conditions) need not know the backend.

Backend exceptions (botocore, aiohttp, ...) never leave :mod:`symfuse.store`: they become
:class:`FileNotFoundError`, :class:`PermissionError`, :class:`ConnectionError` or :class:`OSError` with the original
exception kept as ``__cause__`` (the s3fs convention).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from symfuse.errors import SymfuseError


class ArtifactNotFound(SymfuseError, FileNotFoundError):
    """No complete artifact (no ``manifest.json``) under a key."""


class CorruptArtifact(SymfuseError, OSError):
    """The store holds a damaged artifact: an invalid manifest, or a file whose size or sha256 differs from it.

    Reading again gives the same bytes, so the pipeline's tasks do not retry it (``tasks.policy``).
    """


class IncompleteDownload(CorruptArtifact):
    """A downloaded copy differs from the manifest while the store's own file does not.

    A connection cut mid-file, or a cached copy replaced while being read: reading again can succeed, so tasks
    retry it.
    """


class StoreUnreachable(SymfuseError, ConnectionError):
    """The store's backend did not answer (refused, timed out) within the configured timeouts and attempts."""


# Exception class names (from botocore / aiohttp / fsspec) that mean "the backend could not be reached".
_CONNECTION_NAMES = frozenset(
    {
        "EndpointConnectionError",
        "ConnectTimeoutError",
        "ReadTimeoutError",
        "ConnectionClosedError",
        "ClientConnectorError",
        "ServerDisconnectedError",
        "ClientOSError",
        "FSTimeoutError",
        "HTTPClientError",
        "ProxyConnectionError",
    }
)
_PERMISSION_NAMES = frozenset({"NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError"})


def translate(exc: BaseException, what: str, hint: str = "") -> OSError:
    """The builtin error for a backend exception, with a message naming the artifact.

    Args:
        exc: The backend's exception.
        what: The artifact or path the operation was about (goes into the message).
        hint: How to fix an unreachable backend (names the endpoint and the timeout settings); a generic hint
            when empty.

    Returns:
        A new :class:`OSError` subclass instance; raise it ``from exc``.
    """
    names = {cls.__name__ for cls in type(exc).__mro__}
    detail = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, FileNotFoundError):
        return FileNotFoundError(f"{what}: not found in the store ({detail})")
    if isinstance(exc, PermissionError) or names & _PERMISSION_NAMES:
        return PermissionError(f"{what}: access denied; check the AWS_* credentials for the store ({detail})")
    if isinstance(exc, ConnectionError | TimeoutError) or names & _CONNECTION_NAMES:
        fix = hint or "check AWS_ENDPOINT_URL / network"
        return StoreUnreachable(f"{what}: store backend unreachable ({detail}); {fix}")
    return OSError(f"{what}: store operation failed ({detail})")


@contextlib.contextmanager
def translated(what: str, hint: str = "") -> Iterator[None]:
    """Re-raise backend exceptions as builtins (see :func:`translate`); symfuse's own errors pass through.

    Args:
        what: The artifact or path the operation is about.
        hint: See :func:`translate`.
    """
    try:
        yield
    except SymfuseError:
        raise
    except (ValueError, TypeError, KeyError):
        raise
    except Exception as exc:
        raise translate(exc, what, hint) from exc
