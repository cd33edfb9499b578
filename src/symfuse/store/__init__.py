"""Artifact store: the only package that touches fsspec / s3fs.

``ArtifactStore`` keeps versioned folders of files with a manifest under any fsspec root; ``layout`` builds every
key. :func:`install_log_redaction` keeps credentials out of every log (the CLI calls it after configuring logging).
"""

from symfuse.redact import install_log_redaction
from symfuse.store import layout
from symfuse.store.artifact_store import ArtifactStore, default_cache_dir, default_root
from symfuse.store.errors import ArtifactNotFound, CorruptArtifact, IncompleteDownload, StoreUnreachable
from symfuse.store.layout import content_key, manifest_digest

__all__ = [
    "ArtifactNotFound",
    "ArtifactStore",
    "CorruptArtifact",
    "IncompleteDownload",
    "StoreUnreachable",
    "content_key",
    "default_cache_dir",
    "default_root",
    "install_log_redaction",
    "layout",
    "manifest_digest",
]
