"""The paged KV pool, the radix-tree prefix cache over it, and the events it emits for Redis."""
