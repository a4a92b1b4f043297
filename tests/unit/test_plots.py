"""``--plot``: the hit-rate and I/O pictures are real PNGs with one line per policy / target."""

from __future__ import annotations

from pathlib import Path

import matplotlib.image

from gateway.bench.plots import plot_hitrate, plot_io, progress


def test_hitrate_plot(tmp_path: Path) -> None:
    rows = [{"trace": "t.jsonl", "policy": policy, "capacity_tokens": cap, "hit_rate": rate}
            for policy, scale in (("default", 0.3), ("lru", 0.2), ("belady", 0.4))
            for cap, rate in ((10**5, scale / 4), (10**6, scale / 2), (10**7, scale))]
    out = plot_hitrate(rows, tmp_path / "hitrate.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width, _ = matplotlib.image.imread(out).shape
    assert width > 600 and height > 400


def test_io_plot(tmp_path: Path) -> None:
    figures = [{"target": target, "op": op, "size": size, "clients": clients,
                "bytes_per_s": 1e9 * clients if size else 0.0, "ops_per_s": 1e4 * clients}
               for target in ("kvgw", "nginx") for op, size in (("get", 8 << 20), ("head", 0))
               for clients in (1, 8)]
    out = plot_io(figures, tmp_path / "io.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width, _ = matplotlib.image.imread(out).shape
    assert width > height > 200


def test_progress_passes_every_item_through() -> None:
    assert list(progress(range(5), "steps")) == [0, 1, 2, 3, 4]
