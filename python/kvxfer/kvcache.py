"""Registering a vLLM-style paged KV cache: one tensor (or numpy array) per attention layer.

Layouts understood (``kv_layout``):

- ``"kv_first"``: ``(2, num_blocks, block_size, num_kv_heads, head_dim)`` — vLLM's
  FlashAttention layout. K and V are two segments of the tensor: K's blocks at offset 0,
  V's at ``num_blocks * block_bytes``, both packed.
- ``"blocks_first"``: ``(num_blocks, 2, block_size, num_kv_heads, head_dim)`` — FlashInfer's.
  K and V interleave per block: K at offset 0, V at ``block_bytes``, both at stride
  ``2 * block_bytes``.
- ``"mla"``: ``(num_blocks, block_size, head_size)`` — one latent segment.

``"auto"`` picks from the shape (a 3-dimensional tensor is MLA; a 5-dimensional one is
``kv_first`` unless only its second dimension is 2). Layers that share a tensor are
registered once.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence, Union

from ._kvxfer import Memory, RegistrationError, Segment

KvCaches = Union[Mapping[str, Any], Sequence[Any]]


def _shape(t: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in t.shape)


def _itemsize(t: Any) -> int:
    if hasattr(t, "element_size"):
        return int(t.element_size())
    return int(t.itemsize)


def _dtype(t: Any) -> str:
    return str(t.dtype).replace("torch.", "")


def _address(t: Any) -> int:
    """The start address of a layer's tensor; a clear error for anything else."""
    iface = getattr(t, "__array_interface__", None)
    if not (hasattr(t, "data_ptr") or isinstance(iface, dict)) or not (hasattr(t, "shape") and hasattr(t, "dtype")):
        raise RegistrationError(
            f"cannot register a {type(t).__name__} as a KV-cache layer: expected a numpy array or a tensor "
            "(data_ptr(), shape, dtype)"
        )
    if hasattr(t, "data_ptr"):
        return int(t.data_ptr())
    return int(iface["data"][0])


def _layout_of(shape: tuple[int, ...], kv_layout: str) -> str:
    if kv_layout != "auto":
        return kv_layout
    if len(shape) == 3:
        return "mla"
    if len(shape) == 5 and shape[1] == 2 and shape[0] != 2:
        return "blocks_first"
    return "kv_first"


def kv_cache_segments(
    kv_caches: KvCaches, *, kv_layout: str = "auto"
) -> tuple[list[Segment], int, int, str]:
    """The segments of a per-layer KV cache, and ``(num_blocks, block_size, dtype)``.

    ``kv_caches`` maps layer names to tensors (vLLM's ``register_kv_caches`` argument) or is
    a sequence of them; every layer must have the same shape and dtype. Tensors that are the
    same memory (layers sharing a KV cache) are registered once.
    """
    if isinstance(kv_caches, (str, bytes)) or not isinstance(kv_caches, (Mapping, Iterable)):
        raise RegistrationError(
            f"kv_caches must map layer names to tensors or be a sequence of them, got {type(kv_caches).__name__}"
        )
    tensors: Iterable[Any] = kv_caches.values() if isinstance(kv_caches, Mapping) else kv_caches
    distinct: list[Any] = []
    seen: set[int] = set()
    for t in tensors:
        addr = _address(t)
        if addr not in seen:
            seen.add(addr)
            distinct.append(t)
    if not distinct:
        raise RegistrationError("no KV-cache tensors given")
    shape, dtype = _shape(distinct[0]), _dtype(distinct[0])
    for t in distinct[1:]:
        if _shape(t) != shape or _dtype(t) != dtype:
            raise RegistrationError(
                f"every layer must have the same shape and dtype: {shape} {dtype} vs {_shape(t)} {_dtype(t)}"
            )
    layout = _layout_of(shape, kv_layout)
    item = _itemsize(distinct[0])
    segments: list[Segment] = []
    if layout == "kv_first":
        if len(shape) != 5 or shape[0] != 2:
            raise RegistrationError(f"kv_first expects (2, num_blocks, block_size, heads, head_dim), got {shape}")
        _, num_blocks, block_size, heads, head_dim = shape
        block = block_size * heads * head_dim * item
        for t in distinct:
            segments.append(Segment(t, block_bytes=block, offset=0))
            segments.append(Segment(t, block_bytes=block, offset=num_blocks * block))
    elif layout == "blocks_first":
        if len(shape) != 5 or shape[1] != 2:
            raise RegistrationError(f"blocks_first expects (num_blocks, 2, block_size, heads, head_dim), got {shape}")
        num_blocks, _, block_size, heads, head_dim = shape
        block = block_size * heads * head_dim * item
        for t in distinct:
            segments.append(Segment(t, block_bytes=block, stride=2 * block, offset=0))
            segments.append(Segment(t, block_bytes=block, stride=2 * block, offset=block))
    elif layout == "mla":
        if len(shape) != 3:
            raise RegistrationError(f"mla expects (num_blocks, block_size, head_size), got {shape}")
        num_blocks, block_size, head_size = shape
        for t in distinct:
            segments.append(Segment(t, block_bytes=block_size * head_size * item))
    else:
        raise RegistrationError(f"unknown kv_layout {kv_layout!r} (kv_first, blocks_first, mla or auto)")
    return segments, num_blocks, block_size, dtype


def kv_cache_memory(kv_caches: KvCaches, *, kv_layout: str = "auto") -> Memory:
    """A :class:`Memory` over a per-layer KV cache (see :func:`kv_cache_segments`)."""
    segments, num_blocks, block_size, dtype = kv_cache_segments(kv_caches, kv_layout=kv_layout)
    return Memory(segments, num_blocks=num_blocks, dtype=dtype, block_tokens=block_size)
