"""Two Python processes — a vLLM prefill instance and a vLLM decode instance, each with the
kvxfer connector and numpy KV caches shaped like vLLM's — over TCP on 127.0.0.1, a parent
with n = 4: every child's bytes verified, every lease ends pulled, none expired, no
unrecognized notification."""

from __future__ import annotations

import multiprocessing as mp

import two_process_workers as workers

N = 4


def recv(conn, what: str, timeout: float = 90.0):
    assert conn.poll(timeout), f"no {what} within {timeout} s"
    msg = conn.recv()
    if isinstance(msg, dict) and "error" in msg:
        raise AssertionError(f"{what} failed:\n{msg['error']}")
    return msg


def test_a_parent_with_four_children_across_two_processes():
    ctx = mp.get_context("spawn")
    p_here, p_there = ctx.Pipe()
    d_here, d_there = ctx.Pipe()
    prefill = ctx.Process(target=workers.prefill_main, args=(p_there, N), name="vllm-prefill")
    decode = ctx.Process(target=workers.decode_main, args=(d_there, N), name="vllm-decode")
    prefill.start()
    decode.start()
    try:
        params = recv(p_here, "the prefill instance's params")
        assert len(params["kvxfer_children"]) == N, "the kept params carry every child's hand-off"
        d_here.send(params)  # the router forwards them to the decode instance
        result = recv(d_here, "the decode instance's result")
        assert result["verified"] == [True] * N, "every child's bytes"
        assert result["recving"] == [f"{i}_D" for i in range(N)]
        assert result["load_errors"] == []
        assert result["decode"]["children_done"] == N
        assert result["decode"]["notifications_unacknowledged"] == 0
        books = recv(p_here, "the prefill instance's lease counters")
        assert books["sending"] == [f"{i}_R" for i in range(N)]
        leases = books["leases"]
        assert (leases["pulled"], leases["expired"], leases["released"]) == (N, 0, 0), leases
        assert leases["unrecognized"] == 0 and leases["bad_token"] == 0, leases
    finally:
        for p in (prefill, decode):
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert prefill.exitcode == 0 and decode.exitcode == 0
