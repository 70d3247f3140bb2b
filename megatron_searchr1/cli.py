"""Command-line conventions shared by every entry point: a user mistake is one `error: ...` line and exit code 2.

    from megatron_searchr1.cli import ArgumentParser, UsageError, run_main

    def main(argv=None) -> int:
        args = ArgumentParser(description="...").parse_args(argv)     # --help shows defaults
        if not os.path.isdir(args.data):
            raise UsageError(f"--data {args.data!r} does not exist: run tools/make_synthetic_world.py first")
        ...heavy imports and work...

    if __name__ == "__main__":
        raise SystemExit(run_main(main))

Check arguments and paths before heavy imports (torch, megatron, vllm), so a mistake is reported in well under a
second. A traceback is for our bugs: anything other than UsageError propagates.
"""
from __future__ import annotations

import argparse
import sys
from typing import Callable, NoReturn, Optional, Sequence


class UsageError(Exception):
    """A mistake in the user's input (arguments, paths, file contents); the message says what to change."""


def error_exit(message: str, code: int = 2) -> NoReturn:
    """Print `error: <message>` as one line on stderr and exit."""
    print("error: " + " ".join(str(message).split()), file=sys.stderr, flush=True)
    raise SystemExit(code)


class ArgumentParser(argparse.ArgumentParser):
    """argparse with defaults shown in --help and parse errors as one `error:` line (exit 2)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _Formatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:  # argparse's own mistakes: bad flag, missing value, bad choice
        error_exit(f"{message} (see {self.prog} --help)")


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults in --help, and descriptions/epilogs printed as written (examples keep their lines)."""


def run_main(main: Callable[[Optional[Sequence[str]]], Optional[int]], argv: Optional[Sequence[str]] = None) -> int:
    """Call `main(argv)`; a UsageError becomes one `error:` line and exit code 2."""
    try:
        return int(main(argv) or 0)
    except UsageError as e:
        error_exit(str(e))
