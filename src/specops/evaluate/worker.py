"""An eval worker process (eval.workers > 1): `python -m specops.evaluate.worker ARGS RESULT_FD`.

Started only by specdec._run_workers, which documents the protocol (specdec._worker_main).
"""

import sys

from .specdec import _worker_main

if __name__ == "__main__":
    sys.exit(_worker_main(sys.argv[1:]))
