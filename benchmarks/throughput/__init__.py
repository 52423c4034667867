"""Throughput of the engine against its peers, with each policy's roofline."""
