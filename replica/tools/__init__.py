"""Offline tools: the default model's preparation, the memory planner, tiny test models."""
