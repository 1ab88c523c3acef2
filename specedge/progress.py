"""A progress bar on stderr (tqdm when installed, nothing otherwise), for long exports and benchmarks."""
from __future__ import annotations

import sys


class Progress:
    def __init__(self, total: int, desc: str, unit: str, enabled: bool = True):
        self.bar = None
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, leave=True)
            except ImportError:
                pass

    def update(self, what: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(what[-40:], refresh=False)
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
