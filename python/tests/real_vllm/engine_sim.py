"""Real vLLM engines on a CPU with only the forward pass faked: what the real-vLLM
connector tests drive.

Everything but the model's forward is vLLM's own code, called the way vLLM's engine core,
executor, model runner and front end call it:

- **Config and KV cache.** A real ``VllmConfig`` over the tiny local model
  (``tiny_model.py``); the layers' KV-cache specs as vLLM's attention layers state them
  (``FullAttentionSpec`` from the model config), the layout resolved by
  ``resolve_kv_cache_layout`` from the layouts an attention backend declares (the CPU
  backend's by default), the KV-cache configs planned by ``get_kv_cache_configs`` and the
  tensors allocated by ``allocate_kv_cache`` on the CPU.
- **Scheduler side.** The scheduler class the config names (``Scheduler`` or
  ``AsyncScheduler``), which creates the connector itself (its ``KVConnectorFactory``);
  the handshake metadata the worker reports is handed to it as ``EngineCore`` does.
- **Worker side.** The connector made by ``KVConnectorFactory.create_connector(...,
  WORKER, kv_cache_config)``, given the allocated tensors (``register_kv_caches``) and
  vLLM's ``copy_kv_blocks`` (``set_host_xfer_buffer_ops``). Each step runs vLLM's own
  ``KVConnectorModelRunnerMixin`` around the fake forward (so the hooks are called in the
  model runner's order), with vLLM's worker-process connector global pointed at this
  engine's connector for the step.
- **Crossing processes.** The ``SchedulerOutput`` and the ``ModelRunnerOutput`` are
  pickled as the multiprocess executor's message queue pickles them (with its tensor
  reducer), the output aggregated by ``KVOutputAggregator``; ``EngineCoreRequest`` and
  ``EngineCoreOutputs`` cross as msgpack (vLLM's ``MsgpackEncoder`` / ``MsgpackDecoder``).
- **Front end.** Requests are built as ``EngineCoreRequest``, given internal ids by
  ``InputProcessor.assign_request_id``, fanned out with ``ParentRequest`` for n > 1, and
  their outputs turned into ``RequestOutput`` by ``OutputProcessor``. Connector stats go
  through ``KVConnectorLogging`` as vLLM's stat logger feeds it.

The fake forward writes, for every scheduled token of every request, words derived from
(the prompt's token ids, the position, the layer) into that token's slot of each layer's
cache, and samples ``SAMPLED_TOKEN``.
"""

from __future__ import annotations

import copy
import copyreg
import io
import pickle
import time
import zlib
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch

from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.distributed.device_communicators import shm_broadcast
from vllm.distributed.kv_transfer import kv_transfer_state
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator, copy_kv_blocks
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging
from vllm.forward_context import set_forward_context
from vllm.outputs import RequestOutput
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout
from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
from vllm.v1.core.kv_cache_utils import (
    generate_scheduler_kv_cache_config,
    get_request_block_hasher,
    init_none_hash,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest
from vllm.v1.engine.input_processor import InputProcessor
from vllm.v1.engine.output_processor import OutputProcessor
from vllm.v1.engine.parallel_sampling import ParentRequest
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin
from vllm.v1.worker.utils import allocate_kv_cache

# The token the fake sampler always picks (a byte of the tiny model's vocabulary, not EOS).
SAMPLED_TOKEN = 65
# How vLLM's Llama names its attention layers (the keys of the KV-cache dict).
LAYER_NAME = "model.layers.{}.self_attn.attn"


def cpu_attention_layouts() -> list[str]:
    """The KV-cache layouts vLLM's CPU attention backend declares (what a worker on a CPU
    reports to the engine core)."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    return [layout.name for layout in get_supported_kv_cache_layouts([CPUAttentionBackend])]


def default_attention_layouts() -> list[str]:
    """The layouts a worker reports when no backend states a preference (vLLM's default
    order, as on a GPU with FlashAttention)."""
    return [layout.name for layout in get_supported_kv_cache_layouts([])]


def make_vllm_config(
    model_dir: str,
    kv_role: str,
    *,
    async_scheduling: bool,
    extra_config: Optional[dict[str, Any]] = None,
    num_blocks: int = 128,
    block_size: int = 16,
    max_model_len: int = 512,
    kv_load_failure_policy: str = "fail",
    max_num_seqs: int = 16,
) -> VllmConfig:
    model = ModelConfig(model=model_dir, tokenizer=model_dir, dtype="float32", seed=0, max_model_len=max_model_len)
    scheduler = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=256,
        max_model_len=max_model_len,
        is_encoder_decoder=model.is_encoder_decoder,
        async_scheduling=async_scheduling,
    )
    cache = CacheConfig(block_size=block_size, enable_prefix_caching=True, num_gpu_blocks_override=num_blocks)
    transfer = KVTransferConfig(
        kv_connector="KvxferConnector",
        kv_connector_module_path="kvxfer.vllm",
        kv_role=kv_role,
        kv_connector_extra_config=dict(extra_config or {}),
        kv_load_failure_policy=kv_load_failure_policy,
    )
    return VllmConfig(
        model_config=model,
        scheduler_config=scheduler,
        cache_config=cache,
        kv_transfer_config=transfer,
        device_config=DeviceConfig("cpu"),
    )


def mq_roundtrip(obj: Any) -> Any:
    """``obj`` after crossing vLLM's multiprocess message queue (``MessageQueue.enqueue``
    / ``dequeue``): pickled at the highest protocol with the queue's tensor reducer, large
    buffers out of band."""
    out_of_band: list[Any] = []

    def keep_large_apart(buf: pickle.PickleBuffer) -> bool:
        raw = buf.raw()
        if len(raw) < 1 << 20:
            return True
        out_of_band.append(bytearray(raw))
        return False

    table = dict(copyreg.dispatch_table)
    table[torch.Tensor] = shm_broadcast._reduce_tensor
    with io.BytesIO() as bio:
        pickler = pickle.Pickler(bio, protocol=pickle.HIGHEST_PROTOCOL, buffer_callback=keep_large_apart)
        pickler.dispatch_table = table
        pickler.dump(obj)
        data = bio.getvalue()
    return pickle.loads(data, buffers=out_of_band)


def msgpack_roundtrip(obj: Any, kind: type) -> Any:
    """``obj`` after crossing between vLLM's front end and engine core (msgpack)."""
    return MsgpackDecoder(kind).decode(MsgpackEncoder().encode(obj))


def slot_words(prompt: list[int], position: int, layer: int, count: int) -> torch.Tensor:
    """What the fake forward writes into one token's slot of one layer: ``count`` int32
    words derived from the prompt's token ids, the position and the layer."""
    key = zlib.crc32(b",".join(str(t).encode() for t in prompt))
    seed = (key * 1_000_003 + position * 7_919 + layer * 104_729) % (1 << 31)
    return ((seed + torch.arange(count, dtype=torch.int64) * 2_654_435_761) % (1 << 31)).to(torch.int32)


@contextmanager
def worker_connector(connector: Any) -> Iterator[None]:
    """vLLM's worker-process connector global (``get_kv_transfer_group()``) pointed at
    ``connector`` for the duration: several engines' workers share this process."""
    previous = kv_transfer_state._KV_CONNECTOR_AGENT
    kv_transfer_state._KV_CONNECTOR_AGENT = connector
    try:
        yield
    finally:
        kv_transfer_state._KV_CONNECTOR_AGENT = previous


@dataclass
class _RunnerRequest:
    prompt: list[int]
    block_ids: tuple[list[int], ...]


class FakeWorker:
    """One worker (TP rank 0): vLLM's KV-cache tensors and worker-side connector, and a
    model runner whose forward only writes deterministic words into the KV cache."""

    def __init__(
        self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, layout: Any, defer_finalize: bool = False
    ) -> None:
        self.vllm_config = vllm_config
        # The order GPUModelRunner keeps with a speculative config: the step's finished
        # transfers are asked for before wait_for_save, which runs after the draft model's
        # forward (KVConnectorModelRunnerMixin.finalize_kv_connector).
        self.defer_finalize = defer_finalize
        self.kv_cache_config = kv_cache_config
        self.block_size = vllm_config.cache_config.block_size
        # As the model runner: the connector before the tensors, then registration.
        self.connector = KVConnectorFactory.create_connector(
            config=vllm_config, role=KVConnectorRole.WORKER, kv_cache_config=kv_cache_config
        )
        self.kv_caches: dict[str, torch.Tensor] = allocate_kv_cache(kv_cache_config, torch.device("cpu"), layout)
        self.layers = list(self.kv_caches)
        self.connector.register_kv_caches(self.kv_caches)
        self.connector.set_host_xfer_buffer_ops(copy_kv_blocks)
        self.requests: dict[str, _RunnerRequest] = {}
        # The connector metadata of each step as the worker received it (deserialized).
        self.received_metadata: list[Any] = []

    def handshake_metadata(self) -> Optional[dict[tuple[int, int], Any]]:
        """What ``Worker.get_kv_connector_handshake_metadata`` returns: keyed by (pp, tp)."""
        meta = self.connector.get_handshake_metadata()
        return None if meta is None else {(0, 0): meta}

    def _words(self, cache: torch.Tensor) -> torch.Tensor:
        assert cache.element_size() == 4, "the fake forward writes 32-bit words"
        return cache.view(torch.int32)

    def _update_states(self, so: SchedulerOutput) -> None:
        for rid in so.finished_req_ids:
            self.requests.pop(rid, None)
        if so.new_block_ids_to_zero:
            for cache in self.kv_caches.values():
                cache[so.new_block_ids_to_zero] = 0
        assert not so.kv_cache_block_copies, "copy-on-write blocks are not modelled by this fake runner"
        for new in so.scheduled_new_reqs:
            assert new.prompt_token_ids is not None
            blocks = tuple(list(b) for b in new.block_ids)
            self.requests[new.req_id] = _RunnerRequest(list(new.prompt_token_ids), blocks)
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            state = self.requests[rid]
            blocks = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                assert blocks is not None
                state.block_ids = tuple(list(b) for b in blocks)
            elif blocks is not None:
                for group, more in zip(state.block_ids, blocks):
                    group.extend(more)

    def _computed_before(self, so: SchedulerOutput) -> dict[str, int]:
        start = {new.req_id: new.num_computed_tokens for new in so.scheduled_new_reqs}
        cached = so.scheduled_cached_reqs
        start.update(zip(cached.req_ids, cached.num_computed_tokens))
        return start

    def _forward(self, so: SchedulerOutput, start: dict[str, int]) -> None:
        for rid, count in so.num_scheduled_tokens.items():
            state = self.requests[rid]
            blocks = state.block_ids[0]
            for position in range(start[rid], start[rid] + count):
                block, offset = blocks[position // self.block_size], position % self.block_size
                for layer, name in enumerate(self.layers):
                    words = self._words(self.kv_caches[name])
                    heads, width = words.shape[1], words.shape[3]
                    words[block, :, offset, :] = slot_words(state.prompt, position, layer, heads * width).view(
                        heads, width
                    )

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """One step as ``GPUModelRunner.execute_model`` + ``sample_tokens`` run it."""
        self.received_metadata.append(so.kv_connector_metadata)
        with worker_connector(self.connector):
            assert so.kv_connector_metadata is not None
            kv_transfer_state.get_kv_transfer_group().handle_preemptions(so.kv_connector_metadata)
            self._update_states(so)
            if not so.total_num_scheduled_tokens:
                return KVConnectorModelRunnerMixin.kv_connector_no_forward(so, self.vllm_config)
            start = self._computed_before(so)
            with (
                set_forward_context(None, self.vllm_config),
                KVConnectorModelRunnerMixin.maybe_get_kv_connector_output(
                    so, defer_finalize=self.defer_finalize
                ) as kv_connector_output,
            ):
                self._forward(so, start)
            if self.defer_finalize:
                KVConnectorModelRunnerMixin.finalize_kv_connector()  # after the draft's forward
        req_ids = list(so.num_scheduled_tokens)
        sampled = [
            [SAMPLED_TOKEN] if start[rid] + so.num_scheduled_tokens[rid] >= len(self.requests[rid].prompt) else []
            for rid in req_ids
        ]
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
            sampled_token_ids=sampled,
            kv_connector_output=kv_connector_output,
        )

    def block_words(self, block_ids: list[int]) -> torch.Tensor:
        """A copy of blocks ``block_ids`` of every layer, as int32 words: [layer, block,
        heads, tokens, words]."""
        return torch.stack([self._words(self.kv_caches[n])[list(block_ids)].clone() for n in self.layers])

    def expected_prompt_mismatches(self, words: torch.Tensor, prompt: list[int], first_position: int = 0) -> int:
        """How many prompt slots of ``words`` (``block_words`` of a request's blocks, the
        first holding position ``first_position``) differ from what the fake forward writes."""
        bad = 0
        for position in range(first_position, len(prompt)):
            rel = position - first_position
            for layer in range(words.shape[0]):
                heads, width = words.shape[2], words.shape[4]
                want = slot_words(prompt, position, layer, heads * width).view(heads, width)
                if not torch.equal(words[layer, rel // self.block_size, :, rel % self.block_size, :], want):
                    bad += 1
        return bad

    def shutdown(self) -> None:
        self.connector.shutdown()


@dataclass
class StepRecord:
    """What one engine step reported back to the scheduler (after aggregation)."""

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    invalid_block_ids: set[int] = field(default_factory=set)
    scheduled: dict[str, int] = field(default_factory=dict)
    preempted: set[str] = field(default_factory=set)


class Engine:
    """An engine core (scheduler, executor with one fake worker) and its front end."""

    def __init__(
        self,
        model_dir: str,
        kv_role: str,
        *,
        async_scheduling: bool = False,
        extra_config: Optional[dict[str, Any]] = None,
        attention_layouts: Optional[list[str]] = None,
        num_blocks: int = 128,
        max_model_len: int = 512,
        kv_load_failure_policy: str = "fail",
        max_num_seqs: int = 16,
        defer_finalize: bool = False,
        block_size: int = 16,
    ) -> None:
        self.vllm_config = config = make_vllm_config(
            model_dir,
            kv_role,
            async_scheduling=async_scheduling,
            extra_config=extra_config,
            num_blocks=num_blocks,
            max_model_len=max_model_len,
            kv_load_failure_policy=kv_load_failure_policy,
            max_num_seqs=max_num_seqs,
            block_size=block_size,
        )
        # EngineCore._initialize_kv_caches: specs, layout, planning.
        register_all_kvcache_specs(config)
        model, parallel = config.model_config, config.parallel_config
        spec = FullAttentionSpec(
            block_size=config.cache_config.block_size,
            num_kv_heads=model.get_num_kv_heads(parallel),
            head_size=model.get_head_size(),
            dtype=model.dtype,
        )
        specs = {LAYER_NAME.format(i): spec for i in range(model.get_num_layers(parallel))}
        self.layout = resolve_kv_cache_layout(config, [attention_layouts or cpu_attention_layouts()], specs.values())
        groups = get_global_kv_cache_groups(config, [specs])
        page = spec.page_size_bytes * len(specs)
        kv_cache_configs = get_kv_cache_configs(config, [specs], [page * (num_blocks + 1)], groups)
        for c in kv_cache_configs:
            c.kv_cache_layout = config.cache_config.kv_cache_layout
        scheduler_kv_cache_config = generate_scheduler_kv_cache_config(kv_cache_configs)
        config.cache_config.num_gpu_blocks = scheduler_kv_cache_config.num_blocks
        block_size, hash_block_size = resolve_kv_cache_block_sizes(scheduler_kv_cache_config, config)
        for c in (*kv_cache_configs, scheduler_kv_cache_config):
            c.hash_block_size = hash_block_size
        # The executor's worker comes first (it registers the KV cache) ...
        self.worker = FakeWorker(config, kv_cache_configs[0], self.layout, defer_finalize)
        # ... then the scheduler, which makes the scheduler-side connector itself.
        scheduler_cls = config.scheduler_config.get_scheduler_cls()
        self.scheduler = scheduler_cls(
            vllm_config=config,
            kv_cache_config=scheduler_kv_cache_config,
            structured_output_manager=StructuredOutputManager(config),
            log_stats=True,
            block_size=block_size,
            hash_block_size=hash_block_size,
        )
        self.connector = self.scheduler.connector
        assert self.connector is not None
        self.aggregator = KVOutputAggregator.from_connector(self.connector, world_size=1)
        # EngineCore._set_kv_connector_handshake_metadata (the worker's answer pickled back).
        handshake = mq_roundtrip(self.worker.handshake_metadata())
        if handshake:
            self.connector.set_xfer_handshake_metadata_pp_aware(handshake)
        hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self.block_hasher = get_request_block_hasher(hash_block_size, hash_fn, config.num_hash_lookahead_tokens)
        self.batch_queue_size = config.max_concurrent_batches
        self.batch_queue: Optional[deque[tuple[ModelRunnerOutput, SchedulerOutput]]] = (
            deque(maxlen=self.batch_queue_size) if self.batch_queue_size > 1 else None
        )
        self.output_processor = OutputProcessor(None, log_stats=False)
        self.kv_logging = KVConnectorLogging(config.kv_transfer_config)
        self.aborts_queue: list[str] = []
        self.free_blocks_at_start = self.free_blocks()
        # Records (for the tests).
        self.steps = 0
        self.records: list[StepRecord] = []
        # The connector metadata of each step as the scheduler built it (before pickling).
        self.sent_metadata: list[Any] = []
        self.core_outputs: list[EngineCoreOutput] = []
        self.kv_connector_stats: list[dict[str, Any]] = []
        self.sent_words: dict[str, tuple[dict[str, Any], torch.Tensor]] = {}
        self.recv_words: dict[str, tuple[list[int], torch.Tensor]] = {}
        self.prompts: dict[str, list[int]] = {}

    # ------------------------------------------------------------------ front end

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        *,
        n: int = 1,
        max_tokens: int = 1,
        kv_transfer_params: Optional[dict[str, Any]] = None,
    ) -> list[str]:
        """``LLMEngine.add_request`` for token ids: returns the internal ids of the
        requests the engine core got (the children for n > 1)."""
        extra = {"kv_transfer_params": dict(kv_transfer_params)} if kv_transfer_params is not None else None
        params = SamplingParams(n=n, max_tokens=max_tokens, output_kind=RequestOutputKind.FINAL_ONLY, extra_args=extra)
        request = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            mm_features=None,
            sampling_params=params,
            pooling_params=None,
            arrival_time=time.time(),
            lora_request=None,
            cache_salt=None,
            data_parallel_rank=None,
        )
        InputProcessor.assign_request_id(request)
        if n == 1:
            fanned: list[tuple[EngineCoreRequest, Optional[ParentRequest], int]] = [(request, None, 0)]
        else:
            parent = ParentRequest(request)
            fanned = []
            for index in range(n):
                child_id, child_params = parent.get_child_info(index)
                child = request if index == n - 1 else copy.copy(request)
                child.request_id = child_id
                child.sampling_params = child_params
                fanned.append((child, parent, index))
        ids = []
        for child, parent_req, index in fanned:
            self.output_processor.add_request(child, None, parent_req, index)
            self._core_add(msgpack_roundtrip(child, EngineCoreRequest))
            self.prompts[child.request_id] = list(prompt_token_ids)
            ids.append(child.request_id)
        return ids

    def notify_rejected(self, request_id: str, kv_transfer_params: dict[str, Any]) -> None:
        """``AsyncLLM.notify_kv_transfer_request_rejected``: what vLLM's API server sends
        the engine core when it refuses a request carrying ``do_remote_prefill`` params
        before admitting it (a pre-aborted request, so the connector frees what the
        params pin on the prefill side)."""
        request = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=[0],
            mm_features=None,
            sampling_params=SamplingParams(
                max_tokens=1, extra_args={"kv_transfer_params": dict(kv_transfer_params)}, watermarking=False
            ),
            pooling_params=None,
            arrival_time=time.time(),
            lora_request=None,
            cache_salt=None,
            data_parallel_rank=None,
            abort_immediately=True,
        )
        self._core_add(msgpack_roundtrip(request, EngineCoreRequest))

    def _core_add(self, request: EngineCoreRequest) -> None:
        """``EngineCore.preprocess_add_request`` + ``add_request``."""
        req = Request.from_engine_core_request(request, self.block_hasher)
        self.scheduler.add_request(req)
        if request.abort_immediately:
            self._core_abort([req.request_id])

    def _core_abort(self, request_ids: list[str]) -> None:
        """``EngineCore.abort_requests``."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def abort(self, request_ids: list[str]) -> None:
        """An abort the engine core takes from its input queue (between steps)."""
        self.output_processor.abort_requests(request_ids, internal=True)
        self._core_abort(request_ids)

    def abort_during_next_step(self, request_ids: list[str]) -> None:
        """An abort that arrives while the next step's model runs (``aborts_queue``:
        applied after the forward, before the output is processed)."""
        self.output_processor.abort_requests(request_ids, internal=True)
        self.aborts_queue.extend(request_ids)

    def has_unfinished_requests(self) -> bool:
        """What ``LLMEngine.has_unfinished_requests`` answers (the offline API's loop)."""
        return self.output_processor.has_unfinished_requests()

    # ------------------------------------------------------------------ engine core

    def _execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """The multiprocess executor's ``execute_model``: the scheduler output pickled to
        the worker, its output pickled back and aggregated."""
        self.sent_metadata.append(so.kv_connector_metadata)
        output = mq_roundtrip(self.worker.execute_model(mq_roundtrip(so)))
        output = self.aggregator.aggregate([output], 0)
        record = StepRecord(scheduled=dict(so.num_scheduled_tokens), preempted=set(so.preempted_req_ids or ()))
        kv = output.kv_connector_output
        if kv is not None:
            record.finished_sending = set(kv.finished_sending or ())
            record.finished_recving = set(kv.finished_recving or ())
            record.invalid_block_ids = set(kv.invalid_block_ids or ())
            for rid in record.finished_recving:
                # The pulled blocks, before any later forward writes the request's tail.
                if rid in self.scheduler.requests:
                    blocks = list(self.scheduler.kv_cache_manager.get_block_ids(rid)[0])
                    self.recv_words[rid] = (blocks, self.worker.block_words(blocks))
        self.records.append(record)
        return output

    def _process_aborts_queue(self) -> None:
        if self.aborts_queue:
            ids, self.aborts_queue = self.aborts_queue, []
            self._core_abort(ids)

    def step(self) -> list[RequestOutput]:
        """One ``EngineCore.step`` (or ``step_with_batch_queue`` with async scheduling)
        and the front end's processing of what it returns."""
        self.steps += 1
        if self.batch_queue is None:
            if not self.scheduler.has_requests():
                return []
            so = self.scheduler.schedule()
            output = self._execute(so)
            self._process_aborts_queue()
            return self._to_front_end(self.scheduler.update_from_output(so, output))
        if self.scheduler.has_requests():
            so = self.scheduler.schedule()
            output = self._execute(so)
            executed = so.total_num_scheduled_tokens > 0
            self.batch_queue.appendleft((output, so))
            if len(self.batch_queue) < self.batch_queue_size and (executed or self.scheduler.has_requests()):
                return []
        elif not self.batch_queue:
            return []
        output, so = self.batch_queue.pop()
        self._process_aborts_queue()
        return self._to_front_end(self.scheduler.update_from_output(so, output))

    def _to_front_end(self, by_client: dict[int, EngineCoreOutputs]) -> list[RequestOutput]:
        results: list[RequestOutput] = []
        for outputs in by_client.values():
            for out in outputs.outputs:
                params = out.kv_transfer_params
                if out.finish_reason is not None and params and params.get("remote_block_ids") is not None:
                    # The prefill's blocks as the lease holds them (vLLM frees them only
                    # when the connector reports the request finished sending).
                    blocks = params["remote_block_ids"]
                    self.sent_words[out.request_id] = (params, self.worker.block_words(blocks))
            outputs = msgpack_roundtrip(outputs, EngineCoreOutputs)
            self.core_outputs.extend(outputs.outputs)
            stats = outputs.scheduler_stats
            if stats is not None and stats.kv_connector_stats:
                self.kv_connector_stats.append(stats.kv_connector_stats)
                self.kv_logging.observe(stats.kv_connector_stats)
            processed = self.output_processor.process_outputs(outputs.outputs, outputs.timestamp, None)
            results.extend(processed.request_outputs)
            if processed.reqs_to_abort:
                self.abort(processed.reqs_to_abort)
        return results

    # ------------------------------------------------------------------ introspection

    def idle(self) -> bool:
        """Nothing left: no request (finished ones waiting for their blocks included)
        and no step whose output is still to be processed."""
        return not self.scheduler.has_requests() and not self.batch_queue

    def free_blocks(self) -> int:
        return self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()

    def finished_sending(self) -> set[str]:
        return {rid for r in self.records for rid in r.finished_sending}

    def finished_recving(self) -> set[str]:
        return {rid for r in self.records for rid in r.finished_recving}

    def worker_stats(self) -> dict[str, Any]:
        """The worker connector's ``stats()`` (its agents' counters and its own)."""
        return self.worker.connector.stats()

    def pulled_lease(self, local_request_id: str) -> Optional[str]:
        """The lease (``remote_request_id``) the worker was told to pull for a local
        request, from the connector metadata it received."""
        for meta in self.worker.received_metadata:
            entry = getattr(meta, "to_recv", {}).get(local_request_id)
            if entry is not None:
                return str(entry[0].get("remote_request_id"))
        return None

    def run_until(self, done: Callable[[], bool], what: str, timeout: float = 60.0) -> list[RequestOutput]:
        """Steps until ``done()`` (a guard against a hang, not a timed assertion); a step
        with nothing scheduled yields the CPU briefly, as a busy loop polling transfers."""
        deadline = time.monotonic() + timeout
        results: list[RequestOutput] = []
        while not done():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            before = len(self.records)
            results.extend(self.step())
            if len(self.records) == before or not self.records[-1].scheduled:
                time.sleep(0.002)
        return results

    def shutdown(self) -> None:
        self.scheduler.shutdown()
        self.worker.shutdown()
