"""Implementation of tools/fork. Each module holds one step of the patch-series workflow."""
