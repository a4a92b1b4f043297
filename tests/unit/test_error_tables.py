"""One error vocabulary: every domain error lives in ``gateway.errors`` and both APIs' tables know it."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import gateway
from gateway import errors
from gateway.api.native import STATUS, status_for
from gateway.api.s3.app import DOMAIN_CODES, s3_code
from gateway.api.s3.errors import ERRORS
from gateway.errors import KvgwError


def all_domain_errors() -> list[type[KvgwError]]:
    """KvgwError and its subclasses, recursively, once every gateway module is imported (the benches
    and the deprecated client shims define none); test doubles are left out."""
    for module in pkgutil.walk_packages(gateway.__path__, "gateway."):
        if not module.name.startswith(("gateway.bench", "gateway.client")):
            importlib.import_module(module.name)
    found: list[type[KvgwError]] = [KvgwError]
    for cls in found:
        subs = cls.__subclasses__()
        found.extend(sub for sub in subs if sub not in found and not sub.__module__.startswith("tests."))
    return found


DOMAIN_ERRORS = all_domain_errors()


def test_the_walk_sees_every_error_of_the_module() -> None:
    defined = {obj for obj in vars(errors).values() if isinstance(obj, type) and issubclass(obj, KvgwError)}
    assert defined <= set(DOMAIN_ERRORS)
    assert len(defined) > 20


@pytest.mark.parametrize("cls", DOMAIN_ERRORS, ids=lambda cls: cls.__name__)
def test_every_domain_error_is_defined_in_gateway_errors(cls: type[KvgwError]) -> None:
    assert cls.__module__ == "gateway.errors", f"{cls.__qualname__} belongs in gateway/errors.py"
    assert isinstance(cls.code, str) and cls.code


@pytest.mark.parametrize("cls", DOMAIN_ERRORS, ids=lambda cls: cls.__name__)
def test_every_domain_error_has_a_native_status(cls: type[KvgwError]) -> None:
    assert cls in STATUS, f"{cls.__name__} is missing from gateway.api.native.STATUS"
    assert 400 <= STATUS[cls] <= 599


@pytest.mark.parametrize("cls", DOMAIN_ERRORS, ids=lambda cls: cls.__name__)
def test_every_domain_error_has_an_s3_code(cls: type[KvgwError]) -> None:
    assert cls in DOMAIN_CODES, f"{cls.__name__} is missing from gateway.api.s3.app.DOMAIN_CODES"
    assert DOMAIN_CODES[cls] in ERRORS, f"{DOMAIN_CODES[cls]} is no S3 error code the S3 API knows"


def test_tables_are_keyed_by_class_and_lookups_follow_the_class() -> None:
    assert status_for(errors.NoSuchUpload()) == 404 and s3_code(errors.NoSuchUpload()) == "NoSuchUpload"
    assert status_for(errors.ChunkTooLarge()) == 413 and s3_code(errors.ChunkTooLarge()) == "EntityTooLarge"

    class Unlisted(errors.NoSuchChunk):  # a subclass nobody listed answers as its nearest listed base
        pass

    try:
        assert status_for(Unlisted()) == 404 and s3_code(Unlisted()) == "NoSuchKey"
    finally:
        del Unlisted
