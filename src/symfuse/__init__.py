"""symfuse: symmetry-aware fusion of transformer models."""

__version__ = "0.1.0"
