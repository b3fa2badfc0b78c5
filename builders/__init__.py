"""Checkpoint import and engine builds: ``build_engine`` turns a checkpoint into an engine directory."""

from builders.build import BuildError, BuildOptions, build_engine

__all__ = ["BuildError", "BuildOptions", "build_engine"]
