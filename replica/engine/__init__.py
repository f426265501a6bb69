"""The engine loop: requests in, batched steps, outputs out (scheduler, sequences, sampling settings)."""
