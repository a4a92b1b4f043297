"""Counters and histograms for the request path, at the cost of an attribute add.

prometheus_client's ``Counter.inc`` and ``Histogram.observe`` take a lock and walk a few layers per
call: on a 64-key lookup answered from the index, the five counts and one observation every request
makes were about a sixth of the lookup lane's Python time (profiled, BENCHMARKS.md "kvgw bench floor").
These families keep plain numbers instead and become Prometheus metric families only when scraped
(``TallyCollector``), under the same names, labels and exposition as before.

Event loop only: every ``inc`` and ``observe`` must run on the process's event loop thread (the
request path does; the scrape does too, through the control plane), which is what makes the plain
additions safe without a lock.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector


class Tally:
    """One labelled counter value."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1) -> None:
        self.value += amount


class Spread:
    """One labelled histogram: counts per bucket (not cumulative) and the sum."""

    __slots__ = ("_bounds", "counts", "total")

    def __init__(self, bounds: Sequence[float]) -> None:
        self._bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last: above every bound (+Inf)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self._bounds, value)] += 1
        self.total += value


class TallyFamily:
    """A counter family (``<name>_total`` when exposed), children by label values."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str]) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = list(labelnames)
        self._children: dict[tuple[str, ...], Tally] = {}

    def labels(self, *values: str) -> Tally:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = Tally()
        return child

    def collect(self) -> Metric:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, child in list(self._children.items()):
            family.add_metric(list(values), child.value)
        return family


class SpreadFamily:
    """A histogram family with fixed bucket bounds, children by label values."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str], buckets: Sequence[float]) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = list(labelnames)
        self._bounds = tuple(buckets)
        self._children: dict[tuple[str, ...], Spread] = {}

    def labels(self, *values: str) -> Spread:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = Spread(self._bounds)
        return child

    def collect(self) -> Metric:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, child in list(self._children.items()):
            cumulative, buckets = 0, []
            for bound, count in zip((*map(str, self._bounds), "+Inf"), child.counts, strict=True):
                cumulative += count
                buckets.append((bound, cumulative))
            family.add_metric(list(values), buckets, child.total)
        return family


class TallyCollector(Collector):
    """Exposes tally families through a prometheus_client registry."""

    def __init__(self, families: Sequence[TallyFamily | SpreadFamily]) -> None:
        self._families = list(families)

    def collect(self) -> Iterator[Metric]:
        for family in self._families:
            yield family.collect()
