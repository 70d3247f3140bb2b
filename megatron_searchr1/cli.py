"""Command-line conventions shared by every entry point: a user mistake is one `error: ...` line and exit code 2.

    from megatron_searchr1.cli import ArgumentParser, UsageError, run_main

    def main(argv=None) -> int:
        args = ArgumentParser(description="...").parse_args(argv)     # --help shows defaults
        if not os.path.isdir(args.data):
            raise UsageError(f"--data {args.data!r} does not exist: run tools/make_synthetic_world.py first")
        ...heavy imports and work...

    cli = console(main)                     # setup.py's console script: `name=package.module:cli`

    if __name__ == "__main__":
        raise SystemExit(run_main(main))

Check arguments and paths before heavy imports (torch, megatron, vllm), so a mistake is reported in well under a
second. A traceback is for our bugs: anything other than UsageError propagates. Range checks that need no other
flag go into the argument's type: `p.add_argument("--iters", type=at_least(1), default=5)`.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, NoReturn, Optional, Sequence


class UsageError(Exception):
    """A mistake in the user's input (arguments, paths, file contents); the message says what to change."""


def stderr_line(text: str) -> None:
    """Write `text` and its newline to stderr in one write. Ranks of one torchrun job share the stream, and `print`
    writes the text and its newline separately, so two ranks' lines could run together ("...stopserror: ...")."""
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


def error_exit(message: str, code: int = 2) -> NoReturn:
    """Print `error: <message>` as one line on stderr (`stderr_line`) and exit."""
    stderr_line("error: " + " ".join(str(message).split()))
    raise SystemExit(code)


class ArgumentParser(argparse.ArgumentParser):
    """argparse with defaults shown in --help (also for flags without a help text) and parse errors as one
    `error:` line (exit 2)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _Formatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:  # argparse's own mistakes: bad flag, missing value, bad choice
        error_exit(f"{message} (see {self.prog} --help)")


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults in --help (not None or empty, not for on/off switches), and descriptions/epilogs printed as written
    (examples keep their lines)."""

    def _format_action(self, action):
        if action.help is None and _shows_default(action):
            action.help = "default: %(default)s"  # argparse prints nothing for a flag without a help text
        return super()._format_action(action)

    def _get_help_string(self, action):
        text = (action.help or "").strip()
        if not _shows_default(action) or "%(default)" in text:
            return text
        return f"{text} (default: %(default)s)"


def _shows_default(action: argparse.Action) -> bool:
    """A default worth printing: not for positionals or on/off switches, not None / empty / suppressed."""
    return (bool(action.option_strings) and action.nargs != 0
            and not any(action.default is d or action.default == d for d in (None, argparse.SUPPRESS, "", [], ())))


def at_least(low: float, kind: type = int) -> Callable[[str], float]:
    """An argparse `type` that reads `kind` and refuses values below `low`: `type=at_least(1)`, `at_least(0.0, float)`.

    The parse error names the flag: `error: argument --iters: must be >= 1, got 0`.
    """
    def convert(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, got {text!r}")
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {text}")
        return value

    convert.__name__ = kind.__name__
    return convert


def above(low: float, kind: type = float) -> Callable[[str], float]:
    """Like `at_least`, for a strict bound: `type=above(0)` (seconds, sizes in MiB)."""
    def convert(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, got {text!r}")
        if not value > low:
            raise argparse.ArgumentTypeError(f"must be > {low}, got {text}")
        return value

    convert.__name__ = kind.__name__
    return convert


RETRIEVAL_DOWN_EXIT = 3
"""Exit code of a run stopped because its retrieval server is gone or hung (2 is a usage mistake)."""


EXIT_STATUS_DIR = "SEARCHR1_EXIT_STATUS_DIR"
"""When this variable names a directory (examples/run_node.sh sets it for its torchrun), each process leaving through
`run_main` writes its exit code to `<dir>/rank<RANK>`: torchrun reports any failing rank as its own exit code 1, and
the launcher reads the ranks' codes there (3: retrieval server down, 2: a mistake, 1: a crash)."""


def record_exit(code: int) -> None:
    """Write `code` to this rank's file under $SEARCHR1_EXIT_STATUS_DIR, when it is set (best effort: a launcher's
    nicety must never change how the process ends)."""
    folder = os.environ.get(EXIT_STATUS_DIR)
    if folder:
        try:
            with open(os.path.join(folder, f"rank{os.environ.get('RANK', '0')}"), "w") as f:
                f.write(f"{code}\n")
        except OSError:
            pass


def run_main(main: Callable[[Optional[Sequence[str]]], Optional[int]], argv: Optional[Sequence[str]] = None) -> int:
    """Call `main(argv)`; a UsageError becomes one `error:` line and exit code 2, a RetrievalDown (every rank
    raises it together) one `error:` line and exit code 3. The code is recorded for a launcher (`record_exit`;
    an exception that propagates records 1)."""
    from megatron_searchr1.search.client import RetrievalDown  # stdlib-only module: no heavy import

    code = 1
    try:
        code = int(main(argv) or 0)
        return code
    except UsageError as e:
        code = 2
        error_exit(str(e))
    except RetrievalDown as e:
        code = RETRIEVAL_DOWN_EXIT
        error_exit(str(e), code=RETRIEVAL_DOWN_EXIT)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        raise
    finally:
        record_exit(code)


def console(main: Callable[[Optional[Sequence[str]]], Optional[int]]) -> Callable[[], int]:
    """The zero-argument entry point a console script calls (setup.py `name=module:cli`), reading sys.argv."""
    def cli() -> int:
        return run_main(main)

    cli.__doc__ = f"Console-script entry of {main.__module__}.main: user mistakes are one `error:` line, exit 2."
    return cli


# ---------------------------------------------------------------------------------------------------------------
# The trainers' command line (train, sft, evaluate): a YAML plus dotted overrides, read before torch is imported.
# ---------------------------------------------------------------------------------------------------------------
def parse(argv: Optional[Sequence[str]], cls=None, prog_doc: str = "", translate=None):
    """`CONFIG.yaml KEY=VALUE ...` (or only overrides) -> a validated `cls` (default: the RL Config); a config
    mistake is a UsageError naming the field. `--help-config` prints every field with its default and exits.
    Read from sys.argv (`argv` None, a real run), it also makes Ctrl-C end the process in a second or two with one
    line (megatron_searchr1/interrupt.py).
    `translate`: reads a foreign YAML into ours (the SFT entry passes config/llamafactory.py's)."""
    # here, not at the top: the converters' and the server's command lines share this module and need no config
    from megatron_searchr1.config import Config, ConfigError, describe, load_config

    cls = cls or Config
    p = ArgumentParser(description=(prog_doc or "").split("\n\n")[0], epilog="Overrides: dotted KEY=VALUE, e.g. "
                       "rollout.max_turns=4 algo.adv_estimator=gae data.train_files=[a.parquet,b.parquet]")
    p.add_argument("config", nargs="?", help="experiment YAML (examples/*.yaml); KEY=VALUE overrides may follow")
    p.add_argument("overrides", nargs="*", help="dotted overrides applied after the YAML")
    p.add_argument("--help-config", action="store_true", help="list every config field with its default and exit")
    args = p.parse_args(argv)
    if args.help_config:
        print("\n".join(describe(cls)))
        raise SystemExit(0)
    overrides = list(args.overrides)
    if args.config and "=" in args.config:  # no YAML, only overrides
        overrides.insert(0, args.config)
        args.config = None
    try:
        cfg = load_config(args.config, overrides, cls=cls, translate=translate)
        cfg.validate(world_size=int(os.environ.get("WORLD_SIZE", "1")))
    except ConfigError as e:
        raise UsageError(str(e)) from None
    if argv is None:  # a real command line: Ctrl-C is one line and exit 130 (callers passing argv keep Python's)
        from megatron_searchr1 import interrupt

        interrupt.enable()
    return cfg


def check_retrieval(cfg) -> None:
    """Fail fast (before any model is built) when the retrieval server of an RL config does not answer."""
    if cfg.retrieval.launch:
        return
    import httpx

    base = cfg.retrieval.url.rstrip("/").removesuffix("/retrieve")
    try:
        httpx.post(f"{base}/retrieve", json={"queries": ["ping"], "topk": 1}, timeout=30).raise_for_status()
    except Exception as e:  # noqa: BLE001 - any failure means the same thing to the user
        raise UsageError(f"the retrieval server at {cfg.retrieval.url} does not answer ({type(e).__name__}: {e}): "
                         "start it (python -m megatron_searchr1.search.server --index-dir DIR --port 8000) or set "
                         "retrieval.launch=true retrieval.server_args=[--index-dir,DIR]") from None


def check_data(cfg) -> None:
    """Fail fast (before torch loads) when an RL config's parquet files are missing, unreadable, schema-less,
    empty or hold a data_source without a reward: only their footers and data_source column are read. Token lengths need the tokenizer: trainer/build.py checks them before it
    builds a model."""
    from megatron_searchr1.data.rl_data import DataError, check_schema

    try:
        if not cfg.trainer.val_only:
            check_schema(list(cfg.data.train_files), "data.train_files")
        check_schema(list(cfg.data.val_files), "data.val_files")
    except DataError as e:
        raise UsageError(str(e)) from None
