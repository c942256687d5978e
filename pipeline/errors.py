"""One exception type for everything the user can fix: the CLI prints it as one line."""


class UserError(Exception):
    """Bad input or configuration; the message alone (no traceback) tells the user what to fix."""
