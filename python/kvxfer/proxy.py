"""A router for disaggregated vLLM serving with kvxfer: ``python -m kvxfer.proxy`` (or the
``kvxfer-proxy`` console script; needs ``aiohttp``, the ``proxy`` extra).

It serves the OpenAI-compatible ``POST /v1/completions`` and ``POST /v1/chat/completions``
(streaming and not), ``GET /v1/models`` and ``GET /health``, in front of prefill instances
(``vllm serve ... kv_role kv_producer``) and decode instances (``kv_consumer``) that run
:class:`kvxfer.vllm.KvxferConnector`::

    kvxfer-proxy --port 8000 --prefill http://p0:8100 --prefill http://p1:8100 \\
                 --decode http://d0:8200 --decode http://d1:8200

For each client request:

1. **Prefill.** The request goes to a prefill instance with ``max_tokens`` 1 (and
   ``max_completion_tokens`` 1 for chat), ``stream`` false, the client's ``n``, and
   ``kv_transfer_params = {"do_remote_decode": true, "do_remote_prefill": false,
   "kvxfer_n": n}``. With ``kvxfer_n`` every one of the n children vLLM forks the request
   into is leased with a hand-off of its own, and the params vLLM returns list them all
   (``kvxfer_children``). ``stream_options``, ``min_tokens`` and ``min_completion_tokens``
   are dropped from this request (vLLM refuses them with one token or without streaming).
2. **Hand-off.** vLLM returns the params as the top-level ``kv_transfer_params`` field of
   the (non-streaming) completion or chat completion response.
3. **Decode.** The client's original request goes to a decode instance with those params as
   its ``kv_transfer_params``; vLLM forks it into the same n children, each pulling its own
   child's blocks. The decode's answer (status, content type, body or SSE stream) is passed
   back to the client unchanged.

A prefill response without ``kv_transfer_params`` (an instance without the connector, or
not a producer) is logged and the request is decoded without them: the decode instance
computes the prompt itself. A completion request with several prompts goes straight to a
decode instance (vLLM returns the params of the first prompt only, so a P/D split would
give every prompt the first one's hand-off).

Load balancing: each request goes to the instance of its kind with the fewest outstanding
requests (ties in round-robin order). A prefill request is outstanding until its answer is
read, a decode request until its answer has been passed on.

Errors are OpenAI-style JSON (``{"error": {"message", "type", "param", "code"}}``): an
instance that cannot be reached, times out or answers with something that is not a
completion gives 502 naming the instance; an upstream HTTP error (a 400 for a bad request,
a 5xx) is passed through with its status and body (one that is not JSON becomes an
OpenAI-style error of that status naming the instance). A decode stream cut mid-way ends
with an error event and ``data: [DONE]``, as vLLM ends a stream after an error; events are
passed on whole, so the client never gets half of one. A whole (non-streamed) answer is
read before its status is sent: one cut short (framed by its length or chunks, as vLLM's
are) is a 502, never a 200 with half a body. Every answer carries the
``X-Kvxfer-Upstream`` header naming the instance it came from.

Failures: an instance that cannot be connected to is taken out of rotation for
``--down-for`` seconds (5) and the request is retried on another instance of its kind
(nothing was sent); a prefill instance that closes or resets the connection without
answering (it died, and its leases with it; a kept-alive connection to a killed instance is
reset) is retried on another too. A decode request that reached its
instance is never retried (it may have read the hand-off or streamed tokens). An instance
out of rotation gets requests again after that time, or sooner when every instance of its
kind is out; the first that answers is back in rotation. When no decode instance can be
reached, the prefill's leases are given back at once (the router runs a small kvxfer
decode agent that pulls nothing; ``--cluster-key-file`` when the instances have a key)
before the 502.

A client that disconnects during its prefill does not cut the prefill request off: vLLM
may have made its leases before it would see the connection go, so the answer is read to
the end and its leases given back. A client gone after the prefill answered, before the
decode's answer began, has the prefill's leases given back as well (a decode that already
read them answers that they ended), and its decode request is cancelled (vLLM aborts it as
the connection closes), as is a decode request whose client leaves mid-answer.

The client's ``Authorization`` header is forwarded to every upstream. With ``--api-key KEY``
the router itself also requires ``Authorization: Bearer KEY`` (as ``vllm serve --api-key``).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import copy
import errno
import json
import logging
import sys
import threading
import time
from typing import Any, Collection, Optional

import aiohttp
from aiohttp import web

from ._kvxfer import DecodeAgent, KvxferError, Memory, Segment
from .params import every_rank, handoff_entries

logger = logging.getLogger("kvxfer.proxy")

# Request headers forwarded to the upstream instances.
FORWARDED_HEADERS = ("Authorization",)
UPSTREAM_HEADER = "X-Kvxfer-Upstream"


class Upstream:
    """One vLLM instance: its base URL (without ``/v1``), its outstanding requests, and
    until when it is out of rotation (its last connection attempt failed)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.outstanding = 0
        self.down_until = 0.0
        # Why the last request to it failed before it answered (for the client's 502).
        self.last_error = ""

    def __repr__(self) -> str:
        return f"Upstream({self.url!r}, outstanding={self.outstanding})"

    def is_down(self, now: float) -> bool:
        return now < self.down_until


class Pool:
    """The instances of one kind (prefill or decode). :meth:`pick` takes the one with the
    fewest outstanding requests; among equals, the first from a round-robin cursor."""

    def __init__(self, kind: str, urls: list[str]) -> None:
        if not urls:
            raise ValueError(f"no {kind} instance given")
        self.kind = kind
        self.upstreams = [Upstream(u) for u in urls]
        self._cursor = 0

    def pick(self, tried: Collection[Upstream] = ()) -> Optional[Upstream]:
        """The instance to send to next, never one of ``tried``; instances out of rotation
        only when every other is too (one of them may be back). None when all were tried."""
        k = len(self.upstreams)
        now = time.monotonic()
        best = None
        for i in range(k):
            j = (self._cursor + i) % k
            u = self.upstreams[j]
            if u in tried:
                continue
            if best is None:
                best = j
                continue
            b = self.upstreams[best]
            if (u.is_down(now), u.outstanding) < (b.is_down(now), b.outstanding):
                best = j
        if best is None:
            return None
        self._cursor = (best + 1) % k
        return self.upstreams[best]

    def mark_down(self, upstream: Upstream, seconds: float) -> None:
        """Takes ``upstream`` out of rotation for ``seconds`` (a connection to it failed);
        it is tried again after, or sooner when every other instance is out too."""
        if not upstream.is_down(time.monotonic()):
            logger.warning("%s instance %s is out of rotation for %.0f s: it cannot be reached", self.kind, upstream.url, seconds)
        upstream.down_until = time.monotonic() + seconds

    def mark_up(self, upstream: Upstream) -> None:
        """``upstream`` answered: back in rotation."""
        if upstream.down_until:
            logger.info("%s instance %s answers again: back in rotation", self.kind, upstream.url)
            upstream.down_until = 0.0


class LeaseReleaser:
    """Gives back, at once, the leases of a prefill answer no decode instance will pull —
    its decode request could not be sent (every decode instance unreachable) or the client
    left before it was — instead of leaving the prefill's blocks held until the leases
    expire. A kvxfer decode agent over one small block that pulls nothing: its releases
    reach prefill agents of any cache layout (over control-only connections), and need the
    prefill instances' cluster key when they have one."""

    def __init__(self, cluster_key: Optional[str] = None, io_timeout: float = 5.0) -> None:
        self.cluster_key = cluster_key
        self.io_timeout = io_timeout
        self._agent: Optional[DecodeAgent] = None
        self._lock = threading.Lock()
        # Threads of its own: a release waits up to three io timeouts, and the loop's default
        # pool also resolves host names for the HTTP client.
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvxfer-release")
        self.released = 0
        self.refused = 0
        self._pending: set[asyncio.Future[None]] = set()
        self._closed = False

    def release(self, params: Any, why: str) -> None:
        """Starts giving back every lease ``params`` names, on every prefill rank (not
        waited for: logged and counted)."""
        views = [v for entry in handoff_entries(params) for v in every_rank(entry)]
        if not views:
            return
        if self._closed:
            logger.warning("%s after the router's shutdown began: %d leases left to expire", why, len(views))
            return
        future = asyncio.get_running_loop().run_in_executor(self._pool, self._release_now, views, why)
        self._pending.add(future)
        future.add_done_callback(self._pending.discard)

    async def drain(self) -> None:
        """Waits for the releases under way."""
        if self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)

    def _release_now(self, views: list[dict[str, Any]], why: str) -> None:
        try:
            with self._lock:
                if self._agent is None:
                    memory = Memory([Segment(bytearray(64), block_bytes=64)], num_blocks=1)
                    self._agent = DecodeAgent(
                        memory,
                        agent_name="kvxfer-proxy",
                        cluster_key=self.cluster_key,
                        io_timeout=self.io_timeout,
                        worker_threads=1,
                    )
                agent = self._agent
        except (KvxferError, OSError) as e:
            logger.error("could not start the router's kvxfer agent to release leases (%s): %s", why, e)
            with self._lock:
                self.refused += len(views)
            return
        try:
            answers = agent.release(views, wait=True, timeout=3 * self.io_timeout) or []
        except TimeoutError as e:
            # Not every answer came in time (the releases go on): not sent again.
            logger.warning("releasing %d leases (%s): %s", len(views), why, e)
            answers = []
        except (KvxferError, TypeError, ValueError, OverflowError):
            # One malformed entry refuses the whole call: each alone, so the others go.
            answers = [self._release_one(agent, v) for v in views]
        done = sum(1 for a in answers if a)
        with self._lock:
            self.released += done
            self.refused += len(views) - done
        logger.info("%s: released %d of %d leases of its prefill answer (%s)", why, done, len(views), lease_ids(views))

    def _release_one(self, agent: DecodeAgent, view: dict[str, Any]) -> bool:
        try:
            return bool((agent.release([view], wait=True, timeout=3 * self.io_timeout) or [False])[0])
        except (KvxferError, TimeoutError, TypeError, ValueError, OverflowError) as e:
            logger.error("could not release lease %s: %s", view.get("remote_request_id"), e)
            return False

    def close(self) -> None:
        self._closed = True
        self._pool.shutdown(wait=True)
        with self._lock:
            if self._agent is not None:
                self._agent.shutdown()
                self._agent = None


class UpstreamError(Exception):
    """A request to an upstream instance that produced no usable answer: becomes the
    client's error response (``status``, an OpenAI-style body)."""

    def __init__(self, status: int, message: str, upstream: Optional[Upstream] = None) -> None:
        super().__init__(message)
        self.status = status
        self.upstream = upstream

    def response(self) -> web.Response:
        return error_response(self.status, str(self), upstream=self.upstream)


def error_response(status: int, message: str, upstream: Optional[Upstream] = None) -> web.Response:
    """An OpenAI-style JSON error, as vLLM itself answers."""
    kind = "invalid_request_error" if 400 <= status < 500 else "upstream_error"
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    headers = {UPSTREAM_HEADER: upstream.url} if upstream is not None else None
    return web.json_response(body, status=status, headers=headers)


def normalize_url(url: str) -> str:
    """``host:port`` or ``http://host:port[/][v1]`` as ``http://host:port``."""
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    if url.endswith("/v1"):
        url = url[: -len("/v1")]
    return url


def prefill_request(body: dict[str, Any], chat: bool, n: int) -> dict[str, Any]:
    """The request sent to the prefill instance: the client's, computing one token."""
    out = copy.deepcopy(body)
    out["stream"] = False
    out["max_tokens"] = 1
    if chat:
        out["max_completion_tokens"] = 1
    for key in ("stream_options", "min_tokens", "min_completion_tokens"):
        out.pop(key, None)
    out["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False, "kvxfer_n": n}
    return out


def decode_request(body: dict[str, Any], params: Optional[dict[str, Any]]) -> dict[str, Any]:
    """The request sent to the decode instance: the client's, with the prefill's params."""
    out = dict(body)
    out.pop("kv_transfer_params", None)
    if params is not None:
        out["kv_transfer_params"] = params
    return out


def several_prompts(body: dict[str, Any]) -> bool:
    """A completion request with a batch of prompts (a list of strings or of token lists)."""
    prompt = body.get("prompt")
    return isinstance(prompt, list) and len(prompt) > 1 and not all(isinstance(t, int) for t in prompt)


class Router:
    """The routing state (pools, HTTP client) and the request handlers."""

    def __init__(
        self,
        prefill: list[str],
        decode: list[str],
        timeout: Optional[float] = 300.0,
        api_key: Optional[str] = None,
        prefill_dp_size: int = 1,
        decode_dp_size: int = 1,
        down_for: float = 5.0,
        cluster_key: Optional[str] = None,
        connect_timeout: float = 5.0,
        prefill_grace: float = 2.0,
    ) -> None:
        for name, size in (("prefill_dp_size", prefill_dp_size), ("decode_dp_size", decode_dp_size)):
            if size < 1:
                raise ValueError(f"{name} must be at least 1, not {size}")
        self.prefill = Pool("prefill", [normalize_url(u) for u in prefill])
        # Data-parallel engines per instance of each kind: a request with n > 1 is kept on
        # one of them (vLLM's X-data-parallel-rank, in turn) — vLLM's front end would place
        # each child on an engine of its own, and the children of a parent share one
        # hand-off: one prefill engine holds it, one decode engine reads it.
        self._dp = {"prefill": [prefill_dp_size, 0], "decode": [decode_dp_size, 0]}
        self.decode = Pool("decode", [normalize_url(u) for u in decode])
        self.timeout = timeout if timeout else None
        self.api_key = api_key
        # An instance that cannot be reached is out of rotation this long.
        self.down_for = down_for
        self.connect_timeout = connect_timeout
        # How long a prefill whose client left is still awaited (its answer read, its leases
        # given back) before it is cut off (vLLM then aborts it, making no lease).
        self.prefill_grace = prefill_grace
        self.releaser = LeaseReleaser(cluster_key)
        # Prefill requests still read for clients that left (shutdown waits for them).
        self._graced: set[asyncio.Future[Optional[dict[str, Any]]]] = set()
        self.session: Optional[aiohttp.ClientSession] = None
        self._warned: set[str] = set()

    # ------------------------------------------------------------------ the application

    def app(self) -> web.Application:
        """The aiohttp application. Serve it with ``handler_cancellation=True`` (as
        :func:`main` does) so that a client's disconnect cancels its upstream request."""
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.cleanup_ctx.append(self._client_session)
        return app

    async def _client_session(self, app: web.Application):
        # limit=0: as many connections to the upstreams as there are requests in flight.
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        yield
        if self._graced:
            # Prefills read for clients that left: their answers (each cut off after
            # prefill_grace) are read and their leases given back before the session closes.
            await asyncio.wait(set(self._graced), timeout=self.prefill_grace + self.connect_timeout)
        await self.session.close()
        await self.releaser.drain()
        self.releaser.close()

    def _timeout(self, streaming: bool) -> aiohttp.ClientTimeout:
        # A whole answer must come within the timeout; a stream's next chunk too. A
        # connection not made within connect_timeout counts as an unreachable instance (a
        # host that drops packets never refuses).
        connect = self.connect_timeout
        if streaming:
            return aiohttp.ClientTimeout(total=None, sock_connect=connect, sock_read=self.timeout)
        return aiohttp.ClientTimeout(total=self.timeout, sock_connect=connect)

    def _headers(self, request: web.Request) -> dict[str, str]:
        return {h: request.headers[h] for h in FORWARDED_HEADERS if h in request.headers}

    def _unauthorized(self, request: web.Request) -> Optional[web.Response]:
        if self.api_key is None or request.headers.get("Authorization") == f"Bearer {self.api_key}":
            return None
        return error_response(401, "Unauthorized: a valid 'Authorization: Bearer <key>' header is required")

    # ------------------------------------------------------------------ handlers

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "/v1/completions", chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "/v1/chat/completions", chat=True)

    async def _generate(self, request: web.Request, path: str, chat: bool) -> web.StreamResponse:
        denied = self._unauthorized(request)
        if denied is not None:
            return denied
        try:
            body = await request.json()
        except ValueError as e:
            return error_response(400, f"the request body is not JSON: {e}")
        if not isinstance(body, dict):
            return error_response(400, "the request body is not a JSON object")
        n = body.get("n", 1)
        if n is None:
            n = 1
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            return error_response(400, f"n must be a positive integer, not {n!r}")
        headers = self._headers(request)

        params = None
        if chat or not several_prompts(body):
            prefill = asyncio.ensure_future(
                self._prefill(path, prefill_request(body, chat, n), self._pinned(headers, "prefill", n))
            )
            try:
                # Shielded: a client that leaves does not cut the prefill request off at once.
                # vLLM may have finished it (its leases made) before it sees the connection
                # go, and an answer the router never reads leaves them to expire: an answer
                # that comes within prefill_grace is read and its leases given back; a
                # prefill still running then is cut off (vLLM aborts it, making no lease).
                params = await asyncio.shield(prefill)
            except asyncio.CancelledError:
                self._graced.add(prefill)
                prefill.add_done_callback(self._graced.discard)
                prefill.add_done_callback(self._release_unused)
                asyncio.get_running_loop().call_later(self.prefill_grace, prefill.cancel)
                raise
            except UpstreamError as e:
                return e.response()
            except _PassThrough as e:
                return e.response
        else:
            logger.info("a completion request with several prompts: decoded without a prefill instance")
        return await self._decode(request, path, decode_request(body, params), self._pinned(headers, "decode", n))

    def _release_unused(self, prefill: "asyncio.Future[Optional[dict[str, Any]]]") -> None:
        """A prefill answer whose client left while it was awaited: its leases go back."""
        if prefill.cancelled() or prefill.exception() is not None:
            return
        self.releaser.release(prefill.result(), "the client left during its prefill")

    def _pinned(self, headers: dict[str, str], kind: str, n: int) -> dict[str, str]:
        """``headers``, with a data-parallel rank for a request with n > 1 to an instance of
        ``kind`` that has several engines (see ``__init__``)."""
        size, rank = self._dp[kind]
        if n <= 1 or size <= 1:
            return headers
        self._dp[kind][1] = (rank + 1) % size
        return dict(headers, **{"X-data-parallel-rank": str(rank)})

    async def _prefill(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> Optional[dict[str, Any]]:
        """Sends the prefill request; returns the ``kv_transfer_params`` of its answer. An
        instance that cannot be reached, or that closed the connection without answering
        (it died: its leases went with it), is retried on another one."""
        assert self.session is not None
        tried: list[Upstream] = []
        while True:
            upstream = self.prefill.pick(tried)
            if upstream is None:
                raise UpstreamError(502, _none_answered("prefill", tried), tried[-1])
            tried.append(upstream)
            url = upstream.url + path
            upstream.outstanding += 1
            try:
                async with self.session.post(url, json=body, headers=headers, timeout=self._timeout(False)) as resp:
                    data = await resp.read()
                    self.prefill.mark_up(upstream)
                    if resp.status >= 400:
                        raise _PassThrough(_pass_through(resp.status, resp.content_type, data, upstream, "prefill"))
                break
            except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as e:
                self.prefill.mark_down(upstream, self.down_for)
                upstream.last_error = str(e) or type(e).__name__
                logger.warning("prefill instance %s cannot be reached (%s)", upstream.url, upstream.last_error)
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as e:
                if isinstance(e, aiohttp.ClientOSError) and not _reset(e):
                    raise UpstreamError(502, f"prefill instance {upstream.url} is unreachable or failed: {e}", upstream)
                # It closed or reset the connection before answering (a kept-alive one to an
                # instance that died included): the leases of a dead instance went with it —
                # another instance gets the request. (An answer cut short is a 502: a live
                # instance that began answering has made its leases.)
                upstream.last_error = str(e) or type(e).__name__
                logger.warning("prefill instance %s failed before answering (%s)", upstream.url, upstream.last_error)
            except asyncio.TimeoutError:
                raise UpstreamError(502, f"prefill instance {upstream.url} timed out after {self.timeout} s", upstream)
            except aiohttp.ClientError as e:
                raise UpstreamError(502, f"prefill instance {upstream.url} is unreachable or failed: {e}", upstream)
            finally:
                upstream.outstanding -= 1
        try:
            answer = json.loads(data)
        except ValueError:
            answer = None
        if not isinstance(answer, dict):
            snippet = data[:200].decode("utf-8", "replace")
            why = f"prefill instance {upstream.url} answered with no completion: {snippet!r}"
            raise UpstreamError(502, why, upstream)
        params = answer.get("kv_transfer_params")
        if params is None:
            if upstream.url not in self._warned:
                self._warned.add(upstream.url)
                logger.warning(
                    "prefill instance %s returned no kv_transfer_params (no KV connector, or not a producer?): "
                    "its requests are computed again by the decode instance",
                    upstream.url,
                )
            return None
        if not isinstance(params, (dict, list)):
            why = f"prefill instance {upstream.url} returned kv_transfer_params of type {type(params).__name__}"
            raise UpstreamError(502, why, upstream)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("prefill answer %s from %s: leases %s", answer.get("id"), upstream.url, lease_ids(params))
        return params  # type: ignore[return-value]

    async def _decode(
        self, request: web.Request, path: str, body: dict[str, Any], headers: dict[str, str]
    ) -> web.StreamResponse:
        """Sends the decode request and passes its answer on as it comes. An instance that
        cannot be reached (nothing was sent) is retried on another; when none can be, or
        the client leaves before an answer began, the prefill's leases are given back
        (``LeaseReleaser``) rather than left to expire. A decode that failed after the
        request reached it is never retried: it may have read the hand-off, or streamed."""
        params = body.get("kv_transfer_params")
        tried: list[Upstream] = []
        while True:
            upstream = self.decode.pick(tried)
            if upstream is None:
                self.releaser.release(params, "no decode instance could be reached")
                return error_response(502, _none_answered("decode", tried), tried[-1])
            tried.append(upstream)
            if logger.isEnabledFor(logging.DEBUG):
                logger.debug("decode request to %s: leases %s", upstream.url, lease_ids(params))
            began: list[bool] = []  # set once the decode's answer began
            try:
                return await self._decode_on(upstream, request, path, body, headers, began)
            except _Unreachable:
                continue
            except asyncio.CancelledError:
                # The client left (its handler is cancelled). Unless an answer had begun
                # (then the decode had the request, and vLLM aborts it as the connection
                # closes, releasing what it had not read), the hand-off is given back.
                if not began:
                    self.releaser.release(params, "the client left before its decode answer began")
                raise

    async def _decode_on(
        self,
        upstream: Upstream,
        request: web.Request,
        path: str,
        body: dict[str, Any],
        headers: dict[str, str],
        began: list[bool],
    ) -> web.StreamResponse:
        """The decode request on ``upstream`` (``began`` gets an entry once its answer
        begins); ``_Unreachable`` when it could not be connected to (nothing was sent)."""
        assert self.session is not None
        url = upstream.url + path
        upstream.outstanding += 1
        response: Optional[web.StreamResponse] = None
        try:
            streaming = bool(body.get("stream"))
            async with self.session.post(url, json=body, headers=headers, timeout=self._timeout(streaming)) as resp:
                self.decode.mark_up(upstream)
                began.append(True)
                if resp.status >= 400:
                    data = await resp.read()
                    return _pass_through(resp.status, resp.content_type, data, upstream, "decode")
                if resp.content_type != "text/event-stream":
                    # A whole answer is read before its status is sent: a decode that dies
                    # mid-answer is then a proper 502, not a 200 with half a body.
                    data = await resp.read()
                    return web.Response(status=resp.status, body=data, headers=_content_headers(resp, upstream))
                response = web.StreamResponse(status=resp.status, headers=_content_headers(resp, upstream))
                await response.prepare(request)
                # A stream is passed on whole events at a time: if the upstream is cut
                # mid-event, the client never sees half of one before the error event.
                pending = b""
                async for chunk in resp.content.iter_any():
                    pending += chunk
                    cut = _event_end(pending)
                    if not cut:
                        continue
                    chunk, pending = pending[:cut], pending[cut:]
                    await response.write(chunk)
                cut_short = resp.content.exception()
                if cut_short is not None:
                    raise cut_short
                if pending:
                    # A stream ends with a whole event: the rest of one means the upstream
                    # went away mid-event.
                    raise aiohttp.ClientPayloadError("the event stream ended in the middle of an event")
                await response.write_eof()
                return response
        except ConnectionResetError as e:  # aiohttp's ClientConnectionResetError is one too
            # Writing to a client that has gone: leaving the block closed the upstream
            # connection, which makes vLLM abort the request.
            if response is not None and _client_gone(request):
                logger.info("client gone mid-answer; decode request to %s cancelled", upstream.url)
                return response
            return await self._upstream_failed(request, response, upstream, f"the connection was reset: {e}")
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as e:
            self.decode.mark_down(upstream, self.down_for)
            upstream.last_error = str(e) or type(e).__name__
            logger.warning("decode instance %s cannot be reached (%s)", upstream.url, upstream.last_error)
            raise _Unreachable() from e
        except asyncio.TimeoutError:
            return await self._upstream_failed(request, response, upstream, f"timed out after {self.timeout} s")
        except aiohttp.ClientError as e:
            return await self._upstream_failed(request, response, upstream, f"is unreachable or failed: {e}")
        finally:
            upstream.outstanding -= 1

    async def _upstream_failed(
        self, request: web.Request, response: Optional[web.StreamResponse], upstream: Upstream, why: str
    ) -> web.StreamResponse:
        message = f"decode instance {upstream.url} {why}"
        logger.warning("%s", message)
        if response is None:  # nothing sent yet: a proper error
            return error_response(502, message, upstream)
        # Mid-stream (only a stream's status is sent before its end): it ends with an error
        # event and `[DONE]`, as vLLM ends its own streams after an error (clients wait for
        # `[DONE]`).
        if not _client_gone(request):
            error = {"error": {"message": message, "type": "upstream_error", "param": None, "code": 502}}
            try:
                await response.write(f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode())
            except ConnectionResetError:
                pass
        return response

    async def models(self, request: web.Request) -> web.StreamResponse:
        """``GET /v1/models`` of a decode instance (prefill and decode serve the same model)."""
        denied = self._unauthorized(request)
        if denied is not None:
            return denied
        assert self.session is not None
        upstream = self.decode.pick()
        try:
            async with self.session.get(
                upstream.url + "/v1/models", headers=self._headers(request), timeout=self._timeout(False)
            ) as resp:
                data = await resp.read()
                return _pass_through(resp.status, resp.content_type, data, upstream, "decode")
        except (asyncio.TimeoutError, aiohttp.ClientError) as e:
            return error_response(502, f"decode instance {upstream.url} is unreachable or failed: {e!r}", upstream)

    async def health(self, request: web.Request) -> web.Response:
        """200 while at least one prefill and one decode instance answer their ``/health``,
        else 503; the body lists every instance."""
        assert self.session is not None

        async def check(u: Upstream) -> dict[str, Any]:
            try:
                async with self.session.get(u.url + "/health", timeout=aiohttp.ClientTimeout(total=5)) as r:
                    ok = r.status == 200
            except (asyncio.TimeoutError, aiohttp.ClientError):
                ok = False
            return {"url": u.url, "healthy": ok, "outstanding": u.outstanding, "in_rotation": not u.is_down(now)}

        now = time.monotonic()
        pools = (self.prefill, self.decode)
        results = await asyncio.gather(*(check(u) for p in pools for u in p.upstreams))
        k = len(self.prefill.upstreams)
        body = {"prefill": results[:k], "decode": results[k:]}
        healthy = any(r["healthy"] for r in results[:k]) and any(r["healthy"] for r in results[k:])
        body["status"] = "ok" if healthy else "unavailable"
        # Leases of prefill answers no decode instance got, given back by the router; those
        # the prefill did not release (already ended — pulled or expired — or unreachable).
        body["leases_released"] = self.releaser.released
        body["releases_refused"] = self.releaser.refused
        return web.json_response(body, status=200 if healthy else 503)


def lease_ids(params: Any) -> str:
    """The lease ids ``params`` name (a hand-off, its sibling list, or a list of them), for logs."""
    return ", ".join(sorted({str(e.get("remote_request_id")) for e in handoff_entries(params)}))


def _none_answered(kind: str, tried: list[Upstream]) -> str:
    """The client's error message when every instance of ``kind`` failed before answering."""
    if len(tried) == 1:
        return f"{kind} instance {tried[0].url} is unreachable or failed: {tried[0].last_error}"
    return f"no {kind} instance answered: " + "; ".join(f"{u.url}: {u.last_error}" for u in tried)


class _Unreachable(Exception):
    """A decode instance could not be connected to: nothing was sent, another may be tried."""


class _PassThrough(Exception):
    """Carries an upstream's HTTP error response out of :meth:`Router._prefill`."""

    def __init__(self, response: web.Response) -> None:
        super().__init__(response.status)
        self.response = response


def _pass_through(status: int, content_type: str, data: bytes, upstream: Upstream, kind: str) -> web.Response:
    """An upstream's answer as it came; an HTTP error that is not JSON becomes an
    OpenAI-style one of the same status naming the instance."""
    if status >= 400 and content_type != "application/json":
        snippet = data[:200].decode("utf-8", "replace")
        return error_response(status, f"{kind} instance {upstream.url} answered {status}: {snippet}", upstream)
    return web.Response(status=status, body=data, content_type=content_type, headers={UPSTREAM_HEADER: upstream.url})


def _content_headers(resp: aiohttp.ClientResponse, upstream: Upstream) -> dict[str, str]:
    headers = {UPSTREAM_HEADER: upstream.url}
    for h in ("Content-Type", "Cache-Control"):
        if h in resp.headers:
            headers[h] = resp.headers[h]
    return headers


def _event_end(data: bytes) -> int:
    """Where the last complete server-sent event in ``data`` ends (0: none is complete)."""
    return max(data.rfind(b"\n\n") + 2 if b"\n\n" in data else 0, data.rfind(b"\r\n\r\n") + 4 if b"\r\n\r\n" in data else 0)


def _reset(e: OSError) -> bool:
    """Whether ``e`` is a connection reset by the peer (aiohttp's ``ClientOSError`` keeps
    the errno without being a ``ConnectionResetError``)."""
    return isinstance(e, ConnectionResetError) or e.errno == errno.ECONNRESET


def _client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


# ---------------------------------------------------------------------- command line


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="kvxfer-proxy",
        description="OpenAI-compatible router for disaggregated vLLM serving with the kvxfer KV connector: "
        "prefill on one instance, decode (n > 1 included) on another.",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    p.add_argument(
        "--prefill", action="append", required=True, metavar="URL",
        help="a prefill instance (kv_producer), e.g. http://127.0.0.1:8100; repeat for several",
    )
    p.add_argument(
        "--decode", action="append", required=True, metavar="URL",
        help="a decode instance (kv_consumer), e.g. http://127.0.0.1:8200; repeat for several",
    )
    p.add_argument(
        "--timeout", type=float, default=300.0,
        help="seconds to wait for a prefill answer, a non-streaming decode answer or a stream's next "
        "chunk (default 300; 0: no limit)",
    )
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' from clients")
    p.add_argument(
        "--prefill-dp-size", type=int, default=1, metavar="N",
        help="data-parallel engines in each prefill instance (vllm serve --data-parallel-size): the children "
        "of a request with n > 1 are kept on one engine (X-data-parallel-rank, taken in turn), so that they "
        "share one hand-off (default 1; the engines must be behind one API server, vLLM's default)",
    )
    p.add_argument(
        "--decode-dp-size", type=int, default=1, metavar="N",
        help="data-parallel engines in each decode instance: as --prefill-dp-size, so that one engine reads "
        "the shared hand-off for all the children (default 1)",
    )
    p.add_argument(
        "--down-for", type=float, default=5.0, metavar="SECONDS",
        help="an instance that cannot be connected to is out of rotation this long (its requests go to the "
        "others, and are retried on them), then tried again (default 5)",
    )
    p.add_argument(
        "--prefill-grace", type=float, default=2.0, metavar="SECONDS",
        help="how long the prefill of a client that left is still awaited, its leases then given back, before "
        "it is cut off (default 2)",
    )
    p.add_argument(
        "--connect-timeout", type=float, default=5.0, metavar="SECONDS",
        help="a connection to an instance not made within this long counts as unreachable (default 5)",
    )
    p.add_argument(
        "--cluster-key-file", default=None, metavar="PATH",
        help="the prefill instances' kvxfer cluster key (kvxfer_cluster_key), for giving back the leases of "
        "prefill answers no decode instance got",
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p.parse_args(argv)


def _read_key(path: Optional[str]) -> Optional[str]:
    if path is None:
        return None
    with open(path, encoding="utf-8") as f:
        return f.read().strip()


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    router = Router(
        args.prefill,
        args.decode,
        timeout=args.timeout,
        api_key=args.api_key,
        prefill_dp_size=args.prefill_dp_size,
        decode_dp_size=args.decode_dp_size,
        down_for=args.down_for,
        cluster_key=_read_key(args.cluster_key_file),
        connect_timeout=args.connect_timeout,
        prefill_grace=args.prefill_grace,
    )
    logger.info(
        "routing to prefill %s and decode %s",
        [u.url for u in router.prefill.upstreams],
        [u.url for u in router.decode.upstreams],
    )
    web.run_app(
        router.app(), host=args.host, port=args.port, handler_cancellation=True, print=None, access_log=None
    )


if __name__ == "__main__":
    main()
