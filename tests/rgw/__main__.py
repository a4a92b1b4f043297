"""``python -m tests.rgw start|stop|status DIR``: the throwaway RGW cluster of ``tests.rgw.cluster``
from a shell (for a manual run against it, or another tool's tests)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tests.rgw.cluster import ENDPOINT_FILE, STATE_FILE, RgwCluster, RgwError, _pid_alive, stop_directory


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.rgw", description=__doc__)
    parser.add_argument("action", choices=["start", "stop", "status"])
    parser.add_argument("directory", type=Path, help="where the cluster lives (deleted by stop)")
    parser.add_argument("--port", type=int, default=0, help="radosgw's HTTP port (default: a free one)")
    args = parser.parse_args(argv)
    directory: Path = args.directory.resolve()
    if args.action == "start":
        try:
            cluster = RgwCluster(directory, port=args.port).start()
        except RgwError as exc:
            print(f"rgw: {exc}", file=sys.stderr)
            return 1
        print(cluster.url)
        print(f"rgw: ready in {cluster.startup_seconds:.1f} s; keys in {directory / ENDPOINT_FILE}",
              file=sys.stderr)
        return 0
    if args.action == "stop":
        stop_directory(directory)
        return 0
    try:
        state = json.loads((directory / STATE_FILE).read_text())
        endpoint = json.loads((directory / ENDPOINT_FILE).read_text())["endpoint"]
    except (OSError, ValueError, KeyError):
        print("rgw: no cluster here", file=sys.stderr)
        return 1
    alive = {role: _pid_alive(pid) for role, pid in state.get("pids", {}).items()}
    print(json.dumps({"endpoint": endpoint, "running": alive}))
    return 0 if alive and all(alive.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
