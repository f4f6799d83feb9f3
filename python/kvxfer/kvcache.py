"""Registering a paged KV cache from the tensors (or numpy arrays) as the engine gives them.

A KV cache is one tensor per attention layer; ``kv_caches`` maps layer names to them
(vLLM's ``register_kv_caches`` argument) or is a sequence of them. Each tensor is read
through its shape, strides and element size, never assumed contiguous: one dimension holds
the blocks, and the others describe one block. Those are sorted by stride and merged where
contiguous; each remaining run of a block's bytes becomes one :class:`Segment` (``offset``,
``block_bytes``, the block ``stride``) over the tensor's whole underlying storage. So a
strided view registers as it lies in memory, and layers whose views share one buffer
(vLLM's block-outermost layouts interleave them) register that buffer, every layer its own
segments in it.

Which dimension holds the blocks (``kv_layout``):

- ``"auto"``: a 5-dimensional tensor is one of the explicit layouts below (``kv_first``
  unless only its second dimension is 2). Otherwise the blocks are the first dimension whose
  size is ``num_blocks`` or a multiple of it (dimension 0 without ``num_blocks``): vLLM's
  per-layer views are ``[B, H, N, C]`` (blocks, KV heads, tokens in a block, K and V side
  by side; physical order per ``VLLM_KV_CACHE_LAYOUT``), ``[B, N, C]`` for the older MLA
  caches. A dimension of ``num_blocks * k`` is ``num_blocks`` blocks of ``k`` kernel blocks
  each (vLLM's kernel block size below its block size): one registered block is ``k``
  kernel blocks, ``k * N`` tokens.
- ``"kv_first"``: ``(2, num_blocks, block_size, num_kv_heads, head_dim)`` (FlashAttention's
  layout of older vLLM). K and V are separate segments.
- ``"blocks_first"``: ``(num_blocks, 2, block_size, num_kv_heads, head_dim)`` (FlashInfer's).
- ``"kv_first_hnd"`` / ``"blocks_first_hnd"``: as ``kv_first`` / ``blocks_first`` with the
  heads before the tokens (older vLLM's ``VLLM_KV_CACHE_LAYOUT=HND``).
- ``"mla"``: ``(num_blocks, block_size, head_size)``: one latent.

In the explicit 5-dimensional layouts K and V are never merged into one segment (a peer
with K and V apart reads the same segments). A layout no segments can describe (blocks or
layers overlapping, zero or negative strides, memory off the host) is refused with a
:class:`RegistrationError` naming the shape, the strides and the setting to change.

A hybrid model's KV-cache groups (e.g. full attention and sliding window layers) are
registered with ``groups``: one list of layer names per group (vLLM's
``kv_cache_config.kv_cache_groups[g].layer_names``).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional, Sequence, Union

from ._kvxfer import Memory, RegistrationError, Segment

KvCaches = Union[Mapping[str, Any], Sequence[Any]]

# More runs than this per block and layer is a layout too scattered to serve.
_MAX_PIECES = 1024


@dataclass(frozen=True)
class _Layout:
    """Where the blocks (and, when known, K/V, tokens and heads) are in a tensor."""

    name: str
    block: int
    tokens: Optional[int]
    heads: Optional[int]
    kv: Optional[int] = None


_EXPLICIT = {
    "kv_first": (_Layout("kv_first", block=1, kv=0, tokens=2, heads=3), "(2, num_blocks, block_size, heads, head_dim)"),
    "blocks_first": (
        _Layout("blocks_first", block=0, kv=1, tokens=2, heads=3),
        "(num_blocks, 2, block_size, heads, head_dim)",
    ),
    "kv_first_hnd": (
        _Layout("kv_first_hnd", block=1, kv=0, tokens=3, heads=2),
        "(2, num_blocks, heads, block_size, head_dim)",
    ),
    "blocks_first_hnd": (
        _Layout("blocks_first_hnd", block=0, kv=1, tokens=3, heads=2),
        "(num_blocks, 2, heads, block_size, head_dim)",
    ),
    "mla": (_Layout("mla", block=0, tokens=1, heads=None), "(num_blocks, block_size, head_size)"),
}


@dataclass(frozen=True)
class _Tensor:
    """One layer's tensor: its geometry in bytes and the contiguous buffer it lies in."""

    name: str
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # bytes
    itemsize: int
    dtype: str
    address: int  # of element (0, ..., 0)
    buffer: Any  # registered by the segments: contiguous, starting `base_offset` before `address`
    base_offset: int

    def describe(self) -> str:
        return f"{self.name}: shape {self.shape} ({self.dtype}) with byte strides {self.strides}"


def _torch_tensor(name: str, t: Any) -> _Tensor:
    """A torch tensor: host memory, or CUDA memory (registered as device memory, which only
    UCX's CUDA transports move); its buffer is its whole storage, flat."""
    shape = tuple(int(d) for d in t.shape)
    dtype = str(t.dtype).replace("torch.", "")
    device = t.device
    if getattr(device, "type", str(device)) not in ("cpu", "cuda"):
        raise RegistrationError(
            f"{name}: the KV cache {shape} ({dtype}) is on {device}; kvxfer reads and writes host memory, and "
            'CUDA memory over UCX: set kv_buffer_device to "cpu" in kv_connector_extra_config (host staging), '
            "or register CPU tensors"
        )
    item = int(t.element_size())
    storage = t.untyped_storage()
    base = int(storage.data_ptr())
    address = int(t.data_ptr())
    flat = t.as_strided((int(storage.nbytes()) // item,), (1,), 0)
    return _Tensor(
        name, shape, tuple(int(s) * item for s in t.stride()), item, dtype, address, flat, address - base
    )


def _numpy_array(name: str, a: Any) -> _Tensor:
    """A numpy array; a strided one is registered through a flat view of the bytes it spans."""
    shape = tuple(int(d) for d in a.shape)
    strides = tuple(int(s) for s in a.strides)
    item = int(a.itemsize)
    t = _Tensor(name, shape, strides, item, str(a.dtype), int(a.__array_interface__["data"][0]), a, 0)
    if a.flags.c_contiguous:
        return t
    moving = [(n, s) for n, s in zip(shape, strides) if n > 1]
    if any(s <= 0 or s % item for _, s in moving):
        raise RegistrationError(
            f"{t.describe()}: strides must be positive multiples of the element size (register "
            "numpy.ascontiguousarray of it, or a view of it without reversed or broadcast dimensions)"
        )
    from numpy.lib.stride_tricks import as_strided

    span = sum((n - 1) * s for n, s in moving) + item
    return _Tensor(name, shape, strides, item, t.dtype, t.address, as_strided(a, (span // item,), (item,)), 0)


def _tensor(name: str, t: Any) -> _Tensor:
    """A layer's tensor as registered; a clear error for anything that is not one."""
    iface = getattr(t, "__array_interface__", None)
    if not (hasattr(t, "data_ptr") or isinstance(iface, dict)) or not (hasattr(t, "shape") and hasattr(t, "dtype")):
        raise RegistrationError(
            f"cannot register a {type(t).__name__} as a KV-cache layer ({name}): expected a numpy array or a "
            "tensor (data_ptr(), shape, dtype)"
        )
    if hasattr(t, "untyped_storage") and hasattr(t, "stride"):
        return _torch_tensor(name, t)
    if isinstance(iface, dict) and hasattr(t, "strides"):
        return _numpy_array(name, t)
    # Anything else with data_ptr() and nbytes: trusted to be contiguous, as Segment does.
    shape = tuple(int(d) for d in t.shape)
    item = int(t.element_size()) if hasattr(t, "element_size") else int(t.itemsize)
    strides = tuple(item * math.prod(shape[d + 1 :]) for d in range(len(shape)))
    address = int(t.data_ptr()) if hasattr(t, "data_ptr") else int(iface["data"][0])
    return _Tensor(name, shape, strides, item, str(t.dtype).replace("torch.", ""), address, t, 0)


def _named(kv_caches: KvCaches) -> list[tuple[str, Any]]:
    if isinstance(kv_caches, (str, bytes)) or not isinstance(kv_caches, (Mapping, Iterable)):
        raise RegistrationError(
            f"kv_caches must map layer names to tensors or be a sequence of them, got {type(kv_caches).__name__}"
        )
    if isinstance(kv_caches, Mapping):
        return [(f"layer {n!r}", t) for n, t in kv_caches.items()]
    return [(f"kv_caches[{i}]", t) for i, t in enumerate(kv_caches)]


def _layers(kv_caches: KvCaches) -> list[_Tensor]:
    """The distinct layer tensors (layers sharing a tensor once), all of one shape and dtype."""
    distinct: list[_Tensor] = []
    seen: set[tuple[int, tuple[int, ...], tuple[int, ...]]] = set()
    for name, obj in _named(kv_caches):
        t = _tensor(name, obj)
        key = (t.address, t.shape, t.strides)
        if key not in seen:
            seen.add(key)
            distinct.append(t)
    if not distinct:
        raise RegistrationError("no KV-cache tensors given")
    first = distinct[0]
    for t in distinct[1:]:
        if t.shape != first.shape or t.dtype != first.dtype:
            raise RegistrationError(
                f"every layer must have the same shape and dtype: {first.shape} {first.dtype} ({first.name}) vs "
                f"{t.shape} {t.dtype} ({t.name})"
            )
    return distinct


def _positive(what: str, value: Optional[int]) -> Optional[int]:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
        raise RegistrationError(f"{what} must be a positive integer, got {value!r}")
    return value


def _layout_of(t: _Tensor, kv_layout: str, num_blocks: Optional[int]) -> _Layout:
    """Which dimension of ``t`` holds the blocks (see the module's description)."""
    shape = t.shape
    if kv_layout == "auto" and len(shape) == 5:
        kv_layout = "blocks_first" if shape[1] == 2 and shape[0] != 2 else "kv_first"
    if kv_layout in _EXPLICIT:
        layout, expects = _EXPLICIT[kv_layout]
        if len(shape) != (5 if layout.kv is not None else 3) or (layout.kv is not None and shape[layout.kv] != 2):
            raise RegistrationError(f"{kv_layout} expects {expects}, got {shape}")
        if num_blocks is not None and shape[layout.block] % num_blocks:
            raise RegistrationError(
                f"{t.describe()}: {kv_layout} has its blocks in dimension {layout.block}, whose size is not "
                f"num_blocks={num_blocks} (or a multiple of it)"
            )
        return layout
    if kv_layout != "auto":
        raise RegistrationError(
            f"unknown kv_layout {kv_layout!r} (auto, kv_first, blocks_first, kv_first_hnd, blocks_first_hnd or mla)"
        )
    if not shape:
        raise RegistrationError(f"{t.describe()}: a KV cache needs a blocks dimension")
    block = 0
    if num_blocks is not None:
        found = [d for d, n in enumerate(shape) if n % num_blocks == 0]
        if not found:
            raise RegistrationError(
                f"{t.describe()}: no dimension holds num_blocks={num_blocks} blocks (or a multiple of it: kernel "
                "blocks); pass the engine's number of KV-cache blocks"
            )
        block = found[0]
    if block == 0 and len(shape) == 4:
        return _Layout("[B, H, N, C]", block=0, heads=1, tokens=2)
    if block == 0 and len(shape) == 3:
        return _Layout("[B, N, C]", block=0, heads=None, tokens=1)
    return _Layout(f"blocks in dimension {block}", block=block, heads=None, tokens=None)


@dataclass(frozen=True)
class _Block:
    """One block of one layer: byte runs ``(kv, offset, length)`` from the tensor's element
    0, the block stride, and the roles of the dimensions merged into each run (outermost
    first) and of those iterated over to list the runs."""

    stride: int
    pieces: list[tuple[int, int, int]]
    run_roles: list[Optional[str]]
    outer_roles: list[Optional[str]]


def _block(t: _Tensor, layout: _Layout, num_blocks: int) -> _Block:
    """The byte runs making up block ``b`` of ``t`` (each at ``offset + b * stride``)."""
    kernel = t.shape[layout.block] // num_blocks
    roles = {layout.kv: "kv", layout.tokens: "tokens", layout.heads: "heads"}
    # (size, byte stride, role) of every dimension inside a block that moves.
    dims = [(n, s, roles.get(d)) for d, (n, s) in enumerate(zip(t.shape, t.strides)) if d != layout.block and n > 1]
    if kernel > 1:
        dims.append((kernel, t.strides[layout.block], "kernel"))
    if any(s <= 0 for _, s, _ in dims) or (num_blocks > 1 and t.strides[layout.block] <= 0):
        raise RegistrationError(
            f"{t.describe()}: a stride of zero or below repeats or reverses memory, which no registered "
            "layout can describe (register a tensor with positive strides)"
        )
    dims.sort(key=lambda d: d[1], reverse=True)
    # Merge the innermost dimensions into one contiguous run while each one's stride is the
    # run so far (K/V never merged); the rest are iterated over.
    run, run_roles = t.itemsize, []
    while dims and dims[-1][1] == run and dims[-1][2] != "kv":
        n, _, role = dims.pop()
        run *= n
        run_roles.insert(0, role)
    dims.sort(key=lambda d: d[2] != "kv")  # K/V outermost in the listing: K's runs first
    count = math.prod(n for n, _, _ in dims)
    if count > _MAX_PIECES:
        raise RegistrationError(
            f"{t.describe()}: a block is {count} separate runs of {run} bytes (at most {_MAX_PIECES} are served); "
            "use a layout whose blocks are contiguous (vLLM: VLLM_KV_CACHE_LAYOUT=LBNHC or LBHNC)"
        )
    pieces: list[tuple[int, int, int]] = []
    for index in itertools.product(*(range(n) for n, _, _ in dims)):
        kv = next((i for i, (_, _, role) in zip(index, dims) if role == "kv"), 0)
        offset = sum(i * s for i, (_, s, _) in zip(index, dims))
        if pieces and pieces[-1][0] == kv and pieces[-1][1] + pieces[-1][2] == offset:
            pieces[-1] = (kv, pieces[-1][1], pieces[-1][2] + run)
        else:
            pieces.append((kv, offset, run))
    stride = t.strides[layout.block] * kernel if num_blocks > 1 else max(length for _, _, length in pieces)
    return _Block(stride, pieces, run_roles, [role for _, _, role in dims])


def _check_disjoint(runs: list[tuple[int, int, int, _Tensor]], num_blocks: int) -> None:
    """Refuses runs ``(address, length, stride, tensor)`` of which some block overlaps some
    block of another (or of itself): a pull into one would overwrite the other."""
    last = num_blocks - 1
    for address, length, stride, t in runs:
        if num_blocks > 1 and length > stride:
            raise RegistrationError(
                f"{t.describe()}: a block's {length} contiguous bytes overlap the next block's ({stride} bytes on); "
                "blocks must not overlap"
            )
    ordered = sorted(runs, key=lambda r: r[0])
    for i, (a0, l0, s0, t0) in enumerate(ordered):
        end = a0 + last * s0 + l0
        for a1, l1, s1, t1 in ordered[i + 1 :]:
            if a1 >= end:
                break
            d = a1 - a0  # block b of the first and b' of the second overlap iff d - l0 < (b - b') s < d + l1
            if s0 == s1:
                m = max((d - l0) // s0 + 1, -last)
                overlap = m <= last and m * s0 < d + l1
            else:
                overlap = True
            if overlap:
                what = "two runs of its blocks overlap" if t0 is t1 else f"its blocks overlap those of {t1.name}"
                raise RegistrationError(
                    f"{t0.describe()}: {what} (at byte strides {s0} and {s1}); each block of each layer must be "
                    "memory of its own (vLLM: check VLLM_KV_CACHE_LAYOUT)"
                )


def kv_cache_segments(
    kv_caches: KvCaches,
    *,
    kv_layout: str = "auto",
    num_blocks: Optional[int] = None,
    block_size: Optional[int] = None,
) -> tuple[list[Segment], int, int, str]:
    """The segments of a per-layer KV cache, and ``(num_blocks, block_size, dtype)``.

    ``num_blocks`` is the engine's number of blocks (vLLM: ``kv_cache_config.num_blocks``);
    without it, the size of the blocks dimension. ``block_size`` is tokens per block (vLLM:
    the KV-cache spec's ``block_size``); without it, the tokens dimension's size (times the
    kernel blocks per block). Every layer must have the same shape and dtype.
    """
    num_blocks, block_size = _positive("num_blocks", num_blocks), _positive("block_size", block_size)
    layers = _layers(kv_caches)
    first = layers[0]
    layout = _layout_of(first, kv_layout, num_blocks)
    if num_blocks is None:
        num_blocks = first.shape[layout.block]
    if block_size is None:
        if layout.tokens is None:
            raise RegistrationError(f"{first.describe()}: give block_size (tokens per block)")
        block_size = first.shape[layout.tokens] * (first.shape[layout.block] // num_blocks)
    runs: list[tuple[int, int, int, _Tensor]] = []
    for t in layers:
        block = _block(t, layout, num_blocks)
        runs.extend((t.address + offset, length, block.stride, t) for _, offset, length in block.pieces)
    _check_disjoint(runs, num_blocks)
    segments = [
        Segment(t.buffer, block_bytes=length, stride=stride, offset=t.base_offset + address - t.address)
        for address, length, stride, t in runs
    ]
    return segments, num_blocks, block_size, first.dtype


def _group_caches(kv_caches: KvCaches, groups: Sequence[Sequence[str]]) -> list[dict[str, Any]]:
    """``kv_caches`` split into one mapping per KV-cache group (``groups[g]``: layer names)."""
    if not isinstance(kv_caches, Mapping):
        raise RegistrationError("groups name layers: kv_caches must map layer names to tensors")
    if isinstance(groups, (str, bytes)) or not all(
        isinstance(g, Sequence) and not isinstance(g, (str, bytes)) for g in groups
    ):
        raise RegistrationError("groups must be a list of lists of layer names (one list per KV-cache group)")
    out: list[dict[str, Any]] = []
    for g, names in enumerate(groups):
        missing = [n for n in names if n not in kv_caches]
        if missing:
            raise RegistrationError(f"group {g} names layers that kv_caches does not have: {missing[:4]}")
        if not names:
            raise RegistrationError(f"group {g} has no layers")
        out.append({n: kv_caches[n] for n in names})
    if not out:
        raise RegistrationError("groups is empty")
    return out


def kv_cache_memory(
    kv_caches: KvCaches,
    *,
    kv_layout: str = "auto",
    groups: Optional[Sequence[Sequence[str]]] = None,
    num_blocks: Optional[int] = None,
    block_size: Union[int, Sequence[int], None] = None,
) -> Memory:
    """A :class:`Memory` over a per-layer KV cache (see :func:`kv_cache_segments`); with
    ``groups`` (one list of layer names per KV-cache group), one group of the memory per
    entry (:meth:`Memory.grouped`), each of ``num_blocks`` blocks and of its own
    ``block_size`` (one per group, or one for all). One group is the same as no ``groups``."""
    if groups is not None:
        caches = _group_caches(kv_caches, groups)
        sizes = list(block_size) if isinstance(block_size, Sequence) else [block_size] * len(caches)
        if len(sizes) != len(caches):
            raise RegistrationError(f"block_size lists {len(sizes)} sizes for {len(caches)} groups")
        if len(caches) > 1:
            return Memory.grouped(
                [
                    kv_cache_memory(c, kv_layout=kv_layout, num_blocks=num_blocks, block_size=s)
                    for c, s in zip(caches, sizes)
                ]
            )
        kv_caches, block_size = caches[0], sizes[0]
    elif isinstance(block_size, Sequence):
        raise RegistrationError("one block_size per group needs groups")
    segments, num_blocks, block_size, dtype = kv_cache_segments(
        kv_caches, kv_layout=kv_layout, num_blocks=num_blocks, block_size=block_size
    )
    return Memory(segments, num_blocks=num_blocks, dtype=dtype, block_tokens=block_size)


def kv_cache_heads(
    kv_caches: KvCaches,
    *,
    kv_layout: str = "auto",
    num_blocks: Optional[int] = None,
) -> tuple[int, int]:
    """``(kv_heads, head_dim)`` of one rank's per-layer KV cache, for a :class:`KvShape`
    (``(1, head_size)`` for MLA). ``head_dim`` is what each head holds per token: for vLLM's
    ``[B, H, N, C]`` views ``C``, K and V side by side. Only for caches whose every segment
    holds whole heads one after another, each heads then tokens (HND: vLLM's
    ``VLLM_KV_CACHE_LAYOUT=LBHNC`` or ``HND``, the ``*_hnd`` layouts) or one latent (MLA);
    anything else is refused with a :class:`RegistrationError`: a decode engine of another
    tensor-parallel size cannot read head slices of it."""
    num_blocks = _positive("num_blocks", num_blocks)
    t = _layers(kv_caches)[0]
    layout = _layout_of(t, kv_layout, num_blocks)
    block = _block(t, layout, num_blocks or t.shape[layout.block])
    runs_per_kv = len(block.pieces) // (2 if layout.kv is not None else 1)
    if layout.heads is None and layout.tokens is not None and runs_per_kv == 1:
        return 1, t.shape[-1]  # one latent per token (MLA)
    if layout.heads is not None:
        heads = t.shape[layout.heads]
        if heads == 1 and runs_per_kv == 1:
            return 1, t.shape[-1]
        # Heads outermost in each run (only K/V apart), tokens right inside them.
        first, rest = block.run_roles[:1], block.run_roles[1:]
        tokens_next = rest[:1] == ["tokens"] or "tokens" not in rest
        if block.outer_roles in ([], ["kv"]) and first == ["heads"] and tokens_next:
            return heads, t.shape[-1]
    kernel = t.shape[layout.block] // (num_blocks or t.shape[layout.block])
    split = (
        f"; its blocks are {kernel} kernel blocks each, which interleave the heads (make vLLM's block size the "
        "attention kernel's block size)"
        if kernel > 1
        else ""
    )
    raise RegistrationError(
        f"{t.describe()} ({layout.name}): a block does not hold whole heads one after another (heads, then "
        f"tokens){split}, so a decode engine of another tensor-parallel size cannot read head slices of it: set "
        "VLLM_KV_CACHE_LAYOUT=LBHNC (HND) on both engines, or pair engines of equal tensor-parallel size"
    )
