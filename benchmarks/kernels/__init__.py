"""Single kernels and copies: dequantization, fused elementwise ops, attention, experts, KV-cache slots, links."""
