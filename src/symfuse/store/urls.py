"""Store URLs checked before anything runs: a scheme fsspec can open, and no credential inside the URL.

s3fs does not read ``s3://KEY:SECRET@bucket`` (it takes ``KEY:SECRET@bucket`` for the bucket's name), and a URL is
printed in logs and error lines, so a credential there is refused, naming the URL with the credential masked.
"""

from __future__ import annotations

import os

import fsspec

from symfuse.redact import MASK

# object stores whose credentials come from the environment or store options, never from the URL
OBJECT_STORES = {
    "s3": "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)",
    "s3a": "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)",
    "gs": "GOOGLE_APPLICATION_CREDENTIALS",
    "gcs": "GOOGLE_APPLICATION_CREDENTIALS",
    "az": "AZURE_STORAGE_ACCOUNT_NAME / AZURE_STORAGE_ACCOUNT_KEY",
    "abfs": "AZURE_STORAGE_ACCOUNT_NAME / AZURE_STORAGE_ACCOUNT_KEY",
    "abfss": "AZURE_STORAGE_ACCOUNT_NAME / AZURE_STORAGE_ACCOUNT_KEY",
}
ENDPOINT_VARS = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
_EXAMPLES = "a local folder, file://PATH or s3://bucket/prefix"


def masked_url(url: str) -> str:
    """``url`` with any ``user:password@`` part replaced by ``[REDACTED]@``."""
    scheme, sep, rest = url.partition("://")
    host, slash, path = rest.partition("/")
    if not sep or "@" not in host:
        return url
    return f"{scheme}://{MASK}@{host.rpartition('@')[2]}{slash}{path}"


def store_url_problem(root: str, label: str) -> str | None:
    """Why a store URL cannot be used (one line: ``<label> <url>: <what> — <fix>``), or None.

    Checked: a credential inside an object store's URL, a missing bucket name, a scheme fsspec does not know, a
    scheme whose package is not installed, and for S3 an endpoint variable (``AWS_ENDPOINT_URL``) holding a
    credential. A plain path is not a URL (None).

    Args:
        root: The store root as given.
        label: What the user gave it as (``store_root``, ``--store``).
    """
    scheme, sep, rest = root.partition("://")
    if not sep:
        return None
    if scheme != scheme.lower():  # fsspec knows "s3", not "S3": it failed once the flow had started
        lower = masked_url(f"{scheme.lower()}://{rest}")
        return f"{label} {masked_url(root)}: write the scheme in lower case — {lower}"
    scheme, host, shown = scheme.lower(), rest.partition("/")[0], f"{label} {masked_url(root)}"
    if scheme == "file" and host:  # file://runs/x was stored under ./runs/x of the working folder
        return f"{shown}: {host!r} stands where a file URL names a host — give file:///<absolute path>, or a plain path"
    if "@" in host and scheme in OBJECT_STORES:
        clean = f"{scheme}://{host.rpartition('@')[2]}/{rest.partition('/')[2]}".rstrip("/")
        return (
            f"{shown}: credentials in the URL are not read (and would be written to logs) — give "
            f"{clean} and the credentials in {OBJECT_STORES[scheme]}"
        )
    if scheme in OBJECT_STORES and (not host or host != host.strip() or " " in host):
        return f"{shown}: no bucket name after {scheme}:// — give {scheme}://bucket/prefix"
    try:
        fsspec.get_filesystem_class(scheme)
    except ValueError:
        return f"{shown}: unknown storage scheme {scheme!r} — give {_EXAMPLES} (or another fsspec URL)"
    except ImportError as exc:
        need = " ".join(str(exc).split()) or f"the package for {scheme}://"
        return f"{shown}: {scheme}:// cannot be opened here ({need}) — install it, or give {_EXAMPLES}"
    if scheme in ("s3", "s3a"):
        return _endpoint_problem()
    return None


def lasting_store_problem(root: str, label: str) -> str | None:
    """Why ``root`` cannot keep what a command stores for later, or None.

    A ``memory://`` store lives in one process: the pipeline's command and ``symfuse drop`` would exit 0 and lose
    every artifact with it (the library's tests use one inside their own process). A read-only filesystem
    (``http://``, ``zip://``, ...) would fail at the first artifact written, after the first task's work.
    """
    scheme = root.partition("://")[0].lower() if "://" in root else ""
    if scheme == "memory":
        return (
            f"{label} {root}: an in-memory store ends with this process, and everything the command stores with it "
            f"— give {_EXAMPLES}"
        )
    if scheme in READ_ONLY:
        return f"{label} {masked_url(root)}: {scheme}:// can only be read, and the store is written — give {_EXAMPLES}"
    return None


READ_ONLY = frozenset({"http", "https", "zip", "tar", "libarchive", "github", "git", "reference", "data"})


def _endpoint_problem() -> str | None:
    for var in ENDPOINT_VARS:
        value = os.environ.get(var) or ""
        if "@" in value.partition("://")[2].partition("/")[0]:
            return (
                f"${var} {masked_url(value)}: credentials in the endpoint URL are not read (and would be written to "
                f"logs) — set it without user:password@ and give the credentials in {OBJECT_STORES['s3']}"
            )
    return None
