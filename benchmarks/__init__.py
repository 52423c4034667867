"""The benchmark suite: one folder per kind of measurement, `common/` shared by all (docs/benchmarks.md)."""
