"""Application: the `specrl train` / `specrl eval` commands, experiment configs, run directories and data."""
