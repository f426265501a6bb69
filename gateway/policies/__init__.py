"""Routing policies behind one small interface (see :mod:`gateway.policies.base`).

``make_policy(name, **settings)`` builds one by name; :data:`POLICIES` lists them. Pure and
I/O-free, stdlib plus xxhash only: nothing here may import torch or ``replica``.
"""

from __future__ import annotations

from gateway.policies.base import (
    DEFAULT_DECODE_WEIGHT,
    DEFAULT_LAM,
    DEFAULT_MAX_QUEUE,
    Candidate,
    Decision,
    Policy,
    RouteRequest,
    Score,
    candidate_load,
    matched_tokens,
)
from gateway.policies.kv import KVPolicy
from gateway.policies.least_loaded import LeastLoadedPolicy
from gateway.policies.random_choice import RandomPolicy
from gateway.policies.round_robin import RoundRobinPolicy
from gateway.policies.session import SessionPolicy

POLICIES: dict[str, type[Policy]] = {
    cls.name: cls for cls in (KVPolicy, RoundRobinPolicy, LeastLoadedPolicy, RandomPolicy, SessionPolicy)
}
DEFAULT_POLICY = KVPolicy.name


def make_policy(name: str, **settings) -> Policy:
    """The policy called ``name`` with ``settings`` (``lam``, ``decode_weight``, ``max_queue``, ``rng``).

    Raises ``ValueError`` for an unknown name and ``TypeError`` for an unknown setting.
    """
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; choose one of {', '.join(POLICIES)}") from None
    return cls(**settings)


__all__ = [
    "DEFAULT_DECODE_WEIGHT",
    "DEFAULT_LAM",
    "DEFAULT_MAX_QUEUE",
    "DEFAULT_POLICY",
    "POLICIES",
    "Candidate",
    "Decision",
    "KVPolicy",
    "LeastLoadedPolicy",
    "Policy",
    "RandomPolicy",
    "RoundRobinPolicy",
    "RouteRequest",
    "Score",
    "SessionPolicy",
    "candidate_load",
    "make_policy",
    "matched_tokens",
]
