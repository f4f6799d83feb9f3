//! Model test of the heterogeneous transfer plans: for random tensor-parallel pairs, head
//! counts (GQA with fewer heads than ranks, MLA), block ratios, KV-cache groups, strides and
//! block lists, build every prefill rank's and every decode rank's KV cache as byte arrays
//! laid out as their shapes say, execute each decode rank's plan with memcpy, and check that
//! every destination byte is written exactly once, from the right source byte, and nothing
//! else is touched. Pairs no plan can serve must be refused, naming the field that differs.

use kvxfer_core::xfer::Piece;
use kvxfer_core::{
    expected_consumers, BlockId, CompatError, CompatField, GroupSpec, KvHeads, KvShape, KvShapeSpec,
    RankPlan, SegmentSpec, ShapeError, TransferPair,
};
use proptest::prelude::*;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// One segment: head dimension and the padding each side adds between blocks.
#[derive(Debug, Clone)]
struct Seg {
    head_dim: u32,
    prefill_pad: u64,
    decode_pad: u64,
}

#[derive(Debug, Clone)]
struct Group {
    prefill_blocks: u32,
    decode_blocks: u32,
    segments: Vec<Seg>,
}

#[derive(Debug, Clone)]
struct Case {
    prefill_tp: u32,
    decode_tp: u32,
    heads: KvHeads,
    prefill_tokens: u32,
    decode_tokens: u32,
    dtype_bytes: u32,
    groups: Vec<Group>,
    seed: u64,
}

fn tp() -> impl Strategy<Value = u32> {
    prop_oneof![3 => prop::sample::select(vec![1u32, 2, 4, 8]), 2 => 1u32..=8]
}

fn heads() -> impl Strategy<Value = KvHeads> {
    prop_oneof![
        1 => Just(KvHeads::Latent),
        5 => prop::sample::select(vec![1u32, 2, 3, 4, 6, 8, 12, 16, 24]).prop_map(|total| KvHeads::Split { total }),
    ]
}

fn group() -> impl Strategy<Value = Group> {
    (
        1u32..=8,
        1u32..=8,
        prop::collection::vec((1u32..=3, 0u64..=8, 0u64..=8), 1..=3).prop_map(|v| {
            v.into_iter()
                .map(|(head_dim, prefill_pad, decode_pad)| Seg { head_dim, prefill_pad, decode_pad })
                .collect()
        }),
    )
        .prop_map(|(prefill_blocks, decode_blocks, segments)| Group {
            prefill_blocks,
            decode_blocks,
            segments,
        })
}

fn case() -> impl Strategy<Value = Case> {
    // Decode block tokens: mostly k × prefill (k = 1, 2, 4 or random), sometimes anything
    // (smaller or not a multiple: must be refused).
    let tokens = (1u32..=3).prop_flat_map(|p| {
        (
            Just(p),
            prop_oneof![
                6 => prop_oneof![Just(1u32), Just(2), Just(4), 1u32..=5].prop_map(move |k| p * k),
                1 => 1u32..=12,
            ],
        )
    });
    (
        tp(),
        tp(),
        heads(),
        tokens,
        prop::sample::select(vec![1u32, 2]),
        prop::collection::vec(group(), 1..=3),
        any::<u64>(),
    )
        .prop_map(
            |(prefill_tp, decode_tp, heads, (prefill_tokens, decode_tokens), dtype_bytes, groups, seed)| {
                Case {
                    prefill_tp,
                    decode_tp,
                    heads,
                    prefill_tokens,
                    decode_tokens,
                    dtype_bytes,
                    groups,
                    seed,
                }
            },
        )
}

impl Case {
    fn spec(&self, prefill: bool, tp_rank: u32) -> KvShapeSpec {
        let (tp_size, block_tokens) = if prefill {
            (self.prefill_tp, self.prefill_tokens)
        } else {
            (self.decode_tp, self.decode_tokens)
        };
        let heads_per_rank = match self.heads {
            KvHeads::Latent => 1,
            KvHeads::Split { total } => (total / tp_size).max(1),
        };
        KvShapeSpec {
            tp_size,
            tp_rank,
            heads: self.heads,
            block_tokens,
            dtype: "model".into(),
            dtype_bytes: self.dtype_bytes,
            groups: self
                .groups
                .iter()
                .map(|g| GroupSpec {
                    num_blocks: if prefill { g.prefill_blocks } else { g.decode_blocks },
                    segments: g
                        .segments
                        .iter()
                        .map(|s| {
                            let block_len =
                                u64::from(heads_per_rank * block_tokens * s.head_dim * self.dtype_bytes);
                            let pad = if prefill { s.prefill_pad } else { s.decode_pad };
                            // Packed segments are the common case; padded strides the rest.
                            SegmentSpec { head_dim: s.head_dim, stride: (pad > 0).then_some(block_len + pad) }
                        })
                        .collect(),
                })
                .collect(),
        }
    }
}

fn heads_split(heads: KvHeads, tp: u32) -> bool {
    match heads {
        KvHeads::Latent => true,
        KvHeads::Split { total } => total % tp == 0 || tp.is_multiple_of(total),
    }
}

/// The byte of head `head` (model-wide), in-head offset `rest`, of remote block `block`:
/// what every prefill rank holding that head stores there.
fn pattern(group: usize, segment: usize, block: BlockId, head: u32, rest: u64) -> u8 {
    let mut x =
        (group as u64) << 56 ^ (segment as u64) << 48 ^ u64::from(block) << 24 ^ u64::from(head) << 16 ^ rest;
    x = x.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    (x >> 56) as u8
}

/// One rank's memory: per group, per segment, one region of `num_blocks * stride` bytes.
type Memory = Vec<Vec<Vec<u8>>>;
/// Where a destination byte was copied from: (prefill rank, remote block, offset in block).
type Source = Option<(u32, BlockId, u64)>;

fn prefill_memory(shape: &KvShape) -> Memory {
    let first = shape.local_heads().first;
    (0..shape.num_groups())
        .map(|g| {
            let blocks = shape.num_blocks(g).unwrap_or(0);
            shape
                .segments(g)
                .iter()
                .enumerate()
                .map(|(s, seg)| {
                    let mut region = vec![0u8; (u64::from(blocks) * seg.stride()) as usize];
                    for b in 0..blocks {
                        for o in 0..seg.stride() {
                            region[(u64::from(b) * seg.stride() + o) as usize] = if o < seg.block_len() {
                                let head = first + (o / seg.head_bytes()) as u32;
                                pattern(g, s, b, head, o % seg.head_bytes())
                            } else {
                                0xA5 // padding between blocks: never read
                            };
                        }
                    }
                    region
                })
                .collect()
        })
        .collect()
}

/// Block lists per group: remote ids in short consecutive runs (repeats allowed), local ids
/// distinct, sometimes sorted (so runs coalesce), `ceil(remote / k)` of them.
fn block_lists(case: &Case, ratio: u32, rng: &mut ChaCha8Rng) -> Vec<(Vec<BlockId>, Vec<BlockId>)> {
    case.groups
        .iter()
        .map(|g| {
            let n = rng.random_range(0..=(g.decode_blocks * ratio).min(2 * g.prefill_blocks)) as usize;
            let mut remote = Vec::with_capacity(n);
            while remote.len() < n {
                let start = rng.random_range(0..g.prefill_blocks);
                let len = rng.random_range(1..=4u32);
                remote.extend((start..(start + len).min(g.prefill_blocks)).take(n - remote.len()));
            }
            let mut local: Vec<BlockId> = (0..g.decode_blocks).collect();
            local.shuffle(rng);
            local.truncate(n.div_ceil(ratio as usize));
            if rng.random_bool(0.5) {
                local.sort_unstable();
            }
            (remote, local)
        })
        .collect()
}

/// Executes `plan` into a fresh decode memory with memcpy, recording for every destination
/// byte how often it was written and from where (prefill rank, remote block, offset).
struct Executed {
    memory: Memory,
    writes: Vec<Vec<Vec<u8>>>,
    source: Vec<Vec<Vec<Source>>>,
}

fn execute(plan: &RankPlan, prefill: &[KvShape], prefill_mem: &[Memory], decode: &KvShape) -> Executed {
    let mut memory: Memory = Vec::new();
    let mut writes: Vec<Vec<Vec<u8>>> = Vec::new();
    let mut source: Vec<Vec<Vec<Source>>> = Vec::new();
    for g in 0..decode.num_groups() {
        let blocks = u64::from(decode.num_blocks(g).unwrap_or(0));
        let lens: Vec<usize> = decode.segments(g).iter().map(|s| (blocks * s.stride()) as usize).collect();
        memory.push(lens.iter().map(|&n| vec![0u8; n]).collect());
        writes.push(lens.iter().map(|&n| vec![0u8; n]).collect());
        source.push(lens.iter().map(|&n| vec![None; n]).collect());
    }
    let read_ranks: Vec<u32> = plan.reads().iter().map(|r| r.source_rank()).collect();
    for Piece {
        source_rank,
        group,
        segment,
        remote_block,
        remote_offset,
        local_block,
        local_offset,
        len,
        blocks,
    } in plan.pieces()
    {
        assert!(read_ranks.contains(&source_rank), "piece from rank {source_rank} not among the reads");
        let p = source_rank as usize;
        let rseg = prefill[p].segments(group)[segment];
        let lseg = decode.segments(group)[segment];
        assert!(
            remote_offset + len <= rseg.block_len(),
            "piece crosses a remote block: {remote_offset}+{len}"
        );
        assert!(local_offset + len <= lseg.block_len(), "piece crosses a local block: {local_offset}+{len}");
        assert!(len > 0 && blocks > 0);
        for t in 0..blocks {
            let rb = remote_block + t;
            let src = (u64::from(rb) * rseg.stride() + remote_offset) as usize;
            let dst = (u64::from(local_block + t) * lseg.stride() + local_offset) as usize;
            let n = len as usize;
            memory[group][segment][dst..dst + n]
                .copy_from_slice(&prefill_mem[p][group][segment][src..src + n]);
            for i in 0..n {
                writes[group][segment][dst + i] += 1;
                source[group][segment][dst + i] = Some((source_rank, rb, remote_offset + i as u64));
            }
        }
    }
    Executed { memory, writes, source }
}

/// Checks one decode rank's executed plan against the model of what each byte must be.
fn check(
    case: &Case,
    pair: &TransferPair,
    lists: &[(Vec<BlockId>, Vec<BlockId>)],
    prefill: &[KvShape],
    done: &Executed,
) -> Result<(), TestCaseError> {
    let decode = pair.decode();
    let k = u64::from(pair.block_ratio());
    let first = decode.local_heads().first;
    for (g, (remote, local)) in lists.iter().enumerate() {
        for (s, lseg) in decode.segments(g).iter().enumerate() {
            let elem = u64::from(case.groups[g].segments[s].head_dim * case.dtype_bytes);
            let blocks = decode.num_blocks(g).unwrap_or(0);
            for b in 0..blocks {
                let position = local.iter().position(|&l| l == b);
                for o in 0..lseg.stride() {
                    let at = (u64::from(b) * lseg.stride() + o) as usize;
                    let writes = done.writes[g][s][at];
                    // Which remote block (and token) this byte holds, if it was asked for.
                    let expect = position.filter(|_| o < lseg.block_len()).and_then(|i| {
                        let head = first + (o / lseg.head_bytes()) as u32;
                        let within = o % lseg.head_bytes();
                        let (token, x) = (within / elem, within % elem);
                        let prefill_tokens = u64::from(case.prefill_tokens);
                        let (slot, token) = (token / prefill_tokens, token % prefill_tokens);
                        let index = i as u64 * k + slot;
                        remote.get(index as usize).map(|&r| (r, head, token * elem + x))
                    });
                    let Some((r, head, rest)) = expect else {
                        prop_assert_eq!(
                            writes,
                            0,
                            "group {} segment {} block {} byte {} written",
                            g,
                            s,
                            b,
                            o
                        );
                        continue;
                    };
                    prop_assert_eq!(
                        writes,
                        1,
                        "group {} segment {} block {} byte {} written {} times",
                        g,
                        s,
                        b,
                        o,
                        writes
                    );
                    let (p, rb, ro) = done.source[g][s][at].expect("written bytes have a source");
                    let have = prefill[p as usize].local_heads();
                    prop_assert!(
                        have.contains(head),
                        "head {} read from rank {} holding {:?}",
                        head,
                        p,
                        have
                    );
                    let rseg = prefill[p as usize].segments(g)[s];
                    prop_assert_eq!((rb, ro), (r, u64::from(head - have.first) * rseg.head_bytes() + rest));
                    prop_assert_eq!(done.memory[g][s][at], pattern(g, s, r, head, rest));
                }
            }
        }
    }
    Ok(())
}

fn run_case(case: &Case) -> Result<(), TestCaseError> {
    // Each side's own shape: refused when its heads do not split over its ranks.
    for (is_prefill, tp) in [(true, case.prefill_tp), (false, case.decode_tp)] {
        let made = KvShape::new(case.spec(is_prefill, 0));
        if !heads_split(case.heads, tp) {
            let KvHeads::Split { total } = case.heads else { unreachable!("latent heads always split") };
            prop_assert_eq!(made, Err(ShapeError::HeadsNotDivisible { total_kv_heads: total, tp_size: tp }));
            return Ok(());
        }
        prop_assert!(made.is_ok(), "{:?}", made);
    }
    let shape = |prefill: bool, rank: u32| KvShape::new(case.spec(prefill, rank)).expect("checked above");
    let prefill: Vec<KvShape> = (0..case.prefill_tp).map(|p| shape(true, p)).collect();
    let decode: Vec<KvShape> = (0..case.decode_tp).map(|d| shape(false, d)).collect();

    let (pt, dt) = (case.prefill_tp, case.decode_tp);
    let tp_ok = pt.max(dt) % pt.min(dt) == 0;
    let (pb, db) = (case.prefill_tokens, case.decode_tokens);
    let paired = TransferPair::new(&prefill[0], &decode[0]);
    if !tp_ok {
        prop_assert_eq!(paired, Err(CompatError::TpNotDivisible { prefill: pt, decode: dt }));
        prop_assert!(expected_consumers(pt, dt).is_err());
        return Ok(());
    }
    if db < pb || db % pb != 0 {
        let e = paired.expect_err("block sizes no plan serves");
        prop_assert_eq!(e.field(), CompatField::BlockTokens);
        let text = e.to_string();
        prop_assert!(
            text.contains(&format!("prefill {pb}")) && text.contains(&format!("decode {db}")),
            "{}",
            text
        );
        return Ok(());
    }
    let ratio = db / pb;
    let mut rng = ChaCha8Rng::seed_from_u64(case.seed);
    let lists = block_lists(case, ratio, &mut rng);
    let refs: Vec<(&[BlockId], &[BlockId])> =
        lists.iter().map(|(r, l)| (r.as_slice(), l.as_slice())).collect();
    let prefill_mem: Vec<Memory> = prefill.iter().map(prefill_memory).collect();
    let consumers = expected_consumers(pt, dt).expect("divisible");
    let mut notified = vec![0u32; pt as usize];
    for d in &decode {
        let pair = TransferPair::new(&prefill[0], d).expect("compatible");
        prop_assert_eq!(pair.block_ratio(), ratio);
        prop_assert_eq!(pair.expected_consumers(), consumers);
        let plan = pair.plan(&refs).expect("valid lists");
        for p in plan.notify_ranks() {
            notified[p as usize] += 1;
        }
        prop_assert_eq!(plan.notify_ranks(), pair.source_ranks().collect::<Vec<_>>());
        for r in plan.reads() {
            prop_assert!(!plan.notify_only().contains(&r.source_rank()));
        }
        if case.heads == KvHeads::Latent {
            prop_assert!(plan.reads().len() <= 1, "MLA reads one rank, not {}", plan.reads().len());
        }
        let done = execute(&plan, &prefill, &prefill_mem, d);
        check(case, &pair, &lists, &prefill, &done)?;
        let total: u64 = done.writes.iter().flatten().flatten().map(|&w| u64::from(w)).sum();
        prop_assert_eq!(plan.bytes(), total);
    }
    // Every prefill rank's lease hears from exactly `expected_consumers` decode ranks.
    prop_assert_eq!(notified, vec![consumers; pt as usize]);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    #[test]
    fn every_destination_byte_once_from_the_right_source(case in case()) {
        run_case(&case)?;
    }
}

/// One field of a decode shape changed from an otherwise identical prefill shape.
#[derive(Debug, Clone, Copy)]
enum Change {
    Dtype,
    DtypeBytes,
    Attention,
    TotalKvHeads,
    Groups,
    Segments,
    HeadDim,
    TpSize,
    BlockTokensSmaller,
    BlockTokensNotMultiple,
}

fn base_spec() -> impl Strategy<Value = KvShapeSpec> {
    (1u32..=8)
        .prop_flat_map(|tp| {
            let divisors: Vec<u32> = (1..=tp).filter(|d| tp % d == 0).collect();
            (
                Just(tp),
                prop_oneof![
                    Just(KvHeads::Latent),
                    (1u32..=3).prop_map(move |m| KvHeads::Split { total: tp * m }),
                    prop::sample::select(divisors).prop_map(|total| KvHeads::Split { total }),
                ],
                1u32..=4,
                1u32..=2,
                prop::collection::vec((1u32..=8, prop::collection::vec(1u32..=4, 1..=3)), 1..=3),
            )
        })
        .prop_map(|(tp_size, heads, block_tokens, dtype_bytes, groups)| KvShapeSpec {
            tp_size,
            tp_rank: 0,
            heads,
            block_tokens,
            dtype: "bf16".into(),
            dtype_bytes,
            groups: groups
                .into_iter()
                .map(|(num_blocks, dims)| GroupSpec {
                    num_blocks,
                    segments: dims.into_iter().map(SegmentSpec::packed).collect(),
                })
                .collect(),
        })
}

fn change() -> impl Strategy<Value = Change> {
    prop::sample::select(vec![
        Change::Dtype,
        Change::DtypeBytes,
        Change::Attention,
        Change::TotalKvHeads,
        Change::Groups,
        Change::Segments,
        Change::HeadDim,
        Change::TpSize,
        Change::BlockTokensSmaller,
        Change::BlockTokensNotMultiple,
    ])
}

/// Applies `change`: returns both specs, the field that must be named and both values.
fn apply(
    mut prefill: KvShapeSpec,
    change: Change,
    pick: usize,
) -> (KvShapeSpec, KvShapeSpec, CompatField, String, String) {
    let mut decode = prefill.clone();
    let shown = |h: KvHeads| match h {
        KvHeads::Split { total } => format!("{total} split KV heads"),
        KvHeads::Latent => "an MLA latent".to_string(),
    };
    let (field, p, d) = match change {
        Change::Dtype => {
            decode.dtype = "fp8".into();
            (CompatField::Dtype, "bf16".to_string(), "fp8".to_string())
        }
        Change::DtypeBytes => {
            decode.dtype_bytes = 3 - prefill.dtype_bytes;
            (CompatField::DtypeBytes, prefill.dtype_bytes.to_string(), decode.dtype_bytes.to_string())
        }
        Change::Attention | Change::TotalKvHeads => {
            let t = prefill.tp_size;
            match (change, prefill.heads) {
                (Change::TotalKvHeads, KvHeads::Split { total }) => {
                    let other = if total == 2 * t { t } else { 2 * t };
                    decode.heads = KvHeads::Split { total: other };
                    (CompatField::TotalKvHeads, total.to_string(), other.to_string())
                }
                (_, KvHeads::Latent) => {
                    decode.heads = KvHeads::Split { total: t };
                    (CompatField::Attention, shown(prefill.heads), shown(decode.heads))
                }
                (_, KvHeads::Split { .. }) => {
                    decode.heads = KvHeads::Latent;
                    (CompatField::Attention, shown(prefill.heads), shown(decode.heads))
                }
            }
        }
        Change::Groups => {
            let n = prefill.groups.len();
            if n > 1 && pick.is_multiple_of(2) {
                decode.groups.pop();
            } else {
                decode.groups.push(prefill.groups[0].clone());
            }
            (CompatField::Groups, n.to_string(), decode.groups.len().to_string())
        }
        Change::Segments => {
            let group = pick % prefill.groups.len();
            decode.groups[group].segments.push(SegmentSpec::packed(1));
            let n = prefill.groups[group].segments.len();
            (CompatField::Segments { group }, n.to_string(), (n + 1).to_string())
        }
        Change::HeadDim => {
            let group = pick % prefill.groups.len();
            let segment = (pick / 3) % prefill.groups[group].segments.len();
            let dim = prefill.groups[group].segments[segment].head_dim;
            decode.groups[group].segments[segment].head_dim = dim + 1;
            (CompatField::HeadDim { group, segment }, dim.to_string(), (dim + 1).to_string())
        }
        Change::TpSize => {
            // Heads that split over any TP size up to 8, so only the pairing can refuse.
            prefill.heads = KvHeads::Split { total: 840 };
            prefill.tp_size = prefill.tp_size.max(2);
            let t = prefill.tp_size;
            let other: Vec<u32> = (1..=8).filter(|&o| o.max(t) % o.min(t) != 0).collect();
            decode = prefill.clone();
            decode.tp_size = other[pick % other.len()];
            (CompatField::TpSize, t.to_string(), decode.tp_size.to_string())
        }
        Change::BlockTokensSmaller => {
            prefill.block_tokens = prefill.block_tokens.max(2);
            decode = prefill.clone();
            decode.block_tokens = 1 + pick as u32 % (prefill.block_tokens - 1);
            (CompatField::BlockTokens, prefill.block_tokens.to_string(), decode.block_tokens.to_string())
        }
        Change::BlockTokensNotMultiple => {
            prefill.block_tokens = prefill.block_tokens.max(2);
            decode = prefill.clone();
            decode.block_tokens = prefill.block_tokens * (1 + pick as u32 % 4) + 1;
            (CompatField::BlockTokens, prefill.block_tokens.to_string(), decode.block_tokens.to_string())
        }
    };
    (prefill, decode, field, p, d)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    #[test]
    fn refusals_name_the_differing_field_and_both_values(base in base_spec(), change in change(), pick in 0usize..64) {
        let (prefill, decode, field, p, d) = apply(base, change, pick);
        let prefill = KvShape::new(prefill).expect("valid prefill shape");
        let decode = KvShape::new(decode).expect("valid decode shape");
        // Unchanged, the pair is served.
        prop_assert!(TransferPair::new(&prefill, &prefill).is_ok());
        let e = TransferPair::new(&prefill, &decode).expect_err("no plan serves this pair");
        prop_assert_eq!(e.field(), field);
        let text = e.to_string();
        prop_assert!(text.contains(&field.to_string()), "{} does not name {}", text, field);
        prop_assert!(text.contains(&format!("prefill {p}")) && text.contains(&format!("decode {d}")), "{}", text);
    }
}
