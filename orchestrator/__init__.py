"""Command line, (later) cluster config, launch and routing."""
