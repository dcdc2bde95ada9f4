"""Accounting: the engine's own token counts of each answer, read off the stream, and the per-key
usage book."""
