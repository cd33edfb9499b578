"""Reading and writing safetensors checkpoints and statistics: one parser, one reader, one writer, validation.

No orchestration or storage here (no Prefect, fsspec or :mod:`symfuse.store`): torch and the safetensors
format only.
"""

from symfuse.io.compare import tensor_difference
from symfuse.io.folder import (
    MIN_VOCAB,
    SIDE_FILES,
    TOKENIZER_FILES,
    WEIGHTS,
    WEIGHTS_INDEX,
    check_finite,
    check_finite_tensor,
    check_module_shapes,
    check_tokenizer,
    check_vocab_size,
    checkpoint_files,
    expected_module_shapes,
    open_weight_files,
)
from symfuse.io.modes import plain_mode, umask
from symfuse.io.safetensors import (
    DTYPES,
    BufferPool,
    Header,
    TensorFile,
    TensorInfo,
    fsync_dir,
    parallel_reads,
    read_header,
    rows_per_block,
    save_safetensors,
)

__all__ = [
    "DTYPES",
    "MIN_VOCAB",
    "SIDE_FILES",
    "TOKENIZER_FILES",
    "WEIGHTS",
    "WEIGHTS_INDEX",
    "BufferPool",
    "Header",
    "TensorFile",
    "TensorInfo",
    "check_finite",
    "check_finite_tensor",
    "check_module_shapes",
    "check_tokenizer",
    "check_vocab_size",
    "checkpoint_files",
    "expected_module_shapes",
    "fsync_dir",
    "open_weight_files",
    "parallel_reads",
    "plain_mode",
    "read_header",
    "rows_per_block",
    "save_safetensors",
    "tensor_difference",
    "umask",
]
