"""The gateway's exact, continuously updated copy of every replica's cache contents and load.

One background asyncio task talks to Redis (kvroute.protocol is the contract):

- **Heartbeat poll**, every ``poll_interval``: the live replicas and their load, and the drain set.
  A replica whose heartbeat is gone is dropped from the index at once; a new one, or one whose
  epoch (or model) changed, is (re)loaded from its blocks set. Each poll ends by handing the live
  replicas and the drain set to ``on_poll`` (the gateway's fleet).
- **Bootstrap of a model** (when first seen, or after a gap): the stream's last entry is read
  *before* the heartbeats and blocks sets of the model's replicas, then the stream is tailed from
  that entry. Each replica updates its set and appends the event in one MULTI/EXEC, so replaying
  events already reflected in a snapshot converges (adds and removes are idempotent).
- **Tail**: one blocking ``XREAD`` over every known model's stream, waking at least every
  ``block_ms`` so the poll keeps its schedule. Events of a replica's current epoch are applied;
  a CLEARED event empties the replica and adopts its new epoch; anything else is ignored (a
  replica the poll has not loaded yet, or an epoch the poll will reconcile). Entries trimmed
  before they were read send their model back to bootstrap (``gateway.index.streams``).
- **Outages**: on any Redis error the mirror keeps its last state, reports ``stale`` and retries
  every ``poll_interval``; when Redis answers again it bootstraps everything from scratch, since
  the server may have restarted empty. A changed server ``run_id`` (a restart between two calls)
  forces the same.

Never imports torch or anything from replica/: the gateway must start fast and stay small.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry
from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from gateway.index.block_index import BlockIndex, PrefixMatch
from gateway.index.drains import SharedDrains
from gateway.index.grace import MissingGrace
from gateway.index.metrics import IndexMetrics
from gateway.index.pruning import SilentPruner
from gateway.index.snapshots import ReplicaHeartbeat, Snapshot, SnapshotReader
from gateway.index.streams import StreamPosition, missed_entries, stream_positions
from kvroute.protocol import DEFAULT_PREFIX, EventKind, Keys, decode_event

log = logging.getLogger("kvroute.gateway.mirror")

PollListener = Callable[[Sequence[ReplicaHeartbeat], frozenset[str]], None]


@dataclass
class _PollReads:
    """What one heartbeat poll read from Redis, before any of it is applied."""

    run_id: str
    full: bool  # every model is bootstrapped
    live: dict[str, ReplicaHeartbeat]
    booting: set[str]  # models whose stream positions were read again
    positions: dict[str, StreamPosition]
    snapshots: dict[str, Snapshot]
    drained: set[bytes]  # the drain set as read (see SharedDrains.members)
    expired: frozenset[str]  # registered, but their heartbeat is gone
    at: float  # loop time of the reads


class IndexMirror:
    """Mirrors the replicas' heartbeats and block sets from Redis into a ``BlockIndex``.

    ``poll_interval``: seconds between heartbeat polls, and between retries while Redis is away.
    ``restart_grace``: seconds the replicas known before Redis restarted empty stay in rotation
    while they register again (each does within a heartbeat of Redis answering); without it the
    gateway would know no replica, and answer 404, in between. The same grace keeps replicas
    whose heartbeats expired while this gateway could not poll, or most of them at once
    (``gateway.index.grace``).
    ``prune_after``: seconds a registered replica may go without a heartbeat before its entries in
    the replicas and drained sets and its blocks set are deleted (``gateway.index.pruning``).
    ``block_ms``: the longest one XREAD blocks. ``read_count``: entries per stream per XREAD.
    ``registry``: where the ``kvroute_index_*`` metrics go (a private one if None).
    ``on_poll``: called after every poll with the live replicas (sorted by id) and the drain set.
    """

    def __init__(
        self,
        redis_url: str,
        *,
        prefix: str = DEFAULT_PREFIX,
        poll_interval: float = 0.5,
        block_ms: int = 200,
        read_count: int = 1000,
        socket_timeout: float = 2.0,
        restart_grace: float = 5.0,
        prune_after: float = 600.0,
        registry: CollectorRegistry | None = None,
        on_poll: PollListener | None = None,
    ) -> None:
        if poll_interval <= 0 or block_ms < 1 or read_count < 1:
            raise ValueError("poll_interval, block_ms and read_count must be positive")
        if block_ms / 1000 >= socket_timeout:
            raise ValueError("socket_timeout must exceed block_ms, or every idle XREAD times out")
        self.redis_url = redis_url
        self.poll_interval = poll_interval
        self.block_ms = block_ms
        self.read_count = read_count
        self.socket_timeout = socket_timeout
        self._grace = MissingGrace(restart_grace, poll_interval)
        self.keys = Keys(prefix)
        self.index = BlockIndex()
        self.registry = registry if registry is not None else CollectorRegistry()
        self._metrics = IndexMetrics(self.registry, self.index)
        self.drains = SharedDrains(self.keys, self._client)
        self._pruner = SilentPruner(self.keys, prune_after)
        self._reader = SnapshotReader(self.keys)
        self._on_poll = on_poll
        self._replicas: dict[str, ReplicaHeartbeat] = {}
        self._epochs: dict[str, str] = {}  # the epoch the index holds for each replica
        self._streams: dict[str, StreamPosition] = {}  # model -> position
        self._stream_models: dict[str, str] = {}  # stream key -> model
        self._gap_models: set[str] = set()
        self._run_id: str | None = None
        self._stale = True
        self._outage_reported = False
        self._full_bootstrap = True
        self._next_poll = 0.0
        self._redis: Redis | None = None
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._running = asyncio.Event()  # cleared by pause()
        self._running.set()
        self._parked = asyncio.Event()  # set once the loop waits in a pause

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Bootstraps once (so the gateway starts warm; a Redis outage only makes it stale) and
        starts the background task."""
        self._redis = Redis.from_url(
            self.redis_url,
            socket_timeout=self.socket_timeout,
            socket_connect_timeout=self.socket_timeout,
            retry=Retry(NoBackoff(), 0),  # the loop retries, and reports stale meanwhile
            protocol=2,  # the reply shapes parsed here (RESP3 nests XREAD replies differently)
        )
        try:
            await self._poll()
        except Exception as error:  # the gateway must start without Redis
            self._failed(error)
        self._task = asyncio.create_task(self._run(), name="kvroute-index-mirror")

    async def stop(self) -> None:
        """Ends the background task and closes the connections.

        The flag backs up the cancel: on Python 3.11, redis-py's ``asyncio.wait_for`` around a
        socket write can swallow a cancellation that lands as the write completes (CPython
        gh-86296), and the loop must end anyway.
        """
        self._closing = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._redis is not None:
            await self._redis.aclose()
            self._redis = None

    async def pause(self) -> None:
        """Parks the background task between two steps (tests and benchmarks use it to make a
        mirror fall behind); the index keeps answering from its state."""
        self._parked.clear()
        self._running.clear()
        if self._task is not None and not self._task.done():
            await self._parked.wait()

    def resume(self) -> None:
        self._running.set()

    # -- queries --------------------------------------------------------------------------------

    @property
    def stale(self) -> bool:
        """True until the first bootstrap, and from a Redis failure until the next bootstrap."""
        return self._stale

    def replicas(self, model: str | None = None) -> list[ReplicaHeartbeat]:
        """Live replicas (of ``model``), sorted by id, as of their last heartbeat."""
        beats = sorted(self._replicas.values(), key=lambda beat: beat.replica_id)
        return [beat for beat in beats if model is None or beat.model == model]

    def lookup(self, model: str, hashes: Sequence[int]) -> dict[str, int]:
        """Per live replica of ``model``, its count of leading blocks of ``hashes``."""
        return self.index.lookup(model, hashes)

    def lookup_with_predictions(self, model: str, hashes: Sequence[int]) -> dict[str, PrefixMatch]:
        return self.index.lookup_with_predictions(model, hashes)

    def holds(self, replica_id: str, block_hash: int) -> bool:
        return self.index.holds(replica_id, block_hash)

    def predict(self, replica_id: str, hashes: Sequence[int], ttl_s: float) -> None:
        """Counts ``hashes`` as held by the replica for ``ttl_s`` unless its events confirm them
        first; ignored for a replica dropped meanwhile (or never indexed: a static one)."""
        if self.index.has_replica(replica_id):
            self.index.predict(replica_id, hashes, ttl_s)

    # -- the loop -------------------------------------------------------------------------------

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._closing:
            if not self._running.is_set():
                self._parked.set()
                await self._running.wait()
            try:
                if self._full_bootstrap or loop.time() >= self._next_poll:
                    await self._poll()
                wait_ms = round((self._next_poll - loop.time()) * 1000)
                await self._tail(max(1, min(self.block_ms, wait_ms)))
            except asyncio.CancelledError:
                raise
            except Exception as error:  # a background task: log, retry, never raise
                self._failed(error)
                await asyncio.sleep(self.poll_interval)

    def _failed(self, error: Exception) -> None:
        if isinstance(error, RedisError | OSError):
            if not self._outage_reported:
                self._outage_reported = True
                log.warning(
                    "Redis unreachable (%s: %s); serving the last index state", type(error).__name__, error
                )
        else:
            log.exception("index mirror step failed; bootstrapping again")
        self._set_stale(True)
        self._full_bootstrap = True

    def _set_stale(self, stale: bool) -> None:
        self._stale = stale
        self._metrics.stale.set(int(stale))

    # -- heartbeat poll and bootstrap -----------------------------------------------------------

    async def _poll(self) -> None:
        """Reconciles replicas with their heartbeats, bootstrapping models that need it.

        All reads come first and the index changes after them with no await in between, so a
        lookup never sees a half-applied state.
        """
        self._apply_poll(await self._read_poll())

    async def _read_poll(self) -> _PollReads:
        redis = self._client()
        full = self._full_bootstrap
        async with redis.pipeline(transaction=False) as pipe:
            pipe.info("server")
            pipe.smembers(self.keys.replicas)
            self.drains.read(pipe)
            server, members, drained_members = await pipe.execute()
        run_id = server["run_id"]
        now = asyncio.get_running_loop().time()
        if self._run_id is not None and run_id != self._run_id:
            log.warning("Redis restarted (run id changed); bootstrapping the index again")
            full = True
            self._grace.restarted(now)
        heartbeats = await self._reader.heartbeats(redis, sorted(member.decode() for member in members))
        live = {rid: beat for rid, beat in heartbeats.items() if beat is not None}
        await self._pruner.prune(redis, [rid for rid, beat in heartbeats.items() if beat is None], now)
        models = {beat.model for beat in live.values()}
        if full:
            booting = models
        else:
            booting = {model for model in models if model not in self._streams} | (self._gap_models & models)
        # The ordering rule: stream positions first, then heartbeats and sets, then the tail.
        positions = await stream_positions(redis, self.keys, booting)
        reload = [
            rid
            for rid, beat in live.items()
            if beat.model in booting
            or self._epochs.get(rid) != beat.epoch
            or self._replicas[rid].model != beat.model
        ]
        snapshots = await self._reader.snapshots(redis, reload)
        expired = frozenset(rid for rid, beat in heartbeats.items() if beat is None)
        return _PollReads(run_id, full, live, booting, positions, snapshots, drained_members, expired, now)

    def _apply_poll(self, poll: _PollReads) -> None:
        self._grace.polled(poll.at, set(poll.expired & self._replicas.keys()), len(self._replicas))
        for rid in list(self._replicas):
            if rid not in poll.live and self._grace.keeps(rid, poll.expired, poll.at):
                continue  # it registers again (or refreshes its heartbeat) within a heartbeat
            if rid not in poll.live or (rid in poll.snapshots and poll.snapshots[rid][0] is None):
                self._drop(rid)
        self._apply_positions(poll)
        for rid, (beat, hashes) in poll.snapshots.items():
            if beat is None:
                continue
            self.index.remove_replica(rid)
            self.index.add_replica(rid, beat.model)
            self.index.stored(rid, hashes)
            self._epochs[rid] = beat.epoch
            self._replicas[rid] = beat
        for rid, beat in poll.live.items():
            if rid not in poll.snapshots:
                self._replicas[rid] = beat  # fresh load figures
        if poll.full:
            self._metrics.bootstraps.labels("start" if self._run_id is None else "resync").inc()
            log.info("index bootstrapped: %d replicas, %d blocks", self.index.num_replicas, self.index.size)
        self._metrics.count_replicas(beat.model for beat in self._replicas.values())
        if self._on_poll is not None:
            self._on_poll(self.replicas(), self.drains.members(poll.drained))
        self._run_id = poll.run_id
        self._full_bootstrap = False
        self._outage_reported = False
        self._set_stale(False)
        self._next_poll = asyncio.get_running_loop().time() + self.poll_interval

    def _apply_positions(self, poll: _PollReads) -> None:
        """Forgets the streams of models no replica serves now, and adopts the booting ones'."""
        models = {beat.model for beat in poll.live.values()}
        for model in list(self._streams):
            if model not in models or model in poll.booting:
                del self._stream_models[self._streams.pop(model).key]
        for model in poll.booting:
            stream = poll.positions[model]
            self._streams[model] = stream
            self._stream_models[stream.key] = model
            reason = "gap" if model in self._gap_models else "new_model"
            if not poll.full:
                self._metrics.bootstraps.labels(reason).inc()
        self._gap_models.clear()

    def _drop(self, replica_id: str) -> None:
        self.index.remove_replica(replica_id)
        del self._replicas[replica_id]
        self._epochs.pop(replica_id, None)

    # -- tail -----------------------------------------------------------------------------------

    async def _tail(self, block_ms: int) -> None:
        """One blocking XREAD over every model's stream; applies what it returns, unless entries
        before it were trimmed unread, in which case that model is bootstrapped again."""
        if not self._streams:
            await asyncio.sleep(block_ms / 1000)
            return
        redis = self._client()
        reply = await redis.xread(
            {stream.key: stream.last_id for stream in self._streams.values()},
            count=self.read_count,
            block=block_ms,
        )
        if not reply:
            return
        async with redis.pipeline(transaction=False) as pipe:
            for key, _ in reply:
                pipe.xinfo_stream(key)
            infos = await pipe.execute(raise_on_error=False)
        for (key, entries), info in zip(reply, infos, strict=True):
            model = self._stream_models[key.decode()]
            stream = self._streams[model]
            if missed_entries(stream, info):
                log.warning(
                    "stream %s was trimmed past this mirror; bootstrapping %s again", stream.key, model
                )
                self._gap_models.add(model)
                self._next_poll = 0.0
                continue
            self._apply(model, entries)
            stream.last_id = entries[-1][0]

    def _apply(self, model: str, entries: list[tuple[bytes, dict[bytes, bytes]]]) -> None:
        last_ts = None
        applied = hashes = 0
        for entry_id, fields in entries:
            try:
                event = decode_event(fields)
            except (KeyError, ValueError) as error:
                log.warning("skipping malformed stream entry %s: %r", entry_id, error)
                continue
            last_ts = event.ts
            rid = event.replica_id
            epoch = self._epochs.get(rid)
            if epoch is None or self._replicas[rid].model != model:
                continue  # not loaded yet: the next poll reads its set
            if event.kind is EventKind.CLEARED:
                self.index.clear(rid)
                self._epochs[rid] = event.epoch
            elif event.epoch != epoch:
                continue  # an older epoch, or a newer one the poll will reload
            elif event.kind is EventKind.STORED:
                self.index.stored(rid, event.hashes)
            else:
                self.index.removed(rid, event.hashes)
            applied += 1
            hashes += len(event.hashes)
        self._metrics.applied(applied, hashes, last_ts)

    def _client(self) -> Redis:
        if self._redis is None:
            raise RuntimeError("IndexMirror.start() was not called")
        return self._redis
