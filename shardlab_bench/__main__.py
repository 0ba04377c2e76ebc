"""``python -m shardlab_bench NAME [options]``: run benchmark NAME (shardlab_bench/NAME.py) with its options; bare (or
with --help), list the benchmarks."""

from __future__ import annotations

import importlib
import inspect
import sys

from shardlab_bench import benchmarks


def listing() -> str:
    found = benchmarks()
    width = max(map(len, found))
    lines = ["usage: python -m shardlab_bench NAME [options]   (NAME --help: its options)", "", "benchmarks:"]
    lines += [f"  {name:<{width}}  {line[:100] + ('...' if len(line) > 100 else '')}" for name, line in found.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(listing())
        return 0
    name, args = argv[0], argv[1:]
    if name not in benchmarks():
        print(f"shardlab_bench: no benchmark named {name!r}; known: {', '.join(benchmarks())}", file=sys.stderr)
        return 2
    from shardlab.train import run_tool  # a config mistake: one line and exit code 2, as for shardlab.train

    module = importlib.import_module(f"shardlab_bench.{name}")
    sys.argv = [f"python -m shardlab_bench {name}", *args]  # argparse's usage line names the command as typed
    result = []
    run_tool(lambda: result.append(module.main(args) if inspect.signature(module.main).parameters else module.main()))
    return result[0] if result and isinstance(result[0], int) else 0


if __name__ == "__main__":
    sys.exit(main())
