"""``path_segment``: the gateway's percent-decoder of request paths gives exactly what
``urllib.parse.unquote`` gives (or raises where it raises), with its ASCII shortcut and without."""

from __future__ import annotations

import random
from urllib.parse import unquote

import pytest

from gateway.api.http import path_segment

PIECES = ["a", "/", "~", "%40", "%2F", "%2f", "%C3%A9", "%E2%82", "%zz", "%", "%4", "x%C3", "é", "€", "+", " "]


def unquoted(raw: str, errors: str) -> str | type[ValueError]:
    try:
        return unquote(raw, encoding="utf-8", errors=errors)
    except ValueError:
        return ValueError


def decoded(raw: str, errors: str) -> str | type[ValueError]:
    try:
        return path_segment(raw, errors)
    except ValueError:
        return ValueError


@pytest.mark.parametrize("errors", ["strict", "replace"])
def test_decodes_as_unquote_does(errors: str) -> None:
    rng = random.Random(14)
    raws = ["", "plain/key", "model%40tp1%400%40abc"] + [
        "".join(rng.choice(PIECES) for _ in range(rng.randint(1, 8))) for _ in range(3000)]
    for raw in raws:
        assert decoded(raw, errors) == unquoted(raw, errors), raw


def test_invalid_utf8_raises_value_error_when_strict() -> None:
    with pytest.raises(UnicodeDecodeError, match="utf-8"):
        path_segment("%C3x%A9")
    assert path_segment("%C3x%A9", "replace") == "\ufffdx\ufffd"
