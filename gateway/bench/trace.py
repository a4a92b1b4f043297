"""``kvgw bench trace --mode sim|online``: hit rates on Mooncake traces, offline or against a gateway."""

from __future__ import annotations


def main(argv: list[str]) -> int:
    mode = "sim"
    for i, arg in enumerate(argv):
        if arg == "--mode" and i + 1 < len(argv):
            mode = argv[i + 1]
        elif arg.startswith("--mode="):
            mode = arg.split("=", 1)[1]
    if mode == "online":
        from gateway.bench import trace_online

        return trace_online.main(argv)
    if mode == "sim":
        from gateway.bench import trace_sim

        return trace_sim.main(argv)
    print(f"kvgw bench trace: unknown mode {mode!r} (sim or online)")
    return 2
