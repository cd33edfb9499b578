"""``symfuse convert``: a GGUF file (llama.cpp's format) written as a safetensors checkpoint folder."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from symfuse.cli import app, checks
from symfuse.errors import UsageError

DTYPES = ("float32", "bfloat16", "float16")


@app.command()
def convert(
    source: Annotated[Path, typer.Argument(help="GGUF file (.gguf) to convert.")],
    out: Annotated[Path, typer.Option("--out", help="Output folder (must not exist unless --overwrite).")],
    dtype: Annotated[
        str, typer.Option("--dtype", help=f"dtype of the dequantised weights: {', '.join(DTYPES)}.")
    ] = "float32",
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an existing --out (at the end).")] = False,
) -> None:
    """Write SOURCE.gguf as a save_pretrained folder (config, model.safetensors, tokenizer) transformers loads.

    Weights are dequantised to --dtype, llama's Q/K rows put back in transformers' order; the folder's logits
    equal transformers' own GGUF loading. Every other command also reads a .gguf path directly (converted once
    into $SYMFUSE_CACHE/gguf or ~/.cache/symfuse/gguf).
    """
    checks.one_of("--dtype", dtype, DTYPES)
    checks.local_path("SOURCE", source, folder=False)
    if source.is_dir():
        raise UsageError(f"SOURCE: {source} is a folder — give a .gguf file")
    from symfuse.gguf_in import check_gguf, write_gguf_folder
    from symfuse.outputs import atomic_output_dir

    check_gguf(source)  # header, architecture, tensor types: before any work
    with atomic_output_dir(out, overwrite=overwrite, inputs=[source]) as tmp:
        write_gguf_folder(source, tmp, dtype)
    typer.echo(f"wrote {out} ({dtype}) from {source}")
