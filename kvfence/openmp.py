"""How PyTorch's OpenMP threads (libgomp) wait between parallel regions; imported first by
the package, since libgomp reads its settings once, as torch loads.

With libgomp's defaults, threads waiting between regions give up their cores so soon that
a region often has to wake a sleeping thread, which takes far longer than starting a
spinning one, and a CPU decode step runs about 150 regions (docs/performance.md has the
measured costs). 300000 spins is libgomp's own figure for an unset OMP_WAIT_POLICY, a few
milliseconds: an idle server's threads still go to sleep. A user's own GOMP_SPINCOUNT or
OMP_WAIT_POLICY is left as it is.
"""

import os
import sys

WAIT_CHOSEN = "GOMP_SPINCOUNT" in os.environ or "OMP_WAIT_POLICY" in os.environ
if not WAIT_CHOSEN:
    os.environ["GOMP_SPINCOUNT"] = "300000"
    WAIT_CHOSEN = "torch" not in sys.modules  # False: torch loaded libgomp first, with its defaults
