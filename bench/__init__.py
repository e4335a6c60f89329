"""Microbenchmarks of the fused policy loss against the paths people run today.

    pytest bench/ --benchmark-only     # runs the grid, writes bench/results/, the plots and docs/benchmarks.md's tables
    python -m bench.report             # regenerates plots, docs/benchmarks.md's tables and traffic.md from bench/results/*.json

See bench/README.md for what is measured and how.
"""
