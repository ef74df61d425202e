"""What a command shows on the terminal besides its own lines: other libraries' warnings kept out of
the way, and progress bars closed before an error's one line."""
from __future__ import annotations

import contextlib
import logging
import sys
import warnings


@contextlib.contextmanager
def library_warnings_hidden(hidden: bool):
    """Keep other libraries' warnings (Pillow's, torchvision's, transformers' and accelerate's
    notices) out of the progress bars and one-line errors while a command runs; lit-softmoe's own
    warnings and log lines still show. DataLoader workers forked meanwhile inherit the filters."""
    loggers = [logging.getLogger(name)
               for name in ("transformers", "huggingface_hub", "accelerate")]
    levels = [logger.level for logger in loggers]
    with warnings.catch_warnings():
        if hidden:
            warnings.filterwarnings("ignore")
            # later filters take precedence
            warnings.filterwarnings("default", module=r"lit_softmoe(\.|$)")
            for logger in loggers:
                logger.setLevel(logging.ERROR)
        try:
            yield
        finally:
            for logger, level in zip(loggers, levels):
                logger.setLevel(level)


def end_progress_bars() -> None:
    """Close the progress bars that an error left open (tqdm ends each one's line), so the error's
    one line starts a line of its own instead of trailing the bar's."""
    if "tqdm" in sys.modules:  # a command that failed before any bar did not import it
        from tqdm import tqdm
        for bar in list(getattr(tqdm, "_instances", ())):
            bar.close()
