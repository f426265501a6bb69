"""A SIMULATED backend: the real scheduler and cache, a calibrated cost model instead of the forward pass."""
