//! Registers one engine rank in etcd and keeps its lease alive until stdin closes or
//! SIGTERM/SIGINT arrives (then revokes it: the key goes at once) or the process is killed
//! with SIGKILL (the key expires within the TTL). Prints one JSON line once registered and
//! one once revoked. Exits with status 1 and the reason when the registration is refused
//! (another live process holds the engine rank; etcd refused its credentials, certificate or
//! permissions) or an etcd URL is malformed. TLS and credentials: `--etcd-ca`, `--etcd-cert`,
//! `--etcd-key`, `--etcd-user`, `--etcd-password-file`, or the `KVXFER_ETCD_*` variables
//! (`EtcdConfig::security_from_env`). Used by the `kill -9` discovery test; also a way to publish an engine
//! by hand.

use std::io::Read;
use std::time::Duration;

use clap::Parser;
use kvxfer_cluster::{
    AdvertiseAddr, AgentName, EngineId, EngineKey, EngineRecord, EtcdConfig, Namespace, Registration,
    RegistrationConfig, TransportName,
};

#[derive(Parser, Debug)]
#[command(about = "Register an engine rank in etcd until stdin closes, SIGTERM/SIGINT, or the process dies")]
struct Args {
    /// etcd client URL (repeat for several).
    #[arg(long = "etcd", required = true)]
    etcd: Vec<String>,
    /// Namespace (first key segment).
    #[arg(long, default_value = "kvxfer")]
    namespace: String,
    /// Engine id.
    #[arg(long)]
    engine_id: String,
    /// Rank.
    #[arg(long, default_value_t = 0)]
    rank: u32,
    /// Advertise address: `host:port` or `[v6]:port`.
    #[arg(long)]
    addr: String,
    /// Transports offered, comma-separated.
    #[arg(long, default_value = "tcp", value_delimiter = ',')]
    transports: Vec<String>,
    /// Layout compatibility hash (16 hex digits).
    #[arg(long, default_value = "0000000000000000")]
    compat_hash: String,
    /// Protocol version.
    #[arg(long, default_value_t = 2)]
    protocol_version: u32,
    /// Incarnation (16 hex digits); random when absent.
    #[arg(long)]
    incarnation: Option<String>,
    /// Agent name.
    #[arg(long, default_value = "kvxfer-register")]
    agent: String,
    /// Lease TTL in seconds (2 or more).
    #[arg(long, default_value_t = 10)]
    ttl_secs: u64,
    /// CA certificate (PEM) for `https://` endpoints (default: `$KVXFER_ETCD_CA`).
    #[arg(long)]
    etcd_ca: Option<std::path::PathBuf>,
    /// Client certificate (PEM), with `--etcd-key` (default: `$KVXFER_ETCD_CERT`).
    #[arg(long, requires = "etcd_key")]
    etcd_cert: Option<std::path::PathBuf>,
    /// Client key (PEM), with `--etcd-cert` (default: `$KVXFER_ETCD_KEY`).
    #[arg(long, requires = "etcd_cert")]
    etcd_key: Option<std::path::PathBuf>,
    /// etcd user (default: `$KVXFER_ETCD_USER`); the password comes from
    /// `--etcd-password-file` or `$KVXFER_ETCD_PASSWORD` (never the command line).
    #[arg(long)]
    etcd_user: Option<String>,
    /// A file whose first line is the etcd user's password.
    #[arg(long, requires = "etcd_user")]
    etcd_password_file: Option<std::path::PathBuf>,
}

/// The etcd settings: `--etcd` URLs, TLS and credentials from the flags, else from the
/// `KVXFER_ETCD_*` environment; checked here, so a bad URL or file fails before anything
/// starts.
fn etcd_config(args: &Args) -> Result<EtcdConfig, String> {
    let mut config = EtcdConfig::new(args.etcd.clone()).security_from_env().map_err(|e| e.to_string())?;
    if let Some(ca) = &args.etcd_ca {
        let client = args.etcd_cert.as_deref().zip(args.etcd_key.as_deref());
        config.tls = Some(kvxfer_cluster::EtcdTls::from_files(ca, client).map_err(|e| e.to_string())?);
    } else if args.etcd_cert.is_some() {
        return Err("--etcd-cert needs --etcd-ca".into());
    }
    if let Some(user) = &args.etcd_user {
        let password = match &args.etcd_password_file {
            Some(file) => std::fs::read_to_string(file)
                .map_err(|e| format!("--etcd-password-file {}: {e}", file.display()))?
                .lines()
                .next()
                .unwrap_or_default()
                .to_owned(),
            None => std::env::var("KVXFER_ETCD_PASSWORD")
                .map_err(|_| "--etcd-user needs --etcd-password-file or $KVXFER_ETCD_PASSWORD".to_owned())?,
        };
        config.auth = Some(kvxfer_cluster::EtcdAuth::new(user.clone(), password));
    }
    config.check().map_err(|e| e.to_string())?;
    Ok(config)
}

fn hex64(what: &str, s: &str) -> Result<u64, String> {
    u64::from_str_radix(s, 16).map_err(|e| format!("--{what} {s:?}: {e}"))
}

fn main() {
    if let Err(e) = run() {
        eprintln!("kvxfer-register: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), String> {
    use std::io::IsTerminal;
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        // Colours only on a terminal: escape codes in a log file are noise.
        .with_ansi(std::io::stderr().is_terminal())
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let args = Args::parse();
    let s = |e: kvxfer_cluster::NameError| e.to_string();
    let key = EngineKey::new(
        Namespace::new(&args.namespace).map_err(s)?,
        EngineId::new(&args.engine_id).map_err(s)?,
        args.rank,
    );
    let incarnation = match &args.incarnation {
        Some(h) => hex64("incarnation", h)?,
        None => rand::random::<u64>() | 1,
    };
    let record = EngineRecord {
        addr: args.addr.parse::<AdvertiseAddr>().map_err(|e| e.to_string())?,
        transports: args
            .transports
            .iter()
            .map(|t| TransportName::new(t))
            .collect::<Result<_, _>>()
            .map_err(s)?,
        compat_hash: hex64("compat-hash", &args.compat_hash)?,
        protocol_version: args.protocol_version,
        incarnation,
        agent: AgentName::new(&args.agent).map_err(s)?,
        draining: false,
    };
    let runtime =
        tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(|e| e.to_string())?;
    // Signal handlers before the registration exists: a SIGTERM from then on deregisters.
    let mut signals = {
        let _entered = runtime.enter();
        Signals::new().map_err(|e| format!("installing the SIGTERM/SIGINT handlers: {e}"))?
    };
    let config = RegistrationConfig { key: key.clone(), record, ttl: Duration::from_secs(args.ttl_secs) };
    let registration =
        Registration::start(runtime.handle(), etcd_config(&args)?, config).map_err(|e| e.to_string())?;
    // stdin closing is the signal to leave cleanly; a blocking thread watches for it.
    let (eof_tx, mut eof_rx) = tokio::sync::oneshot::channel::<()>();
    std::thread::spawn(move || {
        let mut sink = [0u8; 256];
        let mut stdin = std::io::stdin();
        while matches!(stdin.read(&mut sink), Ok(n) if n > 0) {}
        let _ = eof_tx.send(());
    });
    runtime.block_on(async {
        let mut status = registration.status_watch();
        let ended = |s: &kvxfer_cluster::EtcdStatus| {
            matches!(s.state, kvxfer_cluster::EtcdState::Connected | kvxfer_cluster::EtcdState::Failed)
        };
        let registered = tokio::select! {
            r = status.wait_until(Duration::MAX, ended) => {
                if let Some(why) = registration.failure() {
                    // Refused for good (another live process holds the engine rank): say so, exit 1.
                    let why = why.to_string();
                    let _ = registration.shutdown().await;
                    return Err(why);
                }
                r.is_ok()
            }
            why = signals.recv() => {
                tracing::info!(signal = why, "stopping before the first registration");
                false
            }
            _ = &mut eof_rx => false,
        };
        if let Some(why) = registration.failure() {
            // Refused while it was also told to leave: the refusal is what to report.
            let why = why.to_string();
            let _ = registration.shutdown().await;
            return Err(why);
        }
        if registered {
            let lease = registration.lease_id().unwrap_or(0);
            let line = serde_json::json!({
                "event": "registered",
                "key": key.to_key(),
                "lease": lease,
                "incarnation": format!("{incarnation:016x}"),
                "pid": std::process::id(),
            });
            println!("{line}");
        }
        if registered {
            tokio::select! {
                why = signals.recv() => tracing::info!(signal = why, "deregistering"),
                _ = &mut eof_rx => tracing::info!("stdin closed: deregistering"),
            }
        }
        registration.shutdown().await.map_err(|e| e.to_string())?;
        println!("{}", serde_json::json!({ "event": "revoked", "key": key.to_key() }));
        Ok(())
    })
}

/// SIGTERM and SIGINT, as one stream.
struct Signals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
}

impl Signals {
    /// Installs the handlers (inside a runtime).
    fn new() -> std::io::Result<Self> {
        use tokio::signal::unix::{signal, SignalKind};
        Ok(Self { term: signal(SignalKind::terminate())?, int: signal(SignalKind::interrupt())? })
    }

    /// The next signal's name.
    async fn recv(&mut self) -> &'static str {
        tokio::select! {
            _ = self.term.recv() => "SIGTERM",
            _ = self.int.recv() => "SIGINT",
        }
    }
}
