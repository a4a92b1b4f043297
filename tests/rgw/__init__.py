"""Ceph RADOS Gateway as the tests' real S3 server: ``fixtures`` puts the cluster of
``gateway.bench.rgw`` (its one launcher, shared with ``kvgw bench s3``) under pytest
(``tests/conftest.py`` re-exports them); ``python -m tests.rgw`` starts and stops one from a shell."""
