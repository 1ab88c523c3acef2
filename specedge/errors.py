"""Errors a user can cause. The CLI prints their one-line message and exits with status 2."""
from __future__ import annotations

import sys
from typing import Callable


class SpecedgeError(Exception):
    """Base of every user-facing error."""


class ExportError(SpecedgeError):
    """Bad export input: paths, unsupported models, options."""


class BundleError(SpecedgeError, ValueError):
    """A bundle that is missing, corrupt, or disagrees with itself."""


class BackendError(SpecedgeError):
    """An inference backend that is not installed or cannot run a graph."""


class PlacementError(BackendError):
    """A valid graph that the chosen backend cannot run as asked (operators its device does not take, or a
    device provider that could not start)."""


class GenerationError(SpecedgeError, ValueError):
    """Bad generation input: prompt too long, bad sampling parameters, unsupported proposer or gamma."""


class ServeError(SpecedgeError):
    """A server that cannot start as asked: an address in use or unknown, a port out of range."""


class SessionError(SpecedgeError, ValueError):
    """A session file that is missing, damaged, or belongs to another bundle."""


class SpecedgeWarning(UserWarning):
    """Something a user should know that does not stop the run; the CLI prints it as one line."""


def exit_status(command: str, run: Callable[[], int]) -> int:
    """Run a command-line entry point: a SpecedgeError becomes one line on stderr and status 2, an interrupt
    status 130, never a traceback; a SpecedgeWarning is one line on stderr."""
    import warnings

    def show(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, SpecedgeWarning):
            print(f"specedge {command}: warning: {message}", file=sys.stderr)
        else:
            python_show(message, category, filename, lineno, file, line)

    python_show, warnings.showwarning = warnings.showwarning, show
    try:
        return run()
    except SpecedgeError as e:
        print(f"specedge {command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        warnings.showwarning = python_show
