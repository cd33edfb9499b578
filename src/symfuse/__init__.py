"""symfuse: symmetry-aware fusion of transformer models."""

import os

# OpenBLAS (scipy's, used by RegMean: symfuse.merge.linalg) keeps its worker threads spinning for 2^28 cycles after
# every call; on a 2-core machine they then take the CPU from the elementwise passes and torch's threads between the
# calls (a K=5 roberta-base RegMean merge: 10.7 s, 20.6 CPU s). 2^18 cycles (~0.1 ms) ends the spin before the next
# pass (9.5 s, 17.5 CPU s) and still bridges the gaps inside one call: at 2^4 the workers went to sleep between the
# steps of every Cholesky factorisation (0.80 s in all against 0.65 s). Read once, when OpenBLAS loads: effective
# when symfuse is imported before scipy.linalg; a value set by the user wins.
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "18")

__version__ = "0.1.0"
