//! The two-phase lease: `LeaseTable::arm` with an id and token minted elsewhere (vLLM's
//! scheduler process), `knows` (what a server asks before it answers "unknown"), and the
//! lease hook that wakes such a server. Fake clock (`t0 + offsets`).

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvxfer_core::{
    CancelOutcome, EndKind, EngineInfo, LeaseConfig, LeaseError, LeaseRequest, LeaseTable, LeaseToken,
    NotifyOutcome,
};

fn table() -> Arc<LeaseTable> {
    let engine = EngineInfo {
        engine_id: "prefill-0".into(),
        host: "127.0.0.1".into(),
        port: 5559,
        tp_size: 1,
        incarnation: 0,
    };
    Arc::new(LeaseTable::new(LeaseConfig::new(engine, 64), [7; 32]))
}

fn token(byte: u8) -> LeaseToken {
    LeaseToken::from_wire(&[byte; 16]).expect("16 bytes")
}

#[test]
fn an_armed_lease_carries_the_minted_id_and_token_and_ends_pulled() {
    let t = table();
    let t0 = Instant::now();
    let minted = token(0xab);
    let (h, generation) = t.arm("2_R", LeaseRequest::new("R", 2, 4, vec![5, 6]), minted, t0).expect("arm");
    assert_eq!(h.remote_request_id(), "2_R");
    assert_eq!(h.token().as_bytes(), minted.as_bytes());
    assert_eq!((h.child_index(), h.n(), h.remote_block_ids()), (2, 4, &[5, 6][..]));
    assert_eq!(t.notify("2_R", minted.as_bytes(), "decode/0", t0), NotifyOutcome::Pulled);
    let end = t.ended().try_recv().expect("one end");
    assert_eq!((end.kind, end.generation), (EndKind::Pulled, generation));
    assert_eq!(t.stats().leased, 1);
}

/// Review of the small-frame cap: an id of any length was leased, but a prefill agent caps a
/// notify or cancel at 16 KiB, so a lease with a 20 KiB id (vLLM takes request ids from a
/// client's `X-Request-Id`) was read and then never notified. Ids over
/// `MAX_REQUEST_ID_LEN` are refused when the lease is made or armed; one at the limit is not.
#[test]
fn request_ids_longer_than_the_limit_are_refused_at_lease_and_arm() {
    let t = table();
    let t0 = Instant::now();
    let long = "x".repeat(kvxfer_core::MAX_REQUEST_ID_LEN + 1);
    let e = t.lease(LeaseRequest::new(long.clone(), 0, 1, vec![1]), t0).expect_err("too long");
    assert!(matches!(e, LeaseError::IdTooLong { len, .. } if len == long.len()), "{e:?}");
    assert!(e.to_string().len() < 200, "the error does not repeat the id: {e}");
    let e = t.arm(&long, LeaseRequest::new(long.clone(), 0, 1, vec![1]), token(1), t0).expect_err("too long");
    assert!(matches!(e, LeaseError::IdTooLong { .. }), "{e:?}");
    let at_limit = "y".repeat(kvxfer_core::MAX_REQUEST_ID_LEN);
    t.lease(LeaseRequest::new(at_limit, 0, 1, vec![1]), t0).expect("an id at the limit");
}

#[test]
fn arm_refuses_a_mismatched_id_a_zero_token_and_what_lease_refuses() {
    let t = table();
    let t0 = Instant::now();
    let e = t.arm("R", LeaseRequest::new("R", 1, 2, vec![1]), token(1), t0).expect_err("n = 2 names 1_R");
    assert_eq!(e, LeaseError::IdMismatch { given: "R".into(), expected: "1_R".into() });
    assert!(e.to_string().contains("1_R"), "{e}");
    let e = t.arm("R", LeaseRequest::new("R", 0, 1, vec![1]), token(0), t0).expect_err("zero token");
    assert_eq!(e, LeaseError::ZeroToken("R".into()));
    let e = t.arm("R", LeaseRequest::new("R", 0, 1, vec![64]), token(1), t0).expect_err("out of range");
    assert!(matches!(e, LeaseError::BlocksOutOfRange { .. }), "{e:?}");
    t.arm("R", LeaseRequest::new("R", 0, 1, vec![1]), token(1), t0).expect("arm");
    let e = t.arm("R", LeaseRequest::new("R", 0, 1, vec![2]), token(2), t0).expect_err("live");
    assert_eq!(e, LeaseError::AlreadyLeased("R".into()));
    assert_eq!(t.stats().leased, 1, "refusals lease nothing");
}

#[test]
fn an_ended_leases_token_cannot_be_armed_again_but_a_fresh_one_can() {
    let t = table();
    let t0 = Instant::now();
    t.arm("R", LeaseRequest::new("R", 0, 1, vec![1]), token(3), t0).expect("arm");
    assert_eq!(t.cancel("R", token(3).as_bytes(), t0), CancelOutcome::Released);
    let e = t.arm("R", LeaseRequest::new("R", 0, 1, vec![1]), token(3), t0).expect_err("replayed arm");
    assert_eq!(e, LeaseError::TokenReused("R".into()));
    // The record still answers the old token; nothing came back to life.
    assert_eq!(
        t.notify("R", token(3).as_bytes(), "d", t0),
        NotifyOutcome::AlreadyEnded { kind: EndKind::Released, counted: false }
    );
    // A new lease of the same id with a new token is a new lease.
    t.arm("R", LeaseRequest::new("R", 0, 1, vec![1]), token(4), t0).expect("fresh token");
    assert_eq!(t.notify("R", token(4).as_bytes(), "d", t0), NotifyOutcome::Pulled);
}

#[test]
fn knows_tells_armed_and_ended_leases_from_unknown_ids_and_wrong_tokens() {
    let t = table();
    let t0 = Instant::now();
    assert!(!t.knows("R", token(5).as_bytes()), "not armed yet");
    t.arm("R", LeaseRequest::new("R", 0, 1, vec![1]).ttl(Duration::from_secs(1)), token(5), t0).expect("arm");
    assert!(t.knows("R", token(5).as_bytes()));
    assert!(!t.knows("R", token(6).as_bytes()), "a wrong token looks like no lease");
    assert!(!t.knows("R", &[5; 3]), "a short token too");
    t.expire(t0 + Duration::from_secs(2));
    assert!(t.knows("R", token(5).as_bytes()), "ended leases are known while on record");
    // Past the record's retention it is gone: an unknown id again.
    t.expire(t0 + Duration::from_secs(2) + LeaseConfig::DEFAULT_ENDED_RECORD_RETENTION);
    assert!(!t.knows("R", token(5).as_bytes()));
    assert_eq!(t.stats().unrecognized, 0, "knows counts nothing");
}

#[test]
fn the_lease_hook_runs_for_every_new_lease_made_or_armed() {
    let t = table();
    let calls = Arc::new(AtomicU32::new(0));
    let c = calls.clone();
    assert!(t.set_lease_hook(move || {
        c.fetch_add(1, Ordering::Relaxed);
    }));
    assert!(!t.set_lease_hook(|| {}), "only the first hook is kept");
    let t0 = Instant::now();
    t.lease(LeaseRequest::new("A", 0, 1, vec![1]), t0).expect("lease");
    t.arm("B", LeaseRequest::new("B", 0, 1, vec![2]), token(9), t0).expect("arm");
    let _ = t.arm("B", LeaseRequest::new("B", 0, 1, vec![2]), token(9), t0).expect_err("live");
    assert_eq!(calls.load(Ordering::Relaxed), 2, "refused arms wake nobody");
}
