"""Matching: find the symmetry transforms that align a model to an anchor."""
