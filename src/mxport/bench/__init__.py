"""Benchmarks behind ``mxport bench``: each module exposes ``run(quick: bool) -> list[dict]`` rows."""
