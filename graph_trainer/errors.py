class UserError(Exception):
    """A configuration / input problem the user can fix. main() prints the message (no traceback) and exits with code 2."""
