"""kvxfer.lifecycle: agents shut down (leases released, logged by the agent) on SIGTERM,
SIGINT and at interpreter exit, and the signal then does what it did before."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

CHILD = textwrap.dedent(
    """
    import signal, sys, time
    import numpy as np
    import kvxfer

    kvxfer.enable_logging("info")
    src = np.zeros((2, 8, 4, 2, 16), dtype=np.float16)
    agent = kvxfer.PrefillAgent(kvxfer.kv_cache_memory([src]))
    agent.lease("P", 0, 1, [1])  # a live lease: the shutdown releases it and logs so
    # Python's own SIGINT handler, as in a terminal: a test run started in the background
    # by a shell without job control inherits SIGINT ignored (then Python installs none).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    mode = sys.argv[1]
    if mode == "exit":
        kvxfer.shutdown_at_exit(agent)
        print("ready", flush=True)
        sys.exit(0)
    if mode == "chain":
        def mine(signum, frame):
            print("my handler ran; agent closed:", agent.closed, flush=True)
            sys.exit(3)
        signal.signal(signal.SIGTERM, mine)
    kvxfer.shutdown_on_signals(agent)
    print("ready", flush=True)
    try:
        time.sleep(60)
    except KeyboardInterrupt:
        print("KeyboardInterrupt; agent closed:", agent.closed, flush=True)
        sys.exit(0)
    print("not interrupted", flush=True)
    """
)

RELEASED = "shutdown: live leases released"


def run(mode: str, send: int | None) -> tuple[int, str, str]:
    env = dict(os.environ, NO_COLOR="1")
    env.pop("RUST_LOG", None)
    p = subprocess.Popen(
        [sys.executable, "-c", CHILD, mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert p.stdout is not None
    line = p.stdout.readline()
    assert line.strip() == "ready", (line, p.stderr.read() if p.stderr else "")
    if send is not None:
        time.sleep(0.2)  # into time.sleep
        p.send_signal(send)
    out, err = p.communicate(timeout=60)
    return p.returncode, out, err


def test_sigterm_shuts_the_agents_down_then_ends_the_process_as_before():
    code, out, err = run("term", signal.SIGTERM)
    assert RELEASED in err, err
    # SIGTERM's default action still ends the process, killed by the signal.
    assert code == -signal.SIGTERM, (code, out, err)
    assert "not interrupted" not in out


def test_sigint_shuts_the_agents_down_then_raises_keyboard_interrupt():
    code, out, err = run("int", signal.SIGINT)
    assert RELEASED in err, err
    assert "KeyboardInterrupt; agent closed: True" in out, (out, err)
    assert code == 0


def test_a_handler_installed_before_still_runs_after_the_shutdown():
    code, out, err = run("chain", signal.SIGTERM)
    assert RELEASED in err, err
    assert "my handler ran; agent closed: True" in out, (out, err)
    assert code == 3


def test_agents_are_shut_down_at_interpreter_exit():
    code, out, err = run("exit", None)
    assert code == 0, err
    assert RELEASED in err, err


def test_only_the_main_thread_installs_signal_handlers():
    import threading

    import kvxfer

    errors: list[BaseException] = []

    def other() -> None:
        try:
            kvxfer.shutdown_on_signals()
        except RuntimeError as e:
            errors.append(e)

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert len(errors) == 1 and "main thread" in str(errors[0])


def test_objects_without_shutdown_are_refused():
    import kvxfer

    with pytest.raises(TypeError):
        kvxfer.shutdown_at_exit(object())
