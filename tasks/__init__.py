"""Thin Prefect @task wrappers over the symfuse library (URIs in, URIs out)."""
