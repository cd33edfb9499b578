"""Evaluation: metrics, loss barriers."""
