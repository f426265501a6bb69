"""The gateway's exact, continuously updated copy of every replica's cache contents and load.

One background asyncio task talks to Redis (kvroute.protocol is the contract):

- **Heartbeat poll**, every ``poll_interval``: the live replicas and their load. A replica whose
  heartbeat is gone is dropped from the index at once; a new one, or one whose epoch (or model)
  changed, is (re)loaded from its blocks set.
- **Bootstrap of a model** (when first seen, or after a gap): the stream's last entry is read
  *before* the heartbeats and blocks sets of the model's replicas, then the stream is tailed from
  that entry. Each replica updates its set and appends the event in one MULTI/EXEC, so replaying
  events already reflected in a snapshot converges (adds and removes are idempotent).
- **Tail**: one blocking ``XREAD`` over every known model's stream, waking at least every
  ``block_ms`` so the poll keeps its schedule. Events of a replica's current epoch are applied;
  a CLEARED event empties the replica and adopts its new epoch; anything else is ignored (a
  replica the poll has not loaded yet, or an epoch the poll will reconcile).
- **Gap detection**: streams are trimmed (approximate MAXLEN), so a slow mirror can lose entries.
  Redis does not record trimmed ids in ``max-deleted-entry-id`` (only XDEL does), so after every
  read that returns entries the mirror checks, with ``XINFO STREAM``, that the entry it had read
  last is still in the stream; trimming removes oldest entries first, so if it is, nothing after
  it was lost. If not, the model is bootstrapped again. (A false alarm needs a mirror already a
  whole MAXLEN behind, where a fresh bootstrap is the right move anyway.)
- **Outages**: on any Redis error the mirror keeps its last state, reports ``stale`` and retries
  every ``poll_interval``; when Redis answers again it bootstraps everything from scratch, since
  the server may have restarted empty. A changed server ``run_id`` (a restart between two calls)
  forces the same.

Never imports torch or anything from replica/: the gateway must start fast and stay small.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge
from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from gateway.block_index import BlockIndex, PrefixMatch
from kvroute.protocol import DEFAULT_PREFIX, EventKind, Heartbeat, Keys, decode_event, unpack_hashes

log = logging.getLogger("kvroute.gateway.mirror")

_NO_ENTRY = b"0-0"

# A replica's blocks set as ONE string of 8-byte members: redis-py parses a multi-bulk reply in
# pure Python (one object per member, 3.6 s for 1,000,000 blocks), a single bulk string is one
# bytes object handed straight to numpy. Members that are not 8 bytes are left out.
_PACKED_MEMBERS = """#!lua flags=no-writes
local members = redis.call('SMEMBERS', KEYS[1])
local packed = table.concat(members)
if #packed == 8 * #members then
    return packed
end
local valid = {}
for _, member in ipairs(members) do
    if #member == 8 then
        valid[#valid + 1] = member
    end
end
return table.concat(valid)
"""


@dataclass(frozen=True)
class ReplicaInfo:
    """One replica as its last heartbeat described it."""

    replica_id: str
    url: str
    model: str
    fingerprint: str
    block_size: int
    epoch: str
    kv_total_pages: int
    kv_used_pages: int
    running: int
    waiting: int
    waiting_prefill_tokens: int
    ts: float  # unix time of the heartbeat
    # each gateway's share of running, waiting and waiting_prefill_tokens (by gateway id); None
    # from a replica that does not report shares
    gateways: Mapping[str, tuple[int, int, int]] | None = None

    @classmethod
    def from_heartbeat(cls, replica_id: str, heartbeat: Heartbeat) -> ReplicaInfo:
        return cls(replica_id, **{f.name: getattr(heartbeat, f.name) for f in dataclasses.fields(heartbeat)})


@dataclass
class _Stream:
    """Where the mirror stands in one model's event stream."""

    key: str
    last_id: bytes  # the last entry read (or the newest at bootstrap); 0-0 if there was none
    removed_at_bootstrap: int  # entries-added − length when bootstrapped (for last_id == 0-0)


class _Metrics:
    def __init__(self, registry: CollectorRegistry, index: BlockIndex) -> None:
        self.blocks = Gauge(
            "kvroute_index_blocks", "Distinct block hashes in the gateway's index", registry=registry
        )
        self.blocks.set_function(lambda: index.size)
        self.replicas = Gauge(
            "kvroute_index_replicas", "Live replicas in the index", ["model"], registry=registry
        )
        self.events = Counter(
            "kvroute_index_events_applied", "Stream entries applied to the index", registry=registry
        )
        self.hashes = Counter(
            "kvroute_index_hashes_applied",
            "Block hashes carried by the stream entries applied",
            registry=registry,
        )
        self.lag = Gauge(
            "kvroute_index_lag_seconds",
            "Now minus the publish time of the last stream entry applied",
            registry=registry,
        )
        self.bootstraps = Counter(
            "kvroute_index_bootstraps",
            "Bootstraps from Redis: start and resync (all models, after an outage or a Redis "
            "restart), new_model and gap (one model whose stream lost entries before they were read)",
            ["reason"],
            registry=registry,
        )
        self.stale = Gauge(
            "kvroute_index_stale",
            "1 while the mirror cannot reach Redis and serves its last state",
            registry=registry,
        )
        self.stale.set(1)


class IndexMirror:
    """Mirrors the replicas' heartbeats and block sets from Redis into a ``BlockIndex``.

    ``poll_interval``: seconds between heartbeat polls, and between retries while Redis is away.
    ``restart_grace``: seconds the replicas known before Redis restarted empty stay in rotation
    while they register again (each does within a heartbeat of Redis answering); without it the
    gateway would know no replica, and answer 404, in between.
    ``prune_after``: seconds a registered replica may go without a heartbeat before its entries in
    the replicas and drained sets and its blocks set are deleted (it crashed; one that was only cut off from
    Redis registers again with its next heartbeat).
    ``block_ms``: the longest one XREAD blocks. ``read_count``: entries per stream per XREAD.
    ``registry``: where the ``kvroute_index_*`` metrics go (a private one if None).
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
        self.prune_after = prune_after
        self.restart_grace = restart_grace
        self._grace_until = 0.0  # loop time until which replicas missing from Redis are kept
        self.keys = Keys(prefix)
        self.index = BlockIndex()
        self.registry = registry if registry is not None else CollectorRegistry()
        self._metrics = _Metrics(self.registry, self.index)
        self._replicas: dict[str, ReplicaInfo] = {}
        self._listed: dict[str | None, list[ReplicaInfo]] = {}  # replicas(model), until they change
        self.drained: frozenset[str] = frozenset()  # ids drained fleet-wide, as of the last poll
        self._epochs: dict[str, str] = {}  # the epoch the index holds for each replica
        self._streams: dict[str, _Stream] = {}  # model -> position
        self._stream_models: dict[str, str] = {}  # stream key -> model
        self._gap_models: set[str] = set()
        self._bad_heartbeats: set[str] = set()  # replica ids already warned about
        self._silent_since: dict[str, float] = {}  # registered ids without a heartbeat -> first seen
        self._gauged_models: set[str] = set()
        self._run_id: str | None = None
        self._stale = True
        self._outage_reported = False
        self._full_bootstrap = True
        self._next_poll = 0.0
        self._redis: Redis | None = None
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._running = asyncio.Event()
        self._running.set()
        self._parked = asyncio.Event()

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
        """Parks the background task between two steps (tests use it to make a mirror fall
        behind); the index keeps answering from its state."""
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

    def replicas(self, model: str | None = None) -> list[ReplicaInfo]:
        """Live replicas (of ``model``), sorted by id, as of their last heartbeat (a shared list:
        every request asks, and it changes only when a poll or a drop does)."""
        listed = self._listed.get(model)
        if listed is None:
            infos = sorted(self._replicas.values(), key=lambda info: info.replica_id)
            listed = [info for info in infos if model is None or info.model == model]
            self._listed[model] = listed
        return listed

    async def set_drained(self, replica_id: str, drained: bool) -> None:
        """Drains (or puts back) ``replica_id`` for every gateway sharing this Redis; this mirror
        applies it at once, the others at their next poll. Raises ``RedisError``/``OSError``."""
        redis = self._client()
        if drained:
            await redis.sadd(self.keys.drained, replica_id)
            self.drained |= {replica_id}
        else:
            await redis.srem(self.keys.drained, replica_id)
            self.drained -= {replica_id}

    def lookup(self, model: str, hashes: Sequence[int]) -> dict[str, int]:
        """Per live replica of ``model``, its count of leading blocks of ``hashes``."""
        return self.index.lookup(model, hashes)

    def lookup_with_predictions(self, model: str, hashes: Sequence[int]) -> dict[str, PrefixMatch]:
        return self.index.lookup_with_predictions(model, hashes)

    def predict(self, replica_id: str, hashes: Sequence[int], ttl_s: float) -> None:
        """Counts ``hashes`` as held by the replica for ``ttl_s`` unless its events confirm them
        first; ignored for a replica dropped meanwhile."""
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
        redis = self._client()
        full = self._full_bootstrap
        async with redis.pipeline(transaction=False) as pipe:
            pipe.info("server")
            pipe.smembers(self.keys.replicas)
            pipe.smembers(self.keys.drained)
            server, members, drained = await pipe.execute()
        run_id = server["run_id"]
        now = asyncio.get_running_loop().time()
        if self._run_id is not None and run_id != self._run_id:
            log.warning("Redis restarted (run id changed); bootstrapping the index again")
            full = True
            self._grace_until = now + self.restart_grace
        ids = sorted(member.decode() for member in members)
        heartbeats = await self._heartbeats(ids)
        live = {rid: info for rid, info in heartbeats.items() if info is not None}
        await self._prune_silent([rid for rid, info in heartbeats.items() if info is None], now)
        models = {info.model for info in live.values()}
        if full:
            booting = models
        else:
            booting = {model for model in models if model not in self._streams} | (self._gap_models & models)
        # The ordering rule: stream positions first, then heartbeats and sets, then the tail.
        positions = await self._stream_positions(booting)
        reload = [
            rid
            for rid, info in live.items()
            if info.model in booting
            or self._epochs.get(rid) != info.epoch
            or self._replicas[rid].model != info.model
        ]
        snapshots = await self._snapshots(reload)

        in_grace = now < self._grace_until
        for rid in list(self._replicas):
            if rid not in live and in_grace:
                continue  # Redis restarted empty: it registers again within a heartbeat
            if rid not in live or (rid in snapshots and snapshots[rid][0] is None):
                self._drop(rid)
        for model in list(self._streams):
            if model not in models or model in booting:
                del self._stream_models[self._streams.pop(model).key]
        for model in booting:
            stream = positions[model]
            self._streams[model] = stream
            self._stream_models[stream.key] = model
            reason = "gap" if model in self._gap_models else "new_model"
            if not full:
                self._metrics.bootstraps.labels(reason).inc()
        self._gap_models.clear()
        for rid, (info, hashes) in snapshots.items():
            if info is None:
                continue
            self.index.remove_replica(rid)
            self.index.add_replica(rid, info.model)
            self.index.stored(rid, hashes)
            self._epochs[rid] = info.epoch
            self._replicas[rid] = info
        for rid, info in live.items():
            if rid not in snapshots:
                self._replicas[rid] = info  # fresh load figures
        if full:
            self._metrics.bootstraps.labels("start" if self._run_id is None else "resync").inc()
            log.info("index bootstrapped: %d replicas, %d blocks", self.index.num_replicas, self.index.size)
        self.drained = frozenset(member.decode() for member in drained)
        self._listed.clear()
        self._update_replica_gauge()
        self._run_id = run_id
        self._full_bootstrap = False
        self._outage_reported = False
        self._set_stale(False)
        self._next_poll = asyncio.get_running_loop().time() + self.poll_interval

    async def _prune_silent(self, silent: list[str], now: float) -> None:
        """Deletes the registrations of replicas silent for ``prune_after`` seconds, as this mirror
        saw it: a crashed replica leaves its id and blocks set behind, and ids that change (a
        Kubernetes pod's address) would otherwise pile up and be read on every poll."""
        self._silent_since = {rid: self._silent_since.get(rid, now) for rid in silent}
        expired = [rid for rid, since in self._silent_since.items() if now - since >= self.prune_after]
        if not expired:
            return
        async with self._client().pipeline(transaction=False) as pipe:
            pipe.srem(self.keys.replicas, *expired)
            pipe.srem(self.keys.drained, *expired)
            pipe.delete(*(self.keys.blocks(rid) for rid in expired))
            await pipe.execute()
        for rid in expired:
            del self._silent_since[rid]
        log.info("pruned registrations silent for %gs: %s", self.prune_after, ", ".join(expired))

    async def _heartbeats(self, ids: list[str]) -> dict[str, ReplicaInfo | None]:
        async with self._client().pipeline(transaction=False) as pipe:
            for rid in ids:
                pipe.hgetall(self.keys.heartbeat(rid))
            replies = await pipe.execute()
        return {rid: self._parse_heartbeat(rid, fields) for rid, fields in zip(ids, replies, strict=True)}

    def _parse_heartbeat(self, replica_id: str, fields: Mapping[bytes, bytes]) -> ReplicaInfo | None:
        """None for a missing heartbeat (expired or deregistered) or a malformed one (warned once)."""
        if not fields:
            return None
        try:
            info = ReplicaInfo.from_heartbeat(replica_id, Heartbeat.decode(fields))
        except (KeyError, ValueError) as error:
            if replica_id not in self._bad_heartbeats:
                self._bad_heartbeats.add(replica_id)
                log.warning("ignoring replica %s: bad heartbeat (%r)", replica_id, error)
            return None
        self._bad_heartbeats.discard(replica_id)
        return info

    async def _stream_positions(self, models: set[str]) -> dict[str, _Stream]:
        """The newest entry of each model's stream (0-0 if none), with the counters that let the
        tail tell a trim from a quiet stream. XINFO STREAM gives both in one atomic reply."""
        ordered = sorted(models)
        keys = [self.keys.events(model) for model in ordered]
        async with self._client().pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.xinfo_stream(key)
            replies = await pipe.execute(raise_on_error=False)
        positions = {}
        for model, key, info in zip(ordered, keys, replies, strict=True):
            if isinstance(info, Exception):  # no such stream yet
                positions[model] = _Stream(key, _NO_ENTRY, 0)
                continue
            last = info["last-entry"][0] if info["length"] else _NO_ENTRY
            positions[model] = _Stream(key, last, info["entries-added"] - info["length"])
        return positions

    async def _snapshots(self, ids: list[str]) -> dict[str, tuple[ReplicaInfo | None, list[int]]]:
        """Each replica's heartbeat and blocks set, read after the stream positions."""
        async with self._client().pipeline(transaction=False) as pipe:
            for rid in ids:
                pipe.hgetall(self.keys.heartbeat(rid))
                pipe.eval(_PACKED_MEMBERS, 1, self.keys.blocks(rid))  # a few hundred bytes: no EVALSHA
            replies = await pipe.execute()
        return {
            rid: (self._parse_heartbeat(rid, replies[2 * i]), unpack_hashes(replies[2 * i + 1]))
            for i, rid in enumerate(ids)
        }

    def _drop(self, replica_id: str) -> None:
        self.index.remove_replica(replica_id)
        del self._replicas[replica_id]
        self._listed.clear()
        self._epochs.pop(replica_id, None)

    def _update_replica_gauge(self) -> None:
        counts: dict[str, int] = {}
        for info in self._replicas.values():
            counts[info.model] = counts.get(info.model, 0) + 1
        gauge = self._metrics.replicas
        for model in self._gauged_models - counts.keys():
            gauge.remove(model)
        for model, count in counts.items():
            gauge.labels(model).set(count)
        self._gauged_models = set(counts)

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
            if _missed_entries(stream, info):
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
        self._metrics.events.inc(applied)
        self._metrics.hashes.inc(hashes)
        if last_ts is not None:
            self._metrics.lag.set(max(0.0, time.time() - last_ts))

    def _client(self) -> Redis:
        if self._redis is None:
            raise RuntimeError("IndexMirror.start() was not called")
        return self._redis


def _entry_id(raw: bytes) -> tuple[int, int]:
    ms, _, seq = raw.partition(b"-")
    return int(ms), int(seq or 0)


def _missed_entries(stream: _Stream, info: Mapping[str, object] | Exception) -> bool:
    """Whether entries after ``stream.last_id`` were trimmed before this mirror read them.

    If the last entry read is still in the stream, every later one is too (trimming removes the
    oldest first). With no entry read yet, any entry removed since the bootstrap counts.
    """
    if isinstance(info, Exception):
        return True  # the stream vanished between XREAD and XINFO
    if stream.last_id == _NO_ENTRY:
        return info["entries-added"] - info["length"] > stream.removed_at_bootstrap  # type: ignore[operator]
    first = info["first-entry"]
    return first is None or _entry_id(first[0]) > _entry_id(stream.last_id)  # type: ignore[index]
