"""One logging setup for every command (and the demo): levels, format, third-party noise.

verbosity -1 (-q): warnings and errors only, no progress bars;
verbosity  0     : rltool's INFO lines; third-party libraries at WARNING;
verbosity  1 (-v): rltool's DEBUG lines, and third-party INFO (httpx's line per request).
Progress bars of transformers and huggingface_hub (one "Loading weights" bar per checkpoint load,
which drowns a loop's step lines) are off at every verbosity; rltool's own progress bars and
progress lines (rltool/progress.py) follow -q.
Logs go to stderr, so `--json` output on stdout stays clean. Under torchrun, ranks other than 0
log warnings and errors only.
"""

from __future__ import annotations

import logging
import os
import sys

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# Libraries whose INFO lines are per request or per file: one line each is noise at our INFO.
NOISY_LOGGERS = ("httpx", "httpcore", "urllib3", "filelock", "huggingface_hub", "transformers",
                 "torch.distributed", "asyncio")


def setup_logging(*, verbosity: int = 0) -> None:
    if int(os.environ.get("RANK", "0")) != 0:
        verbosity = -1  # under torchrun only rank 0 speaks; the others keep warnings and errors
    level = logging.WARNING if verbosity < 0 else logging.DEBUG if verbosity > 0 else logging.INFO
    root = logging.getLogger()
    root.setLevel(level)
    if not any(isinstance(h, StderrHandler) for h in root.handlers):
        handler = StderrHandler()
        handler.setFormatter(logging.Formatter(FORMAT))
        root.addHandler(handler)
    logging.getLogger("rltool.progress").setLevel(logging.NOTSET)  # follows the verbosity
    third_party = logging.INFO if verbosity > 0 else logging.WARNING
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(third_party)
    disable_library_progress_bars()


class StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever sys.stderr is at emit time (a test runner may swap it per command)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property  # type: ignore[override]
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def disable_library_progress_bars() -> None:
    """Off for this process and the engines and trainer ranks it starts (they inherit the
    environment); without importing transformers, so `--help` stays instant."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "huggingface_hub" in sys.modules:  # its flag too is read at import
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    if "transformers" in sys.modules:  # imported already: its flag was read at import
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
