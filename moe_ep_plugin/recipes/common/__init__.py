"""Pieces the recipes share: learning-rate schedule, checkpoints, progress lines, token data, YAML sections."""
