"""Errors a user can cause. The CLI prints their one-line message and exits with status 2."""


class SpecedgeError(Exception):
    """Base of every user-facing error."""


class ExportError(SpecedgeError):
    """Bad export input: paths, unsupported models, options."""


class BundleError(SpecedgeError, ValueError):
    """A bundle that is missing, corrupt, or disagrees with itself."""


class BackendError(SpecedgeError):
    """An inference backend that is not installed or cannot run a graph."""


class GenerationError(SpecedgeError, ValueError):
    """Bad generation input: prompt too long, bad sampling parameters, unsupported proposer or gamma."""
