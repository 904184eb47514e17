class UserError(Exception):
    """A configuration / input problem the user can fix: main() prints the message, no traceback, exit 2."""
