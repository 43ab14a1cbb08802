"""One exception type for errors a user can fix: the CLI prints its message on one line."""


class SpecserveError(Exception):
    """Bad input or environment (unknown model, corrupt file, prompt too long, ...)."""
