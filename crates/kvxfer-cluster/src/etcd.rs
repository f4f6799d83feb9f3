//! The etcd connection settings and the connection state both halves expose.

use std::fmt;
use std::future::Future;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use etcd_client::{Certificate, Client, ConnectOptions, GetOptions, Identity, TlsOptions};

use crate::error::{ConfigError, EtcdError, EtcdOp};

/// TLS to etcd, for `https://` endpoints: the CA that signed etcd's server certificate and,
/// for an etcd started with `--client-cert-auth`, this client's certificate and key (rustls;
/// PEM files). The key is never printed (`Debug` says whether one is set).
#[derive(Clone)]
pub struct EtcdTls {
    /// PEM of the CA certificate(s) etcd's server certificate must chain to.
    pub ca_pem: Vec<u8>,
    /// This client's certificate chain and private key (PEM), when etcd asks for one.
    pub client_cert: Option<(Vec<u8>, Vec<u8>)>,
    /// The name etcd's certificate must carry, when not the endpoint's host.
    pub domain: Option<String>,
}

impl EtcdTls {
    /// Reads the CA certificate and, when given, the client certificate and key from PEM
    /// files; fails at once, naming the file, when one cannot be read or holds no PEM.
    pub fn from_files(ca: &Path, client: Option<(&Path, &Path)>) -> Result<Self, ConfigError> {
        let read = |what: &'static str, path: &Path| {
            let bytes = std::fs::read(path).map_err(|e| ConfigError::TlsFile {
                what,
                path: path.display().to_string(),
                reason: e.to_string(),
            })?;
            if !bytes.windows(11).any(|w| w == b"-----BEGIN ") {
                return Err(ConfigError::TlsFile {
                    what,
                    path: path.display().to_string(),
                    reason: "no PEM block (-----BEGIN ...) in it".into(),
                });
            }
            Ok(bytes)
        };
        let ca_pem = read("CA certificate", ca)?;
        let client_cert = match client {
            Some((cert, key)) => Some((read("client certificate", cert)?, read("client key", key)?)),
            None => None,
        };
        Ok(Self { ca_pem, client_cert, domain: None })
    }

    pub(crate) fn options(&self) -> TlsOptions {
        let mut tls = TlsOptions::new().ca_certificate(Certificate::from_pem(&self.ca_pem));
        if let Some((cert, key)) = &self.client_cert {
            tls = tls.identity(Identity::from_pem(cert, key));
        }
        if let Some(domain) = &self.domain {
            tls = tls.domain_name(domain.clone());
        }
        tls
    }
}

impl fmt::Debug for EtcdTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdTls")
            .field("ca_pem_bytes", &self.ca_pem.len())
            .field("client_cert", &self.client_cert.as_ref().map(|_| "<certificate and key>"))
            .field("domain", &self.domain)
            .finish()
    }
}

/// A user name and password for an etcd with authentication on (`etcdctl auth enable`).
/// The password is never printed.
#[derive(Clone)]
pub struct EtcdAuth {
    user: String,
    password: String,
}

impl EtcdAuth {
    /// `user` with `password`.
    pub fn new(user: impl Into<String>, password: impl Into<String>) -> Self {
        Self { user: user.into(), password: password.into() }
    }

    /// The user name.
    pub fn user(&self) -> &str {
        &self.user
    }
}

impl fmt::Debug for EtcdAuth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdAuth").field("user", &self.user).field("password", &"<redacted>").finish()
    }
}

/// How to reach etcd and how hard to try.
#[derive(Debug, Clone)]
pub struct EtcdConfig {
    /// Client URLs, e.g. `http://10.0.0.1:2379`, or `https://...` with [`Self::tls`]
    /// (`host:port` means `http://host:port`, or `https://` with TLS). Checked when a
    /// registration or directory starts: a malformed URL, another scheme, a missing port,
    /// `https://` without TLS settings or `http://` with them fail at once.
    /// List every member of an HA cluster: one member is used at a time, the next one when
    /// it fails ([`EtcdStatus::endpoint`] says which).
    pub endpoints: Vec<String>,
    /// TLS settings for `https://` endpoints. `None`: plain `http://`.
    pub tls: Option<EtcdTls>,
    /// Credentials for an etcd with authentication on. A wrong password, a missing user
    /// (`user name is empty`) or a role without access to the namespace stops the
    /// registration or directory at the first answer, with the reason (state
    /// [`EtcdState::Failed`]) — it is not retried; once it had connected, the same refusal
    /// is retried like any failure.
    pub auth: Option<EtcdAuth>,
    /// Longest wait for a TCP connection to an endpoint.
    pub connect_timeout: Duration,
    /// Longest wait for any one answer (a grant, a put, a list, a watch being set up).
    pub request_timeout: Duration,
    /// HTTP/2 pings on idle connections, so a dead etcd (or path to it) is noticed by open
    /// watch and keep-alive streams within `keepalive_interval + keepalive_timeout`. Keep it
    /// at or above the server's `--grpc-keepalive-min-time` (5 s by default): etcd answers
    /// pings that come more often with GOAWAY (`too_many_pings`), which closes every stream
    /// of the connection.
    pub keepalive_interval: Duration,
    /// How long a ping may go unanswered.
    pub keepalive_timeout: Duration,
    /// First retry delay after a failure; doubles per failure (with jitter).
    pub backoff_initial: Duration,
    /// Longest retry delay.
    pub backoff_max: Duration,
    /// Largest message accepted from etcd (a listing page, a watch response). Listings are
    /// paged and pages shrink to fit, watch responses are fragmented by etcd, so this only
    /// needs to hold one value etcd accepts (1.5 MiB by default). Default 128 MiB.
    pub max_response_bytes: usize,
}

impl EtcdConfig {
    /// Defaults for `endpoints`: 2 s connect and request timeouts, HTTP/2 pings every 6 s
    /// answered within 4 s (a dead etcd is noticed within 10 s; etcd refuses pings more
    /// often than every 5 s unless configured otherwise), retries from 100 ms doubling to
    /// at most 2 s, messages of up to 128 MiB.
    pub fn new<S: Into<String>>(endpoints: impl IntoIterator<Item = S>) -> Self {
        Self {
            endpoints: endpoints.into_iter().map(Into::into).collect(),
            connect_timeout: Duration::from_secs(2),
            request_timeout: Duration::from_secs(2),
            keepalive_interval: Duration::from_secs(6),
            keepalive_timeout: Duration::from_secs(4),
            backoff_initial: Duration::from_millis(100),
            backoff_max: Duration::from_secs(2),
            max_response_bytes: 128 << 20,
            tls: None,
            auth: None,
        }
    }

    /// Sets the TLS settings (for `https://` endpoints).
    pub fn tls(mut self, tls: EtcdTls) -> Self {
        self.tls = Some(tls);
        self
    }

    /// Sets the credentials.
    pub fn auth(mut self, auth: EtcdAuth) -> Self {
        self.auth = Some(auth);
        self
    }

    /// Takes TLS settings and credentials from the environment, where set:
    /// `KVXFER_ETCD_CA` (a PEM file; turns TLS on), `KVXFER_ETCD_CERT` and `KVXFER_ETCD_KEY`
    /// (the client certificate and key, both or neither), `KVXFER_ETCD_USER` with
    /// `KVXFER_ETCD_PASSWORD` or `KVXFER_ETCD_PASSWORD_FILE` (its first line). Fails at once
    /// on a file that cannot be read or an incomplete pair.
    pub fn security_from_env(mut self) -> Result<Self, ConfigError> {
        let var = |name: &'static str| std::env::var_os(name).filter(|v| !v.is_empty());
        let cert = var("KVXFER_ETCD_CERT");
        let key = var("KVXFER_ETCD_KEY");
        if cert.is_some() != key.is_some() {
            return Err(ConfigError::Env {
                reason:
                    "KVXFER_ETCD_CERT and KVXFER_ETCD_KEY go together (the client certificate and its key)"
                        .into(),
            });
        }
        if let Some(ca) = var("KVXFER_ETCD_CA") {
            let client = cert.as_ref().zip(key.as_ref()).map(|(c, k)| (Path::new(c), Path::new(k)));
            self.tls = Some(EtcdTls::from_files(Path::new(&ca), client)?);
        } else if cert.is_some() {
            return Err(ConfigError::Env { reason: "KVXFER_ETCD_CERT needs KVXFER_ETCD_CA".into() });
        }
        if let Some(user) = var("KVXFER_ETCD_USER") {
            let user = user.to_string_lossy().into_owned();
            let password = match (var("KVXFER_ETCD_PASSWORD"), var("KVXFER_ETCD_PASSWORD_FILE")) {
                (Some(p), _) => p.to_string_lossy().into_owned(),
                (None, Some(file)) => std::fs::read_to_string(&file)
                    .map_err(|e| ConfigError::Env {
                        reason: format!("KVXFER_ETCD_PASSWORD_FILE {}: {e}", Path::new(&file).display()),
                    })?
                    .lines()
                    .next()
                    .unwrap_or_default()
                    .to_owned(),
                (None, None) => {
                    return Err(ConfigError::Env {
                        reason: "KVXFER_ETCD_USER needs KVXFER_ETCD_PASSWORD or KVXFER_ETCD_PASSWORD_FILE"
                            .into(),
                    })
                }
            };
            self.auth = Some(EtcdAuth::new(user, password));
        }
        Ok(self)
    }

    /// Checks what can be checked without etcd: at least one endpoint, each a well-formed
    /// `http://host:port` or `https://host:port` URL whose scheme matches the TLS settings,
    /// and, with credentials, a non-empty user name and password.
    pub fn check(&self) -> Result<(), ConfigError> {
        if self.endpoints.iter().all(|e| e.trim().is_empty()) {
            return Err(ConfigError::NoEndpoints);
        }
        for endpoint in self.endpoint_list() {
            check_endpoint(endpoint, self.tls.is_some())?;
        }
        if self.auth.as_ref().is_some_and(|a| a.user.is_empty()) {
            return Err(ConfigError::Env { reason: "the etcd user name is empty".into() });
        }
        // An empty password is a password file or variable that was not filled in (etcd
        // users without a password authenticate by client certificate: give no EtcdAuth).
        if self.auth.as_ref().is_some_and(|a| a.password.is_empty()) {
            return Err(ConfigError::Env {
                reason: "the etcd password is empty (check KVXFER_ETCD_PASSWORD or the password file; users \
                         that authenticate by client certificate need no EtcdAuth)"
                    .into(),
            });
        }
        Ok(())
    }

    /// The endpoints given, trimmed, empty ones left out.
    fn endpoint_list(&self) -> Vec<&str> {
        self.endpoints.iter().map(|e| e.trim()).filter(|e| !e.is_empty()).collect()
    }

    /// A client of the one member at `endpoint`. etcd-client connects lazily, so this does
    /// no I/O; it asks for a member with a leader (`require_leader`): a member cut off from
    /// its cluster's quorum refuses requests and ends the streams it serves instead of
    /// hanging them.
    async fn client_of(&self, endpoint: &str) -> Result<Client, EtcdError> {
        let mut options = ConnectOptions::new()
            .with_connect_timeout(self.connect_timeout)
            .with_keep_alive(self.keepalive_interval, self.keepalive_timeout)
            .with_keep_alive_while_idle(true)
            .with_require_leader(true);
        if let Some(tls) = &self.tls {
            options = options.with_tls(tls.options());
        }
        if let Some(auth) = &self.auth {
            // etcd's simple tokens expire (5 min by default, JWT by their TTL): renewed on
            // the first request that finds its token expired, not taken for a failure.
            options =
                options.with_user(auth.user.clone(), auth.password.clone()).with_auto_token_refresh(true);
        }
        self.call(EtcdOp::Connect, Client::connect([endpoint], Some(options))).await
    }

    /// Connects to one member at a time, trying the endpoints in turn from
    /// `failover`'s next one, and returns the first that answers a linearizable read (a
    /// cheap count of `probe`, a key the caller may read — its own key or prefix, so a user
    /// whose role covers only the namespace passes — which needs the member to be in a
    /// quorum with a leader) —
    /// so every lease grant, put, keep-alive and watch of a session goes over one
    /// connection to a live member. etcd-client spreads requests over all its endpoints
    /// and leaves failover to its user: a keep-alive stream opened to a dead member would
    /// fail however healthy the others are. Each try is bounded by the connect and request
    /// timeouts; when none answers the error names every endpoint's failure.
    pub(crate) async fn connect(
        &self,
        failover: &mut Failover,
        probe: &str,
    ) -> Result<(Client, Arc<str>), EtcdError> {
        let endpoints = self.endpoint_list();
        if endpoints.is_empty() {
            return Err(EtcdError::NoEndpoint { tried: String::new() });
        }
        let mut tried = Vec::new();
        for step in 0..endpoints.len() {
            let index = (failover.next + step) % endpoints.len();
            let endpoint = endpoints[index];
            let probe = async {
                let mut client = self.client_of(endpoint).await?;
                let options = GetOptions::new().with_count_only();
                self.call(EtcdOp::Health, client.get(probe, Some(options))).await?;
                Ok::<_, EtcdError>(client)
            };
            match probe.await {
                Ok(client) => {
                    if step > 0 {
                        tracing::debug!(endpoint, skipped = ?tried, "etcd: connected to the next live member");
                    }
                    failover.next = index;
                    failover.current = Some(index);
                    return Ok((client, Arc::from(endpoint)));
                }
                // Refused for good (credentials, certificates, permissions): every member
                // would say the same.
                Err(e) if e.is_permanent() => return Err(e),
                Err(e) => tried.push(format!("{endpoint}: {e}")),
            }
        }
        // All failed: start from the next one next time.
        failover.next = (failover.next + 1) % endpoints.len();
        failover.current = None;
        if endpoints.len() == 1 {
            // One endpoint: its own error, as before.
            let only = tried.pop().unwrap_or_default();
            return Err(EtcdError::NoEndpoint { tried: only });
        }
        Err(EtcdError::NoEndpoint { tried: tried.join("; ") })
    }

    /// Runs one etcd call with the request timeout.
    pub(crate) async fn call<T>(
        &self,
        op: EtcdOp,
        fut: impl Future<Output = Result<T, etcd_client::Error>>,
    ) -> Result<T, EtcdError> {
        match tokio::time::timeout(self.request_timeout, fut).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(source)) => Err(EtcdError::Client { op, source }),
            Err(_) => Err(EtcdError::Timeout { op, after: self.request_timeout }),
        }
    }
}

/// Checks one endpoint URL (see [`EtcdConfig::endpoints`]).
fn check_endpoint(endpoint: &str, tls: bool) -> Result<(), ConfigError> {
    let bad = |reason: String| ConfigError::Endpoint { endpoint: endpoint.to_owned(), reason };
    let (scheme, rest) = match endpoint.split_once("://") {
        // As given: the etcd client matches `http://` and `https://` in lower case only.
        Some((scheme, rest)) => (scheme.to_owned(), rest),
        None if endpoint.contains('/') => {
            return Err(bad("not a URL (scheme://host:port) nor host:port".into()));
        }
        None => ((if tls { "https" } else { "http" }).to_owned(), endpoint),
    };
    match (scheme.as_str(), tls) {
        ("http", false) | ("https", true) => {}
        ("https", false) => {
            return Err(bad(
                "https:// needs TLS settings (EtcdConfig::tls: the CA certificate, and a client certificate \
                 if etcd asks for one)"
                    .into(),
            ))
        }
        ("http", true) => {
            return Err(bad(
                "TLS settings are given but the URL is http://: use https:// (or drop the TLS settings)"
                    .into(),
            ))
        }
        (other, _) => {
            return Err(bad(format!("unsupported scheme {other:?}: use http:// or https:// (in lower case)")))
        }
    }
    let uri =
        format!("{scheme}://{rest}").parse::<hyper::Uri>().map_err(|e| bad(format!("not a URL: {e}")))?;
    let authority = uri.authority().ok_or_else(|| bad("no host".into()))?;
    if authority.host().is_empty() || authority.as_str().contains('@') {
        return Err(bad("no host (or a user name in the URL: use EtcdConfig::auth)".into()));
    }
    let text = authority.as_str();
    match authority.port_u16() {
        Some(0) => return Err(bad("port 0".into())),
        Some(_) => {}
        None if text.ends_with(']') || !text.contains(':') => {
            return Err(bad("no port (etcd's client port is 2379 by default)".into()))
        }
        None => return Err(bad("the port is not a number in 1..=65535".into())),
    }
    if !matches!(uri.path(), "" | "/") || uri.query().is_some() {
        return Err(bad("a path or query after host:port".into()));
    }
    Ok(())
}

/// Which etcd member to try first: the one in use, until a session on it fails; then the
/// next one. One per registration or directory task.
#[derive(Debug, Default)]
pub(crate) struct Failover {
    next: usize,
    current: Option<usize>,
}

impl Failover {
    /// The session on the member in use failed: try the next member first next time (a
    /// dead member is then not asked first again; a healthy one is asked again in turn).
    pub(crate) fn session_failed(&mut self) {
        if let Some(current) = self.current.take() {
            self.next = current + 1;
        }
    }
}

/// Where a registration or directory stands with etcd.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EtcdState {
    /// Started, no answer from etcd yet.
    Connecting,
    /// Registered (registration) or listed and watching (directory).
    Connected,
    /// Lost etcd; retrying with backoff while serving from what it has.
    Degraded,
    /// Shut down.
    Stopped,
    /// Gave up for good: a reason retrying cannot mend (another live process registered the
    /// same engine rank; etcd refused the credentials, role or certificates before the first
    /// success; see [`crate::RegistrationError`]). `last_error` says which; nothing is
    /// retried.
    Failed,
}

impl EtcdState {
    /// A short lowercase name (a metric label value).
    pub fn as_str(self) -> &'static str {
        match self {
            EtcdState::Connecting => "connecting",
            EtcdState::Connected => "connected",
            EtcdState::Degraded => "degraded",
            EtcdState::Stopped => "stopped",
            EtcdState::Failed => "failed",
        }
    }

    /// Every state, for metrics that list all of them.
    pub const ALL: [EtcdState; 5] = [
        EtcdState::Connecting,
        EtcdState::Connected,
        EtcdState::Degraded,
        EtcdState::Stopped,
        EtcdState::Failed,
    ];
}

/// A snapshot of a registration's or directory's connection to etcd.
#[derive(Debug, Clone)]
pub struct EtcdStatus {
    /// The state.
    pub state: EtcdState,
    /// Since when.
    pub since: Instant,
    /// The latest failure, kept after recovery (for logs and diagnostics).
    pub last_error: Option<Arc<str>>,
    /// Failures so far (each one followed by a retry).
    pub failures: u64,
    /// Times it became connected again after a failure.
    pub recoveries: u64,
    /// The endpoint of the etcd member it is (or was last) connected to: one member at a
    /// time, rotated on failure.
    pub endpoint: Option<Arc<str>>,
}

/// The shared, watchable status of one registration or directory.
#[derive(Debug)]
pub(crate) struct StatusCell {
    tx: tokio::sync::watch::Sender<EtcdStatus>,
    /// Whether it was ever connected: a refusal after that (a permission taken away and
    /// given back, a certificate rotated) is retried, not final.
    ever_connected: std::sync::atomic::AtomicBool,
}

impl StatusCell {
    pub(crate) fn new() -> Self {
        let status = EtcdStatus {
            state: EtcdState::Connecting,
            since: Instant::now(),
            last_error: None,
            failures: 0,
            recoveries: 0,
            endpoint: None,
        };
        Self { tx: tokio::sync::watch::Sender::new(status), ever_connected: false.into() }
    }

    /// Whether it was ever connected (see `ever_connected`).
    pub(crate) fn was_connected(&self) -> bool {
        self.ever_connected.load(std::sync::atomic::Ordering::Relaxed)
    }

    pub(crate) fn get(&self) -> EtcdStatus {
        self.tx.borrow().clone()
    }

    pub(crate) fn subscribe(&self) -> StatusWatch {
        StatusWatch { rx: self.tx.subscribe() }
    }

    /// Records success; returns whether this was a recovery from a failure.
    pub(crate) fn connected(&self) -> bool {
        self.ever_connected.store(true, std::sync::atomic::Ordering::Relaxed);
        let mut recovered = false;
        self.tx.send_if_modified(|s| {
            if s.state == EtcdState::Connected {
                return false;
            }
            recovered = s.state == EtcdState::Degraded;
            if recovered {
                s.recoveries += 1;
            }
            s.state = EtcdState::Connected;
            s.since = Instant::now();
            true
        });
        recovered
    }

    /// Records a failure; returns whether it was connected (or connecting) until now.
    pub(crate) fn failed(&self, error: &dyn std::fmt::Display) -> bool {
        let mut was_ok = false;
        self.tx.send_modify(|s| {
            was_ok = s.state != EtcdState::Degraded;
            s.failures += 1;
            s.last_error = Some(Arc::from(error.to_string()));
            if was_ok {
                s.state = EtcdState::Degraded;
                s.since = Instant::now();
            }
        });
        was_ok
    }

    /// Records the endpoint of the member in use.
    pub(crate) fn endpoint(&self, endpoint: &Arc<str>) {
        self.tx.send_if_modified(|s| {
            if s.endpoint.as_ref() == Some(endpoint) {
                return false;
            }
            s.endpoint = Some(endpoint.clone());
            true
        });
    }

    /// Records a permanent failure: state `Failed`, with `error` as the last error.
    pub(crate) fn gave_up(&self, error: &dyn std::fmt::Display) {
        self.tx.send_modify(|s| {
            s.failures += 1;
            s.last_error = Some(Arc::from(error.to_string()));
            s.state = EtcdState::Failed;
            s.since = Instant::now();
        });
    }

    pub(crate) fn stopped(&self) {
        self.tx.send_modify(|s| {
            if s.state == EtcdState::Failed {
                return; // stays Failed: the reason is what a caller needs to see
            }
            s.state = EtcdState::Stopped;
            s.since = Instant::now();
        });
    }
}

/// Follows a registration's or directory's status. Hands out copies only, so no caller can
/// hold the status lock while the background task needs it.
#[derive(Debug, Clone)]
pub struct StatusWatch {
    rx: tokio::sync::watch::Receiver<EtcdStatus>,
}

impl StatusWatch {
    /// The status now.
    pub fn current(&self) -> EtcdStatus {
        self.rx.borrow().clone()
    }

    /// Waits for the next change; `None` once the registration or directory is gone.
    pub async fn changed(&mut self) -> Option<EtcdStatus> {
        self.rx.changed().await.ok()?;
        Some(self.rx.borrow_and_update().clone())
    }

    /// Waits until the status satisfies `want` (checked at once, then at every change), up
    /// to `timeout`; on timeout (or when the owner is gone) returns the status as it then is.
    pub async fn wait_until(
        &mut self,
        timeout: Duration,
        want: impl Fn(&EtcdStatus) -> bool,
    ) -> Result<EtcdStatus, EtcdStatus> {
        let reached = match tokio::time::timeout(timeout, self.rx.wait_for(|s| want(s))).await {
            Ok(Ok(status)) => Some(status.clone()),
            _ => None,
        };
        reached.ok_or_else(|| self.current())
    }
}

/// A watch stream's next message, or why the watch ended: closed or failed, cancelled, or
/// compacted past the revision it watched from.
pub(crate) fn watch_message(
    message: Result<Option<etcd_client::WatchResponse>, etcd_client::Error>,
) -> Result<etcd_client::WatchResponse, EtcdError> {
    let response = match message {
        Ok(Some(r)) => r,
        Ok(None) => {
            return Err(EtcdError::StreamEnded { op: EtcdOp::Watch, reason: "closed by etcd".into() })
        }
        Err(source) => return Err(EtcdError::Client { op: EtcdOp::Watch, source }),
    };
    if response.canceled() || response.compact_revision() > 0 {
        let reason = format!(
            "cancelled by etcd (compacted at revision {}; {})",
            response.compact_revision(),
            response.cancel_reason()
        );
        return Err(EtcdError::StreamEnded { op: EtcdOp::Watch, reason });
    }
    Ok(response)
}
