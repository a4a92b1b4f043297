"""The key rules' quick check of many keys (``keys.plainly_valid``) against the rule itself
(``keys.validate_key``): it may only ever say "valid" of keys the rule accepts."""

from __future__ import annotations

import pytest

from kvgw_client.keys import MAX_KEY_BYTES, InvalidKeyError, plainly_valid, validate_key

PLAIN = ["vllm@model@1@0@a1b2c3", "model/a/0", "x" * MAX_KEY_BYTES, "with space", "sym!#$%&'()*+,-./:;<=>?@[]^_`{|}~"]


def rule_accepts(key: str) -> bool:
    try:
        validate_key(key)
    except InvalidKeyError:
        return False
    return True


def test_printable_ascii_keys_within_the_limit_are_plainly_valid() -> None:
    assert plainly_valid(PLAIN)
    assert all(map(rule_accepts, PLAIN))


@pytest.mark.parametrize("odd", ["", "x" * (MAX_KEY_BYTES + 1), "tab\there", "nul\x00", "del\x7f", "c1\x85",
                                 "café", "日本語" * 400, "\ud800"],
                         ids=["empty", "too-long", "tab", "nul", "del", "c1", "accented", "long-cjk", "surrogate"])
def test_anything_else_is_left_to_the_rule_itself(odd: str) -> None:
    """Not plainly valid: each key must then go through ``validate_key``, which decides (an accented
    key is valid, a control character is not)."""
    assert not plainly_valid([*PLAIN, odd])
    assert not plainly_valid([odd])


def test_no_keys_are_not_plainly_valid() -> None:
    assert not plainly_valid([])
