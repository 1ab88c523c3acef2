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


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP (a `kill`, a container stopping, a closed terminal), raised where the process is so that
    cleanup runs as it does for Ctrl-C: without it the process died at once, and an export left its hidden
    half-written bundle behind."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _terminate(signum, frame):
    raise Terminated(signum)


def _catch_termination() -> dict:
    """Turn SIGTERM and SIGHUP into Terminated for the command's run; returns the handlers to put back. A server
    installs its own on start (uvicorn's graceful shutdown), which then take over."""
    import signal

    previous = {}
    for name in ("SIGTERM", "SIGHUP"):
        signum = getattr(signal, name, None)
        if signum is None:
            continue
        try:
            previous[signum] = signal.signal(signum, _terminate)
        except ValueError:  # not the main thread (an embedding application's worker): leave signals alone
            break
    return previous


def exit_status(command: str, run: Callable[[], int]) -> int:
    """Run a command-line entry point: a SpecedgeError becomes one line on stderr and status 2, an interrupt
    status 130 and SIGTERM/SIGHUP 128 + the signal (after the same cleanup), never a traceback; a SpecedgeWarning
    is one line on stderr."""
    import warnings

    def show(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, SpecedgeWarning):
            print(f"specedge {command}: warning: {message}", file=sys.stderr)
        else:
            python_show(message, category, filename, lineno, file, line)

    python_show, warnings.showwarning = warnings.showwarning, show
    handlers = _catch_termination()
    try:
        return run()
    except SpecedgeError as e:
        print(f"specedge {command}: error: {e}", file=sys.stderr)
        return 2
    except Terminated as e:
        print("terminated", file=sys.stderr)
        return 128 + e.signum
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        warnings.showwarning = python_show
        import signal

        for signum, handler in handlers.items():
            if handler is not None:  # None: a handler not set from Python, which cannot be put back
                signal.signal(signum, handler)
