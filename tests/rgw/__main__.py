"""``python -m tests.rgw start|stop|status DIR``: ``python -m gateway.bench.rgw`` under the tests' name
(the cluster's one launcher lives in ``gateway/bench/rgw.py``, which the bench uses too)."""

from __future__ import annotations

import sys

from gateway.bench.rgw import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m tests.rgw"))
