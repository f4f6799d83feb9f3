//! Registering Python-owned memory: [`Segment`] (one segment of every block, over a buffer:
//! a numpy array or anything with the buffer protocol, an object with `data_ptr()` and
//! `nbytes` such as a CPU torch tensor, or an address the caller vouches for) and
//! [`Memory`] (a block layout over those segments, handed to an agent).
//!
//! The pointer comes from the object itself, never from a number Python code typed in
//! (except `Segment.from_address`, whose caller vouches for it). Every region keeps a
//! reference to its owner for as long as the agent may read or write it. For buffer-protocol
//! objects that includes a buffer export, so the memory cannot be freed or resized under a
//! read. For torch tensors it includes the tensor's storage (`untyped_storage()`, checked to
//! hold the tensor's bytes), so swapping the tensor's storage (`t.set_()`) or dropping the
//! tensor frees nothing; but torch has no export lock: resizing the storage itself
//! (`t.untyped_storage().resize_(0)`) frees the memory while registered — do not. Any other
//! object with `data_ptr()` and `nbytes` is trusted for its pointer, as `from_address` is.

use std::ptr::NonNull;
use std::sync::Mutex;

use kvxfer_core::{BlockLayout, Segment as LayoutSegment};
use kvxfer_mem::{KvMemory, Region};
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use crate::errors::{raise, AgentClosedError, LayoutError, RegistrationError};

/// What keeps a registered region's memory alive: its owner (and buffer export).
struct KeepAlive(#[allow(dead_code)] Py<PyAny>);

fn reg_err(py: Python<'_>, msg: String) -> PyErr {
    raise::<RegistrationError>(py, msg, &[])
}

/// The type name of `obj`, for messages.
fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "object".into())
}

/// A buffer resolved to (address, length, what keeps it alive, kind).
struct Resolved {
    addr: usize,
    len: usize,
    owner: Py<PyAny>,
    kind: &'static str,
}

/// Whether a resolved buffer is CUDA device memory (`kind` "cuda tensor").
fn is_device_kind(kind: &str) -> bool {
    kind == "cuda tensor"
}

/// An object with `data_ptr()` and `nbytes` (a torch tensor, duck-typed): host memory, or
/// CUDA device memory (registered as device memory: only UCX moves its bytes), contiguous, a
/// non-null pointer; with `untyped_storage()` (torch), inside that storage, which is kept
/// too. Without it the object's `data_ptr()` is trusted as given.
fn resolve_tensor(obj: &Bound<'_, PyAny>) -> PyResult<Resolved> {
    let py = obj.py();
    let name = type_name(obj);
    let mut kind = "tensor";
    if obj.hasattr("device")? {
        let device = obj.getattr("device")?;
        let device_type: String = match device.getattr("type") {
            Ok(t) => t.str()?.to_string(),
            Err(_) => device.str()?.to_string(),
        };
        match device_type.as_str() {
            "cpu" => {}
            "cuda" => kind = "cuda tensor",
            _ => {
                return Err(reg_err(
                    py,
                    format!(
                        "{name} is on device {}: kvxfer registers host memory and CUDA device memory \
                         (UCX's CUDA transports); register a CPU (pinned) copy",
                        device.str()?
                    ),
                ))
            }
        }
    }
    if obj.hasattr("is_contiguous")? && !obj.call_method0("is_contiguous")?.is_truthy()? {
        return Err(reg_err(py, format!("{name} is not contiguous: register a contiguous tensor")));
    }
    let addr: i128 = obj.call_method0("data_ptr")?.extract()?;
    let len: i128 = obj.getattr("nbytes")?.extract()?;
    let (Ok(addr), Ok(len)) = (usize::try_from(addr), usize::try_from(len)) else {
        return Err(reg_err(
            py,
            format!("{name}: data_ptr() = {addr} and nbytes = {len} are not a valid buffer"),
        ));
    };
    if len == 0 {
        return Err(reg_err(py, format!("{name} is empty (nbytes = 0)")));
    }
    if addr == 0 {
        return Err(reg_err(
            py,
            format!("{name}: data_ptr() is 0 (its storage is freed or was never allocated)"),
        ));
    }
    // A torch tensor's memory belongs to its storage: keep the storage too (`t.set_()` can
    // swap the tensor's storage, freeing the old one unless something else holds it), and
    // check the tensor's bytes lie inside it.
    if !obj.hasattr("untyped_storage")? {
        return Ok(Resolved { addr, len, owner: obj.clone().unbind(), kind });
    }
    let storage = obj.call_method0("untyped_storage")?;
    let start: i128 = storage.call_method0("data_ptr")?.extract()?;
    let size = storage.getattr("nbytes")?;
    let size: i128 = if size.is_callable() { size.call0()? } else { size }.extract()?;
    let (Ok(start), Ok(size)) = (usize::try_from(start), usize::try_from(size)) else {
        return Err(reg_err(
            py,
            format!("{name}: its storage's data_ptr() = {start} and nbytes = {size} are not a buffer"),
        ));
    };
    let inside = match (addr.checked_add(len), start.checked_add(size)) {
        (Some(end), Some(limit)) => addr >= start && end <= limit,
        _ => false,
    };
    if !inside {
        return Err(reg_err(
            py,
            format!(
                "{name}: data_ptr() {addr:#x} + nbytes {len} lies outside its storage ({start:#x} + {size} bytes)"
            ),
        ));
    }
    let owner = PyTuple::new(py, [obj.clone(), storage])?.into_any().unbind();
    Ok(Resolved { addr, len, owner, kind })
}

/// A buffer-protocol object (numpy array, bytearray, ...): writable, C-contiguous,
/// non-empty. Its address is taken through a ctypes view of a byte-cast memoryview, and both
/// are kept: they hold a buffer export, so the object cannot be resized while registered.
fn resolve_buffer(obj: &Bound<'_, PyAny>) -> PyResult<Resolved> {
    let py = obj.py();
    let name = type_name(obj);
    let builtins = py.import("builtins")?;
    let view = match builtins.getattr("memoryview")?.call1((obj,)) {
        Ok(v) => v,
        Err(_) => {
            return Err(reg_err(
                py,
                format!(
                    "cannot register a {name}: expected a writable, C-contiguous buffer (a numpy array, a \
                     bytearray), an object with data_ptr() and nbytes (a CPU torch tensor), or \
                     Segment.from_address(address, length, owner, ...)"
                ),
            ))
        }
    };
    if view.getattr("readonly")?.is_truthy()? {
        return Err(reg_err(
            py,
            format!("{name} is read-only: kvxfer needs writable memory (decode writes into it)"),
        ));
    }
    if !view.getattr("c_contiguous")?.is_truthy()? {
        return Err(reg_err(
            py,
            format!("{name} is not C-contiguous: register a contiguous array (e.g. numpy.ascontiguousarray)"),
        ));
    }
    let len: usize = view.getattr("nbytes")?.extract()?;
    if len == 0 {
        return Err(reg_err(py, format!("{name} is empty (nbytes = 0)")));
    }
    let bytes = view.call_method1("cast", ("B",))?;
    let ctypes = py.import("ctypes")?;
    let first = ctypes.getattr("c_char")?.call_method1("from_buffer", (&bytes,))?;
    let addr: usize = ctypes.getattr("addressof")?.call1((&first,))?.extract()?;
    if addr == 0 {
        return Err(reg_err(py, format!("{name} has a null data pointer")));
    }
    let owner = PyTuple::new(py, [obj.clone(), view, bytes, first])?.into_any().unbind();
    Ok(Resolved { addr, len, owner, kind: "buffer" })
}

/// One segment of every block, over memory Python owns: block `b` of the segment is
/// `block_bytes` bytes at `offset + b * stride` in the buffer.
#[pyclass(module = "kvxfer._kvxfer", frozen)]
pub(crate) struct Segment {
    addr: usize,
    len: usize,
    offset: u64,
    block_bytes: u64,
    stride: u64,
    owner: Py<PyAny>,
    kind: &'static str,
}

impl Segment {
    fn build(r: Resolved, block_bytes: u64, stride: Option<u64>, offset: u64) -> Self {
        Segment {
            addr: r.addr,
            len: r.len,
            offset,
            block_bytes,
            stride: stride.unwrap_or(block_bytes),
            owner: r.owner,
            kind: r.kind,
        }
    }

    /// The address of the segment's first block.
    fn start(&self) -> Option<usize> {
        usize::try_from(self.offset).ok().and_then(|o| self.addr.checked_add(o))
    }
}

#[pymethods]
impl Segment {
    /// A segment over `buffer`: a writable, C-contiguous buffer-protocol object (numpy
    /// array, bytearray) or an object with `data_ptr()` and `nbytes` (a contiguous CPU torch
    /// tensor). `stride` defaults to `block_bytes` (packed blocks).
    #[new]
    #[pyo3(signature = (buffer, *, block_bytes, stride = None, offset = 0))]
    fn new(buffer: &Bound<'_, PyAny>, block_bytes: u64, stride: Option<u64>, offset: u64) -> PyResult<Self> {
        let r = if buffer.hasattr("data_ptr")? && buffer.hasattr("nbytes")? {
            resolve_tensor(buffer)?
        } else {
            resolve_buffer(buffer)?
        };
        Ok(Self::build(r, block_bytes, stride, offset))
    }

    /// A segment over `length` bytes at `address`, kept alive by `owner`. The caller vouches
    /// that the memory stays valid, unmoved and writable while `owner` lives (kvxfer holds a
    /// reference to `owner` while it is registered).
    #[staticmethod]
    #[pyo3(signature = (address, length, owner, *, block_bytes, stride = None, offset = 0))]
    fn from_address(
        py: Python<'_>,
        address: usize,
        length: usize,
        owner: Py<PyAny>,
        block_bytes: u64,
        stride: Option<u64>,
        offset: u64,
    ) -> PyResult<Self> {
        if address == 0 || length == 0 {
            return Err(reg_err(py, format!("address {address:#x} with length {length} is not a buffer")));
        }
        let r = Resolved { addr: address, len: length, owner, kind: "address" };
        Ok(Self::build(r, block_bytes, stride, offset))
    }

    /// The buffer's start address.
    #[getter]
    fn address(&self) -> usize {
        self.addr
    }

    /// The buffer's length in bytes.
    #[getter]
    fn length(&self) -> usize {
        self.len
    }

    /// Bytes of one block in this segment.
    #[getter]
    fn block_bytes(&self) -> u64 {
        self.block_bytes
    }

    /// Distance between consecutive blocks.
    #[getter]
    fn stride(&self) -> u64 {
        self.stride
    }

    /// Offset of block 0 in the buffer.
    #[getter]
    fn offset(&self) -> u64 {
        self.offset
    }

    fn __repr__(&self) -> String {
        format!(
            "Segment({} at {:#x}+{}, {} bytes, block_bytes={}, stride={})",
            self.kind, self.addr, self.offset, self.len, self.block_bytes, self.stride
        )
    }
}

/// A registered KV cache: a block layout over segments of Python-owned memory. Hand it to
/// one agent (`PrefillAgent` or `DecodeAgent`), which takes it over.
#[pyclass(module = "kvxfer._kvxfer", frozen)]
pub(crate) struct Memory {
    inner: Mutex<Option<KvMemory>>,
    /// Every KV-cache group's layout, group 0 first.
    layouts: Vec<BlockLayout>,
    deduplicated: usize,
}

impl Memory {
    /// Takes the registered memory (once) for an agent.
    pub(crate) fn take(&self, py: Python<'_>) -> PyResult<KvMemory> {
        let taken = self.inner.lock().unwrap_or_else(|p| p.into_inner()).take();
        taken.ok_or_else(|| {
            raise::<AgentClosedError>(
                py,
                "this Memory is already registered with an agent or grouped (make one Memory per agent)"
                    .into(),
                &[],
            )
        })
    }

    /// Every KV-cache group's block layout, group 0 first.
    pub(crate) fn layouts(&self) -> &[BlockLayout] {
        &self.layouts
    }
}

#[pymethods]
impl Memory {
    /// Registers `segments` (one piece of every block each) as a KV cache of `num_blocks`
    /// blocks of `block_tokens` tokens of `dtype`. Segments over the same memory (same
    /// start, block size and stride — layers that share a tensor) are registered once.
    #[new]
    #[pyo3(signature = (segments, *, num_blocks, dtype = "u8", block_tokens = 16))]
    fn new(
        py: Python<'_>,
        segments: Vec<Py<Segment>>,
        num_blocks: u32,
        dtype: &str,
        block_tokens: u32,
    ) -> PyResult<Self> {
        let mut kept: Vec<&Segment> = Vec::with_capacity(segments.len());
        let mut deduplicated = 0;
        let segs: Vec<&Segment> = segments.iter().map(|s| s.get()).collect();
        for s in segs {
            let same = |k: &&Segment| {
                k.start() == s.start() && k.block_bytes == s.block_bytes && k.stride == s.stride
            };
            if kept.iter().any(same) {
                deduplicated += 1;
            } else {
                kept.push(s);
            }
        }
        let layout = BlockLayout::new(
            num_blocks,
            kept.iter().map(|s| LayoutSegment { block_len: s.block_bytes, stride: s.stride }).collect(),
            dtype,
            block_tokens,
        )
        .map_err(|e| raise::<LayoutError>(py, format!("block layout: {e}"), &[]))?;
        let mut regions = Vec::with_capacity(kept.len());
        for (i, s) in kept.iter().enumerate() {
            let need = layout.region_len(i).unwrap_or(0);
            let fits = s.offset.checked_add(need).is_some_and(|end| end <= s.len as u64);
            let start = s.start().and_then(|a| NonNull::new(a as *mut u8));
            let (true, Some(start), Ok(need)) = (fits, start, usize::try_from(need)) else {
                return Err(reg_err(
                    py,
                    format!(
                        "segment {i}: {num_blocks} blocks of {} bytes at stride {} need {need} bytes from offset {}, \
                         but its buffer has {} bytes",
                        s.block_bytes, s.stride, s.offset, s.len
                    ),
                ));
            };
            let keep: Box<dyn std::any::Any + Send + Sync> = Box::new(KeepAlive(s.owner.clone_ref(py)));
            if is_device_kind(s.kind) {
                // SAFETY: `start .. start + need` lies inside a CUDA tensor's storage
                // (checked above and in `resolve_tensor`), kept alive by `keep`; it is
                // registered as device memory, so kvxfer never touches it on the CPU (only
                // UCX, which detects its memory type, reads or writes it). The access
                // contract is the caller's, as for host memory.
                regions.push(unsafe { Region::borrowed_device(start, need, Some(keep)) });
                continue;
            }
            // SAFETY: `start .. start + need` lies inside the buffer (checked above), which is
            // host memory: resolved from the object itself (a buffer export, or a CPU tensor's
            // `data_ptr()`), or vouched for by the caller of `Segment.from_address`. `keep`
            // holds its owner (and the buffer export, which forbids resizing) for as long as
            // the region lives. The access contract (no writes to leased blocks, no access to
            // blocks being pulled into) is the caller's, as documented on the agents.
            regions.push(unsafe { Region::borrowed(start, need, Some(keep)) });
        }
        let memory = KvMemory::new(layout.clone(), regions).map_err(|e| reg_err(py, e.to_string()))?;
        Ok(Memory { inner: Mutex::new(Some(memory)), layouts: vec![layout], deduplicated })
    }

    /// A KV cache of several KV-cache groups (a hybrid model: e.g. full attention and
    /// sliding window), `groups[g]` being group `g`'s memory (each its own segments, block
    /// count and block ids). Takes the given memories over (each can be grouped once, and
    /// not also handed to an agent). Hand-offs of such a cache carry one block list per
    /// group (vLLM's nested `remote_block_ids`).
    #[staticmethod]
    fn grouped(py: Python<'_>, groups: Vec<Py<Memory>>) -> PyResult<Self> {
        if groups.is_empty() {
            return Err(raise::<LayoutError>(py, "Memory.grouped: no groups given".into(), &[]));
        }
        for (i, g) in groups.iter().enumerate() {
            if g.get().layouts.len() != 1 {
                return Err(raise::<LayoutError>(
                    py,
                    format!(
                        "Memory.grouped: groups[{i}] has {} groups itself (give single groups)",
                        g.get().layouts.len()
                    ),
                    &[],
                ));
            }
            if groups[..i].iter().any(|o| o.is(g)) {
                return Err(raise::<LayoutError>(
                    py,
                    format!("Memory.grouped: groups[{i}] is given twice"),
                    &[],
                ));
            }
            if g.get().taken() {
                return Err(g.get().take(py).err().unwrap_or_else(|| reg_err(py, "taken".into())));
            }
        }
        // Checked above that every one is untaken: take them all (none is lost on error).
        let mut taken = Vec::with_capacity(groups.len());
        for g in &groups {
            taken.push(g.get().take(py)?);
        }
        let first = taken.remove(0);
        let layouts = groups.iter().flat_map(|g| g.get().layouts.clone()).collect();
        let deduplicated = groups.iter().map(|g| g.get().deduplicated).sum();
        Ok(Memory { inner: Mutex::new(Some(first.with_groups(taken))), layouts, deduplicated })
    }

    /// Number of KV-cache groups.
    #[getter]
    fn num_groups(&self) -> usize {
        self.layouts.len()
    }

    /// Whether this is CUDA device memory (segments over CUDA tensors): agents over it pull
    /// and serve only over UCX. None once an agent took the memory.
    #[getter]
    fn device(&self) -> Option<bool> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner()).as_ref().map(KvMemory::is_device)
    }

    /// Blocks of every group, group 0 first.
    #[getter]
    fn group_num_blocks(&self) -> Vec<u32> {
        self.layouts.iter().map(BlockLayout::num_blocks).collect()
    }

    /// Blocks in the layout (of group 0).
    #[getter]
    fn num_blocks(&self) -> u32 {
        self.layouts[0].num_blocks()
    }

    /// Bytes of one whole block (every segment; of group 0).
    #[getter]
    fn block_bytes(&self) -> u64 {
        self.layouts[0].block_bytes()
    }

    /// Segments registered (after deduplication; every group).
    #[getter]
    fn num_segments(&self) -> usize {
        self.layouts.iter().map(|l| l.segments().len()).sum()
    }

    /// Segments dropped because an identical one (same memory) was already registered.
    #[getter]
    fn deduplicated(&self) -> usize {
        self.deduplicated
    }

    /// The layout's compatibility hash (what peers compare in their handshake).
    #[getter]
    fn compat_hash(&self) -> u64 {
        kvxfer_core::groups_compat_hash(&self.layouts)
    }

    /// Whether an agent has taken this memory over.
    #[getter]
    fn taken(&self) -> bool {
        self.inner.lock().unwrap_or_else(|p| p.into_inner()).is_none()
    }

    fn __repr__(&self) -> String {
        let l = &self.layouts[0];
        let groups = match self.layouts.len() {
            1 => String::new(),
            g => format!(", groups={g}"),
        };
        format!(
            "Memory(num_blocks={}, block_bytes={}, segments={}, dtype={:?}, block_tokens={}{groups})",
            l.num_blocks(),
            l.block_bytes(),
            l.segments().len(),
            l.dtype(),
            l.block_tokens()
        )
    }
}
