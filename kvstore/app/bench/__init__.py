"""Benchmarks behind ``kvstore bench``: each measures a path against a raw reference in the same run."""
