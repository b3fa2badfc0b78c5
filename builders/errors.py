class BuildError(RuntimeError):
    """A checkpoint that cannot be built: missing, corrupt, unsupported, or not shardable as asked."""
