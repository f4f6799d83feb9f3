//! The two-phase lease end to end: a scheduler process mints the request id and token into
//! `kv_transfer_params`, the prefill worker arms the lease with exactly those later
//! (`PrefillAgent::arm`), and a decode peer that is faster than the arm waits (bounded by
//! `Limits::arm_wait`) instead of being told the lease is unknown — vLLM's
//! early-notification race (#43509) cannot happen.

mod support;

use std::time::Duration;

use kvxfer::{
    AgentConfig, BlockLayout, ChildOutcome, EndKind, KvTransferParams, LeaseRequest, LeaseToken,
    PrefillResult, PullError,
};
use kvxfer_proto::v1::LeaseOutcome;
use support::*;

const ENGINE: &str = "prefill-engine";

fn layout() -> BlockLayout {
    BlockLayout::single(16, BLOCK).expect("layout")
}

/// A token as a scheduler process mints it (random, never all zeros in practice).
fn minted() -> LeaseToken {
    let bytes: [u8; 16] = rand::random();
    LeaseToken::from_wire(&bytes).expect("16 bytes")
}

fn prefill_armed_within(wait: Duration) -> kvxfer::blocking::PrefillAgent {
    prefill_with(AgentConfig::new("prefill").engine_id(ENGINE).arm_wait(wait), layout())
}

/// The `kv_transfer_params` the scheduler writes for child `index` of `parent` (n children)
/// before any worker armed the lease: it knows the engine id and the worker's address from
/// its configuration, not the worker's incarnation (not stated).
fn scheduler_params(
    prefill: &kvxfer::blocking::PrefillAgent,
    parent: &str,
    index: u32,
    n: u32,
    blocks: Vec<u32>,
    token: &LeaseToken,
) -> KvTransferParams {
    let mut p = KvTransferParams {
        do_remote_prefill: true,
        remote_block_ids: Some(kvxfer_core::RemoteBlockIds::Flat(blocks)),
        remote_engine_id: Some(ENGINE.into()),
        remote_request_id: Some(kvxfer_core::child_request_id(parent, index, n)),
        remote_host: Some("127.0.0.1".into()),
        remote_port: Some(u32::from(prefill.local_addr().port())),
        tp_size: Some(1),
        ..Default::default()
    };
    p.kvxfer_lease_token = Some(token.to_hex());
    p.kvxfer_parent_request_id = Some(parent.into());
    p.kvxfer_child_index = Some(index);
    p.kvxfer_n = Some(n);
    p
}

/// Sends one notify over a raw keyed connection, from a thread of its own (it blocks until
/// the prefill agent answers).
fn notify_in_thread(
    prefill: &kvxfer::blocking::PrefillAgent,
    id: &str,
    token: LeaseToken,
) -> std::thread::JoinHandle<i32> {
    let (addr, id) = (prefill.local_addr().to_string(), id.to_owned());
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
        rt.block_on(async {
            let mut c = raw_connect(&addr, &raw_hello(&layout(), "decode")).await.expect("connect");
            c.notify(&id, token.as_bytes(), "decode/0").await.expect("notify answered").outcome
        })
    })
}

#[test]
fn a_notify_before_the_arm_waits_and_ends_the_lease_pulled_once_armed() {
    let prefill = prefill_armed_within(Duration::from_secs(60));
    let token = minted();
    let notifier = notify_in_thread(&prefill, "R", token);
    eventually("the notify waits for its lease", || prefill.stats().server.arm_waits == 1);
    let h = prefill.arm("R", LeaseRequest::new("R", 0, 1, vec![3]), token).expect("arm");
    assert_eq!(h.token().as_bytes(), token.as_bytes());
    assert_eq!(notifier.join().expect("notifier"), LeaseOutcome::Pulled as i32);
    let ends = wait_ends(&prefill, 1, Duration::from_secs(10));
    assert_eq!(ends[0].kind, EndKind::Pulled);
    let stats = prefill.stats();
    assert_eq!((stats.leases.unrecognized, stats.server.arm_wait_expired), (0, 0), "{stats:?}");
}

#[test]
fn a_pull_of_children_not_armed_yet_reads_each_once_it_is_armed() {
    let prefill = prefill_armed_within(Duration::from_secs(60));
    let decode = decode_with(AgentConfig::new("decode").io_timeout(Duration::from_secs(30)), layout());
    let blocks = [vec![2, 3], vec![4, 5]];
    let tokens = [minted(), minted()];
    let handoffs = (0..2u32)
        .map(|i| {
            scheduler_params(&prefill, "P", i, 2, blocks[i as usize].clone(), &tokens[i as usize])
                .to_handoff()
                .expect("hand-off")
        })
        .collect();
    let result = PrefillResult::new("P", 2, handoffs).expect("result");
    let pull = decode.submit(result, vec![vec![8, 9], vec![10, 11]]).expect("submit");
    // Arm child 1 first, and child 0 only once its read is known to wait.
    prefill.arm("1_P", LeaseRequest::new("P", 1, 2, blocks[1].clone()), tokens[1]).expect("arm 1");
    eventually("child 0's read waits for its lease", || prefill.stats().server.arm_waits >= 1);
    prefill.arm("0_P", LeaseRequest::new("P", 0, 2, blocks[0].clone()), tokens[0]).expect("arm 0");
    let report = pull.wait();
    assert!(report.all_done(), "{report:?}");
    assert!(verify(&decode, &[2, 3, 4, 5], &[8, 9, 10, 11]), "every byte pulled");
    let ends = wait_ends(&prefill, 2, Duration::from_secs(10));
    assert!(ends.iter().all(|e| e.kind == EndKind::Pulled), "{ends:?}");
    let stats = prefill.stats();
    assert_eq!((stats.leases.unrecognized, stats.server.arm_wait_expired), (0, 0), "{stats:?}");
}

#[test]
fn a_lease_never_armed_is_answered_unrecognized_after_the_bound() {
    let prefill = prefill_armed_within(Duration::from_millis(200));
    let notifier = notify_in_thread(&prefill, "never", minted());
    assert_eq!(notifier.join().expect("notifier"), LeaseOutcome::Unrecognized as i32);
    let stats = prefill.stats();
    assert_eq!((stats.server.arm_waits, stats.server.arm_wait_expired), (1, 1), "{stats:?}");
    assert_eq!(stats.leases.unrecognized, 1);

    // A pull of a hand-off nobody arms fails as an unknown lease (retry from a fresh one).
    let decode = decode_with(AgentConfig::new("decode"), layout());
    let h = scheduler_params(&prefill, "Q", 0, 1, vec![1], &minted()).to_handoff().expect("hand-off");
    let report = decode
        .submit(PrefillResult::new("Q", 1, vec![h]).expect("result"), vec![vec![1]])
        .expect("submit")
        .wait();
    match &report.children[0].outcome {
        ChildOutcome::Failed { error: e @ PullError::LeaseUnknown { .. }, .. } => {
            assert_eq!(e.advice(), kvxfer::Advice::RetryFreshHandoff)
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_wrong_token_for_a_live_lease_waits_like_an_unknown_id() {
    let prefill = prefill_armed_within(Duration::from_millis(200));
    let token = minted();
    prefill.arm("L", LeaseRequest::new("L", 0, 1, vec![1]), token).expect("arm");
    let notifier = notify_in_thread(&prefill, "L", minted());
    assert_eq!(notifier.join().expect("notifier"), LeaseOutcome::Unrecognized as i32);
    let stats = prefill.stats();
    assert_eq!((stats.server.arm_wait_expired, stats.leases.bad_token), (1, 1), "{stats:?}");
    assert_eq!(stats.leases.live, 1, "the lease is untouched");
}

#[test]
fn an_ended_lease_is_answered_from_its_record_without_waiting() {
    let prefill = prefill_armed_within(Duration::from_secs(30));
    let token = minted();
    let h = prefill.arm("E", LeaseRequest::new("E", 0, 1, vec![1]), token).expect("arm");
    assert_eq!(prefill.cancel(&h), kvxfer_core::CancelOutcome::Released);
    let notifier = notify_in_thread(&prefill, "E", token);
    assert_eq!(notifier.join().expect("notifier"), LeaseOutcome::AlreadyReleased as i32);
    assert_eq!(prefill.stats().server.arm_waits, 0, "an ended lease is known: no wait");
}

#[test]
fn an_arm_wait_too_large_for_a_deadline_still_waits_for_the_arm() {
    let prefill = prefill_armed_within(Duration::MAX);
    let token = minted();
    let notifier = notify_in_thread(&prefill, "M", token);
    eventually("the notify waits for its lease", || prefill.stats().server.arm_waits == 1);
    prefill.arm("M", LeaseRequest::new("M", 0, 1, vec![2]), token).expect("arm");
    assert_eq!(notifier.join().expect("notifier"), LeaseOutcome::Pulled as i32);
}

/// Hostile-peer review: a decode agent ran every control exchange with a prefill agent (and
/// every new pull's hello) on one connection, under one lock, and the prefill side holds a
/// frame naming a lease it does not know for its `arm_wait`: one cancel of a lease never
/// armed stalled every other pull from that prefill agent (4.84 s instead of 94 µs; behind
/// 7 of them a pull's lease expired before it started). Now each exchange runs on a control
/// connection of its own, and the stale releases keep waiting while the pull goes through.
#[test]
fn releases_held_for_the_arm_wait_do_not_stall_other_pulls_from_that_prefill() {
    let wait = Duration::from_secs(60);
    let prefill = prefill_armed_within(wait);
    // The decode side's io timeout outlasts the test: only the prefill answers end an exchange.
    let config = AgentConfig::new("decode").io_timeout(Duration::from_secs(300));
    let decode = std::sync::Arc::new(decode_with(config, layout()));
    let stale: Vec<_> = (0..7u32)
        .map(|i| {
            let h = scheduler_params(&prefill, &format!("ghost{i}"), 0, 1, vec![1], &minted())
                .to_handoff()
                .expect("hand-off");
            let decode = decode.clone();
            std::thread::spawn(move || decode.release(&h))
        })
        .collect();
    eventually("every stale release waits at the prefill", || prefill.stats().server.arm_waits == 7);

    let token = minted();
    prefill.arm("P", LeaseRequest::new("P", 0, 1, vec![2, 3]), token).expect("arm");
    let h = scheduler_params(&prefill, "P", 0, 1, vec![2, 3], &token).to_handoff().expect("hand-off");
    let pull = decode
        .submit(PrefillResult::new("P", 1, vec![h]).expect("result"), vec![vec![5, 6]])
        .expect("submit");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || tx.send(pull.wait()));
    // Before, the pull waited for the first release's whole arm wait (60 s) at least.
    let report = rx.recv_timeout(wait / 2).expect("the pull ended while the releases still waited");
    assert!(report.all_done(), "{report:?}");
    assert!(verify(&decode, &[2, 3], &[5, 6]), "every byte pulled");
    assert!(stale.iter().all(|t| !t.is_finished()), "the stale releases are still held by the prefill");
    let stats = prefill.stats();
    assert_eq!((stats.server.arm_waits, stats.server.arm_wait_expired), (7, 0), "{stats:?}");
    assert_eq!(wait_ends(&prefill, 1, Duration::from_secs(10))[0].kind, EndKind::Pulled);
    // Shutting the prefill agent down answers nothing more; the releases end unapplied.
    prefill.shutdown();
    for t in stale {
        assert!(!t.join().expect("release thread"), "a lease nobody armed is not released");
    }
}

/// Hostile-peer review: `release` did not check the incarnation, so the release of a lease
/// made by a prefill process that has restarted since was sent to the new process, which held
/// it for its arm wait. The release is refused here, without asking the peer.
#[test]
fn a_release_of_a_lease_from_an_earlier_incarnation_is_not_sent() {
    let prefill = prefill_armed_within(Duration::from_secs(60));
    let decode = decode_with(AgentConfig::new("decode"), layout());
    let mut p = scheduler_params(&prefill, "R", 0, 1, vec![1], &minted());
    p.kvxfer_incarnation = Some(prefill.incarnation() ^ 1);
    let h = p.to_handoff().expect("hand-off");
    assert!(!decode.release(&h), "nothing to release: the lease went with its process");
    let (d, s) = (decode.stats(), prefill.stats());
    assert_eq!((d.leases_released, d.releases_refused), (0, 1), "{d:?}");
    assert_eq!((s.server.arm_waits, s.leases.unrecognized), (0, 0), "not asked: {s:?}");

    // A lease of the incarnation answering is released as before.
    let token = minted();
    prefill.arm("L", LeaseRequest::new("L", 0, 1, vec![2]), token).expect("arm");
    let mut p = scheduler_params(&prefill, "L", 0, 1, vec![2], &token);
    p.kvxfer_incarnation = Some(prefill.incarnation());
    assert!(decode.release(&p.to_handoff().expect("hand-off")));
    assert_eq!(wait_ends(&prefill, 1, Duration::from_secs(10))[0].kind, EndKind::Released);
}
