"""Artifact store: the only package that touches fsspec / s3fs.

``ArtifactStore`` keeps folders of files with a manifest under any fsspec root; ``layout`` builds every key.
"""

from symfuse.store import layout
from symfuse.store.artifact_store import ArtifactStore, default_cache_dir, default_root
from symfuse.store.errors import ArtifactNotFound, CorruptArtifact
from symfuse.store.layout import content_key, manifest_digest

__all__ = [
    "ArtifactNotFound",
    "ArtifactStore",
    "CorruptArtifact",
    "content_key",
    "default_cache_dir",
    "default_root",
    "layout",
    "manifest_digest",
]
