"""Random-weight benchmark models (Llama and Mixtral shapes) for machines without downloaded weights."""
