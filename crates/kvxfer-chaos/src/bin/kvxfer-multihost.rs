//! The multi-host demo and test, run by `scripts/multihost.sh` inside the hub network
//! namespace it creates (root only): etcd, a prefill node and two decode nodes (TCP and
//! UCX-over-tcp) each in a namespace of its own, joined by veth pairs to a bridge, with
//! their own addresses. It pulls a parent with n = 8 across hosts over both data paths
//! (the TCP one from hand-offs naming only the engine id, resolved through etcd), scrapes
//! `/metrics`, then `kill -9`s the prefill process and measures how long each decode node
//! takes to see its key vanish (the registration lease TTL, 2 s by default), checks that
//! pulls of the dead engine's hand-offs then fail at once with `EngineNotRegistered`,
//! restarts the prefill node (a new incarnation registers) and pulls again.
//!
//! Prints its progress on stderr and one JSON object on stdout; exits non-zero on any
//! failed check. Every process it starts is killed when it exits (also on panic); the
//! script's trap removes the namespaces.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::process::{Child, ChildStdin, Command, ExitCode, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use clap::Parser;
use kvxfer_cluster::testing::{EtcdLaunch, EtcdServer};
use serde_json::{json, Value};

#[derive(Parser, Debug)]
#[command(about = "kvxfer across network namespaces: discovery, both data paths, kill -9, restart")]
struct Args {
    /// The kvxfer-node binary (built with the `cluster` and `ucx` features).
    #[arg(long)]
    node_bin: String,
    /// Namespace of etcd, and its address.
    #[arg(long)]
    etcd_ns: String,
    #[arg(long)]
    etcd_ip: IpAddr,
    /// Where etcd's data directory goes (the script owns it and removes it even when this
    /// process is killed); default: the system's temporary directory.
    #[arg(long)]
    etcd_dir: Option<std::path::PathBuf>,
    /// Namespace of the prefill node, and its address.
    #[arg(long)]
    prefill_ns: String,
    #[arg(long)]
    prefill_ip: IpAddr,
    /// Namespace of the decode nodes, and its address.
    #[arg(long)]
    decode_ns: String,
    #[arg(long)]
    decode_ip: IpAddr,
    /// Registration lease TTL in seconds.
    #[arg(long, default_value_t = 2)]
    ttl_s: u64,
    /// Children per parent.
    #[arg(long, default_value_t = 8)]
    n: u32,
    /// Skip the UCX-over-tcp decode node.
    #[arg(long)]
    no_ucx: bool,
}

/// How long any one step may take before the run fails.
const STEP: Duration = Duration::from_secs(60);
const BLOCKS_PER_CHILD: u32 = 8;

fn say(msg: impl AsRef<str>) {
    eprintln!("multihost: {}", msg.as_ref());
}

/// A kvxfer-node in a namespace, driven by JSON lines; killed when dropped.
struct Node {
    name: &'static str,
    child: Child,
    stdin: Option<ChildStdin>,
    lines: Receiver<(Instant, Value)>,
    /// Lines read while waiting for others.
    backlog: Vec<(Instant, Value)>,
}

impl Node {
    fn start(name: &'static str, ns: &str, bin: &str, args: &[String]) -> Result<Self, String> {
        let mut child = Command::new("ip")
            .args(["netns", "exec", ns, bin])
            .args(args)
            .env("RUST_LOG", std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into()))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| format!("{name}: cannot run {bin} in {ns}: {e}"))?;
        let stdout = child.stdout.take().ok_or("no stdout")?;
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let at = Instant::now();
                let v =
                    serde_json::from_str(&line).unwrap_or_else(|_| json!({"event": "text", "line": line}));
                if tx.send((at, v)).is_err() {
                    return;
                }
            }
        });
        let stdin = child.stdin.take();
        Ok(Node { name, child, stdin, lines, backlog: Vec::new() })
    }

    fn send(&mut self, cmd: Value) -> Result<(), String> {
        let stdin = self.stdin.as_mut().ok_or("stdin closed")?;
        writeln!(stdin, "{cmd}")
            .and_then(|()| stdin.flush())
            .map_err(|e| format!("{}: write: {e}", self.name))
    }

    /// The next line with `"event": event` that `want` accepts (others are kept), and when
    /// it arrived.
    fn wait(&mut self, event: &str, want: impl Fn(&Value) -> bool) -> Result<(Instant, Value), String> {
        let matches = |v: &Value| v["event"] == event && want(v);
        if let Some(i) = self.backlog.iter().position(|(_, v)| matches(v)) {
            return Ok(self.backlog.remove(i));
        }
        let deadline = Instant::now() + STEP;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok((at, v)) if matches(&v) => return Ok((at, v)),
                Ok((_, v)) if v["event"] == "error" => return Err(format!("{}: {v}", self.name)),
                Ok(line) => self.backlog.push(line),
                Err(RecvTimeoutError::Timeout) => {
                    return Err(format!("{}: no {event:?} event within {STEP:?}", self.name))
                }
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(format!("{}: exited while waiting for {event:?}", self.name))
                }
            }
        }
    }

    fn kill9(&mut self) -> Instant {
        // `ip netns exec` execs the node, so this is the node's pid: SIGKILL, no goodbye.
        let _ = self.child.kill();
        let at = Instant::now();
        let _ = self.child.wait();
        at
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The samples of `GET /metrics` at `addr`, by series.
fn scrape(addr: &str) -> Result<BTreeMap<String, f64>, String> {
    let addr: SocketAddr = addr.parse().map_err(|e| format!("{addr}: {e}"))?;
    let mut s =
        TcpStream::connect_timeout(&addr, Duration::from_secs(5)).map_err(|e| format!("{addr}: {e}"))?;
    s.set_read_timeout(Some(Duration::from_secs(10))).map_err(|e| e.to_string())?;
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: kvxfer\r\n\r\n").map_err(|e| e.to_string())?;
    let mut text = String::new();
    s.read_to_string(&mut text).map_err(|e| e.to_string())?;
    let body = text.split("\r\n\r\n").nth(1).ok_or("no body")?;
    Ok(body
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.rsplit_once(' '))
        .filter_map(|(k, v)| Some((k.to_owned(), v.parse().ok()?)))
        .collect())
}

fn check(ok: bool, what: impl AsRef<str>) -> Result<(), String> {
    if ok {
        Ok(())
    } else {
        Err(format!("check failed: {}", what.as_ref()))
    }
}

fn ms(d: Duration) -> f64 {
    (d.as_secs_f64() * 1000.0 * 10.0).round() / 10.0
}

struct Run {
    args: Args,
    etcd_url: String,
    prefill_addr: String,
}

impl Run {
    fn prefill(&self) -> Result<(Node, String), String> {
        let a = &self.args;
        let args: Vec<String> = [
            "prefill",
            "--listen",
            &self.prefill_addr,
            "--etcd",
            &self.etcd_url,
            "--namespace",
            "multihost",
            "--engine-id",
            "prefill-a",
            "--registration-ttl-s",
            &a.ttl_s.to_string(),
            "--metrics",
            &SocketAddr::new(a.prefill_ip, 9100).to_string(),
            "--transport",
            if a.no_ucx { "tcp" } else { "auto" },
            "--blocks",
            "512",
            "--block-bytes",
            "65536",
            "--ttl-ms",
            "30000",
        ]
        .iter()
        .map(|s| s.to_string())
        .chain(if a.no_ucx {
            vec![]
        } else {
            vec!["--ucx-tls".into(), "tcp".into(), "--ucx-peer-failure".into()]
        })
        .collect();
        let mut node = Node::start("prefill", &a.prefill_ns, &a.node_bin, &args)?;
        let (_, listening) = node.wait("listening", |_| true)?;
        let (_, registered) = node.wait("registered", |_| true)?;
        check(registered["ok"] == true, format!("prefill registered in etcd: {registered}"))?;
        let incarnation = listening["incarnation"].as_str().unwrap_or_default().to_owned();
        say(format!("prefill up at {} incarnation {incarnation}, registered", listening["addr"]));
        Ok((node, incarnation))
    }

    fn decode(&self, name: &'static str, ucx: bool, metrics_port: u16) -> Result<Node, String> {
        let a = &self.args;
        let mut args: Vec<String> = [
            "decode",
            "--etcd",
            &self.etcd_url,
            "--namespace",
            "multihost",
            "--metrics",
            &SocketAddr::new(a.decode_ip, metrics_port).to_string(),
            "--blocks",
            "512",
            "--block-bytes",
            "65536",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        if ucx {
            args.extend(["--transport", "ucx", "--ucx-tls", "tcp", "--ucx-peer-failure"].map(String::from));
        } else {
            args.extend(["--transport", "tcp"].map(String::from));
        }
        let mut node = Node::start(name, &a.decode_ns, &a.node_bin, &args)?;
        node.wait("ready", |_| true)?;
        Ok(node)
    }

    /// Leases a parent of n children (`engine_only`: hand-offs naming only the engine id).
    fn lease(&self, prefill: &mut Node, parent: &str, engine_only: bool) -> Result<String, String> {
        prefill.send(json!({
            "cmd": "lease", "parent": parent, "n": self.args.n, "blocks_per_child": BLOCKS_PER_CHILD,
            "engine_only": engine_only,
        }))?;
        let (_, r) = prefill.wait("result", |v| v["parent"] == parent)?;
        r["result"].as_str().map(str::to_owned).ok_or_else(|| format!("no result for {parent}"))
    }

    /// Pulls `result` on `decode`: every child's line, and the pull's elapsed ms.
    fn pull(&self, decode: &mut Node, result: &str) -> Result<(Vec<Value>, f64), String> {
        decode.send(json!({"cmd": "pull", "result": result}))?;
        let mut children = Vec::new();
        for _ in 0..self.args.n {
            children.push(decode.wait("child", |_| true)?.1);
        }
        let (_, done) = decode.wait("pull_done", |_| true)?;
        Ok((children, done["elapsed_ms"].as_f64().unwrap_or(f64::NAN)))
    }

    fn pull_verified(&self, decode: &mut Node, result: &str, what: &str) -> Result<f64, String> {
        let (children, elapsed) = self.pull(decode, result)?;
        let good = children.iter().filter(|c| c["outcome"] == "done" && c["verified"] == true).count();
        check(good == self.args.n as usize, format!("{what}: every child done and verified: {children:?}"))?;
        say(format!("{what}: {} children pulled and verified in {elapsed} ms", self.args.n));
        Ok(elapsed)
    }

    fn stats(&self, node: &mut Node) -> Result<Value, String> {
        node.send(json!({"cmd": "stats"}))?;
        Ok(node.wait("stats", |_| true)?.1)
    }
}

fn run(args: Args) -> Result<Value, String> {
    let etcd = EtcdServer::launch(EtcdLaunch {
        ip: args.etcd_ip,
        ports: Some((2379, 2380)),
        wrapper: ["ip", "netns", "exec", &args.etcd_ns].map(String::from).to_vec(),
        data_root: args.etcd_dir.clone(),
        // etcd's own defaults (keep-alive policy included), as a deployment runs it.
        ..EtcdLaunch::default()
    })?;
    say(format!("etcd up at {} (in {})", etcd.endpoint(), args.etcd_ns));
    let run = Run {
        etcd_url: etcd.endpoint(),
        prefill_addr: SocketAddr::new(args.prefill_ip, 5600).to_string(),
        args,
    };
    let a = &run.args;
    let (mut prefill, incarnation) = run.prefill()?;
    let mut decoders = vec![("tcp", run.decode("decode-tcp", false, 9101)?)];
    if !a.no_ucx {
        decoders.push(("ucx", run.decode("decode-ucx", true, 9102)?));
    }
    for (_, d) in &mut decoders {
        d.wait("directory", |v| {
            (v["kind"] == "added" || v["kind"] == "present") && v["engine"] == "prefill-a"
        })?;
    }
    say("both decode nodes see prefill-a in etcd");

    // Across hosts: TCP from hand-offs naming only the engine id; UCX-tcp from full ones.
    let mut pulls = json!({});
    for (path, d) in &mut decoders {
        let engine_only = *path == "tcp";
        let result = run.lease(&mut prefill, &format!("first-{path}"), engine_only)?;
        let form = if engine_only { "engine-only hand-offs" } else { "hand-offs with the address" };
        let elapsed = run.pull_verified(d, &result, &format!("{path} pull ({form})"))?;
        let s = run.stats(d)?;
        let (bytes, ucx) =
            (s["bytes_pulled"].as_u64().unwrap_or(0), s["bytes_pulled_ucx"].as_u64().unwrap_or(0));
        let want = u64::from(a.n * BLOCKS_PER_CHILD) * 65536;
        check(bytes == want, format!("{path}: {bytes} bytes pulled, {want} expected"))?;
        check((ucx == bytes) == (*path == "ucx"), format!("{path}: {ucx} of {bytes} bytes over UCX"))?;
        pulls[*path] = json!({"elapsed_ms": elapsed, "bytes": bytes, "bytes_ucx": ucx});
    }
    let m = scrape(&SocketAddr::new(a.prefill_ip, 9100).to_string())?;
    let leases = m.get("kvxfer_leases_made_total").copied().unwrap_or(0.0);
    check(
        leases == f64::from(a.n) * decoders.len() as f64,
        format!("prefill /metrics: {leases} leases made"),
    )?;
    let served_tcp = m.get(r#"kvxfer_served_bytes_total{transport="tcp"}"#).copied().unwrap_or(0.0);
    let served_ucx = m.get(r#"kvxfer_served_bytes_total{transport="ucx"}"#).copied().unwrap_or(0.0);
    // Each transport's own counter: exactly what each decode node pulled over it.
    let parent_bytes = (u64::from(a.n * BLOCKS_PER_CHILD) * 65536) as f64;
    check(
        served_tcp == parent_bytes && served_ucx == if a.no_ucx { 0.0 } else { parent_bytes },
        format!("prefill /metrics: {served_tcp} B served over tcp, {served_ucx} B over ucx, {parent_bytes} B each expected"),
    )?;
    let registration =
        m.get(r#"kvxfer_etcd_state{component="registration",state="connected"}"#).copied().unwrap_or(0.0);
    check(registration == 1.0, "prefill /metrics: registration connected")?;
    let dm = scrape(&SocketAddr::new(a.decode_ip, 9101).to_string())?;
    let pulled = dm.get(r#"kvxfer_pulled_bytes_total{transport="tcp"}"#).copied().unwrap_or(0.0);
    check(
        pulled == parent_bytes,
        format!("decode /metrics: {pulled} B pulled over tcp, {parent_bytes} B expected"),
    )?;
    say(format!("/metrics: prefill served {served_tcp} B over tcp and {served_ucx} B over ucx; decode-tcp pulled {pulled} B"));

    // Hand-offs made before the crash, pulled after it.
    let mut stale = Vec::new();
    for (path, _) in &decoders {
        stale.push(run.lease(&mut prefill, &format!("stale-{path}"), *path == "tcp")?);
    }
    say(format!("kill -9 of the prefill process (registration TTL {} s)", a.ttl_s));
    let killed_at = prefill.kill9();
    let mut invalidation = json!({});
    let mut worst = Duration::ZERO;
    for (path, d) in &mut decoders {
        let (at, v) = d.wait("directory", |v| v["kind"] == "removed" && v["engine"] == "prefill-a")?;
        check(
            v["incarnation"] == incarnation.as_str(),
            format!("{path}: the killed incarnation removed: {v}"),
        )?;
        let took = at.saturating_duration_since(killed_at);
        worst = worst.max(took);
        invalidation[*path] = json!(ms(took));
        say(format!("decode-{path} saw the key vanish {} ms after kill -9", ms(took)));
    }
    // The goal: the key gone and every decode agent told within the lease TTL + 1 s.
    let bound = Duration::from_secs(a.ttl_s + 1);
    check(
        worst <= bound,
        format!("kill -9 to invalidation took {} ms, more than TTL + 1 s ({} ms)", ms(worst), ms(bound)),
    )?;
    let mut failed_pulls = json!({});
    for ((path, d), result) in decoders.iter_mut().zip(&stale) {
        let before = run.stats(d)?;
        let (children, elapsed) = run.pull(d, result)?;
        let typed =
            children.iter().all(|c| c["outcome"] == "failed" && c["error_kind"] == "EngineNotRegistered");
        check(
            typed,
            format!("{path}: pulls of the dead engine fail with EngineNotRegistered: {children:?}"),
        )?;
        let after = run.stats(d)?;
        check(
            after["connections_opened"] == before["connections_opened"],
            format!("{path}: no connection tried"),
        )?;
        check(after["peers_invalidated"].as_u64() >= Some(1), format!("{path}: pooled connections dropped"))?;
        say(format!(
            "decode-{path}: a pull of the dead engine failed at once ({elapsed} ms): {}",
            children[0]["reason"]
        ));
        failed_pulls[*path] = json!({"elapsed_ms": elapsed, "reason": children[0]["reason"]});
    }

    // A new process of the same engine: a new incarnation registers, pulls work again.
    let (mut prefill, new_incarnation) = run.prefill()?;
    check(new_incarnation != incarnation, "the restarted prefill has a new incarnation")?;
    for (path, d) in &mut decoders {
        d.wait("directory", |v| v["kind"] != "removed" && v["incarnation"] == new_incarnation.as_str())?;
        let result = run.lease(&mut prefill, &format!("after-{path}"), *path == "tcp")?;
        run.pull_verified(d, &result, &format!("{path} pull after the restart"))?;
    }
    drop(prefill);
    drop(decoders);
    drop(etcd);
    Ok(json!({
        "ok": true,
        "children_per_parent": a.n,
        "registration_ttl_s": a.ttl_s,
        "kill_to_invalidation_ms": invalidation,
        "kill_to_invalidation_worst_ms": ms(worst),
        "within_ttl_plus_1s": true,
        "pulls": pulls,
        "failed_pulls_after_kill": failed_pulls,
        "incarnations": [incarnation, new_incarnation],
    }))
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(args) {
        Ok(summary) => {
            println!("{summary}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            say(format!("FAILED: {e}"));
            println!("{}", json!({"ok": false, "error": e}));
            ExitCode::FAILURE
        }
    }
}
