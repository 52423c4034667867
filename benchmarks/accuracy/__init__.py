"""Output quality: extraction accuracy, sample pipelines, semantic operators, 4-bit perplexity."""
