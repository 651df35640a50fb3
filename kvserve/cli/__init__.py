"""`kvserve` command line: one module per command group.

prepare.py (prepare), generate.py (generate), models.py (models), serve.py (up, down, status,
cache; with launch.py and status.py), bench.py (bench throughput|prefix|serve), eval.py (eval
recall|factuality), loadtest.py (loadtest), trace.py (trace). The engine flags are generated
from kvserve.workers.config (engine_args.py); the argparse value types are in types.py.
"""

from __future__ import annotations

import argparse
import sys

from kvserve.cli.bench import add_bench
from kvserve.cli.eval import add_eval
from kvserve.cli.generate import add_generate
from kvserve.cli.loadtest import add_loadtest
from kvserve.cli.models import add_models
from kvserve.cli.prepare import add_prepare
from kvserve.cli.serve import add_serve_commands
from kvserve.cli.trace import add_trace
from kvserve.workers.errors import EngineConfigError, ModelNotFoundError


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "run"):
        parser.print_help()
        return 2
    try:
        return args.run(args)
    except ModelNotFoundError as exc:  # a user's typo: one line, not a traceback
        print(f"kvserve: {exc}", file=sys.stderr)
        return 2
    except EngineConfigError as exc:  # a setting the model cannot run with
        print(f"kvserve: invalid engine setting: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM where a command turns it into one
        print("kvserve: interrupted", file=sys.stderr)
        return 130


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvserve",
        description="Serve and evaluate open-weight decoder LLMs with a paged KV cache.",
    )
    sub = parser.add_subparsers(title="commands")
    add_prepare(sub)
    add_generate(sub)
    add_models(sub)
    add_serve_commands(sub)
    add_bench(sub)
    add_eval(sub)
    add_loadtest(sub)
    add_trace(sub)
    return parser
