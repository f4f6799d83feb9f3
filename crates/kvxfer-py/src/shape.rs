//! `KvShape`: what an agent states about its rank's KV cache (tensor-parallel size and
//! rank, how KV heads split, head dim, dtype, tokens per block), so a prefill and a decode
//! engine of different tensor-parallel sizes or block sizes can be paired. The per-group,
//! per-segment description the engine needs (`KvShapeSpec`) is completed from the
//! registered `Memory`'s layouts, and every disagreement is refused naming the field.

use kvxfer_core::{BlockLayout, GroupSpec, KvHeads, KvShape as CoreShape, KvShapeSpec, SegmentSpec};
use pyo3::prelude::*;

use crate::errors::{raise, s, LayoutError};

/// A `LayoutError` naming `field` (also its `field` attribute).
fn shape_err(py: Python<'_>, field: &str, msg: String) -> PyErr {
    raise::<LayoutError>(py, format!("kv_shape.{field}: {msg}"), &[("field", s(py, field))])
}

/// Bytes per element of a dtype name (torch's and numpy's spellings), if known.
fn dtype_bytes_of(dtype: &str) -> Option<u32> {
    let d = dtype.trim_start_matches("torch.").to_ascii_lowercase();
    Some(match d.as_str() {
        "u8" | "i8" | "uint8" | "int8" | "bool" => 1,
        d if d.starts_with("fp8") || d.starts_with("float8") => 1,
        "f16" | "bf16" | "fp16" | "float16" | "bfloat16" | "half" | "i16" | "int16" => 2,
        "f32" | "fp32" | "float32" | "float" | "i32" | "int32" => 4,
        "f64" | "fp64" | "float64" | "double" | "i64" | "int64" => 8,
        _ => return None,
    })
}

/// One tensor-parallel rank's KV-cache shape. Heads are split as vLLM splits them: with at
/// least as many KV heads as ranks, each rank holds `total_kv_heads / tp_size` of them;
/// with fewer, each head is replicated on `tp_size / total_kv_heads` ranks. `attention`
/// "mla" is one latent per token and layer, replicated on every rank. Every block holds
/// its heads whole and in order (HND: heads, then tokens, then `head_dim`), which is what
/// lets a rank of another TP size read its head slice of a block. `dtype` and
/// `block_tokens` default to the registered memory's; `head_dim` (None) is derived from
/// each segment's block size; `dtype_bytes` from the dtype's name.
#[pyclass(module = "kvxfer._kvxfer", frozen)]
#[derive(Clone)]
pub(crate) struct KvShape {
    tp_size: u32,
    tp_rank: u32,
    total_kv_heads: Option<u32>,
    latent: bool,
    head_dim: Option<u32>,
    dtype: Option<String>,
    dtype_bytes: Option<u32>,
    block_tokens: Option<u32>,
}

#[pymethods]
impl KvShape {
    #[new]
    #[pyo3(signature = (
        *, tp_size = 1, tp_rank = 0, total_kv_heads = None, attention = "mha", head_dim = None, dtype = None,
        dtype_bytes = None, block_tokens = None
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        tp_size: u32,
        tp_rank: u32,
        total_kv_heads: Option<u32>,
        attention: &str,
        head_dim: Option<u32>,
        dtype: Option<String>,
        dtype_bytes: Option<u32>,
        block_tokens: Option<u32>,
    ) -> PyResult<Self> {
        let latent = match attention {
            "mha" | "gqa" | "mqa" => false,
            "mla" => true,
            other => {
                return Err(shape_err(
                    py,
                    "attention",
                    format!("{other:?} is not \"mha\", \"gqa\", \"mqa\" or \"mla\""),
                ))
            }
        };
        if !latent && total_kv_heads.is_none() {
            return Err(shape_err(
                py,
                "total_kv_heads",
                format!("attention {attention:?} needs the model's number of KV heads (all ranks together)"),
            ));
        }
        let shape = KvShape {
            tp_size,
            tp_rank,
            total_kv_heads: if latent { None } else { total_kv_heads },
            latent,
            head_dim,
            dtype,
            dtype_bytes,
            block_tokens,
        };
        // Checks the TP and head fields now (a placeholder group; the memory's come later).
        shape.heads_per_rank(py)?;
        Ok(shape)
    }

    /// Tensor-parallel size of the engine.
    #[getter]
    fn tp_size(&self) -> u32 {
        self.tp_size
    }

    /// This rank.
    #[getter]
    fn tp_rank(&self) -> u32 {
        self.tp_rank
    }

    /// KV heads of the model (None for MLA).
    #[getter]
    fn total_kv_heads(&self) -> Option<u32> {
        self.total_kv_heads
    }

    /// "mla" or "mha".
    #[getter]
    fn attention(&self) -> &'static str {
        if self.latent {
            "mla"
        } else {
            "mha"
        }
    }

    /// Elements per head and token (None: derived from the memory).
    #[getter]
    fn head_dim(&self) -> Option<u32> {
        self.head_dim
    }

    fn __repr__(&self) -> String {
        format!(
            "KvShape(tp_size={}, tp_rank={}, heads={}, head_dim={:?}, dtype={:?}, block_tokens={:?})",
            self.tp_size,
            self.tp_rank,
            self.total_kv_heads.map_or("mla".to_owned(), |h| h.to_string()),
            self.head_dim,
            self.dtype,
            self.block_tokens
        )
    }
}

impl KvShape {
    fn heads(&self) -> KvHeads {
        match self.total_kv_heads {
            Some(total) if !self.latent => KvHeads::Split { total },
            _ => KvHeads::Latent,
        }
    }

    /// KV heads each rank holds, checking `tp_size`, `tp_rank` and `total_kv_heads`.
    fn heads_per_rank(&self, py: Python<'_>) -> PyResult<u32> {
        let probe = KvShapeSpec {
            tp_size: self.tp_size,
            tp_rank: self.tp_rank,
            heads: self.heads(),
            block_tokens: 1,
            dtype: "u8".into(),
            dtype_bytes: 1,
            groups: vec![GroupSpec { num_blocks: 1, segments: vec![SegmentSpec::packed(1)] }],
        };
        match CoreShape::new(probe) {
            Ok(s) => Ok(s.heads_per_rank()),
            Err(e) => {
                let msg = e.to_string();
                let field = if msg.contains("tp_rank") {
                    "tp_rank"
                } else if msg.contains("KV heads") || msg.contains("total_kv_heads") {
                    "total_kv_heads"
                } else {
                    "tp_size"
                };
                Err(shape_err(py, field, msg.trim_start_matches("KV shape: ").to_owned()))
            }
        }
    }

    /// The engine's description of this rank over `layouts` (one per KV-cache group, as
    /// registered): every segment's head dim derived (or checked) from its block size.
    pub(crate) fn spec_for(&self, py: Python<'_>, layouts: &[BlockLayout]) -> PyResult<KvShapeSpec> {
        let heads_per_rank = self.heads_per_rank(py)?;
        let first = &layouts[0];
        let dtype = self.dtype.clone().unwrap_or_else(|| first.dtype().to_owned());
        if dtype != first.dtype() {
            return Err(shape_err(
                py,
                "dtype",
                format!("{dtype:?}, but the memory is registered as {:?}", first.dtype()),
            ));
        }
        let block_tokens = self.block_tokens.unwrap_or(first.block_tokens());
        if block_tokens != first.block_tokens() {
            return Err(shape_err(
                py,
                "block_tokens",
                format!(
                    "{block_tokens}, but the memory is registered with {} tokens per block",
                    first.block_tokens()
                ),
            ));
        }
        let dtype_bytes = match self.dtype_bytes.or_else(|| dtype_bytes_of(&dtype)) {
            Some(b) if b > 0 => b,
            _ => {
                return Err(shape_err(
                    py,
                    "dtype_bytes",
                    format!("unknown for dtype {dtype:?}: give dtype_bytes (bytes per element)"),
                ))
            }
        };
        // Bytes of one head dim element across a block's tokens and this rank's heads.
        let unit = u64::from(block_tokens) * u64::from(dtype_bytes) * u64::from(heads_per_rank);
        let mut groups = Vec::with_capacity(layouts.len());
        for (g, l) in layouts.iter().enumerate() {
            if l.dtype() != dtype || l.block_tokens() != block_tokens {
                return Err(shape_err(
                    py,
                    if l.dtype() != dtype { "dtype" } else { "block_tokens" },
                    format!(
                        "group {g} is registered as {:?} with {} tokens per block, group 0 as {dtype:?} with {block_tokens}",
                        l.dtype(),
                        l.block_tokens()
                    ),
                ));
            }
            let mut segments = Vec::with_capacity(l.segments().len());
            for (i, seg) in l.segments().iter().enumerate() {
                let derived = (seg.block_len % unit == 0).then(|| seg.block_len / unit);
                let head_dim = match (self.head_dim, derived) {
                    (Some(h), Some(d)) if u64::from(h) == d => h,
                    (None, Some(d)) if d > 0 => u32::try_from(d)
                        .map_err(|_| shape_err(py, "head_dim", format!("{d} is too large")))?,
                    (given, _) => {
                        let what = given.map_or("no head_dim".to_owned(), |h| {
                            format!("head_dim {h} (a block of {} bytes)", unit * u64::from(h))
                        });
                        return Err(shape_err(
                            py,
                            "head_dim",
                            format!(
                                "group {g} segment {i} has {}-byte blocks, which is not {block_tokens} tokens × \
                                 {heads_per_rank} heads per rank × {dtype_bytes} bytes × {what}",
                                seg.block_len
                            ),
                        ));
                    }
                };
                let stride = (seg.stride != seg.block_len).then_some(seg.stride);
                segments.push(SegmentSpec { head_dim, stride });
            }
            groups.push(GroupSpec { num_blocks: l.num_blocks(), segments });
        }
        let spec = KvShapeSpec {
            tp_size: self.tp_size,
            tp_rank: self.tp_rank,
            heads: self.heads(),
            block_tokens,
            dtype,
            dtype_bytes,
            groups,
        };
        CoreShape::new(spec.clone()).map_err(|e| shape_err(py, "shape", e.to_string()))?;
        Ok(spec)
    }
}
