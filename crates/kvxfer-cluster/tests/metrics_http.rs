//! `/metrics` over real HTTP: names, types, units, labels and values of a real scrape.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use kvxfer_cluster::{
    ChildPullOutcome, DecodeSnapshot, DirectoryOptions, EngineDirectory, HandoffOutcome, Metrics,
    MetricsServer, PerTransport, PrefillSnapshot, Registration, RegistrationConfig, OPENMETRICS_CONTENT_TYPE,
};
use support::{key, namespace, record, start_etcd};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::runtime::Handle;

/// What Prometheus 2.x/3.x sends when scraping (OpenMetrics preferred, text as fallback).
const PROMETHEUS_ACCEPT: &str = "application/openmetrics-text;version=1.0.0,application/openmetrics-text;\
                                 version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1";

/// One HTTP/1.1 request; returns (status, headers lowercased, body).
async fn http(addr: SocketAddr, method: &str, path: &str) -> (u16, BTreeMap<String, String>, String) {
    http_accept(addr, method, path, None).await
}

/// [`http`] with an `Accept` header.
async fn http_accept(
    addr: SocketAddr,
    method: &str,
    path: &str,
    accept: Option<&str>,
) -> (u16, BTreeMap<String, String>, String) {
    let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let accept = accept.map(|a| format!("Accept: {a}\r\n")).unwrap_or_default();
    let request = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\n{accept}Connection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.expect("write");
    let mut raw = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut raw))
        .await
        .expect("response within 10 s")
        .expect("read");
    let text = String::from_utf8(raw).expect("utf-8 response");
    let (head, body) = text.split_once("\r\n\r\n").expect("head and body");
    let mut lines = head.lines();
    let status_line = lines.next().expect("status line");
    let status = status_line.split(' ').nth(1).and_then(|s| s.parse().ok()).expect("status code");
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    (status, headers, body.to_owned())
}

/// A metric family as declared by `# TYPE` (and `# UNIT`).
#[derive(Debug, Default)]
struct FamilyDecl {
    kind: String,
    unit: Option<String>,
    help: bool,
}

/// A strict reading of the OpenMetrics text format, enough to check what we export:
/// every sample belongs to a declared family with the suffixes its type allows, every
/// family has HELP and TYPE, units end the family name, and the text ends with `# EOF`.
fn parse_openmetrics(text: &str) -> (BTreeMap<String, FamilyDecl>, BTreeMap<String, f64>) {
    let mut families: BTreeMap<String, FamilyDecl> = BTreeMap::new();
    let mut samples = BTreeMap::new();
    let mut lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.pop(), Some("# EOF"), "the exposition must end with # EOF");
    for line in lines {
        if let Some(rest) = line.strip_prefix("# ") {
            let mut parts = rest.splitn(3, ' ');
            let (what, name, arg) = (parts.next(), parts.next(), parts.next());
            let (Some(what), Some(name), Some(arg)) = (what, name, arg) else {
                panic!("bad comment line {line:?}")
            };
            let family = families.entry(name.to_owned()).or_default();
            match what {
                "HELP" => family.help = true,
                "TYPE" => family.kind = arg.to_owned(),
                "UNIT" => family.unit = Some(arg.to_owned()),
                other => panic!("unknown descriptor {other:?} in {line:?}"),
            }
            continue;
        }
        let (series, value) = line.rsplit_once(' ').unwrap_or_else(|| panic!("bad sample line {line:?}"));
        let value: f64 = value.parse().unwrap_or_else(|_| panic!("bad value in {line:?}"));
        let name = series.split('{').next().expect("name");
        let owner = families
            .iter()
            .filter(|(family, decl)| {
                let suffixes: &[&str] = match decl.kind.as_str() {
                    "counter" => &["_total", "_created"],
                    "gauge" => &[""],
                    "info" => &["_info"],
                    "histogram" => &["_bucket", "_sum", "_count", "_created"],
                    other => panic!("unexpected type {other:?}"),
                };
                suffixes.iter().any(|s| name.strip_suffix(s) == Some(family.as_str()))
            })
            .count();
        assert_eq!(owner, 1, "sample {line:?} must belong to exactly one declared family");
        assert!(samples.insert(series.to_owned(), value).is_none(), "duplicate series {series}");
    }
    for (name, decl) in &families {
        assert!(
            name.starts_with("kvxfer_") || name == "process_start_time_seconds",
            "{name} lacks the kvxfer_ prefix"
        );
        assert!(decl.help && !decl.kind.is_empty(), "{name} lacks HELP or TYPE: {decl:?}");
        assert!(!name.ends_with("_total"), "{name}: the family name carries no _total");
        if let Some(unit) = &decl.unit {
            assert!(name.ends_with(&format!("_{unit}")), "{name} does not end with its unit {unit}");
        }
    }
    (families, samples)
}

/// The label names used in `series`.
fn label_names(series: &str) -> Vec<String> {
    let Some((_, labels)) = series.split_once('{') else { return Vec::new() };
    labels
        .trim_end_matches('}')
        .split(',')
        .filter_map(|kv| kv.split_once('=').map(|(k, _)| k.to_owned()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_are_served_over_http_and_parse() {
    let etcd = start_etcd();
    let metrics = Arc::new(Metrics::new());

    // An agent's counters, read at scrape time.
    let served = Arc::new(AtomicU64::new(4096));
    let served_by_agent = served.clone();
    let _prefill = metrics.add_prefill_source(move || PrefillSnapshot {
        leases_made: 10,
        leases_pulled: 6,
        leases_released: 2,
        leases_expired: 1,
        leases_live: 1,
        notifications_bad_token: 3,
        bytes_served: PerTransport { tcp: served_by_agent.load(Ordering::Relaxed), ucx: 0, rdma: 0 },
        reads_served: 6,
        connections_accepted: 2,
        connections_refused_limit: 1,
        connections_open: 2,
        pins_open: 2,
        ..Default::default()
    });
    let _decode = metrics.add_decode_source(|| DecodeSnapshot {
        pulls: 4,
        children_done: 7,
        children_failed: 1,
        bytes_pulled: PerTransport { tcp: 100, ucx: 200, rdma: 0 },
        integrity_failures: PerTransport { tcp: 1, ucx: 0, rdma: 0 },
        connections_opened: 3,
        peers: 1,
        read_retries: 2,
        control_retries: 1,
        reads_after_broken_batch: 3,
        notifies_with_read: 4,
        read_batches: 5,
        reads_batched: 11,
        ..Default::default()
    });
    metrics.observe_pull(Duration::from_millis(3));
    metrics.observe_pull(Duration::from_millis(40));
    metrics.observe_child_handoff(HandoffOutcome::Pulled, Duration::from_millis(12));
    metrics.observe_child_handoff(HandoffOutcome::Expired, Duration::from_secs(30));
    metrics.observe_child_pull(ChildPullOutcome::Done, Duration::from_millis(2));
    metrics.observe_child_pull(ChildPullOutcome::Failed, Duration::from_millis(5));
    metrics.count_child_failure("timeout");

    // A real registration and directory report their etcd state.
    let reg = Registration::start(
        &Handle::current(),
        etcd.config(),
        RegistrationConfig { key: key("engine-m", 0), record: record(7000, 1), ttl: Duration::from_secs(2) },
    )
    .expect("registration");
    reg.wait_registered(Duration::from_secs(15)).await.expect("registered");
    let dir =
        EngineDirectory::start(&Handle::current(), etcd.config(), namespace(), DirectoryOptions::default())
            .expect("directory");
    dir.wait_synced(Duration::from_secs(15)).await.expect("synced");
    let _reg_metrics = metrics.add_registration(&reg);
    let _dir_metrics = metrics.add_directory(&dir);

    let server =
        MetricsServer::start(&Handle::current(), "127.0.0.1:0", metrics.clone()).expect("metrics server");
    let addr = server.local_addr();
    assert!(addr.ip().is_loopback() && addr.port() != 0);

    let (status, headers, body) = http_accept(addr, "GET", "/metrics", Some(PROMETHEUS_ACCEPT)).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(headers.get("content-type").map(String::as_str), Some(OPENMETRICS_CONTENT_TYPE));
    let (families, samples) = parse_openmetrics(&body);

    let expected_types = [
        ("kvxfer_leases_made", "counter"),
        ("kvxfer_leases_ended", "counter"),
        ("kvxfer_leases_live", "gauge"),
        ("kvxfer_leases_draining", "gauge"),
        ("kvxfer_notifications_rejected", "counter"),
        ("kvxfer_served_bytes", "counter"),
        ("kvxfer_pulled_bytes", "counter"),
        ("kvxfer_pull_duration_seconds", "histogram"),
        ("kvxfer_child_handoff_duration_seconds", "histogram"),
        ("kvxfer_child_pull_duration_seconds", "histogram"),
        ("kvxfer_connections_open", "gauge"),
        ("kvxfer_connections_opened", "counter"),
        ("kvxfer_connections_refused", "counter"),
        ("kvxfer_pins", "counter"),
        ("kvxfer_pins_open", "gauge"),
        ("kvxfer_integrity_failures", "counter"),
        ("kvxfer_retries", "counter"),
        ("kvxfer_notifies_with_read", "counter"),
        ("kvxfer_read_batches", "counter"),
        ("kvxfer_reads_batched", "counter"),
        ("kvxfer_etcd_state", "gauge"),
        ("kvxfer_etcd_failures", "counter"),
        ("kvxfer_discovery_engines", "gauge"),
        ("kvxfer_discovery_ignored", "counter"),
    ];
    for (name, kind) in expected_types {
        let decl = families.get(name).unwrap_or_else(|| panic!("{name} missing from:\n{body}"));
        assert_eq!(decl.kind, kind, "{name}");
    }
    assert_eq!(families["kvxfer_served_bytes"].unit.as_deref(), Some("bytes"));
    assert_eq!(families["kvxfer_pull_duration_seconds"].unit.as_deref(), Some("seconds"));

    let value =
        |series: &str| samples.get(series).copied().unwrap_or_else(|| panic!("{series} missing:\n{body}"));
    assert_eq!(value("kvxfer_leases_made_total"), 10.0);
    assert_eq!(value(r#"kvxfer_leases_ended_total{outcome="expired"}"#), 1.0);
    assert_eq!(value(r#"kvxfer_notifications_rejected_total{kind="bad_token"}"#), 3.0);
    assert_eq!(value(r#"kvxfer_served_bytes_total{transport="tcp"}"#), 4096.0);
    assert_eq!(value(r#"kvxfer_pulled_bytes_total{transport="ucx"}"#), 200.0);
    assert_eq!(value(r#"kvxfer_connections_opened_total{side="decode"}"#), 3.0);
    assert_eq!(value(r#"kvxfer_connections_refused_total{kind="limit"}"#), 1.0);
    assert_eq!(value("kvxfer_pull_duration_seconds_count"), 2.0);
    assert_eq!(value(r#"kvxfer_child_handoff_duration_seconds_count{outcome="expired"}"#), 1.0);
    assert_eq!(value(r#"kvxfer_child_pull_duration_seconds_count{outcome="failed"}"#), 1.0);
    assert_eq!(value(r#"kvxfer_children_total{outcome="done"}"#), 7.0);
    assert_eq!(value(r#"kvxfer_children_total{outcome="failed",kind="timeout"}"#), 1.0);
    assert_eq!(value(r#"kvxfer_retries_total{kind="read"}"#), 2.0);
    assert_eq!(value(r#"kvxfer_retries_total{kind="control"}"#), 1.0);
    assert_eq!(value(r#"kvxfer_retries_total{kind="broken_batch"}"#), 3.0);
    assert_eq!(value("kvxfer_notifies_with_read_total"), 4.0);
    assert_eq!(value("kvxfer_read_batches_total"), 5.0);
    assert_eq!(value("kvxfer_reads_batched_total"), 11.0);
    assert_eq!(value("kvxfer_connections_open"), 2.0);
    assert_eq!(value(r#"kvxfer_etcd_state{component="registration",state="connected"}"#), 1.0);
    assert_eq!(value(r#"kvxfer_etcd_state{component="directory",state="connected"}"#), 1.0);
    assert_eq!(value(r#"kvxfer_etcd_state{component="directory",state="degraded"}"#), 0.0);
    assert_eq!(value("kvxfer_discovery_engines"), 1.0);

    // Bounded label names only (no request ids, no addresses).
    let allowed: BTreeSet<&str> =
        ["transport", "outcome", "kind", "side", "component", "state", "reason", "le"].into();
    for series in samples.keys().filter(|s| !s.starts_with("kvxfer_build_info")) {
        for label in label_names(series) {
            assert!(allowed.contains(label.as_str()), "unexpected label {label} in {series}");
        }
    }

    // Read at scrape time: a counter the agent bumps shows in the next scrape.
    served.store(8192, Ordering::Relaxed);
    let (_, _, body) = http_accept(addr, "GET", "/metrics", Some("application/openmetrics-text")).await;
    let (_, samples) = parse_openmetrics(&body);
    assert_eq!(samples.get(r#"kvxfer_served_bytes_total{transport="tcp"}"#), Some(&8192.0));

    let (status, _, _) = http(addr, "GET", "/").await;
    assert_eq!(status, 404);
    let (status, _, _) = http(addr, "GET", "/metrics/extra").await;
    assert_eq!(status, 404);
    let (status, headers, _) = http(addr, "POST", "/metrics").await;
    assert_eq!((status, headers.get("allow").map(String::as_str)), (405, Some("GET, HEAD")));

    server.shutdown().await;
    let refused = tokio::net::TcpStream::connect(addr).await;
    assert!(refused.is_err(), "the listener is closed after shutdown");
    reg.shutdown().await.expect("shutdown");
    dir.shutdown().await;
}

/// A client that pipelines requests and never reads their answers blocks its connection
/// in a write. Shutting the server down must still end that connection (it is the server's
/// task, not a detached one that outlives it): the client's next write then fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_ends_a_connection_whose_client_never_reads() {
    use std::io::Write;
    let server =
        MetricsServer::start(&Handle::current(), "127.0.0.1:0", Arc::new(Metrics::new())).expect("start");
    let addr = server.local_addr();
    let stream = std::net::TcpStream::connect(addr).expect("connect");
    let closer = stream.try_clone().expect("clone");
    let written = Arc::new(AtomicU64::new(0));
    let (tx, rx) = std::sync::mpsc::channel();
    let progress = written.clone();
    let writer = std::thread::spawn(move || {
        let mut stream = stream;
        let batch = "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n".repeat(256);
        loop {
            if let Err(e) = stream.write_all(batch.as_bytes()) {
                let _ = tx.send(e.kind());
                return;
            }
            progress.fetch_add(batch.len() as u64, Ordering::Relaxed);
        }
    });
    // Blocked: nothing written for a while (both sides' buffers are full).
    let mut last = u64::MAX;
    loop {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let now = written.load(Ordering::Relaxed);
        if now == last {
            break;
        }
        last = now;
    }
    server.shutdown().await;
    let ended =
        tokio::task::spawn_blocking(move || rx.recv_timeout(Duration::from_secs(15))).await.expect("join");
    let _ = closer.shutdown(std::net::Shutdown::Both);
    writer.join().expect("writer");
    assert!(ended.is_ok(), "the connection outlived the server's shutdown ({last} bytes written)");
}

/// A strict reading of the Prometheus text format 0.0.4: every family has HELP and TYPE
/// (counter names carry their `_total`, as the format wants), every sample belongs to one
/// declared family, no OpenMetrics-only lines (`# UNIT`, `# EOF`, `info`/`unknown` types).
fn parse_prometheus_text(text: &str) -> (BTreeMap<String, String>, BTreeMap<String, f64>) {
    let mut kinds: BTreeMap<String, String> = BTreeMap::new();
    let mut helps = BTreeSet::new();
    let mut samples = BTreeMap::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# ") {
            let mut parts = rest.splitn(3, ' ');
            match (parts.next(), parts.next(), parts.next()) {
                (Some("HELP"), Some(name), Some(_)) => {
                    assert!(helps.insert(name.to_owned()), "two HELP: {line}")
                }
                (Some("TYPE"), Some(name), Some(kind)) => {
                    assert!(["counter", "gauge", "histogram"].contains(&kind), "type {kind:?} in {line:?}");
                    assert!(kinds.insert(name.to_owned(), kind.to_owned()).is_none(), "two TYPE: {line}");
                }
                _ => panic!("not a Prometheus text comment line: {line:?}"),
            }
            continue;
        }
        assert!(!line.is_empty(), "empty line");
        let (series, value) = line.rsplit_once(' ').unwrap_or_else(|| panic!("bad sample line {line:?}"));
        let value: f64 = value.parse().unwrap_or_else(|_| panic!("bad value in {line:?}"));
        let name = series.split('{').next().expect("name");
        let owners = kinds
            .iter()
            .filter(|(family, kind)| match kind.as_str() {
                "histogram" => ["_bucket", "_sum", "_count"]
                    .iter()
                    .any(|s| name.strip_suffix(s) == Some(family.as_str())),
                _ => name == family.as_str(),
            })
            .count();
        assert_eq!(owners, 1, "sample {line:?} must belong to exactly one declared family");
        assert!(samples.insert(series.to_owned(), value).is_none(), "duplicate series {series}");
    }
    for name in kinds.keys() {
        assert!(helps.contains(name), "{name} has no HELP");
    }
    (kinds, samples)
}

/// A process with both sides, a registration and a failure or two, for the scrapes below.
struct Scraped {
    _etcd: support::EtcdServer,
    metrics: Arc<Metrics>,
    server: MetricsServer,
    reg: Registration,
    _guards: Vec<kvxfer_cluster::SourceGuard>,
}

async fn both_sides() -> Scraped {
    let etcd = start_etcd();
    let metrics = Arc::new(Metrics::new());
    let reg = Registration::start(
        &Handle::current(),
        etcd.config(),
        RegistrationConfig {
            key: key("engine-i", 3),
            record: record(7001, 0x00ab_cdef_0123_4567),
            ttl: Duration::from_secs(10),
        },
    )
    .expect("registration");
    reg.wait_registered(Duration::from_secs(15)).await.expect("registered");
    let guards = vec![
        metrics.add_prefill_source(|| PrefillSnapshot { leases_made: 3, ..Default::default() }),
        metrics.add_decode_source(|| DecodeSnapshot { pulls: 2, children_done: 5, ..Default::default() }),
        metrics.add_registration(&reg),
    ];
    metrics.observe_pull(Duration::from_millis(3));
    metrics.observe_child_handoff(HandoffOutcome::Pulled, Duration::from_millis(3));
    let server =
        MetricsServer::start(&Handle::current(), "127.0.0.1:0", metrics.clone()).expect("metrics server");
    Scraped { _etcd: etcd, metrics, server, reg, _guards: guards }
}

/// `/metrics` answers the Prometheus text format 0.0.4 unless the `Accept` header prefers
/// OpenMetrics (it always answered OpenMetrics, also to `text/plain;version=0.0.4`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_answer_the_format_the_scraper_asks_for() {
    let s = both_sides().await;
    let addr = s.server.local_addr();
    let text_type = "text/plain; version=0.0.4; charset=utf-8";
    for accept in
        [None, Some("text/plain;version=0.0.4"), Some("text/plain"), Some("*/*"), Some("application/json")]
    {
        let (status, headers, body) = http_accept(addr, "GET", "/metrics", accept).await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(headers.get("content-type").map(String::as_str), Some(text_type), "Accept: {accept:?}");
        assert_eq!(headers.get("vary").map(String::as_str), Some("Accept"));
        let (kinds, samples) = parse_prometheus_text(&body);
        assert_eq!(kinds.get("kvxfer_leases_made_total").map(String::as_str), Some("counter"), "{body}");
        assert_eq!(kinds.get("kvxfer_pull_duration_seconds").map(String::as_str), Some("histogram"));
        assert_eq!(kinds.get("kvxfer_build_info").map(String::as_str), Some("gauge"));
        assert_eq!(samples.get("kvxfer_leases_made_total"), Some(&3.0), "{body}");
        assert_eq!(samples.get("kvxfer_pull_duration_seconds_count"), Some(&1.0), "{body}");
    }
    for accept in [
        PROMETHEUS_ACCEPT,
        "application/openmetrics-text",
        "application/openmetrics-text; version=1.0.0",
        "text/plain;q=0.5, application/openmetrics-text;q=0.9",
    ] {
        let (status, headers, body) = http_accept(addr, "GET", "/metrics", Some(accept)).await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(
            headers.get("content-type").map(String::as_str),
            Some(OPENMETRICS_CONTENT_TYPE),
            "{accept}"
        );
        let (families, samples) = parse_openmetrics(&body);
        assert_eq!(families["kvxfer_leases_made"].kind, "counter");
        assert_eq!(samples.get("kvxfer_leases_made_total"), Some(&3.0));
    }
    // Text preferred over OpenMetrics, or OpenMetrics refused.
    for accept in ["application/openmetrics-text;q=0.2, text/plain;q=0.8", "application/openmetrics-text;q=0"]
    {
        let (_, headers, _) = http_accept(addr, "GET", "/metrics", Some(accept)).await;
        assert_eq!(headers.get("content-type").map(String::as_str), Some(text_type), "{accept}");
    }
    s.server.shutdown().await;
    s.reg.shutdown().await.expect("shutdown");
}

/// `kvxfer_build_info` names the version and each registration's engine id, rank and
/// incarnation (16 hex digits, as etcd holds it); `process_start_time_seconds` is there in
/// both formats.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn build_info_and_process_start_time_are_exported() {
    let s = both_sides().await;
    let addr = s.server.local_addr();
    let (_, _, body) = http_accept(addr, "GET", "/metrics", Some("application/openmetrics-text")).await;
    let (families, samples) = parse_openmetrics(&body);
    assert_eq!(families["kvxfer_build"].kind, "info", "{body}");
    let version = env!("CARGO_PKG_VERSION");
    let info = format!(
        r#"kvxfer_build_info{{version="{version}",engine_id="engine-i",rank="3",incarnation="00abcdef01234567"}}"#
    );
    assert_eq!(samples.get(&info), Some(&1.0), "{body}");
    assert_eq!(families["process_start_time_seconds"].kind, "gauge");
    let now =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("clock").as_secs_f64();
    let started = samples["process_start_time_seconds"];
    assert!(started <= now + 1.0 && started > now - 86_400.0, "started {started}, now {now}");

    let (_, _, body) = http(addr, "GET", "/metrics").await;
    let (_, samples) = parse_prometheus_text(&body);
    assert_eq!(samples.get(&info), Some(&1.0), "{body}");
    assert!(samples.contains_key("process_start_time_seconds"), "{body}");

    // Without registrations: the version alone.
    let bare = Metrics::new().encode().expect("encode");
    assert!(bare.contains(&format!("kvxfer_build_info{{version=\"{version}\"}} 1\n")), "{bare}");
    s.server.shutdown().await;
    s.reg.shutdown().await.expect("shutdown");
    drop(s.metrics);
}

/// Failed children carry the error kind (`PullError::kind`) in the decode failure counter.
#[test]
fn failed_children_are_counted_by_error_kind() {
    let metrics = Metrics::new();
    let _decode = metrics.add_decode_source(|| DecodeSnapshot {
        children_done: 4,
        children_cancelled: 1,
        ..Default::default()
    });
    metrics.count_child_failure("engine_not_registered");
    metrics.count_child_failure("connect");
    metrics.count_child_failure("engine_not_registered");
    let text = metrics.encode().expect("encode");
    let (families, samples) = parse_openmetrics(&text);
    assert_eq!(families["kvxfer_children"].kind, "counter");
    let get = |s: &str| samples.get(s).copied().unwrap_or_else(|| panic!("{s} missing:\n{text}"));
    assert_eq!(get(r#"kvxfer_children_total{outcome="failed",kind="engine_not_registered"}"#), 2.0);
    assert_eq!(get(r#"kvxfer_children_total{outcome="failed",kind="connect"}"#), 1.0);
    assert_eq!(get(r#"kvxfer_children_total{outcome="done"}"#), 4.0);
    assert_eq!(get(r#"kvxfer_children_total{outcome="cancelled"}"#), 1.0);
    assert!(!text.contains(r#"outcome="failed"}"#), "a failure without its kind:\n{text}");
}

/// A prefill-only process has no (always empty) decode histograms, a decode-only one no
/// prefill histogram; no RDMA series while no RDMA bytes were counted (none is built).
#[test]
fn each_side_exports_only_its_own_families() {
    let prefill = Metrics::new();
    let _p = prefill.add_prefill_source(|| PrefillSnapshot { leases_made: 1, ..Default::default() });
    let text = prefill.encode().expect("encode");
    let (families, samples) = parse_openmetrics(&text);
    assert!(families.contains_key("kvxfer_child_handoff_duration_seconds"), "{text}");
    for decode_only in ["kvxfer_pull_duration_seconds", "kvxfer_child_pull_duration_seconds", "kvxfer_pulls"]
    {
        assert!(!families.contains_key(decode_only), "{decode_only} on a prefill:\n{text}");
    }
    assert!(samples.keys().all(|s| !s.contains("rdma")), "RDMA series without RDMA:\n{text}");
    assert_eq!(samples.get(r#"kvxfer_served_bytes_total{transport="tcp"}"#), Some(&0.0));

    let decode = Metrics::new();
    let _d = decode.add_decode_source(DecodeSnapshot::default);
    let text = decode.encode().expect("encode");
    let (families, samples) = parse_openmetrics(&text);
    assert!(families.contains_key("kvxfer_pull_duration_seconds"), "{text}");
    assert!(
        !families.contains_key("kvxfer_child_handoff_duration_seconds"),
        "prefill histogram on a decode:\n{text}"
    );
    assert!(samples.keys().all(|s| !s.contains("rdma")), "RDMA series without RDMA:\n{text}");

    // A count that is not zero is shown.
    let _r = decode.add_decode_source(|| DecodeSnapshot {
        bytes_pulled: PerTransport { tcp: 0, ucx: 0, rdma: 5 },
        ..Default::default()
    });
    let text = decode.encode().expect("encode");
    assert!(text.contains("kvxfer_pulled_bytes_total{transport=\"rdma\"} 5\n"), "{text}");
}
