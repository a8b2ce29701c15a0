"""The error of a request that cannot be served as asked (a 400 / INVALID_ARG naming the field)."""


class RequestError(ValueError):
    """A request that cannot be served as asked; the message names the offending field."""
