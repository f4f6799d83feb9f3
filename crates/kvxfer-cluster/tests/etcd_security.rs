//! Misconfiguration fails fast, and etcd with authentication and with TLS (real etcd on
//! 127.0.0.1 free ports; certificates made with the `openssl` command line).

mod support;

use std::time::{Duration, Instant};

use kvxfer_cluster::testing::{EtcdLaunch, TestCerts};
use kvxfer_cluster::{
    ConfigError, DirectoryOptions, EngineDirectory, Error, EtcdAuth, EtcdConfig, EtcdState, EtcdStatus,
    EtcdTls, Registration, RegistrationConfig, RegistrationError,
};
use support::{init_logs, key, namespace, record, wait_added, EtcdServer};
use tokio::runtime::Handle;

const TTL: Duration = Duration::from_secs(2);
const WAIT: Duration = Duration::from_secs(15);

fn register(etcd: EtcdConfig, engine: &str, incarnation: u64) -> Result<Registration, Error> {
    let config = RegistrationConfig { key: key(engine, 0), record: record(7000, incarnation), ttl: TTL };
    Registration::start(&Handle::current(), etcd, config)
}

fn directory(etcd: EtcdConfig) -> Result<EngineDirectory, Error> {
    EngineDirectory::start(&Handle::current(), etcd, namespace(), DirectoryOptions::default())
}

/// A directory and a registration of `engine` through `etcd`, both up, the directory having
/// listed the engine (`how` names the setup in failures).
async fn registered_and_listed(
    etcd: EtcdConfig,
    engine: &str,
    incarnation: u64,
    how: &str,
) -> (EngineDirectory, Registration) {
    let dir = directory(etcd.clone()).expect("directory");
    if let Err(s) = dir.wait_synced(WAIT).await {
        panic!("directory {how}: {s:?}");
    }
    let mut events = dir.subscribe();
    let reg = register(etcd, engine, incarnation).expect("registration");
    if let Err(s) = reg.wait_registered(WAIT).await {
        panic!("registration {how}: {s:?}");
    }
    wait_added(&mut events, &[engine]).await;
    (dir, reg)
}

/// A registration etcd refuses for good: state `Failed` at once with `want` in the reason,
/// and no retry after it (the failure count stays where it is).
async fn refused(reg: &Registration, want: &str) -> EtcdStatus {
    let status = match reg.wait_registered(WAIT).await {
        Ok(s) => panic!("registered although it should be refused ({want}): {s:?}"),
        Err(s) => s,
    };
    assert_eq!(status.state, EtcdState::Failed, "{status:?}");
    let reason = status.last_error.clone().expect("a reason").to_string();
    assert!(reason.contains(want), "{reason}");
    assert!(matches!(reg.failure(), Some(RegistrationError::Refused { .. })), "{:?}", reg.failure());
    let failures = status.failures;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(reg.status().failures, failures, "retried after a permanent refusal");
    status
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_or_unsupported_endpoints_fail_at_start() {
    init_logs();
    let cases: &[(&str, &str)] = &[
        ("http//127.0.0.1:2379", "not a URL"),
        ("ftp://127.0.0.1:2379", "unsupported scheme"),
        ("unix:///run/etcd.sock", "unsupported scheme"),
        // The etcd client matches the scheme in lower case only: refused at start, not
        // retried for ever as an unreachable `https://HTTPS://...`.
        ("HTTPS://127.0.0.1:2379", "in lower case"),
        ("https://127.0.0.1:2379", "https:// needs TLS settings"),
        ("http://127.0.0.1", "no port"),
        ("http://:2379", "no host"),
        ("http://user:pw@127.0.0.1:2379", "EtcdConfig::auth"),
        ("http://127.0.0.1:2379/v3", "a path"),
        ("127.0.0.1:notaport", "not a number"),
        ("http://[::1]", "no port"),
    ];
    for (endpoint, want) in cases {
        // A good endpoint beside it does not excuse it.
        let config = EtcdConfig::new(["http://127.0.0.1:2379", endpoint]);
        for started in [register(config.clone(), "engine-x", 1).map(drop), directory(config).map(drop)] {
            match started {
                Err(Error::Config(e @ ConfigError::Endpoint { .. })) => {
                    assert!(e.to_string().contains(want), "{endpoint}: {e}");
                    assert!(e.to_string().contains(endpoint), "names the endpoint: {e}");
                }
                other => panic!("{endpoint}: expected an endpoint error, got {other:?}"),
            }
        }
    }
    // TLS settings with an http:// URL are a mistake too.
    let dir = tempfile::tempdir().expect("temp dir");
    let certs = TestCerts::generate(dir.path(), "mismatch").expect("certificates");
    let config = EtcdConfig::new(["http://127.0.0.1:2379"]).tls(certs.client_tls());
    assert!(matches!(register(config, "engine-x", 1), Err(Error::Config(ConfigError::Endpoint { .. }))));
    // A missing certificate file is named at once.
    let missing = EtcdTls::from_files(&dir.path().join("nope.pem"), None);
    assert!(
        matches!(&missing, Err(ConfigError::TlsFile { path, .. }) if path.ends_with("nope.pem")),
        "{missing:?}"
    );
    // Good forms still start.
    for endpoint in
        ["http://127.0.0.1:2379", "127.0.0.1:2379", "http://[::1]:2379", "http://etcd-0.local:2379/"]
    {
        let reg = register(EtcdConfig::new([endpoint]), "engine-x", 1).expect(endpoint);
        drop(reg);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_with_authentication_registers_with_credentials_and_refuses_bad_ones_at_once() {
    let etcd = support::start_etcd();
    let prefix = format!("/{}/", namespace());
    etcd.enable_auth(
        "root-pw",
        &[("kvxfer", "kvxfer-pw", prefix.as_str()), ("other", "other-pw", "/other/")],
    )
    .await;
    let with = |auth: Option<EtcdAuth>| {
        let mut c = etcd.config();
        c.auth = auth;
        c
    };

    // The right credentials: registered, listed, drained by the key, revoked at shutdown.
    let good = with(Some(EtcdAuth::new("kvxfer", "kvxfer-pw")));
    assert!(!format!("{good:?}").contains("kvxfer-pw"), "the password is never printed: {good:?}");
    let (dir, reg) = registered_and_listed(good.clone(), "engine-a", 0xa, "with credentials").await;
    let mut root = etcd.client_as("root", "root-pw").await;
    root.put(kvxfer_cluster::drain_key(&namespace(), &key("engine-a", 0).engine_id), "", None)
        .await
        .expect("put the drain key");
    let deadline = Instant::now() + WAIT;
    while !reg.is_draining() {
        assert!(Instant::now() < deadline, "the drain key is readable with the namespace role");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // No credentials, a wrong password, a role without the namespace: refused at once.
    let started = Instant::now();
    let none = register(with(None), "engine-b", 0xb).expect("start");
    refused(&none, "user name is empty").await;
    let wrong = register(with(Some(EtcdAuth::new("kvxfer", "nope"))), "engine-b", 0xb).expect("start");
    refused(&wrong, "authentication failed").await;
    let elsewhere = register(with(Some(EtcdAuth::new("other", "other-pw"))), "engine-b", 0xb).expect("start");
    refused(&elsewhere, "permission denied").await;
    eprintln!(
        "three refusals took {:?} (each waits 0.5 s for a retry that must not come)",
        started.elapsed()
    );
    // An empty password (a password file left empty) is refused before anything is tried.
    let e = register(with(Some(EtcdAuth::new("kvxfer", ""))), "engine-b", 0xb).expect_err("empty password");
    assert!(e.to_string().contains("password is empty"), "{e}");
    let unknown_user = directory(with(Some(EtcdAuth::new("ghost", "x")))).expect("start");
    let status = unknown_user.wait_synced(WAIT).await.expect_err("refused");
    assert_eq!(status.state, EtcdState::Failed, "{status:?}");
    assert!(status.last_error.expect("reason").contains("authentication failed"));
    for r in [none, wrong, elsewhere] {
        r.shutdown().await.expect("shutdown of a refused registration");
    }

    // The key is revoked under authentication too.
    reg.shutdown().await.expect("revoke with credentials");
    let got = root.get(key("engine-a", 0).to_key(), None).await.expect("get");
    assert!(got.kvs().is_empty(), "revoked at shutdown");
    dir.shutdown().await;
    unknown_user.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_over_tls_with_client_certificates() {
    init_logs();
    let certs_dir = tempfile::tempdir().expect("temp dir");
    let certs = TestCerts::generate(certs_dir.path(), "etcd").expect("certificates");
    let etcd = EtcdServer::launch(EtcdLaunch { tls: Some(certs.clone()), ..EtcdLaunch::for_tests() })
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(etcd.endpoint().starts_with("https://"));

    let (dir, reg) = registered_and_listed(etcd.config(), "engine-t", 0x7, "over TLS").await;

    // No client certificate, while etcd asks for one: etcd answers with a BadCertificate
    // alert (rustls names it so, without a space: review found the spaced pattern never
    // matched), refused at once.
    let mut config = etcd.config();
    config.tls = Some(EtcdTls::from_files(&certs.ca, None).expect("CA"));
    let anonymous = register(config, "engine-u", 0x8).expect("start");
    let status = refused(&anonymous, "certificate").await;
    eprintln!("without a client certificate: {:?}", status.last_error);
    // A CA that did not sign etcd's certificate: refused at once.
    let other = TestCerts::generate(certs_dir.path(), "other").expect("other certificates");
    let mut config = etcd.config();
    config.tls = Some(other.client_tls());
    let untrusted = register(config, "engine-u", 0x8).expect("start");
    let status = refused(&untrusted, "certificate").await;
    eprintln!("with an untrusted CA: {:?}", status.last_error);

    for r in [anonymous, untrusted, reg] {
        r.shutdown().await.expect("shutdown");
    }
    dir.shutdown().await;
}

/// `kvxfer-register` exits with status 1 and the reason, at once, for a malformed URL, a
/// wrong password, and an engine rank a live process holds; with the right password (from
/// a file) it registers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kvxfer_register_exits_with_the_reason_when_refused() {
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};
    let etcd = support::start_etcd();
    let prefix = format!("/{}/", namespace());
    etcd.enable_auth("root-pw", &[("kvxfer", "kvxfer-pw", prefix.as_str())]).await;
    let secrets = tempfile::tempdir().expect("temp dir");
    let (good, bad) = (secrets.path().join("good"), secrets.path().join("bad"));
    std::fs::write(&good, "kvxfer-pw\n").expect("write");
    std::fs::write(&bad, "wrong\n").expect("write");
    let register = |endpoint: &str, password_file: &std::path::Path| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_kvxfer-register"));
        c.args(["--etcd", endpoint, "--namespace", namespace().as_str(), "--engine-id", "engine-r"])
            .args(["--addr", "127.0.0.1:7300", "--ttl-secs", "2", "--etcd-user", "kvxfer"])
            .arg("--etcd-password-file")
            .arg(password_file)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        c
    };
    let exits = |mut c: Command, want: &str| {
        let mut child = c.spawn().expect("run kvxfer-register");
        let stdin = child.stdin.take(); // open while it runs: EOF would mean "leave"
        let out = child.wait_with_output().expect("wait");
        drop(stdin);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{stderr}");
        let last = stderr.lines().last().unwrap_or_default().to_owned();
        assert!(last.starts_with("kvxfer-register: ") && last.contains(want), "{stderr}");
    };
    exits(register("https://127.0.0.1:2379", &good), "https:// needs TLS settings");
    exits(register(&etcd.endpoint(), &bad), "authentication failed");
    // The right password: registered (one JSON line), and a second process is refused.
    let mut first = register(&etcd.endpoint(), &good).spawn().expect("spawn");
    let mut line = String::new();
    let mut stdout = BufReader::new(first.stdout.take().expect("stdout"));
    stdout.read_line(&mut line).expect("read");
    assert!(line.contains(r#""event":"registered""#), "{line}");
    exits(register(&etcd.endpoint(), &good), "already registered by a live process");
    drop(first.stdin.take()); // stdin closed: it revokes and exits
    line.clear();
    stdout.read_line(&mut line).expect("read");
    assert!(line.contains(r#""event":"revoked""#), "{line}");
    assert!(first.wait().expect("wait").success());
}

/// etcd unreachable from the start: one warning that says no key was written (not that a
/// key "stays until its lease expires"), then silence in the log while the retries go on —
/// the next warning comes a minute later at the earliest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_etcd_warns_once_and_claims_no_key() {
    use std::io::Read;
    use std::process::{Command, Stdio};
    let dead = kvxfer_cluster::testing::dead_endpoint();
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvxfer-register"))
        .args(["--etcd", &dead, "--engine-id", "engine-w", "--addr", "127.0.0.1:7500", "--ttl-secs", "2"])
        .env("RUST_LOG", "kvxfer_cluster=debug")
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn kvxfer-register");
    let stdin = child.stdin.take();
    let mut stderr = child.stderr.take().expect("stderr");
    let reader = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = stderr.read_to_string(&mut text);
        text
    });
    tokio::time::sleep(Duration::from_secs(3)).await;
    drop(stdin); // leave
    let status = child.wait().expect("wait");
    let log = reader.join().expect("log");
    let warnings: Vec<&str> = log.lines().filter(|l| l.contains("WARN")).collect();
    let retries = log.lines().filter(|l| l.contains("still failing")).count();
    assert!(status.success(), "{log}");
    assert_eq!(warnings.len(), 1, "{log}");
    assert!(warnings[0].contains("not registered yet: no key was written"), "{log}");
    assert!(!log.contains("stays until its lease expires"), "{log}");
    assert!(retries >= 3, "it kept retrying (at debug level): {retries} in {log}");
}
