"""The package's exceptions: one small hierarchy, each also a builtin where that fits."""


class SymfuseError(Exception):
    """Base class of every error symfuse raises on purpose."""


class UnsupportedArchitecture(SymfuseError, ValueError):
    """The model's ``config.model_type`` has no architecture spec."""


class MissingStats(SymfuseError, ValueError):
    """A merge strategy needs statistics that were not given."""


class CheckpointError(SymfuseError, ValueError):
    """A checkpoint folder is missing, incomplete or holds bad values (names the artifact)."""
