"""Prefect @flow composition (no tensors, no maths)."""
