"""Pure compute: paged attention and KV cache operations (no state, nothing of ours imported)."""
