"""The corpus 3 to 5 of :mod:`loadtests.bench_index` measure: chains of shared prefixes over many
replicas, written straight into Redis as those replicas would have published them."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import redis

from kvroute.protocol import DEFAULT_BLOCK_SIZE, PROTOCOL_VERSION
from loadtests.bench_index.settings import (
    CHAIN_BLOCKS,
    FINGERPRINT,
    FULL_MATCH_REPLICAS,
    KEYS,
    MAX_SHARERS,
    MODEL,
    PARTIAL_MATCH_REPLICAS,
    SADD_MEMBERS,
    random_hashes,
)


@dataclass
class Corpus:
    """``blocks`` distinct hashes cut into chains (one chain = one long shared prefix, such as a
    system prompt plus a document), and per replica which prefix of which chain it holds.

    Every chain has an owner holding all of it (so every block is indexed) and up to
    ``MAX_SHARERS`` replicas holding a random prefix of it. Chain 0 is the measured prompt's:
    ``full_match`` replicas hold all of it, ``partial_match`` ones a prefix shorter than the prompt.
    """

    chains: list[np.ndarray]
    holdings: list[list[tuple[int, int]]]  # per replica: (chain, prefix length)
    full_match: list[int]
    partial_match: list[int]
    prompt_blocks: int

    @property
    def blocks(self) -> int:
        return sum(len(chain) for chain in self.chains)

    @property
    def pairs(self) -> int:
        """(replica, block) pairs: blocks times how many replicas hold each, on average."""
        return sum(length for held in self.holdings for _, length in held)

    def replica_hashes(self, replica: int) -> np.ndarray:
        parts = [self.chains[chain][:length] for chain, length in self.holdings[replica]]
        return np.concatenate(parts) if parts else np.empty(0, dtype="<u8")

    def prompt(self) -> list[int]:
        """Fresh int objects, as a gateway gets from hashing a request's tokens."""
        return self.chains[0][: self.prompt_blocks].tolist()


def build_corpus(rng: np.random.Generator, blocks: int, replicas: int, prompt_blocks: int) -> Corpus:
    num_chains = max(1, min(blocks // CHAIN_BLOCKS, blocks // prompt_blocks))
    chains = np.array_split(random_hashes(rng, blocks), num_chains)  # chain 0 ≥ prompt_blocks long
    holdings: list[list[tuple[int, int]]] = [[] for _ in range(replicas)]
    matched = rng.choice(replicas, FULL_MATCH_REPLICAS + PARTIAL_MATCH_REPLICAS, replace=False).tolist()
    full_match, partial_match = matched[:FULL_MATCH_REPLICAS], matched[FULL_MATCH_REPLICAS:]
    for replica in full_match:
        holdings[replica].append((0, len(chains[0])))
    for replica in partial_match:
        holdings[replica].append((0, int(rng.integers(1, prompt_blocks))))
    owners = rng.permutation(np.arange(num_chains - 1) % replicas)  # every replica owns a share
    for chain, owner in enumerate(owners.tolist(), start=1):
        length = len(chains[chain])
        holdings[owner].append((chain, length))
        num_sharers = int(rng.integers(0, MAX_SHARERS + 1))
        for offset in rng.choice(replicas - 1, num_sharers, replace=False).tolist():
            holdings[(owner + 1 + offset) % replicas].append((chain, int(rng.integers(1, length + 1))))
    return Corpus(chains, holdings, full_match, partial_match, prompt_blocks)


def replica_id(replica: int) -> str:
    return f"bench-replica-{replica:03d}:8000"


def heartbeat(rid: str) -> dict[str, str]:
    """An idle replica's heartbeat, every field of ``HEARTBEAT_FIELDS``; no TTL, the run is short."""
    return {
        "v": str(PROTOCOL_VERSION),
        "url": f"http://{rid}",
        "model": MODEL,
        "fingerprint": FINGERPRINT,
        "block_size": str(DEFAULT_BLOCK_SIZE),
        "epoch": "1",
        "kv_total_pages": "65536",
        "kv_used_pages": "0",
        "running": "0",
        "waiting": "0",
        "waiting_prefill_tokens": "0",
        "ts": repr(time.time()),
    }


def write_corpus(client: redis.Redis, corpus: Corpus) -> None:
    """What the corpus's replicas would have published: heartbeats, registrations, blocks sets."""
    step = 8 * SADD_MEMBERS
    for replica in range(len(corpus.holdings)):
        rid = replica_id(replica)
        packed = corpus.replica_hashes(replica).astype("<u8").tobytes()
        with client.pipeline(transaction=False) as pipe:
            pipe.hset(KEYS.heartbeat(rid), mapping=heartbeat(rid))
            pipe.sadd(KEYS.replicas, rid)
            for start in range(0, len(packed), step):
                chunk = packed[start : start + step]
                pipe.sadd(KEYS.blocks(rid), *(chunk[i : i + 8] for i in range(0, len(chunk), 8)))
            pipe.execute()
