"""The one exception family of pagelm.

Every message names the file, the field or offset, and what was expected.
"""


class PagelmError(Exception):
    """Base of every error pagelm raises on purpose."""


class ModelFormatError(PagelmError):
    """A model file is malformed, truncated or hostile."""


class UnsupportedError(PagelmError):
    """A valid file uses something pagelm does not implement."""


class ImageError(PagelmError):
    """An image that cannot be used: unreadable, truncated, empty, too large or too elongated."""
