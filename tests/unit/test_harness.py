"""The test suite's own habits: a missing service fails CI instead of skipping, and waiting for a
background effect polls with a deadline instead of sleeping a fixed time."""

from __future__ import annotations

import re

import pytest

from tests.conftest import REPO, wait_for
from tests.requirements import REQUIRE_ENV, require_module, require_or_skip

# A skip that does not go through tests/requirements.py would pass CI without running its test.
_BARE_SKIP = re.compile(r"pytest\.importorskip\(|pytest\.skip\(|\.mark\.skip(if)?\b")


def test_missing_service_skips_locally(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(REQUIRE_ENV, raising=False)
    with pytest.raises(pytest.skip.Exception, match="no such service"):
        require_or_skip("no such service")
    with pytest.raises(pytest.skip.Exception, match="kvgw_no_such_module"):
        require_module("kvgw_no_such_module")


def test_missing_service_fails_when_required(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(REQUIRE_ENV, "1")
    with pytest.raises(pytest.fail.Exception, match=r"required service missing.*no such service"):
        require_or_skip("no such service")
    with pytest.raises(pytest.fail.Exception, match="kvgw_no_such_module"):
        require_module("kvgw_no_such_module", reason="a package the test needs")
    assert require_module("json").__name__ == "json"  # present: the module itself


def test_every_skip_for_a_missing_thing_goes_through_the_helper() -> None:
    helper = REPO / "tests" / "requirements.py"
    bare = [
        f"{path.relative_to(REPO)}:{n}: {line.strip()}"
        for path in sorted((REPO / "tests").rglob("*.py"))
        if path != helper
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if _BARE_SKIP.search(line)
    ]
    assert bare == [], "use tests.requirements.require_or_skip / require_module:\n" + "\n".join(bare)


def test_wait_for_polls_until_true_and_fails_saying_what() -> None:
    answers = iter([False, False, True])
    wait_for(lambda: next(answers), "third time lucky", interval=0.001)
    with pytest.raises(pytest.fail.Exception, match=r"not within 0\.01 s: the impossible"):
        wait_for(lambda: False, "the impossible", timeout=0.01, interval=0.001)
