"""Data preparation and loading: download, extract, clean, binarize, batch.

Atomic outputs and hashing live in nmt.fileio (shared with checkpoints and translation).
"""
