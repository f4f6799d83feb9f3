"""The router (``kvxfer.proxy``) against stand-in upstreams: small aiohttp servers on
127.0.0.1 free ports that record what they are sent and answer as a vLLM instance would
(or fail, hang, reset). What is checked is the router's own behaviour: how it rewrites
requests, passes answers and errors on, balances load and cancels upstream requests of
clients that have gone. The real engines are in ``real_vllm/test_serve_router.py``."""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import time
from typing import Any, Awaitable, Callable, Optional

import pytest

aiohttp = pytest.importorskip("aiohttp", reason="the router needs aiohttp (the `proxy` extra)")
from aiohttp import web  # noqa: E402

from kvxfer import proxy  # noqa: E402

PARAMS = {"do_remote_prefill": True, "remote_request_id": "cmpl-p", "kvxfer_n": 4, "kvxfer_children": [{"i": 0}]}
SSE = [b'data: {"choices":[{"index":0,"text":"a"}]}\n\n', b'data: {"choices":[{"index":1,"text":"b"}]}\n\n',
       b"data: [DONE]\n\n"]


class Upstream:
    """A stand-in vLLM instance. ``behave(kind, request, body)`` answers a generation
    request (default: a prefill's or a decode's answer); every request is recorded."""

    def __init__(
        self, kind: str, behave: Optional[Callable[..., Awaitable[web.StreamResponse]]] = None, port: int = 0
    ):
        self.kind = kind
        self.port = port
        self.behave = behave
        self.requests: list[tuple[str, dict[str, Any], dict[str, str]]] = []
        self.cancelled = asyncio.Event()  # a handler was cancelled: its client went away
        self.entered = asyncio.Event()
        self.release = asyncio.Event()    # lets a `hold` handler finish
        self.runner: Optional[web.AppRunner] = None
        self.url = ""

    async def start(self) -> "Upstream":
        app = web.Application()
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        self.runner = web.AppRunner(app, handler_cancellation=True)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", self.port)
        await site.start()
        host, port = self.runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append((request.path, body, dict(request.headers)))
        self.entered.set()
        try:
            if self.behave is not None:
                return await self.behave(self, request, body)
            return await default_answer(self, request, body)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "tiny", "served_by": self.url}]})

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)


async def default_answer(up: Upstream, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
    if up.kind == "prefill":
        choices = [{"index": i, "text": "x"} for i in range(body.get("n", 1))]
        return web.json_response({"id": "cmpl-p", "choices": choices, "kv_transfer_params": PARAMS})
    if body.get("stream"):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for chunk in SSE:
            await resp.write(chunk)
        await resp.write_eof()
        return resp
    return web.json_response({"id": "cmpl-d", "served_by": up.url, "choices": [{"index": 0, "text": "decoded"}]})


async def hold(up: Upstream, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
    """Answers only once ``up.release`` is set."""
    await up.release.wait()
    return await default_answer(up, request, body)


async def slow_stream(up: Upstream, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
    """Sends one SSE chunk, then nothing until cancelled."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    await resp.write(SSE[0])
    await asyncio.sleep(60)
    return resp


def answer(status: int, body: bytes, content_type: str = "application/json"):
    async def behave(up: Upstream, request: web.Request, _body: dict[str, Any]) -> web.Response:
        return web.Response(status=status, body=body, content_type=content_type)
    return behave


class Setup:
    """Upstreams, the router in front of them and a client session, torn down at the end.
    ``prefill`` / ``decode``: stand-ins, or URLs where nothing listens."""

    def __init__(self, prefill: list, decode: list, **kw):
        self.upstreams = [u for u in prefill + decode if isinstance(u, Upstream)]
        self.prefill, self.decode, self.kw = prefill, decode, kw
        self.runner: Optional[web.AppRunner] = None

    async def __aenter__(self) -> "Setup":
        for u in self.upstreams:
            await u.start()
        self.router = proxy.Router([getattr(u, "url", u) for u in self.prefill],
                                   [getattr(u, "url", u) for u in self.decode], **self.kw)
        self.runner = web.AppRunner(self.router.app(), handler_cancellation=True)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        host, port = self.runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"
        self.client = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
        return self

    async def __aexit__(self, *exc) -> None:
        await self.client.close()
        if self.runner is not None:
            await self.runner.cleanup()
        for u in self.upstreams:
            u.release.set()
            await u.stop()

    async def post(self, path: str, body: Any, **kw) -> tuple[int, bytes, Any]:
        async with self.client.post(self.url + path, json=body, **kw) as r:
            return r.status, await r.read(), r.headers


def run(coro) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 20))


def closed_port_url() -> str:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    return f"http://127.0.0.1:{port}"


# ---------------------------------------------------------------------- rewriting


def test_a_completion_with_n_4_prefills_one_token_and_decodes_with_the_returned_params():
    async def go():
        p, d = Upstream("prefill"), Upstream("decode")
        async with Setup([p], [d]) as s:
            client = {"model": "tiny", "prompt": "hello", "n": 4, "seed": 7, "max_tokens": 16, "min_tokens": 2,
                      "stream_options": {"include_usage": True}, "kv_transfer_params": {"junk": 1}}
            status, body, headers = await s.post("/v1/completions", client)
            assert status == 200
            assert json.loads(body)["id"] == "cmpl-d"
            assert headers["X-Kvxfer-Upstream"] == d.url
            [(path, sent, _)] = p.requests
            assert path == "/v1/completions"
            assert sent == {"model": "tiny", "prompt": "hello", "n": 4, "seed": 7, "max_tokens": 1, "stream": False,
                            "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False,
                                                   "kvxfer_n": 4}}
            [(path, sent, _)] = d.requests
            assert path == "/v1/completions"
            expected = dict(client, kv_transfer_params=PARAMS)
            assert sent == expected  # the client's request as it was, with the prefill's params
    run(go())


def test_a_streaming_chat_request_is_passed_through_byte_for_byte():
    async def go():
        p, d = Upstream("prefill"), Upstream("decode")
        async with Setup([p], [d]) as s:
            client = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "n": 2,
                      "max_completion_tokens": 9, "stream": True}
            async with s.client.post(s.url + "/v1/chat/completions", json=client) as r:
                assert r.status == 200
                assert r.headers["Content-Type"].startswith("text/event-stream")
                assert await r.read() == b"".join(SSE)
            [(path, sent, _)] = p.requests
            assert path == "/v1/chat/completions"
            assert sent["max_tokens"] == 1 and sent["max_completion_tokens"] == 1 and sent["stream"] is False
            assert sent["n"] == 2 and sent["kv_transfer_params"]["kvxfer_n"] == 2
            [(path, sent, _)] = d.requests
            assert path == "/v1/chat/completions" and sent == dict(client, kv_transfer_params=PARAMS)
    run(go())


def test_without_n_the_prefill_is_asked_for_kvxfer_n_1_and_bad_n_or_json_is_refused():
    async def go():
        p, d = Upstream("prefill"), Upstream("decode")
        async with Setup([p], [d]) as s:
            status, _, _ = await s.post("/v1/completions", {"model": "tiny", "prompt": "x"})
            assert status == 200
            assert "n" not in p.requests[0][1]
            assert p.requests[0][1]["kv_transfer_params"]["kvxfer_n"] == 1
            for bad in ({"prompt": "x", "n": 0}, {"prompt": "x", "n": "2"}, [1, 2]):
                status, body, _ = await s.post("/v1/completions", bad)
                assert status == 400, bad
                assert json.loads(body)["error"]["code"] == 400
            async with s.client.post(s.url + "/v1/completions", data=b"{nope") as r:
                assert r.status == 400 and "not JSON" in (await r.json())["error"]["message"]
            assert len(p.requests) == 1 and len(d.requests) == 1
    run(go())


def test_a_prefill_without_kv_transfer_params_leaves_the_decode_to_compute_the_prompt():
    async def no_params(up, request, body):
        return web.json_response({"id": "cmpl-p", "choices": [], "kv_transfer_params": None})

    async def go():
        p, d = Upstream("prefill", no_params), Upstream("decode")
        async with Setup([p], [d]) as s:
            status, _, _ = await s.post("/v1/completions", {"prompt": "x", "kv_transfer_params": {"stale": 1}})
            assert status == 200
            assert "kv_transfer_params" not in d.requests[0][1]
    run(go())


def test_several_prompts_go_straight_to_decode():
    async def go():
        p, d = Upstream("prefill"), Upstream("decode")
        async with Setup([p], [d]) as s:
            assert (await s.post("/v1/completions", {"prompt": ["a", "b"]}))[0] == 200
            assert (await s.post("/v1/completions", {"prompt": [[1, 2], [3]]}))[0] == 200
            assert p.requests == [] and len(d.requests) == 2
            assert (await s.post("/v1/completions", {"prompt": [1, 2, 3]}))[0] == 200  # one tokenized prompt
            assert len(p.requests) == 1
    run(go())


def test_authorization_is_forwarded_and_api_key_enforced():
    async def go():
        p, d = Upstream("prefill"), Upstream("decode")
        async with Setup([p], [d], api_key="sesame") as s:
            status, body, _ = await s.post("/v1/completions", {"prompt": "x"})
            assert status == 401 and json.loads(body)["error"]["code"] == 401
            status, _, _ = await s.post("/v1/completions", {"prompt": "x"}, headers={"Authorization": "Bearer nope"})
            assert status == 401
            async with s.client.get(s.url + "/v1/models") as r:
                assert r.status == 401
            assert p.requests == [] and d.requests == []
            auth = {"Authorization": "Bearer sesame", "X-Other": "not forwarded"}
            status, _, _ = await s.post("/v1/chat/completions", {"messages": []}, headers=auth)
            assert status == 200
            for up in (p, d):
                headers = up.requests[0][2]
                assert headers["Authorization"] == "Bearer sesame" and "X-Other" not in headers
    run(go())


# ---------------------------------------------------------------------- load balancing


def test_pool_picks_least_outstanding_with_round_robin_ties():
    pool = proxy.Pool("decode", ["a", "b", "c"])
    assert [pool.pick().url for _ in range(4)] == ["a", "b", "c", "a"]
    pool.upstreams[1].outstanding = 2
    pool.upstreams[2].outstanding = 1
    assert pool.pick().url == "a"            # the only idle one, again and again
    pool.upstreams[0].outstanding = 1
    assert [pool.pick().url for _ in range(2)] == ["c", "a"]  # a and c tie at 1; b is busier
    with pytest.raises(ValueError):
        proxy.Pool("prefill", [])


def test_requests_spread_over_instances_and_avoid_a_busy_one():
    async def go():
        p0, p1 = Upstream("prefill"), Upstream("prefill")
        d0, d1 = Upstream("decode", hold), Upstream("decode")
        async with Setup([p0, p1], [d0, d1]) as s:
            # The first request is held by d0 until released.
            first = asyncio.ensure_future(s.post("/v1/completions", {"prompt": "0"}))
            await asyncio.wait_for(d0.entered.wait(), 5)
            # d0 is busy: the next ones all go to d1; the prefill instances take turns.
            for i in range(1, 5):
                status, body, _ = await s.post("/v1/completions", {"prompt": str(i)})
                assert status == 200 and json.loads(body)["served_by"] == d1.url
            assert [b["prompt"] for _, b, _ in p0.requests] == ["0", "2", "4"]
            assert [b["prompt"] for _, b, _ in p1.requests] == ["1", "3"]
            assert [u.outstanding for u in s.router.decode.upstreams] == [1, 0]
            d0.release.set()
            status, body, _ = await first
            assert status == 200 and json.loads(body)["served_by"] == d0.url
            assert [u.outstanding for u in s.router.decode.upstreams + s.router.prefill.upstreams] == [0, 0, 0, 0]
            async with s.client.get(s.url + "/v1/models") as r:
                assert r.status == 200 and (await r.json())["data"][0]["id"] == "tiny"
    run(go())


# ---------------------------------------------------------------------- errors


def test_an_unreachable_prefill_is_a_502_naming_it():
    async def go():
        d = Upstream("decode")
        dead = closed_port_url()
        async with Setup([dead], [d]) as s:
            status, body, headers = await s.post("/v1/completions", {"prompt": "x"})
            assert status == 502
            error = json.loads(body)["error"]
            assert dead in error["message"] and "prefill" in error["message"]
            assert error["code"] == 502 and error["type"] == "upstream_error"
            assert headers["X-Kvxfer-Upstream"] == dead
            assert d.requests == []
            async with s.client.get(s.url + "/health") as r:  # no prefill instance answers
                assert r.status == 503
                health = await r.json()
                assert health["prefill"][0] == {"url": dead, "healthy": False, "outstanding": 0, "in_rotation": False}
                assert health["decode"][0]["healthy"] is True
    run(go())


def test_prefill_http_errors_pass_through_and_garbage_is_a_502():
    vllm_error = b'{"error":{"message":"bad prompt","type":"BadRequestError","param":null,"code":400}}'

    async def go():
        for behave, want_status, want in (
            (answer(400, vllm_error), 400, vllm_error),
            (answer(500, b"Internal Server Error", "text/plain"), 500, b"Internal Server Error"),
            (answer(200, b"<html>not a completion</html>", "text/html"), 502, b"answered with no completion"),
            (answer(200, b'{"kv_transfer_params": 7}'), 502, b"kv_transfer_params of type int"),
        ):
            p, d = Upstream("prefill", behave), Upstream("decode")
            async with Setup([p], [d]) as s:
                status, body, headers = await s.post("/v1/completions", {"prompt": "x"})
                assert status == want_status
                assert want in body
                assert headers["X-Kvxfer-Upstream"] == p.url
                if want_status != 400:  # the router's own errors name the instance
                    assert p.url in json.loads(body)["error"]["message"]
                assert d.requests == []
    run(go())


def test_decode_errors_pass_through_and_an_unreachable_decode_is_a_502():
    async def go():
        p, d = Upstream("prefill"), Upstream("decode", answer(503, b'{"error":{"message":"busy","code":503}}'))
        async with Setup([p], [d]) as s:
            status, body, _ = await s.post("/v1/completions", {"prompt": "x", "stream": True})
            assert status == 503 and json.loads(body)["error"]["message"] == "busy"
        p = Upstream("prefill")
        dead = closed_port_url()
        async with Setup([p], [dead]) as s:
            status, body, _ = await s.post("/v1/chat/completions", {"messages": []})
            assert status == 502 and dead in json.loads(body)["error"]["message"]
    run(go())


def test_an_unreachable_decode_is_retried_on_another_and_out_of_rotation_until_it_answers():
    async def go():
        dead = closed_port_url()
        p, d = Upstream("prefill"), Upstream("decode")
        async with Setup([p], [dead, d], down_for=0.3) as s:
            for i in range(3):
                status, body, headers = await s.post("/v1/completions", {"prompt": "x", "stream": i == 1})
                assert status == 200, body
                assert headers["X-Kvxfer-Upstream"] == d.url
            assert len(d.requests) == 3
            async with s.client.get(s.url + "/health") as r:
                health = await r.json()
                assert [u["in_rotation"] for u in health["decode"]] == [False, True]
            # The instance comes back on its port: once its time out of rotation is over it
            # gets requests again (the pool's cursor and least-outstanding order).
            back = Upstream("decode", port=int(dead.rsplit(":", 1)[1]))
            await back.start()
            try:
                await asyncio.sleep(0.4)
                for _ in range(4):
                    status, _, _ = await s.post("/v1/completions", {"prompt": "x"})
                    assert status == 200
                assert back.requests, "the instance that answers again got no request"
                assert s.router.decode.upstreams[0].down_until == 0.0
            finally:
                await back.stop()
    run(go())


def silent_port_url() -> tuple[str, list[socket.socket]]:
    """A port on 127.0.0.1 whose listener never accepts and whose queue is full: a
    connection attempt there is neither accepted nor refused (SYNs dropped), as a host that
    drops packets. The sockets must stay open for it to stay so."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    for _ in range(4):  # fill the accept queue (never accepted)
        c = socket.socket()
        c.setblocking(False)
        c.connect_ex(("127.0.0.1", port))
        fillers.append(c)
    return f"http://127.0.0.1:{port}", [listener, *fillers]


def test_a_decode_that_never_answers_the_connect_is_unreachable_after_the_connect_timeout():
    async def go():
        silent, keep = silent_port_url()
        try:
            p, d = Upstream("prefill"), Upstream("decode")
            async with Setup([p], [silent, d], connect_timeout=0.5) as s:
                status, body, headers = await s.post("/v1/completions", {"prompt": "x"})
                assert status == 200, body
                assert headers["X-Kvxfer-Upstream"] == d.url
                assert s.router.decode.upstreams[0].is_down(time.monotonic())
        finally:
            for sock in keep:
                sock.close()
    run(go())


def test_a_prefill_whose_client_left_is_cut_off_after_the_grace():
    async def go():
        p, d = Upstream("prefill", hold), Upstream("decode")
        async with Setup([p], [d], prefill_grace=0.3) as s:
            task = asyncio.ensure_future(s.post("/v1/completions", {"prompt": "x"}))
            await asyncio.wait_for(p.entered.wait(), 5)
            task.cancel()
            await asyncio.wait_for(p.cancelled.wait(), 5)  # vLLM would abort it: no lease made
            await _eventually(lambda: s.router.prefill.upstreams[0].outstanding == 0)
            assert d.requests == [] and s.router.releaser.released == 0
    run(go())


def test_an_unreachable_prefill_is_retried_on_another_and_all_unreachable_is_one_502():
    async def go():
        dead, dead2 = closed_port_url(), closed_port_url()
        p, d = Upstream("prefill"), Upstream("decode")
        async with Setup([dead, p], [d]) as s:
            for _ in range(2):
                status, body, headers = await s.post("/v1/completions", {"prompt": "x"})
                assert status == 200, body
            assert len(p.requests) == 2 and len(d.requests) == 2
        async with Setup([dead, dead2], [d]) as s:
            status, body, _ = await s.post("/v1/completions", {"prompt": "x"})
            assert status == 502
            message = json.loads(body)["error"]["message"]
            assert dead in message and dead2 in message, message
    run(go())


async def reset_connection(up: Upstream, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
    """Resets the connection without answering (RST: an instance killed with the request on a
    kept-alive connection)."""
    assert request.transport is not None
    sock = request.transport.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    request.transport.close()
    await asyncio.sleep(0.05)
    return web.Response()


def test_a_prefill_that_resets_the_connection_is_retried_on_another():
    async def go():
        reset, p, d = Upstream("prefill", reset_connection), Upstream("prefill"), Upstream("decode")
        async with Setup([reset, p], [d]) as s:
            for _ in range(2):
                status, body, _ = await s.post("/v1/completions", {"prompt": "x"})
                assert status == 200, body
            assert len(reset.requests) >= 1 and len(p.requests) == 2 and len(d.requests) == 2
    run(go())


@pytest.fixture
def leased():
    """A real prefill agent and a parent of two children leased on it: the params vLLM's
    prefill answer carries (``kvxfer_children``)."""
    kvxfer = pytest.importorskip("kvxfer")
    import numpy as np

    cache = np.zeros((2, 8, 4, 2, 16), dtype=np.float16)
    agent = kvxfer.PrefillAgent(kvxfer.kv_cache_memory([cache]), engine_id="prefill-engine")
    children = [h.to_params() for h in agent.lease_parent("R", [[1], [2]])]
    params = dict(children[0], kvxfer_children=children)
    yield agent, params
    agent.shutdown()


def test_no_decode_reachable_gives_the_prefills_leases_back_before_the_502(leased):
    agent, params = leased

    async def prefill_answer(up: Upstream, request: web.Request, body: dict[str, Any]) -> web.Response:
        return web.json_response({"id": "cmpl-p", "choices": [{"index": 0, "text": "x"}], "kv_transfer_params": params})

    async def go():
        dead, dead2 = closed_port_url(), closed_port_url()
        async with Setup([Upstream("prefill", prefill_answer)], [dead, dead2]) as s:
            status, body, _ = await s.post("/v1/completions", {"prompt": "x", "n": 2})
            assert status == 502
            assert dead in json.loads(body)["error"]["message"]
            await s.router.releaser.drain()
            assert (s.router.releaser.released, s.router.releaser.refused) == (2, 0)
    run(go())
    ends = agent.wait_ends(2, timeout=10)
    assert sorted((e["kind"], e["child_index"]) for e in ends) == [("released", 0), ("released", 1)]


def test_a_client_gone_before_the_decode_answered_gives_the_leases_back(leased):
    agent, params = leased

    async def prefill_answer(up: Upstream, request: web.Request, body: dict[str, Any]) -> web.Response:
        return web.json_response({"id": "cmpl-p", "choices": [{"index": 0, "text": "x"}], "kv_transfer_params": params})

    async def go():
        p, d = Upstream("prefill", prefill_answer), Upstream("decode", hold)
        async with Setup([p], [d]) as s:
            task = asyncio.ensure_future(s.post("/v1/completions", {"prompt": "x", "n": 2}))
            await asyncio.wait_for(d.entered.wait(), 5)
            task.cancel()  # the client leaves while the decode holds its answer
            await asyncio.wait_for(d.cancelled.wait(), 5)
            await _eventually(lambda: s.router.releaser.released + s.router.releaser.refused == 2, timeout=15)
            assert s.router.releaser.released == 2
    run(go())
    ends = agent.wait_ends(2, timeout=10)
    assert {e["kind"] for e in ends} == {"released"}


# ---------------------------------------------------------------------- disconnects


def test_a_client_gone_mid_stream_cancels_the_decode_request():
    async def go():
        p, d = Upstream("prefill"), Upstream("decode", slow_stream)
        async with Setup([p], [d]) as s:
            r = await s.client.post(s.url + "/v1/completions", json={"prompt": "x", "stream": True})
            assert r.status == 200
            assert await r.content.readuntil(b"\n\n") == SSE[0]
            r.close()  # the client goes away mid-stream
            await asyncio.wait_for(d.cancelled.wait(), 5)
            await _eventually(lambda: s.router.decode.upstreams[0].outstanding == 0)
    run(go())


def test_a_client_gone_during_the_prefill_has_its_answer_read_and_its_leases_given_back(leased):
    """vLLM may make a prefill's leases before it sees its client go: the router does not cut
    the prefill request off, reads its answer and gives its leases back; nothing is decoded."""
    agent, params = leased

    async def prefill_answer(up: Upstream, request: web.Request, body: dict[str, Any]) -> web.Response:
        await up.release.wait()
        return web.json_response({"id": "cmpl-p", "choices": [{"index": 0, "text": "x"}], "kv_transfer_params": params})

    async def go():
        p, d = Upstream("prefill", prefill_answer), Upstream("decode")
        async with Setup([p], [d]) as s:
            task = asyncio.ensure_future(s.post("/v1/completions", {"prompt": "x", "n": 2}))
            await asyncio.wait_for(p.entered.wait(), 5)
            task.cancel()  # closes the client's connection
            await asyncio.sleep(0.2)
            assert not p.cancelled.is_set(), "the prefill request was cut off"
            p.release.set()  # the prefill answers, to nobody
            await _eventually(lambda: s.router.releaser.released == 2, timeout=15)
            assert s.router.prefill.upstreams[0].outstanding == 0
            assert d.requests == []
    run(go())
    ends = agent.wait_ends(2, timeout=10)
    assert {e["kind"] for e in ends} == {"released"}


def test_a_router_shut_down_while_a_left_clients_prefill_runs_still_gives_its_leases_back(leased):
    """The router stops right after a client left during its prefill: shutdown waits (at
    most the prefill grace) for that answer and gives its leases back before closing."""
    agent, params = leased

    async def prefill_answer(up: Upstream, request: web.Request, body: dict[str, Any]) -> web.Response:
        await asyncio.sleep(0.5)
        return web.json_response({"id": "cmpl-p", "choices": [{"index": 0, "text": "x"}], "kv_transfer_params": params})

    async def go():
        p, d = Upstream("prefill", prefill_answer), Upstream("decode")
        s = Setup([p], [d])
        await s.__aenter__()
        try:
            task = asyncio.ensure_future(s.post("/v1/completions", {"prompt": "x", "n": 2}))
            await asyncio.wait_for(p.entered.wait(), 5)
            task.cancel()  # closes the client's connection
            await asyncio.sleep(0.1)
            router = s.router
            await s.client.close()
            assert s.runner is not None
            await s.runner.cleanup()  # the router shuts down, the prefill still running
            s.runner = None
            assert router.releaser.released == 2, (router.releaser.released, router.releaser.refused)
        finally:
            await s.__aexit__()
    run(go())
    ends = agent.wait_ends(2, timeout=10)
    assert {e["kind"] for e in ends} == {"released"}


async def _eventually(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.01)


# ---------------------------------------------------------------------- command line


def test_command_line_and_urls():
    args = proxy.parse_args(["--prefill", "127.0.0.1:8100", "--prefill", "http://h:1/v1/", "--decode", "http://d:2",
                             "--timeout", "0", "--api-key", "k"])
    assert args.host == "127.0.0.1" and args.port == 8000 and args.timeout == 0 and args.api_key == "k"
    router = proxy.Router(args.prefill, args.decode, timeout=args.timeout)
    assert [u.url for u in router.prefill.upstreams] == ["http://127.0.0.1:8100", "http://h:1"]
    assert [u.url for u in router.decode.upstreams] == ["http://d:2"]
    assert router.timeout is None
    with pytest.raises(SystemExit):
        proxy.parse_args(["--prefill", "x"])  # no decode instance


def test_data_parallel_instances_get_each_parent_on_one_engine_in_turn():
    """With --prefill-dp-size 2 and --decode-dp-size 3, a request with n > 1 names one engine
    of each instance (vLLM's X-data-parallel-rank), engines taken in turn; n = 1 is left to
    vLLM's balancer."""

    async def go():
        p, d = Upstream("prefill"), Upstream("decode")
        async with Setup([p], [d], prefill_dp_size=2, decode_dp_size=3) as s:
            for n in (4, 2, 1, 3):
                status, _, _ = await s.post("/v1/completions", {"model": "tiny", "prompt": "x", "n": n})
                assert status == 200
            assert [h.get("X-data-parallel-rank") for _, _, h in p.requests] == ["0", "1", None, "0"]
            assert [h.get("X-data-parallel-rank") for _, _, h in d.requests] == ["0", "1", None, "2"]

    run(go())
    for kind in ("prefill_dp_size", "decode_dp_size"):
        with pytest.raises(ValueError):
            proxy.Router(["http://a"], ["http://b"], **{kind: 0})


async def cut_stream(up: Upstream, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
    """Sends one whole SSE event and half of the next, then drops the connection (a decode
    instance killed mid-answer)."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    await resp.write(SSE[0] + SSE[1][:20])
    await asyncio.sleep(0.05)
    assert request.transport is not None
    request.transport.close()
    return resp


def test_a_stream_cut_mid_event_ends_with_an_error_event_and_done_never_half_an_event():
    async def go():
        p, d = Upstream("prefill"), Upstream("decode", cut_stream)
        async with Setup([p], [d]) as s:
            status, body, _ = await s.post("/v1/completions", {"prompt": "x", "n": 2, "stream": True})
            assert status == 200
            events = body.split(b"\n\n")
            assert events[-1] == b"", body
            assert events[0] + b"\n\n" == SSE[0], "the whole first event"
            assert events[1].startswith(b"data: ") and b"upstream_error" in events[1], body
            assert json.loads(events[1][len(b"data: "):])["error"]["code"] == 502
            assert events[2] == b"data: [DONE]", "the stream ends with [DONE], as vLLM's do after an error"
            assert len(events) == 4, "no half event in between"
    run(go())


async def cut_answer(up: Upstream, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
    """Sends a 200 and half of a JSON answer, then drops the connection (a decode instance
    killed mid-answer)."""
    resp = web.StreamResponse(headers={"Content-Type": "application/json"})
    resp.content_length = 400
    await resp.prepare(request)
    await resp.write(b'{"id": "cmpl-1", "choices": [{"text": "half')
    await asyncio.sleep(0.05)
    assert request.transport is not None
    request.transport.close()
    return resp


def test_a_whole_answer_cut_short_is_a_502_not_a_200_with_half_a_body():
    async def go():
        p, d = Upstream("prefill"), Upstream("decode", cut_answer)
        async with Setup([p], [d]) as s:
            status, body, _ = await s.post("/v1/completions", {"prompt": "x", "n": 2})
            assert status == 502, (status, body)
            error = json.loads(body)["error"]
            assert error["code"] == 502 and d.url in error["message"], error
    run(go())
