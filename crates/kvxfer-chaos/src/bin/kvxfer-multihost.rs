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
//! Then the failure scenarios, each with its figures in the summary:
//! - `partition`: the prefill host's link goes down (`ip link set <veth> down` on the
//!   bridge): a pull during the cut fails, the decode side sees the engine leave after about
//!   the registration TTL, a pull then fails at once with `EngineNotRegistered`; once the
//!   link is back the same process registers again and pulls succeed.
//! - `sigterm`: a prefill node with a 10 s TTL gets SIGTERM: it deregisters, the decode side
//!   sees its key go well within a second (not after the TTL), and a pull of a hand-off it
//!   made fails at once with `EngineNotRegistered`.
//! - `etcd_outage`, twice: etcd killed for a few seconds (less than the 10 s TTL) and
//!   started again on its data, then frozen (SIGSTOP) as long and thawed: pulls between the known engines go on from the decode side's cache
//!   (done/failed counted), the registration and directories reconnect (time measured) and
//!   nothing leaves or comes back in the directory.
//! - `etcd_ha`: a three-member etcd, one member per namespace (`--etcd-member`, three
//!   times), every node listing all three; under steady pulls the member the registration
//!   uses (or the leader: `--ha-kill leader`) is killed: pulls go on without a failure, and
//!   the registration and directory are on a live member again (time measured), with no
//!   directory event.
//!
//! `--skip NAME` leaves a scenario out. Prints its progress on stderr and one JSON object on stdout; exits non-zero on any
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
    /// The prefill host's veth on the bridge, in this (the hub) namespace: taken down for
    /// the partition scenario (skipped without it).
    #[arg(long)]
    prefill_link: Option<String>,
    /// `NAMESPACE=IP` of one member of the three-member etcd (repeat three times; the
    /// `etcd_ha` scenario is skipped otherwise). Members listen on ports 2479 and 2480.
    #[arg(long = "etcd-member", value_parser = parse_member)]
    etcd_members: Vec<(String, IpAddr)>,
    /// Registration TTL of the prefill nodes of the sigterm, etcd_outage and etcd_ha
    /// scenarios (seconds).
    #[arg(long, default_value_t = 10)]
    long_ttl_s: u64,
    /// How long etcd stays down in the etcd_outage scenario (seconds; less than
    /// `--long-ttl-s` minus 1.5).
    #[arg(long, default_value_t = 5.0)]
    outage_s: f64,
    /// How etcd goes away in the etcd_outage scenario, one run each: `kill` (SIGKILL, then
    /// started again on its data; a restarted etcd extends every lease, so none can expire)
    /// and `stop` (SIGSTOP, then SIGCONT: etcd's clock runs on, so this is the one the TTL
    /// bounds).
    #[arg(long, value_delimiter = ',', default_value = "kill,stop", value_parser = ["kill", "stop"])]
    outage_modes: Vec<String>,
    /// The steady load window of the etcd_ha scenario (seconds); a member is killed after a
    /// third of it.
    #[arg(long, default_value_t = 15.0)]
    ha_load_s: f64,
    /// Which etcd member the etcd_ha scenario kills: `registration` (the one the prefill
    /// node's registration is connected to) or `leader`.
    #[arg(long, default_value = "registration", value_parser = ["registration", "leader"])]
    ha_kill: String,
    /// Leave a scenario out: partition, sigterm, etcd_outage or etcd_ha (repeatable).
    #[arg(long)]
    skip: Vec<String>,
}

fn parse_member(s: &str) -> Result<(String, IpAddr), String> {
    let (ns, ip) = s.split_once('=').ok_or("expected NAMESPACE=IP")?;
    Ok((ns.to_owned(), ip.parse().map_err(|e| format!("{ip}: {e}"))?))
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

    /// Sends `signal` (`-TERM`, ...) to the node; when it was sent.
    fn signal(&mut self, signal: &str) -> Result<Instant, String> {
        let pid = self.child.id().to_string();
        let at = Instant::now();
        let status = Command::new("kill").args([signal, &pid]).status().map_err(|e| format!("kill: {e}"))?;
        check(status.success(), format!("{}: kill {signal} {pid}: {status}", self.name))?;
        Ok(at)
    }

    /// Waits (at most a STEP) for the node to exit.
    fn exit_status(&mut self) -> Result<std::process::ExitStatus, String> {
        let deadline = Instant::now() + STEP;
        loop {
            if let Some(status) = self.child.try_wait().map_err(|e| e.to_string())? {
                return Ok(status);
            }
            if Instant::now() > deadline {
                return Err(format!("{}: still running {STEP:?} later", self.name));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Takes every line with `"event": event` that `want` accepts, of those read so far.
    fn take(&mut self, event: &str, want: impl Fn(&Value) -> bool) -> Vec<(Instant, Value)> {
        while let Ok(line) = self.lines.try_recv() {
            self.backlog.push(line);
        }
        let (taken, kept) =
            std::mem::take(&mut self.backlog).into_iter().partition(|(_, v)| v["event"] == event && want(v));
        self.backlog = kept;
        taken
    }

    /// Where the node's registration (prefill) or directory (decode) stands with etcd.
    fn etcd_status(&mut self) -> Result<Value, String> {
        self.send(json!({"cmd": "status"}))?;
        Ok(self.wait("status", |_| true)?.1["etcd"].take())
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
    /// Parents leased so far (their names are unique).
    parents: std::cell::Cell<u32>,
}

impl Run {
    fn prefill(&self) -> Result<(Node, String), String> {
        self.prefill_on(std::slice::from_ref(&self.etcd_url), self.args.ttl_s)
    }

    /// A prefill node registered in the etcd at `etcd` with a `ttl_s` lease.
    fn prefill_on(&self, etcd: &[String], ttl_s: u64) -> Result<(Node, String), String> {
        let a = &self.args;
        let etcd_args = etcd.iter().flat_map(|e| ["--etcd".to_owned(), e.clone()]);
        let args: Vec<String> = [
            "prefill",
            "--listen",
            &self.prefill_addr,
            "--namespace",
            "multihost",
            "--engine-id",
            "prefill-a",
            "--registration-ttl-s",
            &ttl_s.to_string(),
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
        .chain(etcd_args)
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
        self.decode_on(name, ucx, metrics_port, std::slice::from_ref(&self.etcd_url))
    }

    fn decode_on(
        &self,
        name: &'static str,
        ucx: bool,
        metrics_port: u16,
        etcd: &[String],
    ) -> Result<Node, String> {
        let a = &self.args;
        let mut args: Vec<String> = [
            "decode",
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
        args.extend(etcd.iter().flat_map(|e| ["--etcd".to_owned(), e.clone()]));
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
    let mut etcd = EtcdServer::launch(EtcdLaunch {
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
        parents: std::cell::Cell::new(0),
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
    let skip = |name: &str| a.skip.iter().any(|s| s == name);
    let mut scenarios = json!({});
    if a.prefill_link.is_some() && !skip("partition") {
        scenarios["partition"] = partition(&run, &mut prefill, &new_incarnation, &mut decoders)?;
    }
    // The rest with a long TTL: a SIGTERM'd prefill's key goes at once (not after the TTL),
    // and etcd may be away for seconds without the key expiring.
    prefill.signal("-TERM")?;
    prefill.wait("shutdown", |_| true)?;
    drop(prefill);
    let (mut prefill, long_incarnation) =
        run.prefill_on(std::slice::from_ref(&run.etcd_url), a.long_ttl_s)?;
    for (_, d) in &mut decoders {
        d.wait("directory", |v| v["kind"] != "removed" && v["incarnation"] == long_incarnation.as_str())?;
    }
    if !skip("etcd_outage") {
        scenarios["etcd_outage"] = json!({});
        for mode in &a.outage_modes {
            scenarios["etcd_outage"][mode] =
                etcd_outage(&run, &mut etcd, mode == "stop", &mut prefill, &mut decoders)?;
        }
    }
    if !skip("sigterm") {
        scenarios["sigterm"] = sigterm(&run, prefill, &long_incarnation, &mut decoders)?;
    } else {
        drop(prefill);
    }
    drop(decoders);
    drop(etcd);
    if a.etcd_members.len() == 3 && !skip("etcd_ha") {
        scenarios["etcd_ha"] = etcd_ha(&run)?;
    }
    Ok(json!({
        "ok": true,
        "scenarios": scenarios,
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

/// Runs `ip ARGS` in this (the hub) namespace.
fn ip(args: &[&str]) -> Result<(), String> {
    let status = Command::new("ip").args(args).status().map_err(|e| format!("ip: {e}"))?;
    check(status.success(), format!("ip {}: {status}", args.join(" ")))
}

/// Pulls under load: how many parents were pulled whole and how many failed, and why.
#[derive(Default)]
struct Load {
    done: u32,
    failed: u32,
    kinds: BTreeMap<String, u32>,
    first_error: Option<Value>,
    pull_ms: Vec<f64>,
}

impl Load {
    fn json(&self) -> Value {
        let mut ms = self.pull_ms.clone();
        ms.sort_by(f64::total_cmp);
        let q = |p: f64| ms.get(((ms.len() as f64 - 1.0) * p).round() as usize).copied();
        json!({
            "pulls_done": self.done, "pulls_failed": self.failed, "failed_by_kind": self.kinds,
            "first_error": self.first_error, "pull_ms_p50": q(0.5), "pull_ms_max": q(1.0),
        })
    }
}

impl Run {
    fn parent(&self, tag: &str) -> String {
        let i = self.parents.get();
        self.parents.set(i + 1);
        format!("{tag}-{i}")
    }

    /// Leases a parent (engine-only hand-offs) and pulls it: counted in `load`.
    fn pull_once(
        &self,
        prefill: &mut Node,
        decode: &mut Node,
        tag: &str,
        load: &mut Load,
    ) -> Result<(), String> {
        let result = self.lease(prefill, &self.parent(tag), true)?;
        let (children, elapsed) = self.pull(decode, &result)?;
        if children.iter().all(|c| c["outcome"] == "done" && c["verified"] == true) {
            load.done += 1;
            load.pull_ms.push(elapsed);
        } else {
            load.failed += 1;
            let bad = children.iter().find(|c| c["outcome"] != "done" || c["verified"] != true);
            let kind = bad.and_then(|c| c["error_kind"].as_str()).unwrap_or("unverified").to_owned();
            *load.kinds.entry(kind).or_default() += 1;
            if load.first_error.is_none() {
                load.first_error = bad.cloned();
            }
        }
        Ok(())
    }

    /// Pulls one parent after the other for `span`.
    fn load_for(
        &self,
        prefill: &mut Node,
        decode: &mut Node,
        span: Duration,
        tag: &str,
        load: &mut Load,
    ) -> Result<(), String> {
        let end = Instant::now() + span;
        while Instant::now() < end {
            self.pull_once(prefill, decode, tag, load)?;
        }
        Ok(())
    }
}

/// The first child's outcome of a pull, for the summary.
fn outcome(children: &[Value], elapsed: f64) -> Value {
    let c = &children[0];
    json!({
        "elapsed_ms": elapsed, "outcome": c["outcome"], "error_kind": c["error_kind"], "reason": c["reason"],
        "children_failed": children.iter().filter(|c| c["outcome"] != "done").count(),
    })
}

fn all_not_registered(children: &[Value]) -> bool {
    children.iter().all(|c| c["outcome"] == "failed" && c["error_kind"] == "EngineNotRegistered")
}

/// Waits until every decoder's directory reports `kind` ("added" or "removed") for prefill-a's
/// `incarnation`: per decoder path the milliseconds since `since` (each said with `what`), and
/// the slowest.
fn seen_by_every_decoder(
    decoders: &mut [(&str, Node)],
    kind: &str,
    incarnation: &str,
    since: Instant,
    what: impl Fn(&str, f64) -> String,
) -> Result<(Value, Duration), String> {
    let mut seen = json!({});
    let mut worst = Duration::ZERO;
    for (path, d) in decoders.iter_mut() {
        let (at, _) = d.wait("directory", |v| {
            v["kind"] == kind && v["engine"] == "prefill-a" && v["incarnation"] == incarnation
        })?;
        let took = at.saturating_duration_since(since);
        worst = worst.max(took);
        seen[*path] = json!(ms(took));
        say(what(path, ms(took)));
    }
    Ok((seen, worst))
}

/// The prefill host's link down: the engine leaves after the TTL; back up: it registers again.
fn partition(
    run: &Run,
    prefill: &mut Node,
    incarnation: &str,
    decoders: &mut [(&str, Node)],
) -> Result<Value, String> {
    let link = run.args.prefill_link.as_deref().ok_or("no --prefill-link")?;
    for (_, d) in decoders.iter_mut() {
        d.take("directory", |_| true);
    }
    let before = run.lease(prefill, &run.parent("partition-before"), true)?;
    say(format!("partition: {link} down (the prefill host is cut off from etcd and the decode host)"));
    ip(&["link", "set", link, "down"])?;
    let cut = Instant::now();
    // Healed whatever happens next.
    struct Heal<'a>(&'a str, bool);
    impl Drop for Heal<'_> {
        fn drop(&mut self) {
            if !self.1 {
                let _ = ip(&["link", "set", self.0, "up"]);
            }
        }
    }
    let mut heal = Heal(link, false);
    let d = &mut decoders[0].1;
    let (children, elapsed) = run.pull(d, &before)?;
    check(
        children.iter().all(|c| c["outcome"] != "done"),
        format!("partition: a pull across the cut failed: {children:?}"),
    )?;
    let during = outcome(&children, elapsed);
    say(format!("partition: a pull across the cut failed after {elapsed} ms: {}", children[0]["reason"]));
    let (detection, worst) = seen_by_every_decoder(decoders, "removed", incarnation, cut, |path, took| {
        format!("partition: decode-{path} saw prefill-a leave {took} ms after the cut")
    })?;
    let ttl = Duration::from_secs(run.args.ttl_s);
    check(
        worst <= ttl + Duration::from_secs(1),
        format!("partition: detection took {} ms, more than TTL + 1 s", ms(worst)),
    )?;
    let stale = run.lease(prefill, &run.parent("partition-during"), true)?;
    let d = &mut decoders[0].1;
    let (children, elapsed) = run.pull(d, &stale)?;
    check(
        all_not_registered(&children),
        format!("partition: once the engine left, pulls fail with EngineNotRegistered: {children:?}"),
    )?;
    let after_detection = outcome(&children, elapsed);
    say(format!("partition: then a pull failed in {elapsed} ms: {}", children[0]["reason"]));
    ip(&["link", "set", link, "up"])?;
    heal.1 = true;
    let healed = Instant::now();
    let (reregistration, _) = seen_by_every_decoder(decoders, "added", incarnation, healed, |path, took| {
        format!(
            "partition: decode-{path} saw prefill-a (same incarnation) back {took} ms after the link came up"
        )
    })?;
    let result = run.lease(prefill, &run.parent("partition-after"), true)?;
    let after = run.pull_verified(&mut decoders[0].1, &result, "partition: tcp pull after healing")?;
    let registration = prefill.etcd_status()?;
    Ok(json!({
        "registration_ttl_s": run.args.ttl_s,
        "pull_across_the_cut": during,
        "cut_to_engine_removed_ms": detection,
        "pull_after_removal": after_detection,
        "heal_to_registered_again_ms": reregistration,
        "pull_after_heal_ms": after,
        "registration_after": registration,
    }))
}

/// SIGTERM of the prefill node: its key goes at once, its hand-offs fail at once.
fn sigterm(
    run: &Run,
    mut prefill: Node,
    incarnation: &str,
    decoders: &mut [(&str, Node)],
) -> Result<Value, String> {
    let stale = run.lease(&mut prefill, &run.parent("sigterm-stale"), true)?;
    say(format!("sigterm: SIGTERM to the prefill node (registration TTL {} s)", run.args.long_ttl_s));
    let sent = prefill.signal("-TERM")?;
    let (removed, worst) = seen_by_every_decoder(decoders, "removed", incarnation, sent, |path, took| {
        format!("sigterm: decode-{path} saw the key go {took} ms after SIGTERM")
    })?;
    check(worst < Duration::from_secs(1), format!("sigterm: the key went {} ms after SIGTERM", ms(worst)))?;
    let (at, _) = prefill.wait("shutdown", |v| v["signal"] == "SIGTERM")?;
    let status = prefill.exit_status()?;
    check(status.success(), format!("sigterm: the prefill node exited with {status}"))?;
    let d = &mut decoders[0].1;
    let before = run.stats(d)?;
    let (children, elapsed) = run.pull(d, &stale)?;
    check(
        all_not_registered(&children),
        format!("sigterm: a pull of its hand-off fails with EngineNotRegistered: {children:?}"),
    )?;
    let after = run.stats(d)?;
    check(after["connections_opened"] == before["connections_opened"], "sigterm: no connection tried")?;
    say(format!("sigterm: a pull of its hand-off failed in {elapsed} ms: {}", children[0]["reason"]));
    Ok(json!({
        "registration_ttl_s": run.args.long_ttl_s,
        "sigterm_to_key_removed_ms": removed,
        "sigterm_to_shutdown_line_ms": ms(at.saturating_duration_since(sent)),
        "exit_status": status.code(),
        "pull_after": outcome(&children, elapsed),
    }))
}

/// How long after `from` each of `nodes` that `disturbed` says was connected again with
/// more recoveries than it had `before` (when its status changed; negative when before
/// `from`), waiting at most a STEP; `"undisturbed"` for the others.
fn wait_reconnected(
    nodes: &mut [(&str, &mut Node)],
    before: &[Value],
    disturbed: &[bool],
    from: Instant,
) -> Result<Value, String> {
    let mut took = json!({});
    let mut left = Vec::new();
    for (i, (name, _)) in nodes.iter().enumerate() {
        if disturbed[i] {
            left.push(i);
        } else {
            took[*name] = json!("undisturbed");
        }
    }
    while !left.is_empty() {
        check(from.elapsed() < STEP, format!("not reconnected within {STEP:?}: {left:?}"))?;
        let mut still = Vec::new();
        for i in left {
            let (name, node) = &mut nodes[i];
            let asked = Instant::now();
            let s = node.etcd_status()?;
            if s["state"] == "connected" && s["recoveries"].as_u64() > before[i]["recoveries"].as_u64() {
                let since = Duration::from_millis(s["since_ms"].as_u64().unwrap_or(0));
                let at = asked.checked_sub(since).unwrap_or(asked);
                took[*name] = json!(if at >= from { ms(at - from) } else { -ms(from - at) });
            } else {
                still.push(i);
            }
        }
        left = still;
        if !left.is_empty() {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    Ok(took)
}

/// etcd killed for a few seconds, then started again on its data (`--outage-mode kill`), or
/// frozen and thawed (`stop`).
fn etcd_outage(
    run: &Run,
    etcd: &mut EtcdServer,
    stop: bool,
    prefill: &mut Node,
    decoders: &mut [(&str, Node)],
) -> Result<Value, String> {
    let outage = Duration::from_secs_f64(run.args.outage_s);
    for (_, d) in decoders.iter_mut() {
        d.take("directory", |_| true);
    }
    let mut nodes: Vec<(&str, &mut Node)> = vec![("prefill", prefill)];
    for (path, d) in decoders.iter_mut() {
        nodes.push((if *path == "tcp" { "decode-tcp" } else { "decode-ucx" }, d));
    }
    let before = nodes.iter_mut().map(|(_, n)| n.etcd_status()).collect::<Result<Vec<_>, _>>()?;
    say(format!(
        "etcd_outage: {} of etcd for {outage:?} (registration TTL {} s), pulls go on",
        if stop { "SIGSTOP" } else { "kill -9" },
        run.args.long_ttl_s
    ));
    let down = Instant::now();
    if stop {
        etcd.pause();
    } else {
        etcd.kill();
    }
    let mut during = Load::default();
    let [(_, prefill), (_, d), ..] = &mut nodes[..] else { return Err("no decode node".into()) };
    run.load_for(prefill, d, outage, "outage", &mut during)?;
    let states = nodes.iter_mut().map(|(_, n)| n.etcd_status()).collect::<Result<Vec<_>, _>>()?;
    // Who noticed: not connected, or failed since.
    let disturbed: Vec<bool> = states
        .iter()
        .zip(&before)
        .map(|(s, b)| s["state"] != "connected" || s["failures"].as_u64() > b["failures"].as_u64())
        .collect();
    say(format!(
        "etcd_outage: {} pulls done, {} failed in {outage:?} with etcd away; {}, pulls go on",
        during.done,
        during.failed,
        if stop { "SIGCONT" } else { "starting it again" }
    ));
    let restart = Instant::now();
    let [(_, prefill), (_, d), ..] = &mut nodes[..] else { return Err("no decode node".into()) };
    let up = if stop {
        etcd.resume();
        Instant::now()
    } else {
        // On the same ports and data, while the pulls go on (EtcdServer::restart panics if
        // etcd does not come back: the run fails).
        std::thread::scope(|scope| {
            let restarting = scope.spawn(|| {
                etcd.restart();
                Instant::now()
            });
            while !restarting.is_finished() {
                run.pull_once(prefill, d, "outage", &mut during)?;
            }
            restarting.join().map_err(|_| "etcd did not come back".to_owned())
        })?
    };
    let reconnect = wait_reconnected(&mut nodes, &before, &disturbed, up)?;
    say(format!(
        "etcd_outage: etcd answering {} ms after the {}; reconnected: {reconnect}",
        ms(up - restart),
        if stop { "SIGCONT" } else { "restart" }
    ));
    let mut after = Load::default();
    let [(_, prefill), (_, d), ..] = &mut nodes[..] else { return Err("no decode node".into()) };
    run.load_for(prefill, d, Duration::from_secs(2), "after-outage", &mut after)?;
    let mut flaps = Vec::new();
    for (name, d) in nodes.iter_mut().skip(1) {
        flaps.extend(
            d.take("directory", |v| v["engine"] == "prefill-a")
                .into_iter()
                .map(|(_, v)| json!({"decode": name, "event": v})),
        );
    }
    check(flaps.is_empty(), format!("etcd_outage: the directory changed: {flaps:?}"))?;
    check(during.failed == 0 && after.failed == 0, "etcd_outage: no pull failed")?;
    let states: BTreeMap<&str, Value> = nodes.iter().map(|(name, _)| *name).zip(states).collect();
    Ok(json!({
        "mode": if stop { "SIGSTOP" } else { "kill -9 and restart" },
        "registration_ttl_s": run.args.long_ttl_s,
        "etcd_away_ms": ms(restart - down),
        "etcd_restart_to_healthy_ms": (!stop).then(|| ms(up - restart)),
        "pulls_while_down": during.json(),
        "etcd_state_while_down": states,
        "answering_to_reconnected_ms": reconnect,
        "pulls_after": after.json(),
        "directory_events": flaps.len(),
    }))
}

/// One member of the three-member etcd.
struct HaMember {
    name: String,
    ns: String,
    ip: IpAddr,
    child: Option<Child>,
}

/// A three-member etcd, a member per namespace; killed when dropped.
struct HaEtcd {
    members: Vec<HaMember>,
    dir: std::path::PathBuf,
}

const HA_CLIENT_PORT: u16 = 2479;
const HA_PEER_PORT: u16 = 2480;

impl HaEtcd {
    fn launch(members: &[(String, IpAddr)], root: &std::path::Path) -> Result<Self, String> {
        let etcd = kvxfer_cluster::testing::etcd_binary().ok_or("etcd not found")?;
        let dir = root.join(format!("ha-{}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let peer = |ip: IpAddr| format!("http://{}", SocketAddr::new(ip, HA_PEER_PORT));
        let initial: Vec<String> =
            members.iter().enumerate().map(|(i, (_, ip))| format!("m{i}={}", peer(*ip))).collect();
        let mut ha = HaEtcd { members: Vec::new(), dir };
        for (i, (ns, ip)) in members.iter().enumerate() {
            let name = format!("m{i}");
            let log_path = ha.dir.join(format!("{name}.log"));
            let log = std::fs::File::create(&log_path).map_err(|e| e.to_string())?;
            let err_log = log.try_clone().map_err(|e| e.to_string())?;
            let client = format!("http://{}", SocketAddr::new(*ip, HA_CLIENT_PORT));
            let child = Command::new("ip")
                .args(["netns", "exec", ns])
                .arg(&etcd)
                .arg(format!("--name={name}"))
                .arg(format!("--data-dir={}", ha.dir.join(&name).display()))
                .arg(format!("--listen-client-urls={client}"))
                .arg(format!("--advertise-client-urls={client}"))
                .arg(format!("--listen-peer-urls={}", peer(*ip)))
                .arg(format!("--initial-advertise-peer-urls={}", peer(*ip)))
                .arg(format!("--initial-cluster={}", initial.join(",")))
                .arg("--initial-cluster-state=new")
                .arg(format!("--initial-cluster-token=kvxfer-multihost-{}", std::process::id()))
                .args(["--logger=zap", "--log-level=warn"])
                .stdin(Stdio::null())
                .stdout(Stdio::from(log))
                .stderr(Stdio::from(err_log))
                .spawn()
                .map_err(|e| format!("cannot run {} in {ns}: {e}", etcd.display()))?;
            ha.members.push(HaMember { name, ns: ns.clone(), ip: *ip, child: Some(child) });
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        while !(0..ha.members.len()).all(|i| ha.healthy(i)) {
            for m in &mut ha.members {
                if let Some(status) = m.child.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
                    let log =
                        std::fs::read_to_string(ha.dir.join(format!("{}.log", m.name))).unwrap_or_default();
                    return Err(format!("etcd member {} in {} exited with {status}: {log}", m.name, m.ns));
                }
            }
            check(Instant::now() < deadline, "the three etcd members not healthy within 30 s")?;
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(ha)
    }

    fn addr(&self, i: usize) -> SocketAddr {
        SocketAddr::new(self.members[i].ip, HA_CLIENT_PORT)
    }

    fn endpoint(&self, i: usize) -> String {
        format!("http://{}", self.addr(i))
    }

    fn healthy(&self, i: usize) -> bool {
        self.members[i].child.is_some() && kvxfer_cluster::testing::healthy_at(self.addr(i))
    }

    /// (this member's id, the leader's id), from the JSON gateway.
    fn status(&self, i: usize) -> Option<(String, String)> {
        kvxfer_cluster::testing::member_status(self.addr(i))
    }

    fn leader(&self) -> Option<usize> {
        let leader = (0..self.members.len()).find_map(|i| self.status(i))?.1;
        (0..self.members.len()).find(|&i| self.status(i).is_some_and(|(id, _)| id == leader))
    }

    fn kill(&mut self, i: usize) {
        if let Some(mut child) = self.members[i].child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for HaEtcd {
    fn drop(&mut self) {
        for i in 0..self.members.len() {
            self.kill(i);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Three etcd members, one killed under steady pulls.
fn etcd_ha(run: &Run) -> Result<Value, String> {
    let a = &run.args;
    let root = a.etcd_dir.clone().unwrap_or_else(std::env::temp_dir);
    let started = Instant::now();
    let mut ha = HaEtcd::launch(&a.etcd_members, &root)?;
    let endpoints: Vec<String> = (0..ha.members.len()).map(|i| ha.endpoint(i)).collect();
    say(format!("etcd_ha: three members healthy in {} ms: {}", ms(started.elapsed()), endpoints.join(" ")));
    let (mut prefill, incarnation) = run.prefill_on(&endpoints, a.long_ttl_s)?;
    let mut decode = run.decode_on("decode-ha", false, 9103, &endpoints)?;
    decode.wait("directory", |v| v["engine"] == "prefill-a" && v["incarnation"] == incarnation.as_str())?;
    let registration = prefill.etcd_status()?;
    let directory = decode.etcd_status()?;
    let trim = |v: &Value| v["endpoint"].as_str().unwrap_or_default().trim_end_matches('/').to_owned();
    let leader = ha.leader();
    let victim = match a.ha_kill.as_str() {
        "leader" => leader.ok_or("etcd_ha: no leader")?,
        _ => endpoints
            .iter()
            .position(|e| *e == trim(&registration))
            .ok_or("etcd_ha: registration's member?")?,
    };
    let span = Duration::from_secs_f64(a.ha_load_s);
    let mut load = Load::default();
    run.load_for(&mut prefill, &mut decode, span / 3, "ha", &mut load)?;
    say(format!(
        "etcd_ha: {} pulls so far; killing member {} ({}, {}; the registration is on {}, the directory on {})",
        load.done,
        ha.members[victim].name,
        endpoints[victim],
        if leader == Some(victim) { "the leader" } else { "a follower" },
        trim(&registration),
        trim(&directory),
    ));
    ha.kill(victim);
    let killed = Instant::now();
    run.load_for(&mut prefill, &mut decode, span - span / 3, "ha", &mut load)?;
    // Where each stands at the end, and since when: connected on a live member since before
    // the kill is 0 (undisturbed).
    let mut settled = json!({});
    for (name, node, before) in
        [("registration", &mut prefill, &registration), ("directory", &mut decode, &directory)]
    {
        let asked = Instant::now();
        let s = node.etcd_status()?;
        check(
            s["state"] == "connected" && trim(&s) != endpoints[victim],
            format!("etcd_ha: the {name} is connected to a live member at the end: {s}"),
        )?;
        let since =
            asked.checked_sub(Duration::from_millis(s["since_ms"].as_u64().unwrap_or(0))).unwrap_or(asked);
        settled[name] = json!({
            "was_on": trim(before), "now_on": trim(&s),
            "kill_to_connected_on_live_member_ms": ms(since.saturating_duration_since(killed)),
            "failures": s["failures"].as_u64().unwrap_or(0) - before["failures"].as_u64().unwrap_or(0),
            "recoveries": s["recoveries"].as_u64().unwrap_or(0) - before["recoveries"].as_u64().unwrap_or(0),
        });
    }
    let events: Vec<Value> =
        decode.take("directory", |v| v["engine"] == "prefill-a").into_iter().map(|(_, v)| v).collect();
    say(format!(
        "etcd_ha: {} pulls done, {} failed in {span:?}; after the kill: {settled}",
        load.done, load.failed
    ));
    check(load.failed == 0, format!("etcd_ha: no pull failed: {}", load.json()))?;
    check(events.is_empty(), format!("etcd_ha: no directory event: {events:?}"))?;
    prefill.signal("-TERM")?;
    prefill.wait("shutdown", |_| true)?;
    Ok(json!({
        "registration_ttl_s": a.long_ttl_s,
        "members": endpoints,
        "killed": endpoints[victim],
        "killed_was_leader": leader == Some(victim),
        "load_window_s": a.ha_load_s,
        "pulls": load.json(),
        "after_the_kill": settled,
        "directory_events": events.len(),
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
