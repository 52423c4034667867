"""Where a block's time and device memory go: profiles, memory traces, device timelines."""
