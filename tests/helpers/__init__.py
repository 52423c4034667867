"""Shared builders of the test suite, one concern per module; test modules import them as
`from helpers.<module> import ...` (pyproject.toml puts tests/ on sys.path). No test module imports another."""
