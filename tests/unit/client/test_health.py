"""Circuit (fail fast, probe, recover) and FailureLog (count all, log once per burst)."""

from __future__ import annotations

import logging

import pytest

from kvgw_client.config import HealthPolicy
from kvgw_client.health import Circuit, CircuitState, Counters, FailureLog
from tests.unit.client.fakes import Clock


def test_opens_after_threshold_consecutive_failures_only() -> None:
    clock = Clock()
    circuit = Circuit(HealthPolicy(failure_threshold=3, cooldown=1.0), clock)
    assert not circuit.on_failure() and not circuit.on_failure()
    circuit.on_success()  # a success resets the count
    assert not circuit.on_failure() and not circuit.on_failure()
    assert circuit.allow()
    assert circuit.on_failure()
    assert circuit.state is CircuitState.OPEN and not circuit.allow()
    assert circuit.retry_in() == pytest.approx(1.0)


def test_probe_after_cooldown_then_close_or_back_off() -> None:
    clock = Clock()
    circuit = Circuit(HealthPolicy(failure_threshold=1, cooldown=1.0, cooldown_max=3.0), clock)
    circuit.on_failure()
    assert not circuit.begin_probe()  # still cooling down
    clock.now += 1.0
    assert circuit.begin_probe() and circuit.state is CircuitState.PROBING and not circuit.allow()
    circuit.end_probe(False)
    assert circuit.state is CircuitState.OPEN and circuit.retry_in() == pytest.approx(2.0)
    clock.now += 2.0
    assert circuit.begin_probe()
    circuit.end_probe(False)
    assert circuit.retry_in() == pytest.approx(3.0)  # capped at cooldown_max
    clock.now += 3.0
    assert circuit.begin_probe()
    circuit.end_probe(True)
    assert circuit.state is CircuitState.CLOSED and circuit.allow()
    circuit.on_failure()
    assert circuit.retry_in() == pytest.approx(1.0)  # cooldown starts over after recovery


def test_a_success_while_open_closes_it() -> None:
    circuit = Circuit(HealthPolicy(failure_threshold=1), Clock())
    circuit.on_failure()
    assert circuit.on_success() and circuit.allow()


def test_failure_log_warns_once_per_burst_and_counts_everything(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    log = FailureLog(logging.getLogger("test.kvgw"), "gw", clock, summary_every=60.0)
    with caplog.at_level(logging.DEBUG, logger="test.kvgw"):
        for _ in range(50):
            log.failure("get", "timeout", "slow")
            clock.now += 1.0
        log.failure("put", "server_error", "503")
        log.success()
        log.success()  # no burst: nothing to say
        log.failure("get", "timeout", "again")
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    infos = [r for r in caplog.records if r.levelno == logging.INFO]
    # first failure of burst 1, one summary after 60s... (50s here: none), first failure of burst 2
    assert len(warnings) == 2
    assert "get failed (timeout)" in warnings[0].getMessage()
    assert len(infos) == 1
    assert "get.timeout=50" in infos[0].getMessage() and "put.server_error=1" in infos[0].getMessage()
    assert log.counts() == {"get.timeout": 51, "put.server_error": 1}
    assert log.in_burst


def test_failure_log_summarises_a_long_burst(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    log = FailureLog(logging.getLogger("test.kvgw2"), "gw", clock, summary_every=10.0)
    with caplog.at_level(logging.WARNING, logger="test.kvgw2"):
        for _ in range(35):
            log.failure("exists", "unavailable", "refused")
            clock.now += 1.0
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 4  # first + summaries at 10s, 20s, 30s
    assert "still failing" in messages[1]


def test_counters() -> None:
    counters = Counters()
    counters.add("a")
    counters.add("a", 4)
    assert counters.get("a") == 5 and counters.get("b") == 0
    assert counters.snapshot() == {"a": 5}
