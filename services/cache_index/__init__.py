"""cache_index: keeps the global prefix index in Redis consistent with the workers' KV events."""
