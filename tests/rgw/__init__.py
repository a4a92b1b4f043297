"""Ceph RADOS Gateway as the tests' real S3 server: ``cluster`` starts and stops it (also from a shell,
``python -m tests.rgw``), ``fixtures`` puts it under pytest (``tests/conftest.py`` re-exports them)."""
