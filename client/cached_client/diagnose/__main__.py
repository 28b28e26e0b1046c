"""``python -m cached_client.diagnose --worker``: a reader process of the transport
measurement (:func:`cached_client.diagnose.rates.run_readers` starts them)."""

import sys

from .rates import worker_main

if sys.argv[1:] == ["--worker"]:
    sys.exit(worker_main())
sys.exit("usage: cached diagnose ... (this entry point is its reader process)")
