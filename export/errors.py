"""Errors a user can cause at export time: the CLI prints their message and exits 2."""


class ExportError(Exception):
    """A problem with the user's input (paths, model, options), stated in one line."""
