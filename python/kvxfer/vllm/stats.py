"""Transfer statistics in vLLM's own channels: ``KVConnectorStats`` (the periodic "KV
Transfer metrics" log line) and ``KVConnectorPromMetrics`` (``/metrics``).

A worker records each finished pull (decode side) and each lease end (prefill side); vLLM
ships the records to its logger process, aggregates them across workers and intervals, and
hands them to :class:`KvxferPromMetrics`."""

from __future__ import annotations

from typing import Any

try:  # pragma: no cover - exercised only where vLLM is installed
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics as _PromBase,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorStats as _StatsBase,
    )
except ImportError:  # no vLLM (or one without connector metrics)

    class _StatsBase:  # type: ignore[no-redef]
        """Stand-in for vLLM's ``KVConnectorStats``."""

        def __init__(self, data: Any = None) -> None:
            self.data = data if data is not None else {}

    class _PromBase:  # type: ignore[no-redef]
        """Stand-in for vLLM's ``KVConnectorPromMetrics``."""

        def __init__(self, vllm_config: Any, metric_types: Any, labelnames: Any, per_engine_labelvalues: Any):
            self._gauge_cls, self._counter_cls, self._histogram_cls = (None, None, None)
            self._labelnames = labelnames
            self.per_engine_labelvalues = per_engine_labelvalues


# Counters summed across workers and intervals; "seconds" and "bytes" are per-pull lists.
COUNTERS = (
    "pulls_done",
    "pulls_failed",
    "pulls_cancelled",
    "leases_made",
    "leases_pulled",
    "leases_released",
    "leases_expired",
    # Completed pulls by data path (a report's "path"), and their bytes.
    "pulls_ucx",
    "pulls_tcp",
    "bytes_ucx",
    "bytes_tcp",
)
LEASE_END_COUNTER = {"pulled": "leases_pulled", "released": "leases_released", "expired": "leases_expired"}


def _empty() -> dict[str, Any]:
    out: dict[str, Any] = {k: 0 for k in COUNTERS}
    out["seconds"] = []
    out["bytes"] = []
    # Per completed UCX pull, the transports its endpoint used, as UCX names them
    # ("cma/memory,posix/memory,sysv/memory", "tcp/eth0").
    out["ucx_paths"] = []
    return out


class KvxferConnectorStats(_StatsBase):  # type: ignore[misc]
    """Pulls and lease ends since the last interval (serializable: a dict of ints and
    lists)."""

    def __init__(self, data: Any = None) -> None:
        full = _empty()
        for k, v in (data or {}).items():
            if k in full:
                full[k] = list(v) if isinstance(full[k], list) else int(v)
        super().__init__(data=full)

    def record(self, report: dict[str, Any]) -> None:
        """One decode-side pull report (``DecodeAgent.poll_reports``)."""
        outcome = report.get("outcome")
        if outcome == "done":
            self.data["pulls_done"] += 1
            self.data["seconds"].append(float(report.get("seconds") or 0.0))
            self.data["bytes"].append(int(report.get("bytes_delivered") or 0))
            path = str(report.get("path") or "")
            kind = "ucx" if path.startswith("ucx") else "tcp" if path == "tcp" else None
            if kind is not None:
                self.data[f"pulls_{kind}"] += 1
                self.data[f"bytes_{kind}"] += int(report.get("bytes_delivered") or 0)
            if kind == "ucx":
                self.data["ucx_paths"].append(",".join(sorted(report.get("ucx_transports") or ())) or "unknown")
        elif outcome == "cancelled":
            self.data["pulls_cancelled"] += 1
        else:
            self.data["pulls_failed"] += 1

    def record_made(self, count: int) -> None:
        """Prefill-side leases armed (each ends once: pulled, released or expired)."""
        self.data["leases_made"] += count

    def record_end(self, kind: str) -> None:
        """One prefill-side lease end ("pulled", "released" or "expired")."""
        key = LEASE_END_COUNTER.get(kind)
        if key is not None:
            self.data[key] += 1

    def reset(self) -> None:
        self.data = _empty()

    def aggregate(self, other: Any) -> "KvxferConnectorStats":
        theirs = getattr(other, "data", None) or {}
        for k in COUNTERS:
            self.data[k] += int(theirs.get(k, 0))
        self.data["seconds"].extend(theirs.get("seconds", ()))
        self.data["bytes"].extend(theirs.get("bytes", ()))
        self.data["ucx_paths"].extend(str(p) for p in theirs.get("ucx_paths", ()))
        return self

    def reduce(self) -> dict[str, int | float]:
        seconds = sorted(self.data["seconds"])
        total_bytes = sum(self.data["bytes"])
        out: dict[str, int | float] = {k: self.data[k] for k in COUNTERS}
        if seconds:
            out["avg_pull_ms"] = round(1000 * sum(seconds) / len(seconds), 3)
            out["p90_pull_ms"] = round(1000 * seconds[min(len(seconds) - 1, int(0.9 * len(seconds)))], 3)
            out["pulled_MiB"] = round(total_bytes / (1 << 20), 3)
        names = {n for p in self.data["ucx_paths"] for n in p.split(",")}
        if names:
            out["ucx_transports"] = ",".join(sorted(names))  # type: ignore[assignment]
        return out

    def is_empty(self) -> bool:
        return not any(self.data[k] for k in COUNTERS)


class KvxferPromMetrics(_PromBase):  # type: ignore[misc]
    """kvxfer's series in vLLM's ``/metrics`` (one per engine label set)."""

    def __init__(self, vllm_config: Any, metric_types: Any, labelnames: Any, per_engine_labelvalues: Any) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {}
        for key, doc in (
            ("pulls_done", "KV-cache pulls that completed"),
            ("pulls_failed", "KV-cache pulls that failed (their blocks reported as load errors)"),
            ("pulls_cancelled", "KV-cache pulls cancelled (the request was aborted)"),
            ("leases_made", "Prefill leases armed; each ends once, pulled, released or expired"),
            ("leases_pulled", "Prefill leases that ended pulled by every expected consumer"),
            ("leases_released", "Prefill leases released without a pull"),
            ("leases_expired", "Prefill leases that expired unpulled (their blocks were held until then)"),
            ("pulls_ucx", "KV-cache pulls that completed over UCX"),
            ("pulls_tcp", "KV-cache pulls that completed over kvxfer's TCP data path"),
            ("bytes_ucx", "Bytes pulled over UCX"),
            ("bytes_tcp", "Bytes pulled over kvxfer's TCP data path"),
        ):
            counter = self._counter_cls(name=f"vllm:kvxfer_{key}", documentation=doc, labelnames=labelnames)
            self._counters[key] = {i: counter.labels(*v) for i, v in per_engine_labelvalues.items()}
        histogram = self._histogram_cls(
            name="vllm:kvxfer_pull_seconds",
            documentation="Time from a pull's submission to its report",
            buckets=[0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0],
            labelnames=labelnames,
        )
        self._seconds = {i: histogram.labels(*v) for i, v in per_engine_labelvalues.items()}
        pulled = self._counter_cls(
            name="vllm:kvxfer_pulled_bytes", documentation="Bytes pulled into this engine's KV cache",
            labelnames=labelnames,
        )
        self._bytes = {i: pulled.labels(*v) for i, v in per_engine_labelvalues.items()}
        self._labelvalues = per_engine_labelvalues
        self._ucx_pulls = self._counter_cls(
            name="vllm:kvxfer_ucx_pulls",
            documentation="KV-cache pulls that completed over UCX, by the transports UCX's endpoint used",
            labelnames=[*labelnames, "transports"],
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, by_engine in self._counters.items():
            n = int(transfer_stats_data.get(key, 0) or 0)
            if n:
                by_engine[engine_idx].inc(n)
        for s in transfer_stats_data.get("seconds", ()) or ():
            self._seconds[engine_idx].observe(float(s))
        total = sum(int(b) for b in transfer_stats_data.get("bytes", ()) or ())
        if total:
            self._bytes[engine_idx].inc(total)
        for path in transfer_stats_data.get("ucx_paths", ()) or ():
            self._ucx_pulls.labels(*self._labelvalues[engine_idx], str(path)).inc()
