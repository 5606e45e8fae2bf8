"""Checkpoints: the store (atomic commits, local or remote), the background committer, and finding and reading one to resume."""
