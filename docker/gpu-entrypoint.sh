#!/bin/sh
# Entrypoint of docker/Dockerfile.gpu: a GPU worker without a usable GPU fails at once with one line, instead of
# running every flow on the CPU (or failing in the first CUDA call). Then it runs the command (CMD / compose command).
set -e
python -c "
import sys, torch
if not torch.cuda.is_available():
    sys.exit(f'error: symfuse-gpu: torch.cuda.is_available() is False (torch {torch.__version__}, CUDA {torch.version.cuda}) '
             '- run the container with a GPU (docker run --gpus all / compose device reservation, NVIDIA container toolkit) '
             'or use the CPU image')
"
exec "$@"
