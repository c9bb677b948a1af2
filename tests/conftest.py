"""Test-wide JAX setup: eight simulated CPU devices for the sharding tests.

Must run before JAX initialises a backend, hence environment variables at import.
"""
import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
