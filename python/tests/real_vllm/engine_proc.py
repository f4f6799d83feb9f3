"""One real vLLM engine (the offline ``LLM`` API, with vLLM's multiprocess engine core) in a
process of its own, driven over stdin/stdout by the real-engine tests.

``python engine_proc.py MODEL_DIR [KV_TRANSFER_CONFIG_JSON]`` prints ``READY`` once the
engine is up, then answers one JSON command per line with ``RESULT <json>``:

- ``{"op": "generate", "prompts": [...], "sampling": {...SamplingParams kwargs...},
  "kv_transfer_params": {...} | [...] | null}``: every request's outputs (token ids,
  logprobs of the sampled tokens, text) and the ``kv_transfer_params`` vLLM returned.
- ``{"op": "metrics"}``: the engine's ``vllm:kvxfer_*`` (and ``vllm:nixl_*``) Prometheus
  series (the connector's ``KVConnectorPromMetrics``, fed through vLLM's own stats path);
  histograms as ``{"count", "sum"}``.
- ``{"op": "quit"}``.
"""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # Results go to the original stdout; everything else (vLLM logs to stdout, and so do
    # the engine core and worker processes it starts) goes to stderr, the engine's log.
    results = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    from vllm import LLM, SamplingParams

    model = sys.argv[1]
    kv = json.loads(sys.argv[2]) if len(sys.argv) > 2 and sys.argv[2] else None
    kwargs = dict(
        model=model,
        dtype="float32",
        max_model_len=256,
        enforce_eager=True,
        seed=0,
        block_size=32,
        disable_log_stats=False,
    )
    if kv is not None:
        from vllm.config import KVTransferConfig

        kwargs["kv_transfer_config"] = KVTransferConfig(**kv)
    llm = LLM(**kwargs)
    print("READY", file=results, flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        if cmd["op"] == "metrics":
            series = {}
            for m in llm.get_metrics():
                if "kvxfer" in m.name or "nixl" in m.name:
                    # A series with a `transports` label is keyed by it too.
                    transports = (getattr(m, "labels", None) or {}).get("transports")
                    name = f"{m.name}{{transports={transports}}}" if transports else m.name
                    if hasattr(m, "sum") and hasattr(m, "count"):
                        series[name] = {"count": m.count, "sum": m.sum}
                    else:
                        series[name] = getattr(m, "value", None)
            print("RESULT " + json.dumps(series), file=results, flush=True)
            continue
        sampling = dict(cmd.get("sampling") or {})
        if cmd.get("kv_transfer_params") is not None:
            sampling["extra_args"] = {"kv_transfer_params": cmd["kv_transfer_params"]}
        outputs = llm.generate(cmd["prompts"], SamplingParams(**sampling), use_tqdm=False)
        result = []
        for out in outputs:
            choices = []
            for c in sorted(out.outputs, key=lambda c: c.index):
                logprobs = None
                if c.logprobs is not None:
                    logprobs = [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)]
                choices.append({"index": c.index, "token_ids": list(c.token_ids), "text": c.text, "logprobs": logprobs})
            result.append({"request_id": out.request_id, "choices": choices, "kv_transfer_params": out.kv_transfer_params})
        print("RESULT " + json.dumps(result), file=results, flush=True)


if __name__ == "__main__":
    main()
