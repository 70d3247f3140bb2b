"""What a run prints: third-party warning noise filtered, progress that suits a terminal and a log file alike.

    from megatron_searchr1.console import progress, quiet_third_party_warnings

    quiet_third_party_warnings()                       # first thing in an entry point's main()
    bar = progress(total=steps, initial=step, desc="SFT steps", unit="step", disable=rank != 0)
    for ...:
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.4f}")
    bar.close()

Why: a CPU demo run printed dozens of FutureWarning / DeprecationWarning lines from torch.distributed, Megatron's
dist_checkpointing and vLLM, which a user can do nothing about and which hide the lines that matter; our own
warnings (module ``megatron_searchr1.*``) still show. And tqdm redraws a bar with ``\\r``: in a cluster job's log
file every redraw is a new line (two per SFT step), so when the stream is not a terminal, progress is one plain
line every few steps or seconds instead.

No torch import here: entry points call this before their heavy imports.
"""
from __future__ import annotations

import math
import re
import sys
import time
import warnings
from typing import Any, Iterable, Iterator, Optional, TextIO

# Packages whose start-up and deprecation warnings are not the user's to act on. A module matches when its name
# is one of these or starts with one of them plus "." (so `megatron` does not match `megatron_searchr1`).
THIRD_PARTY = ("torch", "megatron", "vllm", "transformers", "tensorboard", "triton", "transformer_engine", "apex")
NOISY_CATEGORIES = (FutureWarning, DeprecationWarning, UserWarning)


def quiet_third_party_warnings(modules: Iterable[str] = THIRD_PARTY,
                               categories: Iterable[type[Warning]] = NOISY_CATEGORIES) -> bool:
    """Ignore `categories` of warnings attributed to `modules` (and their submodules); other warnings, ours
    included, are left as they are. Returns False and changes nothing when the user chose warning filters
    (``python -W ...`` or ``PYTHONWARNINGS``): their choice wins.

    A warning belongs to the module of the frame it is attributed to (``warnings.warn``'s stacklevel), so a
    third-party deprecation that points at a line of ours is kept: it is about our code.
    """
    if sys.warnoptions:
        return False
    pattern = "|".join(re.escape(m) for m in modules)
    for category in categories:
        warnings.filterwarnings("ignore", category=category, module=rf"(?:{pattern})(?:\.|$)")
    return True


def _is_tty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class PlainProgress:
    """tqdm's interface (iteration, ``update``, ``set_postfix``, ``write``, ``close``, a context manager) printing
    ``desc: n/total (p%) rate, elapsed, left | postfix`` as one line every `every_steps` steps or `every_seconds`
    seconds, whichever comes first, and once more at close if the last count was not printed yet."""

    def __init__(self, iterable: Optional[Iterable] = None, *, total: Optional[int] = None, initial: int = 0,
                 desc: str = "", unit: str = "it", disable: bool = False, every_steps: Optional[int] = None,
                 every_seconds: float = 60.0, file: Optional[TextIO] = None):
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)
        self.iterable, self.total, self.n, self.desc, self.unit = iterable, total, initial, desc, unit
        self.disable, self.file = disable, file
        # ~20 lines over a run with a known length, else every 10 steps (and at least every `every_seconds`)
        self.every_steps = every_steps or (max(1, math.ceil((total - initial) / 20)) if total else 10)
        self.every_seconds = every_seconds
        self._start = self._last_time = time.monotonic()
        self._start_n = self._last_n = initial
        self._postfix = ""

    def _out(self) -> TextIO:
        return self.file if self.file is not None else sys.stderr

    def format_line(self) -> str:
        elapsed = time.monotonic() - self._start
        done = self.n - self._start_n
        rate = done / elapsed if elapsed > 0 else 0.0
        count = f"{self.n}/{self.total} ({100 * self.n / self.total:.0f}%)" if self.total else f"{self.n}"
        parts = [f"{self.desc}: {count}" if self.desc else count, f"{rate:.2f} {self.unit}/s",
                 f"{_clock(elapsed)} elapsed"]
        if self.total and rate > 0:
            parts.append(f"{_clock((self.total - self.n) / rate)} left")
        return ", ".join(parts) + (f" | {self._postfix}" if self._postfix else "")

    def _print(self) -> None:
        print(self.format_line(), file=self._out(), flush=True)
        self._last_n, self._last_time = self.n, time.monotonic()

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.disable:
            return
        if self.n - self._last_n >= self.every_steps or time.monotonic() - self._last_time >= self.every_seconds:
            self._print()

    def set_postfix(self, ordered_dict: Optional[dict] = None, refresh: bool = True, **kwargs: Any) -> None:
        items = {**(ordered_dict or {}), **kwargs}
        self._postfix = ", ".join(f"{k}={v}" for k, v in items.items())

    def write(self, text: str, file: Optional[TextIO] = None, end: str = "\n") -> None:
        # like tqdm.write, also when the bar is disabled: logging.progress_bar=false hides the bar, not the
        # caller's step lines (callers print on rank 0 only)
        print(text, file=file or self._out(), end=end, flush=True)

    def close(self) -> None:
        if not self.disable and self.n != self._last_n:
            self._print()
        self.disable = True  # a second close prints nothing

    def __iter__(self) -> Iterator:
        try:
            for item in self.iterable:
                yield item
                self.update(1)
        finally:
            self.close()

    def __enter__(self) -> "PlainProgress":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _clock(seconds: float) -> str:
    """
    >>> _clock(59.4), _clock(61), _clock(3725)
    ('59s', '1m01s', '1h02m05s')
    """
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m{s % 60:02d}s"


def progress(iterable: Optional[Iterable] = None, *, total: Optional[int] = None, initial: int = 0, desc: str = "",
             unit: str = "it", disable: bool = False, every_steps: Optional[int] = None, every_seconds: float = 60.0,
             file: Optional[TextIO] = None):
    """A progress bar over `iterable` (or a counter up to `total` that the caller ``update``s): tqdm when `file`
    (default stderr, as tqdm) is a terminal, else a PlainProgress line every `every_steps` steps (default: ~20
    lines per run) or `every_seconds` seconds."""
    out = file if file is not None else sys.stderr
    if _is_tty(out):
        from tqdm import tqdm

        return tqdm(iterable, total=total, initial=initial, desc=desc, unit=unit, disable=disable,
                    dynamic_ncols=True, file=out)
    return PlainProgress(iterable, total=total, initial=initial, desc=desc, unit=unit, disable=disable,
                         every_steps=every_steps, every_seconds=every_seconds, file=file)
