"""The package's exceptions: one small hierarchy, each also a builtin where that fits."""


class SymfuseError(Exception):
    """Base class of every error symfuse raises on purpose."""


class UnsupportedArchitecture(SymfuseError, ValueError):
    """The model's ``config.model_type`` has no architecture spec."""


class MissingStats(SymfuseError, ValueError):
    """A merge strategy needs statistics that were not given."""


class CheckpointError(SymfuseError, ValueError):
    """A checkpoint folder is missing, incomplete or holds bad values (names the artifact)."""


class NonFiniteError(CheckpointError):
    """A tensor (weights, statistics, a merged result) or a training loss holds NaN or inf (names file and tensor)."""


class StatsMismatchError(SymfuseError, ValueError):
    """Statistics do not belong to the model they are paired with, or one stats folder mixes two models."""


class TokenizerError(SymfuseError, ValueError):
    """A command that tokenizes found no usable tokenizer in the checkpoint folder."""
