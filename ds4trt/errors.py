"""The one error type users see: a single line naming the file, tensor or key and what was expected."""


class Ds4Error(Exception):
    """A user-facing error. str(err) is one line; the CLI prints it and exits non-zero."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))
