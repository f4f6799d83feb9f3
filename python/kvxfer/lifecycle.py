"""Shutting agents down when the process is asked to stop.

An agent's ``shutdown()`` is graceful: a prefill agent stops accepting, lets reads in flight
finish (up to ``shutdown_grace``), releases every live lease (each end still reported) and
closes its connections, so a decode agent pulling one of its hand-offs is told the lease
ended instead of finding a refused connection. Python does not run it by itself when the
process stops:

- **SIGTERM** ends a Python process at once by default (no ``finally``, no ``atexit``, no
  destructor);
- at interpreter exit an agent that is merely dropped shuts down on a background thread the
  exit does not wait for.

So a process that owns agents and is stopped by signals should call ``shutdown()`` itself, or
use the two helpers here:

- :func:`shutdown_at_exit` — the agents are shut down at interpreter exit (``atexit``: the end
  of the main module, ``sys.exit()``, an uncaught ``KeyboardInterrupt`` from Ctrl-C). Safe in
  any process: it touches no signal handler.
- :func:`shutdown_on_signals` — for a process of your own: SIGTERM and SIGINT shut the agents
  down first, then do whatever the handler installed before did (the default SIGTERM still
  ends the process, killed by SIGTERM; the default SIGINT still raises
  ``KeyboardInterrupt``; a handler of yours still runs).

**Under vLLM, use neither**: vLLM's worker processes catch SIGTERM and SIGINT themselves and
shut the KV connector down on the way out (``KvxferConnector.shutdown()`` shuts both agents
down), and its multiprocessing workers do not run ``atexit`` hooks anyway.

``shutdown()`` may be called any number of times (later calls return at once), so these
helpers never conflict with an explicit one. They keep the agents given to them alive until
the exit (or until shut down), like any reference would.
"""

from __future__ import annotations

import atexit
import os
import signal
import threading
from types import FrameType
from typing import Any, Callable, Optional, Protocol, Sequence, Union

__all__ = ["shutdown_at_exit", "shutdown_on_signals", "shutdown_registered"]


class _Agent(Protocol):
    def shutdown(self) -> None: ...

    @property
    def closed(self) -> bool: ...


_lock = threading.Lock()
_agents: list[_Agent] = []
_atexit_registered = False
_Handler = Union[Callable[[int, Optional[FrameType]], Any], int, signal.Handlers, None]
_previous: dict[int, _Handler] = {}


def _keep(agents: Sequence[_Agent]) -> None:
    global _atexit_registered
    for agent in agents:
        if not callable(getattr(agent, "shutdown", None)):
            raise TypeError(f"{agent!r} has no shutdown() method")
    with _lock:
        # Agents shut down meanwhile need no reference any more.
        _agents[:] = [a for a in _agents if not getattr(a, "closed", False)]
        for agent in agents:
            if not any(a is agent for a in _agents):
                _agents.append(agent)
        if not _atexit_registered:
            atexit.register(shutdown_registered)
            _atexit_registered = True


def shutdown_registered() -> None:
    """Shuts down every agent given to :func:`shutdown_at_exit` or :func:`shutdown_on_signals`
    (in the order given; each waits for its graceful shutdown) and forgets them. What the
    ``atexit`` hook and the signal handlers run."""
    with _lock:
        agents = list(_agents)
        _agents.clear()
    for agent in agents:
        try:
            agent.shutdown()
        except Exception:  # noqa: BLE001 - one agent's failure must not keep the others up
            pass


def shutdown_at_exit(*agents: _Agent) -> None:
    """Shuts ``agents`` down at interpreter exit (``atexit``), unless they were shut down
    before. Covers a normal end, ``sys.exit()`` and an uncaught ``KeyboardInterrupt`` (SIGINT
    by default); not SIGTERM, whose default ends the process at once — see
    :func:`shutdown_on_signals`, or catch it yourself and call ``shutdown()``."""
    _keep(agents)


def shutdown_on_signals(
    *agents: _Agent,
    signals: Sequence[int] = (signal.SIGTERM, signal.SIGINT),
) -> None:
    """Shuts ``agents`` down when one of ``signals`` arrives (and at interpreter exit, as
    :func:`shutdown_at_exit`), then hands the signal on to the handler installed before:

    - Python's default SIGINT handler raises ``KeyboardInterrupt`` as before;
    - the default action (SIGTERM's) is restored and the signal sent again: the process ends
      killed by it, as it would have without this;
    - a handler of your own is called with the same arguments;
    - an ignored signal stays without effect (the agents are still shut down).

    Installing the handlers again (more agents later) keeps the first handler it found as the
    one to hand on to. Must be called from the main thread (Python runs signal handlers
    there, and ``signal.signal`` refuses other threads). Not under vLLM: see the module's
    documentation.
    """
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("shutdown_on_signals() must be called from the main thread")
    _keep(agents)
    for sig in signals:
        current = signal.getsignal(sig)
        if current is _on_signal:
            continue
        _previous[sig] = current
        signal.signal(sig, _on_signal)


def _on_signal(signum: int, frame: Optional[FrameType]) -> None:
    shutdown_registered()
    previous = _previous.get(signum, signal.SIG_DFL)
    if callable(previous):
        previous(signum, frame)
    elif previous == signal.SIG_IGN:
        return
    else:
        # SIG_DFL (or a handler not installed from Python: None): the default action.
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
