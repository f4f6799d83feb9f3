"""The connector's scheduler half: mints prefill hand-offs, picks the hand-off each decode
request pulls, and tells the workers what to do at each step (``KvxferConnectorMetadata``).

Prefill: a request with ``do_remote_decode`` gets its hand-off (``remote_request_id`` and a
random lease token) minted when the step that computes its prompt's last token is
scheduled; the workers arm the lease right after that step's forward, so the hand-off is
live before its params leave the engine, with no later step needed (the offline ``LLM``
API takes none). ``request_finished`` returns those params; a minted lease whose request
does not hand it off (aborted, preempted) is retracted. Without a bound KV-cache manager
(or when the finished blocks differ from the minted ones) the lease is minted in
``request_finished`` and armed at the next step, and a decode side that is quicker waits
for the arm (bounded, ``kvxfer_arm_wait``)."""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional

from ..params import handoff_entries
from .common import (
    CHILD_ID,
    FORGET_AFTER,
    NULL_BLOCK_ID,
    Settings,
    all_ids,
    group_blocks,
    int_or_none,
    local_blocks,
    logger,
    nested,
    num_prompt_tokens,
    status_name,
    strip_null_prefix,
)
from .metadata import KvxferConnectorMetadata, KvxferHandshakeMetadata

# Finished normally (a hand-off); aborted, errored or ignored requests hand off nothing.
_SENDING_STATES = ("FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED", "FINISHED_REPETITION")


@dataclass
class _SharedHandoff:
    """A parent's one prompt hand-off, shared by every child of the parent that finishes
    with it (the first child to finish holds the lease with its blocks)."""

    holder: str
    params: dict[str, Any]
    at: float
    # The parent's n when the prefill request states it (kvxfer_n), and the children counted.
    n: Optional[int] = None
    children: int = 1


@dataclass
class _Source:
    """The local request whose pull reads a shared hand-off, and the step its pull was sent."""

    rid: str
    request: Any
    step: int


@dataclass
class _Minted:
    """A lease minted at a request's last-token step, until ``request_finished``."""

    params: dict[str, Any]
    request: Any
    at: float


def _clip_to_prompt(blocks: Any, prompt_tokens: int, block_size: int) -> Any:
    """The head of ``blocks`` (flat or per group) that holds ``prompt_tokens`` tokens."""
    per = -(-prompt_tokens // block_size)
    return [list(g)[:per] for g in blocks] if nested(blocks) else list(blocks)[:per]


def _nulls_window_before_request_finished() -> bool:
    """Whether this vLLM's scheduler frees a finished request's out-of-window blocks
    (``remove_skipped_blocks``) just before it calls ``request_finished`` (0.32 and 0.33 do):
    only then is the lease minted at the prompt's last step predicted to match."""
    try:
        import inspect

        from vllm.v1.core.sched.scheduler import Scheduler

        return "remove_skipped_blocks" in inspect.getsource(Scheduler._connector_finished)
    except Exception:  # noqa: BLE001 - another vLLM (or none): no prediction, re-mint as before
        return False


def _multi(params: Any) -> bool:
    """Whether ``params`` hold the hand-offs of several children (a parent's fan-out):
    only then does a request id's ``{i}_`` prefix name a child index."""
    if isinstance(params, list):
        return sum(1 for p in params if isinstance(p, dict)) > 1
    if isinstance(params, dict):
        return params.get("kvxfer_children") is not None
    return False


class KvxferScheduler:
    """Scheduler-side state and hooks (one per vLLM scheduler process)."""

    def __init__(self, settings: Settings, counters: dict[str, int]) -> None:
        self.s = settings
        self.counters = counters
        self._kv_cache_manager: Any = None
        # Whether vLLM nulls out-of-window blocks just before request_finished (checked when
        # the manager is bound).
        self._window_nulled_at_finish = False
        self._step = 0
        # Prefill requests that hand off (do_remote_decode), until their lease is minted.
        self._producing: dict[str, Any] = {}
        # Prefill: request id -> the params minted for it (armed after its last-token step).
        self._minted: dict[str, _Minted] = {}
        # How many times a request's lease was minted (re-mints get a fresh lease id).
        self._mints: dict[str, int] = {}
        self._to_arm: dict[str, dict[str, Any]] = {}
        self._to_retract: list[dict[str, Any]] = []
        # parent -> (first minted at, {child index: params}, children finished) for
        # kvxfer_children.
        self._siblings: OrderedDict[str, tuple[float, dict[int, dict[str, Any]], set[int]]] = OrderedDict()
        # (parent, prompt identity) -> the parent's shared prompt hand-off: children of one
        # parallel-sampling parent compute the same prompt KV, so one lease serves them all.
        self._shared: OrderedDict[tuple[Any, ...], _SharedHandoff] = OrderedDict()
        # Prefill ranks' agents as their workers reported them (handshake metadata).
        self._ranks: dict[int, KvxferHandshakeMetadata] = {}
        # Decode.
        self._to_recv: dict[str, tuple[dict[str, Any], Any]] = {}
        # Decode requests whose pull was handed to the workers and has not reported yet,
        # with their hand-off: heartbeated like queued ones until the report (a worker step
        # can start late, and the lease must not run out before the pull reads it).
        self._recv_inflight: dict[str, dict[str, Any]] = {}
        self._handled: set[str] = set()
        self._to_cancel: list[str] = []
        self._to_release: list[dict[str, Any]] = []
        self._queued: dict[str, dict[str, Any]] = {}
        self._selected: dict[str, Optional[dict[str, Any]]] = {}
        # remote_request_id -> the local requests that pull it: one, or several children of
        # one decode request naming a shared prompt hand-off (``kvxfer_shared``).
        self._claimed: dict[str, set[str]] = {}
        # Shared hand-offs whose pull was handed to the workers (a later sibling must not
        # release what another child pulls), until no local request claims them.
        self._shared_pulling: set[str] = set()
        # Shared hand-off -> the local request whose pull reads it (the workers' primary);
        # those whose primary is gone (finished, aborted or preempted after its pull was
        # sent): a sibling allocated later has nothing to copy.
        self._shared_source: dict[str, _Source] = {}
        # Shared hand-off -> (local requests naming it that were allocated, or finished
        # unallocated; how many of them needed nothing from it; since when): it is given back
        # only once all kvxfer_n of them have settled without a read — a child whose prompt
        # is all in the local prefix cache must not end it for a sibling allocated after it.
        self._shared_settled: OrderedDict[str, tuple[int, int, float]] = OrderedDict()
        self._shared_lost: set[str] = set()
        # Shared hand-offs this scheduler read or gave back, once no local request claims
        # them (-> since when): a sibling arriving after that computes its prompt instead
        # of reading an ended lease.
        self._shared_ended: OrderedDict[str, float] = OrderedDict()
        self._last_heartbeat = 0.0

    # ------------------------------------------------------------------ vLLM hooks

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        self._kv_cache_manager = kv_cache_manager
        self._window_nulled_at_finish = _nulls_window_before_request_finished()

    def on_new_request(self, request: Any) -> None:
        """Starts heartbeating the lease of a decode request waiting in the queue; notes a
        prefill request that will hand off."""
        params = self._decode_params(request)
        rid = request.request_id
        if params is not None and rid not in self._handled:
            self._queued[rid] = params
        elif params is None and self.s.is_producer:
            own = self._prefill_params(rid, getattr(request, "kv_transfer_params", None), quiet=True)
            if own is not None and own.get("do_remote_decode"):
                self._producing[rid] = request

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        params = self._decode_params(request)
        if params is None or request.request_id in self._handled:
            return 0, False
        if params.get("kvxfer_shared") and self._nothing_to_copy(str(params.get("remote_request_id")), request.request_id):
            return 0, False
        self._queued.setdefault(request.request_id, params)
        count = num_prompt_tokens(request) - num_computed_tokens
        if count > 0:
            return count, True
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        rid = request.request_id
        params = self._decode_params(request)
        if params is None or rid in self._handled:
            return
        self._handled.add(rid)
        self._queued.pop(rid, None)
        remote = str(params.get("remote_request_id"))
        local = local_blocks(blocks, self.s.num_groups) if num_external_tokens > 0 else None
        if params.get("kvxfer_shared"):
            # Nothing to read when vLLM loads nothing or no block is left to fill (the
            # prompt is in the local prefix cache, up to a sub-block tail vLLM keeps).
            others = bool(self._claimed.get(remote, set()) - {rid})
            self._settle_shared(remote, params, hit=local is None or not all_ids(local), others=others)
        if local is not None:
            self._to_recv[rid] = (params, local)
            self._recv_inflight[rid] = params
            if params.get("kvxfer_shared") and all_ids(local):
                self._shared_source.setdefault(remote, _Source(rid, request, self._step))
        elif not params.get("kvxfer_shared") and not (self._claimed.get(remote, set()) - {rid}):
            # Everything is in the local prefix cache: nothing to pull, release the lease.
            self._to_release.append(params)

    def _reads_nothing_now(self, remote: str) -> bool:
        """A local request settled as reading shared hand-off ``remote`` will not read it
        after all: true while siblings are still to settle (the last one gives it back if
        none reads it), false once all have (the caller may give it back now)."""
        entry = self._shared_settled.get(remote)
        if entry is None:
            return False
        count, hits, since = entry
        self._shared_settled[remote] = (count, hits + 1, since)
        return True

    def _settle_shared(self, remote: str, params: dict[str, Any], hit: bool, others: bool) -> None:
        """One more local request naming shared hand-off ``remote`` was allocated (or
        finished before it was); ``hit``: it reads nothing from it; ``others``: other local
        requests claim it now. Once the parent's ``kvxfer_n`` requests have all settled and
        none reads it, it is given back. Without a known n (params of a router that sent no
        kvxfer_n, as Dynamo's) it is given back when no other local request claims it."""
        n = int_or_none(params.get("kvxfer_n")) or 1
        count, hits, _ = self._shared_settled.pop(remote, (0, 0, 0.0))
        count, hits = count + 1, hits + int(hit)
        now = time.monotonic()
        if count < n:
            self._shared_settled[remote] = (count, hits, now)
            while self._shared_settled:
                # Siblings that never come (a decode request with a smaller n): forgotten;
                # the lease ends by expiry.
                oldest, (_, _, since) = next(iter(self._shared_settled.items()))
                if now - since < FORGET_AFTER:
                    break
                del self._shared_settled[oldest]
            return
        if hits == count and remote not in self._shared_pulling and (n > 1 or not others):
            self._to_release.append(self._own(params))
            self._shared_end(remote)

    def build_connector_meta(self, scheduler_output: Any) -> KvxferConnectorMetadata:
        self._step += 1
        for rid in getattr(scheduler_output, "preempted_req_ids", None) or ():
            self._retract(rid, "preempted")
            self._source_gone(rid)
        self._mint_scheduled(scheduler_output)
        meta = KvxferConnectorMetadata(self._step)
        meta.to_arm, self._to_arm = self._to_arm, {}
        meta.to_retract, self._to_retract = self._to_retract, []
        meta.to_recv, self._to_recv = self._to_recv, {}
        for params, _ in meta.to_recv.values():
            if params.get("kvxfer_shared"):
                self._shared_pulling.add(str(params.get("remote_request_id")))  # read from now on
        meta.to_cancel, self._to_cancel = self._to_cancel, []
        meta.to_release, self._to_release = self._to_release, []
        if self.s.is_consumer:
            meta.gone = [
                *(getattr(scheduler_output, "preempted_req_ids", None) or ()),
                *(getattr(scheduler_output, "finished_req_ids", None) or ()),
            ]
        now = time.monotonic()
        waiting = [p for rid, p in self._recv_inflight.items() if rid not in meta.to_recv]
        # Children naming one shared hand-off heartbeat it once.
        beats = list({str(p.get("remote_request_id")): p for p in [*self._queued.values(), *waiting]}.values())
        if beats and now - self._last_heartbeat >= self._heartbeat_interval(beats):
            self._last_heartbeat = now
            meta.heartbeats = beats
        return meta

    def _heartbeat_interval(self, leases: list[dict[str, Any]]) -> float:
        """The configured interval, or a sixth of the shortest time-to-live the leases state
        (``kvxfer_lease_ttl_ms``, the prefill instance's ``kvxfer_lease_ttl``) if shorter: a
        prefill instance configured with a shorter TTL than this one must not see its leases
        expire while their requests wait here."""
        interval = self.s.heartbeat_interval
        for params in leases:
            ttl_ms = int_or_none(params.get("kvxfer_lease_ttl_ms"))
            if ttl_ms is not None and ttl_ms > 0:
                interval = min(interval, ttl_ms / 6000)
        return interval

    def update_connector_output(self, connector_output: Any) -> None:
        for rid in getattr(connector_output, "finished_recving", None) or ():
            self._recv_inflight.pop(rid, None)

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, Optional[dict[str, Any]]]:
        rid = request.request_id
        self._queued.pop(rid, None)
        self._producing.pop(rid, None)
        decode = self._decode_params(request)
        self._selected.pop(rid, None)
        if getattr(request, "abort_immediately", False) and self.s.is_consumer:
            self._release_refused(rid, getattr(request, "kv_transfer_params", None), decode)
        if decode is not None:
            return self._decode_finished(rid, decode)
        try:
            return self._prefill_finished(request, block_ids)
        finally:
            self._mints.pop(rid, None)

    def _prefill_finished(self, request: Any, block_ids: Any) -> tuple[bool, Optional[dict[str, Any]]]:
        rid = request.request_id
        record = self._minted.pop(rid, None)
        minted = record.params if record is not None else None
        params = self._prefill_params(rid, getattr(request, "kv_transfer_params", None))
        if params is None or not (self.s.is_producer and params.get("do_remote_decode")):
            self._drop(rid, minted, finished=True)
            return False, None
        if status_name(request) not in _SENDING_STATES:
            self._drop(rid, minted, finished=True)  # aborted: its blocks are freed now
            return False, None
        try:
            blocks = self._prompt_part(rid, group_blocks(block_ids, self.s.num_groups), num_prompt_tokens(request))
        except (TypeError, ValueError) as e:
            self.counters["bad_params"] += 1
            logger.error("kvxfer: cannot lease the blocks of %s (%s); freed now, the decode side computes", rid, e)
            self._drop(rid, minted, finished=True)
            return False, None
        blocks, skipped = strip_null_prefix(blocks)
        if not all_ids(blocks):
            self._drop(rid, minted, finished=True)
            return False, None
        key = self._share_key(rid, request) if self.s.share_prompt else None
        shared = self._shared.get(key) if key is not None else None
        if shared is not None and time.monotonic() - shared.at > self.s.lease_ttl / 2:
            # Nothing heartbeats the shared lease before a decode pulls it: a sibling
            # finishing this late holds a fresh one (as a holder's own re-mint does).
            shared = None
        if shared is not None:
            shared.children += 1
            if shared.n is not None and shared.children >= shared.n:
                self._shared.pop(key, None)  # every child counted
            # A sibling already holds the parent's prompt hand-off: this child's blocks hold
            # the same prompt KV, so they are freed now (its own lease, if armed, is
            # retracted: counted released) and its params name the shared lease.
            self._drop(rid, minted, finished=True)
            self.counters["shared_children"] += 1
            logger.debug("kvxfer: %s shares the hand-off of %s; its blocks are freed now", rid, shared.holder)
            return False, dict(shared.params)
        if minted is not None and (
            minted["remote_block_ids"] != blocks or (minted.get("kvxfer_skipped_blocks") or 0) != (skipped or 0)
        ):
            # The blocks changed since the last-token step (e.g. a sliding window dropped
            # some): the armed lease would hold the wrong ones; lease the final ones.
            self._drop(rid, minted)
            minted = None
        elif record is not None and time.monotonic() - record.at > self.s.lease_ttl / 2:
            # A prefill that kept generating long after its prompt: nothing heartbeats the
            # lease until a decode side pulls, so hand off a fresh one, not one about to end.
            self._drop(rid, minted)
            minted = None
        if minted is None:
            logger.debug("kvxfer: %s minted at request_finished (armed at the next step)", rid)
            minted = self._mint(rid, params, blocks, skipped)
        if key is not None:
            return True, self._hold_shared(key, rid, minted)
        return True, self._with_siblings(rid, minted)

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        """Learns every prefill rank's agent address and incarnation from its worker."""
        for rank, meta in (metadata or {}).items():
            if isinstance(meta, KvxferHandshakeMetadata):
                self._ranks[int(rank)] = meta

    # ------------------------------------------------------------------ prefill

    def _mint_scheduled(self, scheduler_output: Any) -> None:
        """Mints the hand-off of every producing request whose prompt's last token this
        step computes (armed by the workers after the step's forward)."""
        if not self._producing or self._kv_cache_manager is None:
            return
        scheduled = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
        for rid, count in scheduled.items():
            request = self._producing.get(rid)
            if request is None:
                continue
            done = int(getattr(request, "num_computed_tokens", 0) or 0)
            prompt = num_prompt_tokens(request)
            if done + int(count) < prompt:
                continue  # a chunk of the prompt; the last one mints
            del self._producing[rid]
            params = self._prefill_params(rid, getattr(request, "kv_transfer_params", None))
            if params is None:
                continue
            try:
                blocks = self._prompt_blocks(rid, prompt)
            except (AttributeError, KeyError, TypeError, ValueError) as e:
                # Minted at request_finished instead (armed one step later).
                logger.debug("kvxfer: the blocks of %s are not known at its last step (%s)", rid, e)
                continue
            blocks, skipped = strip_null_prefix(self._out_of_window_nulled(blocks, prompt))
            if all_ids(blocks):
                logger.debug("kvxfer: %s minted at its last-token step (blocks %s)", rid, blocks)
                self._minted[rid] = _Minted(self._mint(rid, params, blocks, skipped), request, time.monotonic())

    def _out_of_window_nulled(self, blocks: Any, prompt_tokens: int) -> Any:
        """``blocks`` with the head blocks vLLM will null when the request finishes (a sliding
        window's blocks wholly before the window of the prompt's next token) already null,
        as vLLM's own manager counts them: the lease minted now is then the one
        ``request_finished`` hands off, not re-minted there and armed only at the engine's
        next step (which an in-process offline ``LLM`` never takes once its requests are
        done). Only managers with vLLM's head-prefix ``remove_skipped_blocks`` are predicted;
        a wrong prediction is caught at ``request_finished`` (the blocks differ: re-mint)."""
        if not self._window_nulled_at_finish:
            return blocks
        managers = getattr(getattr(self._kv_cache_manager, "coordinator", None), "single_type_managers", None)
        try:
            managers = list(managers or ())
        except TypeError:
            return blocks
        groups = blocks if nested(blocks) else [blocks]
        if len(managers) != len(groups):
            return blocks
        out = []
        for manager, ids in zip(managers, groups):
            ids = list(ids)
            try:
                base = type(manager).remove_skipped_blocks.__qualname__.startswith("SingleTypeKVCacheManager.")
                skip = int(manager.get_num_skipped_tokens(prompt_tokens)) // int(manager.block_size) if base else 0
            except (AttributeError, TypeError, ValueError, ZeroDivisionError):
                skip = 0
            skip = max(0, min(skip, len(ids)))
            out.append([NULL_BLOCK_ID] * skip + ids[skip:])
        return out if nested(blocks) else out[0]

    def _prompt_blocks(self, rid: str, prompt_tokens: int) -> Any:
        """The blocks that hold the prompt's KV (per group for several groups)."""
        manager = self._kv_cache_manager
        if hasattr(manager, "get_block_ids_for_computed_tokens"):
            ids = manager.get_block_ids_for_computed_tokens(rid, prompt_tokens)
        else:
            if not self.s.block_size:
                raise ValueError("the block size is unknown")
            ids = _clip_to_prompt(list(manager.get_block_ids(rid)), prompt_tokens, self.s.block_size)
        return group_blocks(list(ids), self.s.num_groups)

    def _prompt_part(self, rid: str, blocks: Any, prompt_tokens: int) -> Any:
        """The part of a finished request's blocks (flat or per group) that holds its
        prompt: what the decode side pulls. A request that generated more than one token
        computed the KV of its outputs too, in blocks past the prompt's; leasing those
        would hand off more blocks than the decode allocates for the prompt, and its pull
        aligns the lease's tail with its blocks."""
        try:
            return self._prompt_blocks(rid, prompt_tokens)
        except (AttributeError, KeyError, TypeError, ValueError):
            pass  # no KV-cache manager bound (or it no longer knows the request)
        if not self.s.block_size:
            return blocks
        return _clip_to_prompt(blocks, prompt_tokens, self.s.block_size)

    def _drop(self, rid: str, minted: Optional[dict[str, Any]], finished: bool = False) -> None:
        """Retracts ``minted`` (if any) for request ``rid``: the workers cancel the lease
        and forget the request's lease state; siblings no longer list it. ``finished``:
        the child ends without a hand-off (it counts as done for the parent's bookkeeping)."""
        if minted is not None:
            self._to_retract.append((rid, minted))
        n = int_or_none((minted or {}).get("kvxfer_n")) or 1
        if n <= 1:
            return
        parent, index, _ = self._child_of(rid, minted or {})
        entry = self._siblings.get(parent)
        if entry is None:
            return
        _, siblings, done = entry
        if siblings.get(index) is minted:
            del siblings[index]
        if finished:
            done.add(index)
            if len(done) >= n:
                del self._siblings[parent]

    def _retract(self, rid: str, why: str) -> None:
        record = self._minted.pop(rid, None)
        if record is None:
            return
        logger.info("kvxfer: the lease minted for %s is retracted (%s)", rid, why)
        self._drop(rid, record.params)
        self._producing[rid] = record.request  # minted again at its next last-token step

    def _prefill_params(self, rid: str, params: Any, quiet: bool = False) -> Optional[dict[str, Any]]:
        """A prefill request's own ``kv_transfer_params`` dict (vLLM's per-child list form:
        the child's entry), or None; malformed params are logged and counted, never raised."""
        if params is None:
            return None
        if isinstance(params, list):
            if not any(isinstance(p, dict) and p.get("do_remote_decode") for p in params):
                return None  # a decode request's params (or nothing for kvxfer)
            m = CHILD_ID.match(rid)
            index = int(m.group(1)) if m and len(params) > 1 else 0
            params = params[index] if index < len(params) else None
        if not isinstance(params, dict):
            if not quiet:
                self.counters["bad_params"] += 1
                kind = type(params).__name__
                logger.error("kvxfer: the kv_transfer_params of %s are not a dict (%s); nothing leased", rid, kind)
            return None
        return params

    @staticmethod
    def _child_of(rid: str, params: dict[str, Any]) -> tuple[str, int, int]:
        """(parent, child index, n) of a prefill request."""
        n = int_or_none(params.get("kvxfer_n"))
        if n is not None and n > 1:
            m = CHILD_ID.match(rid)
            if m and int(m.group(1)) < n:
                return m.group(2), int(m.group(1)), n
            logger.warning("kvxfer: request %s has kvxfer_n=%s but is not named like a child; leased alone", rid, n)
        return rid, 0, 1

    def _port_of(self, rank: int) -> int:
        known = self._ranks.get(rank)
        return known.port if known is not None else self.s.port_of(rank)

    def _mint(self, rid: str, params: dict[str, Any], blocks: Any, skipped: Any = 0) -> dict[str, Any]:
        """A child's hand-off (a fresh lease id and token), queued for the workers to arm.
        ``skipped``: the null-block entries dropped from the head of each block list."""
        parent, index, n = self._child_of(rid, params)
        decode_tp = int_or_none(params.get("kvxfer_decode_tp_size")) or self.s.decode_tp_size
        tp = self.s.tp_size
        # As kvxfer_core::expected_consumers: a wider decode engine reads every prefill
        # rank's lease from decode_tp / prefill_tp ranks; otherwise one rank per lease.
        consumers = decode_tp // tp if decode_tp > tp and decode_tp % tp == 0 else 1
        mints = self._mints.get(rid, 0)
        self._mints[rid] = mints + 1
        # A re-minted lease (the request was preempted, or its blocks changed) gets an id of
        # its own — the retracted one's stays ended — as the child of a parent named apart
        # ("P~1"): a prefill agent arms only a lease whose id is its parent's child id.
        lease_parent = parent if mints == 0 else f"{parent}~{mints}"
        lease_id = rid if mints == 0 else (lease_parent if n == 1 else f"{index}_{lease_parent}")
        out: dict[str, Any] = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": blocks,
            "remote_engine_id": self.s.engine_id,
            "remote_request_id": lease_id,
            "remote_host": self.s.host,
            "remote_port": self._port_of(0),
            "tp_size": tp,
            "kvxfer_lease_token": secrets.token_hex(16),
            "kvxfer_parent_request_id": lease_parent,
            "kvxfer_child_index": index,
            "kvxfer_n": n,
            "kvxfer_expected_consumers": consumers,
            "kvxfer_lease_ttl_ms": int(self.s.lease_ttl * 1000),
        }
        if self.s.block_size:
            out["kvxfer_block_size"] = self.s.block_size
        if any(skipped if isinstance(skipped, list) else [skipped]):
            out["kvxfer_skipped_blocks"] = skipped
        rank0 = self._ranks.get(0)
        if rank0 is not None:
            out["remote_host"] = rank0.host
            out["kvxfer_incarnation"] = rank0.incarnation
            if getattr(rank0, "layout", ""):
                out["kvxfer_kv_layout"] = rank0.layout
        if tp > 1:
            out["kvxfer_rank_ports"] = [self._port_of(r) for r in range(tp)]
            if all(r in self._ranks for r in range(tp)):
                out["kvxfer_rank_hosts"] = [self._ranks[r].host for r in range(tp)]
                out["kvxfer_rank_incarnations"] = [self._ranks[r].incarnation for r in range(tp)]
        self._to_arm[rid] = out
        if n > 1:
            now = time.monotonic()
            while self._siblings:
                oldest, (since, _, _) = next(iter(self._siblings.items()))
                if now - since < FORGET_AFTER:
                    break
                del self._siblings[oldest]
            _, siblings, _ = self._siblings.setdefault(parent, (now, {}, set()))
            siblings[index] = out
        return out

    def _with_siblings(self, rid: str, own: dict[str, Any]) -> dict[str, Any]:
        """The params finished child ``rid`` returns: its own hand-off plus every sibling's
        minted so far (``kvxfer_children``), so the params vLLM's output path keeps (one
        child's) carry them all."""
        result = dict(own)
        n = int(own.get("kvxfer_n") or 1)
        if n <= 1:
            return result
        parent = self._child_of(rid, own)[0]  # vLLM's parent (a re-minted lease names its own)
        entry = self._siblings.get(parent)
        if entry is None:
            return result
        _, siblings, finished = entry
        result["kvxfer_children"] = [dict(siblings[i]) for i in sorted(siblings)]
        finished.add(int(own["kvxfer_child_index"]))
        if len(finished) >= n:
            del self._siblings[parent]
        return result

    @staticmethod
    def _share_key(rid: str, request: Any) -> Optional[tuple[Any, ...]]:
        """What makes two finished prefill requests' prompt KV the same bytes: a child of
        vLLM's parallel-sampling fan-out (``f"{i}_{parent}"``) that computed nothing past
        its prompt's first sampled token, keyed by its parent, prompt tokens, LoRA adapter,
        cache salt and multimodal inputs; None for a request that cannot share (not a
        child, more than one generated token, or a prompt given as embeddings)."""
        m = CHILD_ID.match(rid)
        if m is None:
            return None
        outputs = getattr(request, "num_output_tokens", None)
        if not isinstance(outputs, int):
            outputs = len(getattr(request, "output_token_ids", None) or ())
        if outputs > 1:
            return None  # its KV past the prompt differs from its siblings'
        prompt = getattr(request, "prompt_token_ids", None)
        if prompt is None:
            return None
        lora = getattr(getattr(request, "lora_request", None), "lora_name", None)
        features = getattr(request, "mm_features", None) or ()
        mm = tuple(str(getattr(f, "identifier", f)) for f in features)
        # Siblings share the parent's arrival time: two client requests that only look like
        # children ("1_X", "2_X") with the same prompt are kept apart by it.
        arrival = getattr(request, "arrival_time", None)
        return (m.group(2), arrival, len(prompt), hash(tuple(prompt)), lora, getattr(request, "cache_salt", None), mm)

    def _hold_shared(self, key: tuple[Any, ...], rid: str, own: dict[str, Any]) -> dict[str, Any]:
        """Makes child ``rid``'s hand-off its parent's shared one: every sibling finishing
        after it returns these params and frees its own blocks at once."""
        result = dict(own)
        result["kvxfer_shared"] = True
        now = time.monotonic()
        while self._shared:
            # Past half the TTL a sibling would not share it anyway (see _prefill_finished).
            oldest = next(iter(self._shared.values()))
            if now - oldest.at <= self.s.lease_ttl / 2:
                break
            self._shared.popitem(last=False)
        n = int_or_none(own.get("kvxfer_n")) or 1
        # Re-inserted: the dict stays ordered by age (a stale entry replaced goes last).
        self._shared.pop(key, None)
        self._shared[key] = _SharedHandoff(rid, result, now, n=n if n > 1 else None)
        if n > 1:
            parent, index, _ = self._child_of(rid, own)
            entry = self._siblings.get(parent)
            if entry is not None:
                entry[2].add(index)
                if len(entry[2]) >= n:
                    del self._siblings[parent]
        return result

    # ------------------------------------------------------------------ decode

    def _decode_finished(self, rid: str, decode: dict[str, Any]) -> tuple[bool, None]:
        remote = str(decode.get("remote_request_id"))
        pulled = remote in self._shared_pulling
        self._source_gone(rid, decode)
        others = self._unclaim(remote, rid)
        handled = rid in self._handled
        self._handled.discard(rid)
        # A shared hand-off is given back only by the last local request that names it and
        # only if none of them pulls it: a sibling's abort never ends it for the others.
        release = not others and not pulled
        if rid in self._to_recv:  # allocated, the pull not sent to the worker yet
            params = self._to_recv.pop(rid)[0]
            self._recv_inflight.pop(rid, None)
            self._source_unsent(remote, rid)
            if release and not (params.get("kvxfer_shared") and self._reads_nothing_now(remote)):
                self._to_release.append(params)
                if params.get("kvxfer_shared"):
                    self._shared_end(remote)
            return False, None
        if rid in self._recv_inflight:  # the pull runs: cancel, free when it reports
            self._to_cancel.append(rid)
            return True, None
        if not handled:
            # Finished (aborted) in the queue, never pulled.
            if decode.get("kvxfer_shared"):
                self._settle_shared(remote, decode, hit=True, others=bool(others))
            elif release:
                self._to_release.append(decode)
        return False, None

    def _unclaim(self, remote: str, rid: str) -> set[str]:
        """Drops ``rid``'s claim on lease ``remote``; the local requests still claiming it."""
        holders = self._claimed.get(remote)
        if holders is None:
            return set()
        holders.discard(rid)
        if not holders:
            del self._claimed[remote]
            if remote in self._shared_pulling:
                self._shared_end(remote)
            self._shared_pulling.discard(remote)
            self._shared_source.pop(remote, None)
            self._shared_lost.discard(remote)
        return holders

    def _shared_end(self, remote: str) -> None:
        """Shared hand-off ``remote`` was read or given back here: remembered (for
        ``FORGET_AFTER``) so a sibling naming it later computes its prompt."""
        now = time.monotonic()
        self._shared_ended[remote] = now
        self._shared_ended.move_to_end(remote)
        while self._shared_ended:
            oldest, since = next(iter(self._shared_ended.items()))
            if now - since < FORGET_AFTER:
                break
            del self._shared_ended[oldest]

    def _source_unsent(self, remote: str, rid: str) -> None:
        """Local request ``rid`` finished before its pull of ``remote`` was sent: if it was
        the hand-off's source, the next sibling allocated with it (whose pull the workers
        will make first) is, and nothing was read."""
        source = self._shared_source.get(remote)
        if source is None or source.rid != rid:
            return
        del self._shared_source[remote]
        self._shared_lost.discard(remote)
        for other, (params, _) in self._to_recv.items():
            if str(params.get("remote_request_id")) == remote:
                self._shared_source[remote] = _Source(other, None, source.step)
                break

    def _source_gone(self, rid: str, params: Optional[dict[str, Any]] = None) -> None:
        """Local request ``rid`` finished or was preempted: if it read a shared hand-off,
        its blocks are no longer a source for siblings allocated later."""
        params = params if params is not None else self._selected.get(rid)
        if params is None or not params.get("kvxfer_shared"):
            return
        remote = str(params.get("remote_request_id"))
        source = self._shared_source.get(remote)
        if source is not None and source.rid == rid:
            self._shared_lost.add(remote)

    def _nothing_to_copy(self, remote: str, rid: str) -> bool:
        """Whether local request ``rid``, naming shared hand-off ``remote``, must compute its
        prompt: another local request's pull has read the lease (or was sent and given up),
        and its blocks are gone or may change before a copy (a sliding window). It stops
        naming the hand-off then (counted ``shared_recomputed``); it never fails."""
        source = self._shared_source.get(remote)
        if source is None:
            if remote not in self._shared_ended:
                return False
            # Every sibling that named it here has finished: the lease was read (or given
            # back) and nothing is left to copy from.
            return self._recompute(remote, rid, "an earlier sibling")
        if source.rid == rid:
            return False
        state = status_name(source.request)
        lost = (
            remote in self._shared_lost
            # Preempted or finished before the scheduler's hooks said so (vLLM's prefix-cache
            # reset preempts running requests between steps).
            or state == "PREEMPTED"
            or state.startswith("FINISHED")
            # Without stable blocks the workers keep nothing to copy from once the read
            # reports, which may be before this scheduler hears of it (async scheduling,
            # TP ranks reporting apart): only siblings allocated with the reader follow it.
            or (not self.s.stable_blocks and self._step > source.step)
        )
        if not lost:
            return False
        return self._recompute(remote, rid, f"local request {source.rid}")

    def _recompute(self, remote: str, rid: str, reader: str) -> bool:
        """Local request ``rid`` stops naming shared hand-off ``remote`` (ended for it) and
        computes its prompt; True."""
        self.counters["shared_recomputed"] += 1
        logger.warning(
            "kvxfer: %s names the shared hand-off %s, which %s has read or given back and whose blocks are gone; "
            "its prompt is computed locally",
            rid,
            remote,
            reader,
        )
        self._queued.pop(rid, None)
        self._unclaim(remote, rid)
        self._selected[rid] = None
        return True

    def _release_refused(self, rid: str, params: Any, own: Optional[dict[str, Any]]) -> None:
        """A request vLLM refused before admitting it (``abort_immediately``: its API
        server's ``notify_kv_transfer_request_rejected``, sent under the client's request id
        with the request's params, so the connector frees what they pin on the prefill
        side): releases every hand-off the params list that no other local request pulls,
        not only the one it would have pulled (``own``, released as any unpulled one)."""
        mine = str(own.get("remote_request_id")) if own is not None else None
        for entry in handoff_entries(params):
            remote = str(entry.get("remote_request_id"))
            if remote == mine or self._claimed.get(remote, set()) - {rid}:
                continue
            try:
                self._to_release.append(self._own(entry))
            except TypeError as e:
                self.counters["bad_params"] += 1
                logger.error("kvxfer: a hand-off listed by refused request %s is malformed (%s); not released", rid, e)

    def _decode_params(self, request: Any) -> Optional[dict[str, Any]]:
        """The hand-off this decode request pulls, or None (the prompt is computed locally).

        Each lease is pulled by one local request at most. A request whose params hold
        several children's hand-offs (``kvxfer_children``, or vLLM's list of per-child
        params) is a forked child ``f"{i}_{D}"`` and picks the entry with
        ``kvxfer_child_index == i``, never a sibling's; params of one child are pulled by the
        request that holds them, whatever its id looks like (a client id such as
        ``"1_router-req"`` is not a child index)."""
        rid = request.request_id
        if rid in self._selected:
            return self._selected[rid]
        chosen: Optional[dict[str, Any]] = None
        try:
            chosen = self._select(rid, getattr(request, "kv_transfer_params", None))
        except (TypeError, ValueError, AttributeError) as e:
            self.counters["bad_params"] += 1
            logger.error("kvxfer: the kv_transfer_params of %s are malformed (%s); computed locally", rid, e)
        if chosen is not None:
            remote = str(chosen.get("remote_request_id"))
            holders = self._claimed.setdefault(remote, set())
            if holders - {rid} and not chosen.get("kvxfer_shared"):
                self.counters["handoff_taken"] += 1
                logger.warning(
                    "kvxfer: the lease of %s is already pulled by local request %s; %s is computed locally",
                    remote,
                    min(holders),
                    rid,
                )
                chosen = None
            else:
                # A shared prompt hand-off (kvxfer_shared) serves every local request that
                # names it: the workers read it once and copy it to each.
                holders.add(rid)
        self._selected[rid] = chosen
        return chosen

    def _select(self, rid: str, params: Any) -> Optional[dict[str, Any]]:
        """The entry of ``params`` (a dict, or a list of per-child dicts) request ``rid``
        pulls; raises TypeError / ValueError on malformed params."""
        wants_pull = (isinstance(params, dict) and bool(params.get("do_remote_prefill"))) or (
            isinstance(params, list) and any(isinstance(p, dict) and p.get("do_remote_prefill") for p in params)
        )
        if not wants_pull:
            return None
        if not self.s.is_consumer:
            # A router's mistake: nothing here would ever pull or report it.
            self.counters["misrouted"] += 1
            logger.error(
                "kvxfer: %s asks to pull (do_remote_prefill) but this instance is kv_role=%s; computed locally",
                rid,
                self.s.kv_role,
            )
            return None
        m = CHILD_ID.match(rid) if _multi(params) else None
        index = int(m.group(1)) if m else None
        if isinstance(params, list):
            entries = [p for p in params if isinstance(p, dict) and p.get("do_remote_prefill")]
            if len(entries) != len(params):
                raise TypeError("a list of kv_transfer_params holds entries that are not hand-off dicts")
            if len(entries) == 1:
                return self._select(rid, entries[0])  # one hand-off: as if given alone
            if index is None:
                raise ValueError(f"{len(entries)} hand-offs for a request that is not a forked child")
            if all(int_or_none(e.get("kvxfer_n")) in (None, 1) for e in entries):
                # Per-child leases of their own (the prefill side had no kvxfer_n): vLLM's
                # list form, child i takes entry i.
                return self._own(entries[index]) if index < len(entries) else self._none_of_its_own(rid)
            return self._by_index(rid, index, entries)
        assert isinstance(params, dict)
        children = params.get("kvxfer_children")
        if children is not None and not isinstance(children, list):
            raise TypeError(f"kvxfer_children is a {type(children).__name__}, not a list")
        if index is not None and children:
            if not all(isinstance(c, dict) for c in children):
                raise TypeError("kvxfer_children holds entries that are not dicts")
            return self._by_index(rid, index, children)
        if not params.get("kvxfer_lease_token"):
            return None
        return self._own(params)

    def _by_index(self, rid: str, index: int, entries: list[dict[str, Any]]) -> Optional[dict[str, Any]]:
        for e in entries:
            if int_or_none(e.get("kvxfer_child_index")) == index:
                return self._own(e)
        return self._none_of_its_own(rid)

    @staticmethod
    def _own(params: dict[str, Any]) -> dict[str, Any]:
        """One child's params (without the sibling list); TypeError if its child index or
        n is not an int."""
        for key in ("kvxfer_child_index", "kvxfer_n"):
            if params.get(key) is not None and int_or_none(params[key]) is None:
                raise TypeError(f"{key} is {params[key]!r}, not an int")
        return {k: v for k, v in params.items() if k != "kvxfer_children"}

    def _none_of_its_own(self, rid: str) -> None:
        self.counters["no_own_handoff"] += 1
        logger.warning("kvxfer: no hand-off of its own for %s (a sibling's is never taken); computed locally", rid)
        return None
