//! Running in a cluster: hand-offs naming only the engine id; with the `cluster` feature,
//! agents registering in and resolving through a real etcd (`kvxfer_cluster::testing`, on
//! 127.0.0.1 free ports), invalidation of pooled connections, pulls while etcd is down, and
//! the metrics both agents feed, scraped over HTTP.

mod support;

use std::time::Duration;

use kvxfer::{Error, SubmitError};
use support::*;

/// A hand-off naming only the engine id cannot be pulled without discovery: refused at
/// submit, before any I/O, naming the engine.
#[test]
fn an_engine_only_handoff_is_refused_without_discovery() {
    let prefill = prefill(16, Duration::from_secs(30));
    let decode = decode(16);
    let result = prefill.lease_parent("P", vec![vec![1], vec![2]], 1, None).expect("lease");
    let engine = result.children()[0].engine().engine_id.clone();
    match decode.submit(result.engine_only(), vec![vec![1], vec![2]]) {
        Err(Error::Submit(SubmitError::NoAddress { parent, engine: named })) => {
            assert_eq!((parent.as_str(), named), ("P", engine));
        }
        other => panic!("expected NoAddress, got {other:?}"),
    }
    assert_eq!(decode.stats().connections_opened, 0);
    // The same result with its addresses pulls as usual.
    let report = decode.submit(result, vec![vec![1], vec![2]]).expect("submit").wait();
    assert!(report.all_done(), "{report:?}");
}

#[cfg(feature = "cluster")]
mod discovery {
    use std::collections::BTreeMap;
    use std::io::{Read, Write};
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use kvxfer::blocking::{DecodeAgent, PrefillAgent};
    use kvxfer::cluster::{DiscoveryConfig, EtcdState, Metrics};
    use kvxfer::{AgentConfig, BlockId, ChildOutcome, Error, PullError, PullReport, TransportChoice};
    use kvxfer_cluster::testing::etcd_client::PutOptions;
    use kvxfer_cluster::testing::EtcdServer;
    use kvxfer_cluster::EngineRecord;

    fn layout(blocks: u32) -> kvxfer::BlockLayout {
        kvxfer::BlockLayout::single(blocks, BLOCK).expect("layout")
    }
    use super::support::*;

    const NS: &str = "kvxfer-engine-test";

    fn discovery(etcd: &EtcdServer, ttl_secs: u64) -> DiscoveryConfig {
        DiscoveryConfig {
            etcd: etcd.config(),
            namespace: NS.into(),
            registration_ttl: Duration::from_secs(ttl_secs),
        }
    }

    fn prefill_in(etcd: &EtcdServer, engine: &str, ttl_secs: u64) -> PrefillAgent {
        let config = AgentConfig::new("prefill")
            .engine_id(engine)
            .io_timeout(Duration::from_secs(5))
            .discovery(discovery(etcd, ttl_secs));
        let prefill = prefill_with(config, layout(64));
        if let Err(status) = prefill.wait_registered(Duration::from_secs(15)) {
            panic!("not registered: {status:?}");
        }
        prefill
    }

    fn decode_in(etcd: &EtcdServer) -> DecodeAgent {
        let config =
            AgentConfig::new("decode").io_timeout(Duration::from_secs(5)).discovery(discovery(etcd, 2));
        decode_with(config, layout(64))
    }

    /// Waits up to 15 s for `cond` (etcd round trips, watch events).
    fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(15);
        while !cond() {
            assert!(Instant::now() < deadline, "timed out waiting for: {what}");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    fn wait_resolves(decode: &DecodeAgent, engine: &str, incarnation: u64) {
        let dir = decode.directory().expect("a directory").clone();
        wait_for(&format!("{engine} incarnation {incarnation:#x} in the directory"), || {
            dir.resolve(engine, 0).is_some_and(|e| e.record.incarnation == incarnation)
        });
    }

    fn blocks(first: u32, n: u32) -> Vec<Vec<BlockId>> {
        (0..n).map(|i| vec![first + 2 * i, first + 2 * i + 1]).collect()
    }

    fn assert_done_and_verified(decode: &DecodeAgent, report: &PullReport, remote: &[Vec<BlockId>]) {
        assert!(report.all_done(), "{report:?}");
        for (c, blocks) in report.children.iter().zip(remote) {
            assert!(matches!(c.outcome, ChildOutcome::Done { acknowledged: true, .. }), "{c:?}");
            assert!(verify(decode, blocks, blocks), "child {} bytes", c.child_index);
        }
    }

    /// Every child failed because discovery says the engine is gone; returns the messages.
    fn assert_engine_gone(report: &PullReport) -> Vec<String> {
        report
            .children
            .iter()
            .map(|c| match &c.outcome {
                ChildOutcome::Failed { error: e @ PullError::EngineNotRegistered { .. }, .. } => {
                    assert!(e.is_retryable(), "{e}");
                    e.to_string()
                }
                other => panic!("child {}: expected EngineNotRegistered, got {other:?}", c.child_index),
            })
            .collect()
    }

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime")
    }

    #[test]
    fn a_prefill_agent_registers_at_start_and_its_key_is_gone_when_shutdown_returns() {
        let etcd = EtcdServer::start();
        let prefill = prefill_in(&etcd, "engine-a", 2);
        let decode = decode_in(&etcd);
        wait_resolves(&decode, "engine-a", prefill.incarnation());
        let entry = decode.directory().and_then(|d| d.resolve("engine-a", 0)).expect("registered");
        let r = &entry.record;
        assert_eq!(r.addr.to_string(), prefill.local_addr().to_string());
        assert_eq!(r.compat_hash, layout(64).compat_hash());
        assert_eq!(r.protocol_version, kvxfer_proto::PROTOCOL_VERSION);
        let offered: &[&str] = if prefill.offers_ucx() { &["ucx", "tcp"] } else { &["tcp"] };
        assert_eq!(r.transports.iter().map(|t| t.as_str()).collect::<Vec<_>>(), offered);
        assert_eq!(r.agent.as_str(), "prefill");
        assert_ne!(entry.lease, 0, "the key is on a lease");
        let status = prefill.registration_status().expect("status");
        assert_eq!(status.state, EtcdState::Connected);

        prefill.shutdown();
        // Revoked, not left to expire: the key is gone when shutdown returns.
        let key = format!("/{NS}/v1/engines/engine-a/0");
        let stored = runtime().block_on(async { etcd.client().await.get(key, None).await.expect("get") });
        assert!(stored.kvs().is_empty(), "{stored:?}");
        assert!(prefill.registration_status().is_none());
        drop(prefill);
        drop(decode);
    }

    #[test]
    fn pulls_of_a_gone_engine_fail_at_once_and_engine_only_handoffs_resolve_through_etcd() {
        let etcd = EtcdServer::start();
        let prefill = prefill_in(&etcd, "engine-b", 2);
        let decode = decode_in(&etcd);
        wait_resolves(&decode, "engine-b", prefill.incarnation());

        // Only the engine id: the address comes from the directory's cache.
        let remote = blocks(0, 4);
        let result = prefill.lease_parent("P1", remote.clone(), 1, None).expect("lease").engine_only();
        assert!(!result.children()[0].engine().names_address());
        let report = decode.submit(result, remote.clone()).expect("submit").wait();
        assert_done_and_verified(&decode, &report, &remote);
        let with_address = prefill.lease_parent("P2", blocks(16, 2), 1, None).expect("lease");
        let engine_only = prefill.lease_parent("P3", blocks(24, 2), 1, None).expect("lease").engine_only();
        let before = decode.stats();
        assert_eq!(before.peers, 1);

        // Deregistered first thing at shutdown: the decode agent drops its pooled
        // connections to the engine as soon as the watch tells it.
        prefill.shutdown();
        wait_for("the peer invalidated", || decode.stats().peers_invalidated == 1);
        assert_eq!(decode.stats().peers, 0, "the peer is forgotten");

        let report = decode.submit(with_address, blocks(16, 2)).expect("submit").wait();
        let messages = assert_engine_gone(&report);
        let incarnation = format!("{:016x}", prefill.incarnation());
        assert!(messages[0].contains(&incarnation) && messages[0].contains("engine-b"), "{messages:?}");
        let report = decode.submit(engine_only, blocks(24, 2)).expect("submit").wait();
        assert_engine_gone(&report);
        // Neither pull tried to connect.
        assert_eq!(decode.stats().connections_opened, before.connections_opened);
        drop(decode);
    }

    #[test]
    fn a_new_incarnation_put_in_etcd_drops_pooled_connections_at_once() {
        let etcd = EtcdServer::start();
        let prefill = prefill_in(&etcd, "engine-c", 10);
        let decode = decode_in(&etcd);
        wait_resolves(&decode, "engine-c", prefill.incarnation());
        let report =
            decode.submit(prefill.lease_parent("P1", blocks(0, 2), 1, None).expect("lease"), blocks(0, 2));
        assert_done_and_verified(&decode, &report.expect("submit").wait(), &blocks(0, 2));
        let opened = decode.stats().connections_opened;

        // Another process takes the key over (what a restart that beats the old lease's
        // expiry looks like): same address, a new incarnation, same lease.
        let rt = runtime();
        let key = format!("/{NS}/v1/engines/engine-c/0");
        let (original, lease) = rt.block_on(async {
            let got = etcd.client().await.get(key.as_str(), None).await.expect("get");
            let kv = got.kvs().first().expect("registered").clone();
            (kv.value().to_vec(), kv.lease())
        });
        let mut record = EngineRecord::from_json(&original).expect("our record");
        record.incarnation = prefill.incarnation() ^ 0x5a5a;
        let put = |value: Vec<u8>| {
            rt.block_on(async {
                let options = PutOptions::new().with_lease(lease);
                etcd.client().await.put(key.as_str(), value, Some(options)).await.expect("put");
            })
        };
        #[cfg(feature = "ucx")]
        let over_ucx = decode.stats().bytes_pulled_ucx > 0;
        #[cfg(feature = "ucx")]
        assert_eq!(decode.stats().ucx_endpoints, u64::from(over_ucx));
        put(record.to_json());
        wait_for("the peer invalidated", || decode.stats().peers_invalidated == 1);
        assert_eq!(decode.stats().peers, 0);
        // Its UCX endpoint (and the rkeys it unpacked) is closed with it.
        #[cfg(feature = "ucx")]
        wait_for("no UCX endpoint to the invalidated peer", || decode.stats().ucx_endpoints == 0);
        // The live agent's hand-offs now name an incarnation etcd says is gone.
        let report =
            decode.submit(prefill.lease_parent("P2", blocks(8, 2), 1, None).expect("lease"), blocks(8, 2));
        assert_engine_gone(&report.expect("submit").wait());
        assert_eq!(decode.stats().connections_opened, opened, "failed before any I/O");

        // The original record back: its incarnation is live again, and the pull opens fresh
        // connections (the pooled ones were dropped).
        put(original);
        wait_resolves(&decode, "engine-c", prefill.incarnation());
        let report =
            decode.submit(prefill.lease_parent("P3", blocks(16, 2), 1, None).expect("lease"), blocks(16, 2));
        assert_done_and_verified(&decode, &report.expect("submit").wait(), &blocks(16, 2));
        assert!(decode.stats().connections_opened > opened);
        drop(decode);
        drop(prefill);
    }

    #[test]
    fn pulls_resolve_from_the_cache_while_etcd_is_unreachable() {
        let mut etcd = EtcdServer::start();
        let prefill = prefill_in(&etcd, "engine-d", 10);
        let decode = decode_in(&etcd);
        wait_resolves(&decode, "engine-d", prefill.incarnation());
        let dir = decode.directory().expect("directory").clone();

        etcd.pause();
        wait_for("the directory degraded", || dir.status().state == EtcdState::Degraded);
        let remote = blocks(0, 3);
        let result = prefill.lease_parent("P1", remote.clone(), 1, None).expect("lease");
        // Both forms pull from what is cached; nothing waits for etcd.
        let report = decode.submit(result.engine_only(), remote.clone()).expect("submit").wait();
        assert_done_and_verified(&decode, &report, &remote);
        let result = prefill.lease_parent("P2", blocks(8, 2), 1, None).expect("lease");
        assert_done_and_verified(
            &decode,
            &decode.submit(result, blocks(8, 2)).expect("submit").wait(),
            &blocks(8, 2),
        );
        assert_eq!(dir.status().state, EtcdState::Degraded);

        etcd.resume();
        wait_for("the directory back", || dir.status().state == EtcdState::Connected);
        drop(decode);
        drop(prefill);
        etcd.kill();
    }

    /// `GET /metrics` over HTTP/1.0, asking for OpenMetrics (the default answer is the
    /// Prometheus text format): the samples by series.
    fn scrape(addr: std::net::SocketAddr) -> BTreeMap<String, f64> {
        let mut s = std::net::TcpStream::connect(addr).expect("connect to /metrics");
        s.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
        let request = "GET /metrics HTTP/1.0\r\nHost: test\r\nAccept: application/openmetrics-text\r\n\r\n";
        s.write_all(request.as_bytes()).expect("request");
        let mut text = String::new();
        s.read_to_string(&mut text).expect("response");
        assert!(text.starts_with("HTTP/1.0 200") || text.starts_with("HTTP/1.1 200"), "{text}");
        let body = text.split("\r\n\r\n").nth(1).expect("body");
        assert!(body.ends_with("# EOF\n"), "{body}");
        body.lines()
            .filter(|l| !l.starts_with('#'))
            .filter_map(|l| l.rsplit_once(' '))
            .map(|(series, value)| (series.to_owned(), value.parse().expect("a number")))
            .collect()
    }

    /// Both agents of a process feed one registry (no etcd: metrics alone), the prefill agent
    /// serves it; pull and per-child latencies, lease lives by outcome, bytes per transport
    /// and the open connections show up.
    #[test]
    fn both_agents_feed_one_registry_served_at_metrics() {
        let metrics = Arc::new(Metrics::new());
        let prefill = prefill_with(
            AgentConfig::new("prefill")
                .transport(TransportChoice::Tcp)
                .lease_ttl(Duration::from_millis(300))
                .metrics(metrics.clone())
                .metrics_listen("127.0.0.1:0"),
            layout(64),
        );
        let decode = decode_with(
            AgentConfig::new("decode").transport(TransportChoice::Tcp).metrics(metrics.clone()),
            layout(64),
        );
        let addr = prefill.metrics_addr().expect("served");
        assert!(addr.ip().is_loopback());
        assert!(decode.metrics_addr().is_none());

        // Children 0 and 1 are pulled; child 2 is nobody's and expires.
        let result = prefill.lease_parent("M", blocks(0, 3), 1, None).expect("lease");
        let report = decode.submit_subset(&result, vec![(0, blocks(0, 1)[0].clone()), (1, vec![2, 3])]);
        let report = report.expect("submit").wait();
        assert!(report.all_done(), "{report:?}");
        wait_ends(&prefill, 3, Duration::from_secs(10));

        let m = scrape(addr);
        let get = |series: &str| m.get(series).copied().unwrap_or_else(|| panic!("{series} missing: {m:#?}"));
        let bytes = (4 * BLOCK) as f64;
        assert_eq!(get("kvxfer_leases_made_total"), 3.0);
        assert_eq!(get(r#"kvxfer_leases_ended_total{outcome="pulled"}"#), 2.0);
        assert_eq!(get(r#"kvxfer_leases_ended_total{outcome="expired"}"#), 1.0);
        assert_eq!(get(r#"kvxfer_child_handoff_duration_seconds_count{outcome="pulled"}"#), 2.0);
        assert_eq!(get(r#"kvxfer_child_handoff_duration_seconds_count{outcome="expired"}"#), 1.0);
        // The expired lease lived at least its ttl.
        assert!(get(r#"kvxfer_child_handoff_duration_seconds_sum{outcome="expired"}"#) >= 0.3);
        assert_eq!(get("kvxfer_pulls_total"), 1.0);
        assert_eq!(get("kvxfer_pull_duration_seconds_count"), 1.0);
        assert_eq!(get(r#"kvxfer_child_pull_duration_seconds_count{outcome="done"}"#), 2.0);
        assert_eq!(get(r#"kvxfer_pulled_bytes_total{transport="tcp"}"#), bytes);
        assert_eq!(get(r#"kvxfer_pulled_bytes_total{transport="ucx"}"#), 0.0);
        assert_eq!(get(r#"kvxfer_served_bytes_total{transport="tcp"}"#), bytes);
        assert_eq!(get(r#"kvxfer_integrity_failures_total{transport="tcp"}"#), 0.0);
        // The two children's reads went pipelined, in one batch, and nothing was made again.
        assert_eq!((get("kvxfer_read_batches_total"), get("kvxfer_reads_batched_total")), (1.0, 2.0));
        assert_eq!(get(r#"kvxfer_retries_total{kind="broken_batch"}"#), 0.0);
        assert_eq!(get("kvxfer_notifies_with_read_total"), 0.0);
        assert_eq!(get("kvxfer_peers"), 1.0);
        // The decode side's pooled connections are still open.
        let open = prefill.stats().connections_open;
        assert!(open >= 1);
        assert_eq!(get("kvxfer_connections_open"), open as f64);
        assert_eq!(get(r#"kvxfer_connections_opened_total{side="decode"}"#), open as f64);

        // The decode agent gone: its connections close, its counters stay.
        drop(decode);
        wait_for("connections closed", || prefill.stats().connections_open == 0);
        let m = scrape(addr);
        assert_eq!(m.get("kvxfer_connections_open"), Some(&0.0));
        assert_eq!(m.get(r#"kvxfer_pulled_bytes_total{transport="tcp"}"#), Some(&bytes));
        assert_eq!(m.get("kvxfer_peers"), Some(&0.0));
        prefill.shutdown();
        assert!(std::net::TcpStream::connect(addr).is_err(), "/metrics stops with the agent");
    }

    /// A decode agent that started after an engine rank restarted never saw the old
    /// incarnation go; the rank registered at a hand-off's address says it did: the pull
    /// fails at once, without a connect, instead of reaching the new process.
    #[test]
    fn a_handoff_of_an_incarnation_the_cache_lists_replaced_fails_without_a_connect() {
        let etcd = EtcdServer::start();
        let prefill = prefill_in(&etcd, "engine-f", 10);
        // Another incarnation takes the rank's key over (a restart at the same address).
        let rt = runtime();
        let key = format!("/{NS}/v1/engines/engine-f/0");
        rt.block_on(async {
            let mut client = etcd.client().await;
            let got = client.get(key.as_str(), None).await.expect("get");
            let kv = got.kvs().first().expect("registered").clone();
            let mut record = EngineRecord::from_json(kv.value()).expect("our record");
            record.incarnation = prefill.incarnation() ^ 0x77;
            let options = PutOptions::new().with_lease(kv.lease());
            client.put(key.as_str(), record.to_json(), Some(options)).await.expect("put");
        });
        let decode = decode_in(&etcd);
        wait_resolves(&decode, "engine-f", prefill.incarnation() ^ 0x77);
        let result = prefill.lease_parent("P1", blocks(0, 2), 1, None).expect("lease");
        assert!(result.children()[0].engine().names_address());
        let report = decode.submit(result, blocks(0, 2)).expect("submit").wait();
        let messages = assert_engine_gone(&report);
        assert!(messages[0].contains("restarted"), "{messages:?}");
        assert_eq!(decode.stats().connections_opened, 0, "failed before any I/O");
        drop(decode);
        drop(prefill);
    }

    /// A prefill process restarted (same address, a new incarnation) while etcd is down
    /// cannot register, and the decode side's cache still lists its predecessor there: a
    /// degraded directory does not judge restarts by that stale cache, so the new process's
    /// hand-offs pull (its handshake checks the incarnation). Once etcd is back the new
    /// process registers, the directory lists it, and the old incarnation is gone.
    #[test]
    fn a_prefill_restarted_while_etcd_is_down_is_pulled_from() {
        let mut etcd = EtcdServer::start();
        let old = prefill_in(&etcd, "engine-r", 10);
        let addr = old.local_addr();
        let decode = decode_in(&etcd);
        wait_resolves(&decode, "engine-r", old.incarnation());
        let dir = decode.directory().expect("directory").clone();
        let result = old.lease_parent("P1", blocks(0, 2), 1, None).expect("lease");
        assert_done_and_verified(
            &decode,
            &decode.submit(result, blocks(0, 2)).expect("submit").wait(),
            &blocks(0, 2),
        );

        etcd.kill();
        wait_for("the directory degraded", || dir.status().state == EtcdState::Degraded);
        assert!(!dir.is_current() && dir.is_synced());
        let old_incarnation = old.incarnation();
        old.shutdown();
        drop(old);
        // The restart: same engine, same address, a new incarnation.
        let config = AgentConfig::new("prefill")
            .engine_id("engine-r")
            .io_timeout(Duration::from_secs(5))
            .discovery(discovery(&etcd, 10));
        let mem = kvxfer_mem::pattern::alloc_filled(layout(64)).expect("patterned memory");
        let new =
            PrefillAgent::start(keyed(config), &addr.to_string(), mem).expect("restarted prefill agent");
        assert_ne!(new.incarnation(), old_incarnation);
        assert_eq!(
            dir.resolve("engine-r", 0).map(|e| e.record.incarnation),
            Some(old_incarnation),
            "the stale cache lists the old process"
        );
        for (i, parent) in ["P2", "P3"].into_iter().enumerate() {
            let remote = blocks(8 + 4 * i as u32, 2);
            let result = new.lease_parent(parent, remote.clone(), 1, None).expect("lease");
            // With its address, and naming only the engine id (the cached address is the same).
            let result = if i == 0 { result } else { result.engine_only() };
            let report = decode.submit(result, remote.clone()).expect("submit").wait();
            assert_done_and_verified(&decode, &report, &remote);
        }

        // etcd back: the new process registers once its predecessor's key expires (its
        // lease, not renewed by anyone, runs out within the 10 s TTL etcd's restart gave
        // it), the directory lists it, and a hand-off of the old incarnation is refused as
        // gone.
        etcd.restart();
        if let Err(status) = new.wait_registered(Duration::from_secs(15)) {
            panic!("not registered: {status:?}");
        }
        wait_resolves(&decode, "engine-r", new.incarnation());
        wait_for("the directory current", || dir.is_current());
        let old_addr = kvxfer_cluster::AdvertiseAddr::from_socket_addr(addr).expect("addr");
        assert!(matches!(
            dir.check_handoff("engine-r", old_incarnation, Some(&old_addr)),
            Err(kvxfer_cluster::ResolveError::Gone { .. })
        ));
        let result = new.lease_parent("P4", blocks(32, 2), 1, None).expect("lease");
        assert_done_and_verified(
            &decode,
            &decode.submit(result, blocks(32, 2)).expect("submit").wait(),
            &blocks(32, 2),
        );
        drop(decode);
        drop(new);
    }

    /// An IPv6 advertise host written in a non-canonical form: hand-offs and the registered
    /// record name the same address, so an event about the record finds the pooled peer.
    #[test]
    fn a_non_canonical_ipv6_advertise_host_is_registered_as_hand_offs_name_it() {
        if std::net::TcpListener::bind("[::1]:0").is_err() {
            eprintln!("skipped: no IPv6 loopback here");
            return;
        }
        let etcd = EtcdServer::start();
        let mut config = AgentConfig::new("prefill")
            .engine_id("engine-6")
            .io_timeout(Duration::from_secs(5))
            .discovery(discovery(&etcd, 10));
        config.advertise_host = Some("0:0:0::1".into());
        let mem = kvxfer_mem::pattern::alloc_filled(layout(64)).expect("patterned memory");
        let prefill = PrefillAgent::start(keyed(config), "[::1]:0", mem).expect("prefill agent");
        if let Err(status) = prefill.wait_registered(Duration::from_secs(15)) {
            panic!("not registered: {status:?}");
        }
        let decode = decode_in(&etcd);
        wait_resolves(&decode, "engine-6", prefill.incarnation());
        let entry = decode.directory().and_then(|d| d.resolve("engine-6", 0)).expect("registered");
        let result = prefill.lease_parent("P1", blocks(0, 2), 1, None).expect("lease");
        assert_eq!(result.children()[0].engine().addr(), entry.record.addr.to_string());
        let report = decode.submit(result, blocks(0, 2)).expect("submit").wait();
        assert_done_and_verified(&decode, &report, &blocks(0, 2));
        // The engine leaves: the pooled peer (named as the hand-off named it) is found.
        prefill.shutdown();
        wait_for("the peer invalidated", || decode.stats().peers_invalidated == 1);
        drop(decode);
    }

    /// A second prefill process started with the engine id of a live one: its registration
    /// is refused with a clear error (state `Failed`, `wait_registered` says why), and the
    /// first keeps its key — its hand-offs, with their address or naming only the engine,
    /// go on being pulled, and no decode agent drops its connections.
    #[test]
    fn a_second_prefill_with_a_live_ones_engine_id_is_refused_and_the_first_keeps_serving() {
        let etcd = EtcdServer::start();
        let first = prefill_in(&etcd, "engine-dup", 2);
        let decode = decode_in(&etcd);
        wait_resolves(&decode, "engine-dup", first.incarnation());
        let config = AgentConfig::new("prefill")
            .engine_id("engine-dup")
            .io_timeout(Duration::from_secs(5))
            .discovery(discovery(&etcd, 2));
        let second = prefill_with(config, layout(64));
        let status = match second.wait_registered(Duration::from_secs(15)) {
            Ok(status) => panic!("the duplicate registered: {status:?}"),
            Err(status) => status.expect("discovery is configured"),
        };
        assert_eq!(status.state, EtcdState::Failed, "{status:?}");
        let message = status.last_error.expect("why").to_string();
        assert!(message.contains("already registered by a live process"), "{message}");
        assert!(message.contains(&format!("{:016x}", first.incarnation())), "{message}");

        // Two TTLs later the first still holds the key, and its hand-offs pull.
        std::thread::sleep(Duration::from_secs(4));
        let dir = decode.directory().expect("directory").clone();
        assert_eq!(dir.resolve("engine-dup", 0).map(|e| e.record.incarnation), Some(first.incarnation()));
        for (i, parent) in ["P1", "P2"].into_iter().enumerate() {
            let remote = blocks(4 * i as u32, 2);
            let result = first.lease_parent(parent, remote.clone(), 1, None).expect("lease");
            let result = if i == 0 { result } else { result.engine_only() };
            let report = decode.submit(result, remote.clone()).expect("submit").wait();
            assert_done_and_verified(&decode, &report, &remote);
        }
        assert_eq!(decode.stats().peers_invalidated, 0);
        assert_eq!(first.registration_status().map(|s| s.state), Some(EtcdState::Connected));
        // The refused process shuts down without touching the first's key.
        second.shutdown();
        drop(second);
        let result = first.lease_parent("P3", blocks(16, 2), 1, None).expect("lease").engine_only();
        let report = decode.submit(result, blocks(16, 2)).expect("submit").wait();
        assert_done_and_verified(&decode, &report, &blocks(16, 2));
        drop(decode);
        drop(first);
    }

    /// Draining a prefill agent, by its call and by the engine's etcd drain key: new
    /// leases are refused with `Error::Draining`; leases made before are pulled (with
    /// their address and naming only the engine); the decode agent's directory says the
    /// engine is draining and keeps its connections; undraining lets leases through again.
    #[test]
    fn a_draining_prefill_refuses_new_leases_while_its_leases_are_pulled() {
        let etcd = EtcdServer::start();
        let prefill = prefill_in(&etcd, "engine-dr", 2);
        let decode = decode_in(&etcd);
        wait_resolves(&decode, "engine-dr", prefill.incarnation());
        let dir = decode.directory().expect("directory").clone();
        let draining = || dir.resolve("engine-dr", 0).is_some_and(|e| e.record.draining);
        let report =
            decode.submit(prefill.lease_parent("P0", blocks(0, 2), 1, None).expect("lease"), blocks(0, 2));
        assert_done_and_verified(&decode, &report.expect("submit").wait(), &blocks(0, 2));
        let assert_refused = |parent: &str| match prefill.lease_parent(parent, blocks(40, 2), 1, None) {
            Err(e @ Error::Draining { .. }) => {
                assert!(e.to_string().contains("engine-dr is draining"), "{e}")
            }
            other => panic!("a draining engine leased {parent}: {other:?}"),
        };

        for by_key in [false, true] {
            let existing = prefill.lease_parent("E1", blocks(4, 2), 1, None).expect("lease");
            let engine_only = prefill.lease_parent("E2", blocks(8, 2), 1, None).expect("lease").engine_only();
            let drain_key = format!("/{NS}/v1/drain/engine-dr");
            if by_key {
                runtime().block_on(async {
                    etcd.client().await.put(drain_key.as_str(), "", None).await.expect("put the drain key")
                });
                wait_for("the agent draining by the key", || prefill.is_draining());
            } else {
                prefill.drain();
                assert!(prefill.is_draining());
            }
            assert_refused("N1");
            wait_for("the directory reporting the engine draining", draining);
            // What was leased before the drain is still pulled, and ends as usual.
            let report = decode.submit(existing, blocks(4, 2)).expect("submit").wait();
            assert_done_and_verified(&decode, &report, &blocks(4, 2));
            let report = decode.submit(engine_only, blocks(8, 2)).expect("submit").wait();
            assert_done_and_verified(&decode, &report, &blocks(8, 2));
            assert_refused("N2");
            assert_eq!(decode.stats().peers_invalidated, 0, "draining keeps connections");
            if by_key {
                runtime().block_on(async {
                    etcd.client().await.delete(drain_key.as_str(), None).await.expect("delete the drain key")
                });
            } else {
                prefill.undrain();
            }
            wait_for("the agent serving again", || !prefill.is_draining());
            wait_for("the directory reporting the engine serving", || !draining());
            let result = prefill.lease_parent("A1", blocks(12, 2), 1, None).expect("lease after undrain");
            let report = decode.submit(result, blocks(12, 2)).expect("submit").wait();
            assert_done_and_verified(&decode, &report, &blocks(12, 2));
        }
        drop(decode);
        drop(prefill);
    }

    /// A malformed or unsupported etcd URL fails the agent's start with the reason, instead
    /// of a warning and retries for ever.
    #[test]
    fn an_agent_with_a_bad_etcd_url_fails_to_start() {
        for (url, want) in
            [("https://127.0.0.1:2379", "needs TLS settings"), ("etcd://10.0.0.1:2379", "scheme")]
        {
            let mut d = DiscoveryConfig::new([url], NS);
            d.registration_ttl = Duration::from_secs(2);
            let config = AgentConfig::new("prefill").engine_id("engine-bad").discovery(d.clone());
            let mem = kvxfer_mem::pattern::alloc_filled(layout(64)).expect("patterned memory");
            match PrefillAgent::start(keyed(config), "127.0.0.1:0", mem) {
                Err(e @ Error::Cluster(_)) => assert!(e.to_string().contains(want), "{url}: {e}"),
                Err(e) => panic!("{url}: expected a cluster config error, got {e}"),
                Ok(_) => panic!("{url}: the prefill agent started"),
            }
            let config = AgentConfig::new("decode").discovery(d);
            match DecodeAgent::start(keyed(config), kvxfer_mem::KvMemory::alloc(layout(64)).expect("memory"))
            {
                Err(e @ Error::Cluster(_)) => assert!(e.to_string().contains(want), "{url}: {e}"),
                Err(e) => panic!("{url}: expected a cluster config error, got {e}"),
                Ok(_) => panic!("{url}: the decode agent started"),
            }
        }
    }
}
