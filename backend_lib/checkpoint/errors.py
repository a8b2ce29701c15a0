class CheckpointError(ValueError):
    """A checkpoint that cannot be served; the message names the file, field or tensor at fault."""
