"""Artifact store: the only package that touches fsspec / s3fs."""
