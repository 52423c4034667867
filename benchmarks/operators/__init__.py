"""The product paths (llmops run, Polars, DuckDB, Ray) against the engine alone on the same rows."""
