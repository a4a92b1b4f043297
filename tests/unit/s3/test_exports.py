"""The public surface the S3 front end builds on: every exported name exists (fails when one goes away)."""

from __future__ import annotations

import importlib

import pytest

MODULES = ["auth", "checksums", "chunked", "errors", "payload", "xml"]


@pytest.mark.parametrize("name", MODULES)
def test_exported_names_exist(name: str) -> None:
    module = importlib.import_module(f"gateway.api.s3.{name}")
    missing = [member for member in module.__all__ if not hasattr(module, member)]
    assert not missing


def test_entry_points() -> None:
    from gateway.api.s3.auth import authenticate, parse_request, verify
    from gateway.api.s3.errors import S3Error, error_response
    from gateway.api.s3.payload import open_payload

    assert all(callable(f) for f in (authenticate, parse_request, verify, error_response, open_payload))
    assert issubclass(S3Error, Exception)
