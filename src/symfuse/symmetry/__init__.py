"""Exact symmetry transforms (value objects acting on module weights and on statistics)."""
