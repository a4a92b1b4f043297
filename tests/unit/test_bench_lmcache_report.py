"""``kvgw bench lmcache``'s report: companion rows (measured between a target's rounds) and its ratio lines,
the ones with a target deciding the exit status, the ones without only saying where the time goes."""

from __future__ import annotations

from pathlib import Path

from gateway.bench.lmcache import Companion, Result, Target, report


def target(key: str, mbps: float, *companions: tuple[str, list[float]], cache: str = "warm") -> Target:
    result = Result(key, f"target {key}", cache, get_mbps=mbps)
    made = tuple(Companion(c, f"companion of {key}", "a note", lambda _w, _k, _b: 0.0) for c, _ in companions)
    result.companion_mbps = dict(companions)
    files: list[Path] = []
    return Target(key, f"target {key}", "backend", lambda: None, lambda: files, companions=made, results=[result])


def line(text: str, starts: str) -> str:
    found = [row for row in text.splitlines() if row.startswith(starts)]
    assert len(found) == 1, (starts, text)
    return found[0]


def test_a_companion_is_a_row_of_its_own_with_the_median_of_its_rounds() -> None:
    text, _ = report([target("f", 600.0, ("v", [900.0, 500.0, 800.0])), target("e", 1000.0, ("w", [640.0]))],
                     ["warm"], "header")
    row = line(text, "warm  (v) companion of f")
    assert "800" in row and "median of 3, a note" in row
    assert "0.75" in line(text, "warm  (f) / (v)") and "no target" in line(text, "warm  (f) / (v)")
    assert "0.64" in line(text, "warm  (w) / (e)")
    assert "1.25" in line(text, "warm  (v) / (w)")


def test_lines_without_a_target_never_fail_the_run() -> None:
    # every target met; (f) is half of its bare verified read, which has no target
    targets = [target("a", 900.0, ("s", [1000.0])), target("b", 1200.0), target("c", 300.0), target("d", 100.0),
               target("e", 1000.0), target("f", 950.0, ("v", [1900.0]))]
    text, ok = report(targets, ["warm"], "header")
    assert "0.50" in line(text, "warm  (f) / (v)") and "FAIL" not in text
    assert ok
    targets[4].results[0].get_mbps = 2000.0  # now (a), (b), (f) fall below (e)
    text, ok = report(targets, ["warm"], "header")
    assert not ok and "FAIL" in line(text, "warm  (f) >= 0.9x (e)")


def test_a_warm_target_below_its_ratio_fails_and_cold_has_its_own_line() -> None:
    warm, _ = report([target("f", 800.0), target("e", 1000.0)], ["warm"], "header")
    assert "FAIL" in line(warm, "warm  (f) >= 0.9x (e)") and "PASS" in line(warm, "warm  (f) >= 70% of (e)")
    assert "(f) >= (e)" not in warm  # issue 14's cold target is printed for cold only
    cold, _ = report([target("f", 1200.0, cache="cold"), target("e", 1000.0, cache="cold")], ["cold"], "header")
    assert "PASS" in line(cold, "cold  (f) >= (e)") and "0.9x" not in cold


def test_every_companion_of_a_target_has_its_row_and_the_verified_stream_its_ratios() -> None:
    """(a) has two companions: the raw stream (s) and the same stream hashed as it lands (t)."""
    text, ok = report([target("a", 900.0, ("s", [1000.0, 1200.0]), ("t", [950.0]))], ["warm"], "header")
    assert "1100" in line(text, "warm  (s) companion of a") and "950" in line(text, "warm  (t) companion of a")
    assert "0.82" in line(text, "warm  (a) >= 0.8x (s)")
    assert "0.95" in line(text, "warm  (a) / (t)") and "no target" in line(text, "warm  (a) / (t)")
    assert "0.86" in line(text, "warm  (t) / (s)")
    assert "FAIL" not in text and not ok  # the targets without (e) could not run
