"""Does the cost model rank and predict policies as they run: validation, trials, prediction errors."""
