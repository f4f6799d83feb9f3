//! Arbitrary bytes into every decoder that network input reaches: protobuf messages,
//! prefill-result validation, layouts and vLLM's kv_transfer_params JSON. Errors are
//! values; nothing panics, and nothing allocates by a length it was told.

use kvxfer_core::{BlockLayout, ChildHandoff, KvTransferParams, PrefillResult};
use kvxfer_proto::v1;
use kvxfer_proto::Message;
use proptest::prelude::*;

/// Shapes with small and extreme numbers alike.
fn shape_wire() -> impl Strategy<Value = v1::KvShape> {
    let n = || prop_oneof![0u32..9, Just(u32::MAX), any::<u32>()];
    // Head counts: small or random, never u32::MAX on both sides at once (equal huge head
    // counts on both sides would be a local misconfiguration, and a plan at a block ratio
    // above 1 lists one slice per head).
    let heads = prop_oneof![0u32..9, any::<u32>()];
    (
        n(),
        n(),
        heads,
        any::<bool>(),
        n(),
        n(),
        proptest::collection::vec((n(), proptest::collection::vec((n(), any::<u64>()), 0..3)), 0..3),
    )
        .prop_map(|(tp_size, tp_rank, total_kv_heads, latent, block_tokens, dtype_bytes, groups)| {
            v1::KvShape {
                tp_size,
                tp_rank,
                total_kv_heads,
                latent,
                block_tokens,
                dtype: "bf16".into(),
                dtype_bytes,
                groups: groups
                    .into_iter()
                    .map(|(num_blocks, segs)| v1::KvShapeGroup {
                        num_blocks: num_blocks % 128,
                        segments: segs
                            .into_iter()
                            .map(|(head_dim, stride)| v1::KvShapeSegment { head_dim, stride })
                            .collect(),
                    })
                    .collect(),
            }
        })
}

fn bytes() -> impl Strategy<Value = Vec<u8>> {
    proptest::collection::vec(any::<u8>(), 0..512)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn every_protobuf_message_decodes_or_errs(b in bytes()) {
        let _ = v1::Hello::decode(b.as_slice());
        let _ = v1::HelloAck::decode(b.as_slice());
        let _ = v1::ReadRequest::decode(b.as_slice());
        let _ = v1::ReadResponse::decode(b.as_slice());
        let _ = v1::Notify::decode(b.as_slice());
        let _ = v1::NotifyAck::decode(b.as_slice());
        let _ = v1::Heartbeat::decode(b.as_slice());
        let _ = v1::HeartbeatAck::decode(b.as_slice());
        let _ = v1::Cancel::decode(b.as_slice());
        let _ = v1::CancelAck::decode(b.as_slice());
        let _ = v1::Error::decode(b.as_slice());
        let _ = v1::PinAck::decode(b.as_slice());
        let _ = v1::Unpin::decode(b.as_slice());
        let _ = v1::UnpinAck::decode(b.as_slice());
        let _ = v1::UcxInfo::decode(b.as_slice());
        if let Ok(h) = v1::ChildHandoff::decode(b.as_slice()) {
            let _ = ChildHandoff::from_wire(h);
        }
        if let Ok(l) = v1::BlockLayout::decode(b.as_slice()) {
            let _ = BlockLayout::from_wire(&l);
        }
        if let Ok(r) = v1::PrefillResult::decode(b.as_slice()) {
            let _ = PrefillResult::from_wire(r);
        }
    }

    /// A peer's KV-cache shape (handshake) is checked and paired without panicking, whatever
    /// its numbers: zero sizes, huge head counts and dims, TP sizes that do not divide.
    #[test]
    fn any_shape_pair_is_checked_or_refused(
        p in shape_wire(), d in shape_wire(), remote in proptest::collection::vec(0u32..64, 0..8),
    ) {
        use kvxfer_core::{KvShape, KvShapeSpec, TransferPair};
        let (Ok(p), Ok(d)) = (KvShape::new(KvShapeSpec::from_wire(&p)), KvShape::new(KvShapeSpec::from_wire(&d))) else {
            return Ok(());
        };
        if let Ok(pair) = TransferPair::new(&p, &d) {
            let k = pair.block_ratio() as usize;
            let local: Vec<u32> = (0..remote.len().div_ceil(k) as u32).collect();
            let groups: Vec<(&[u32], &[u32])> = (0..p.num_groups()).map(|_| (&remote[..], &local[..])).collect();
            if let Ok(plan) = pair.plan(&groups) {
                // Bounded: at most a few pieces per block, segment and head.
                let _ = plan.pieces().take(10_000).count();
            }
        }
    }

    #[test]
    fn prefill_result_validation_names_what_is_wrong(
        n in 0u32..12,
        indices in proptest::collection::vec(0u32..16, 0..16),
        huge_n in any::<bool>(),
    ) {
        let n = if huge_n { u32::MAX } else { n };
        let children = indices.iter().map(|&i| v1::ChildHandoff {
            parent_request_id: "P".into(),
            child_index: i,
            n,
            remote_request_id: format!("{i}_P"),
            lease_token: vec![1; 16],
            remote_block_ids: vec![1],
            remote_engine_id: "e".into(),
            remote_host: "127.0.0.1".into(),
            remote_port: 1,
            expected_consumers: 1,
            lease_ttl_ms: 1000,
            tp_size: 1,
            incarnation: 0,
            other_group_block_ids: vec![],
        }).collect();
        let wire = v1::PrefillResult { parent_request_id: "P".into(), n, children };
        match PrefillResult::from_wire(wire) {
            Ok(r) => {
                // Accepted only when the children are exactly 0..n, each once.
                let mut sorted = indices.clone();
                sorted.sort_unstable();
                prop_assert_eq!(sorted, (0..n).collect::<Vec<_>>());
                prop_assert_eq!(r.children().len(), n as usize);
            }
            Err(e) => prop_assert!(!e.to_string().is_empty()),
        }
    }

    #[test]
    fn kv_transfer_params_json_never_panics(s in "\\PC{0,200}") {
        if let Ok(p) = KvTransferParams::from_json(&s) {
            let _ = p.to_handoff();
            let back = KvTransferParams::from_json(&p.to_json());
            prop_assert!(back.is_ok());
        }
    }

    #[test]
    fn kv_transfer_params_with_arbitrary_field_values(
        port in any::<i64>(),
        token in "[0-9a-fA-Fxz]{0,40}",
        ids in proptest::collection::vec(any::<i64>(), 0..8),
    ) {
        let json = format!(
            r#"{{"do_remote_prefill": true, "remote_block_ids": {ids:?}, "remote_engine_id": "e",
                "remote_request_id": "r", "remote_host": "h", "remote_port": {port},
                "kvxfer_lease_token": "{token}"}}"#
        );
        match KvTransferParams::from_json(&json) {
            Ok(p) => { let _ = p.to_handoff(); }
            Err(e) => prop_assert!(!e.to_string().is_empty()),
        }
    }
}
