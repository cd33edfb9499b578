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


def overflowed(where: object, what: str) -> NonFiniteError:
    """The error for NaN / inf a model computed from finite weights: ``<where>: <what> came out NaN / inf, ...``."""
    return NonFiniteError(
        f"{where}: {what} came out NaN / inf, though the weights are finite — the model's activations overflow (a "
        "weight far out of range?); check the checkpoint, or use another"
    )


class StatsMismatchError(SymfuseError, ValueError):
    """Statistics do not belong to the model they are paired with, or one stats folder mixes two models."""


class TokenizerError(SymfuseError, ValueError):
    """A command that tokenizes found no usable tokenizer in the checkpoint folder."""


class UsageError(SymfuseError, ValueError):
    """A bad option or argument value (a command exits 2): ``<option>: <what is wrong> — <fix>``."""


class DataError(SymfuseError, ValueError):
    """An input artifact (checkpoint, statistics, dataset) is unreadable or holds bad values (a command exits 1)."""


class OutputExistsError(SymfuseError, FileExistsError):
    """The output folder exists (and ``overwrite`` was not asked), or appeared while a command was writing it."""


class OutputLockedError(SymfuseError, BlockingIOError):
    """Another process is writing the same output folder (its lock file names the holder's pid)."""


class UnknownChoiceError(SymfuseError, ValueError, KeyError):
    """A name (merge strategy, symmetry kind) that no registry holds; the message lists the choices."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class VerificationError(SymfuseError, ValueError):
    """A result failed its own check (e.g. a matched module no longer computes the source's function)."""


class DeviceError(UsageError):
    """A device that is not there (``cuda`` without a GPU, ``cuda:3`` on a one-GPU machine) or not supported."""


# A Ctrl-C before a command runs (its seconds of imports), said by the console script and by the CLI's entry point.
INTERRUPTED_STARTING = "error: interrupted while the command was starting — nothing was written"
