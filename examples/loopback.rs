//! Loopback: a prefill and a decode agent on 127.0.0.1 hand over one parent request with n
//! children, every byte verified.
//!
//! ```text
//! cargo run --release --example loopback -- --n 8 --blocks-per-child 1024 --block-bytes 65536 --json
//! ```
//! Exits non-zero unless every child ended as asked (pulled; `--cancel-child` released
//! without being pulled, as for a request aborted before its pull; `--skip-child` expired)
//! and every pulled byte verified.
//!
//! Both agents prove the cluster key of `KVXFER_CLUSTER_KEY` / `KVXFER_CLUSTER_KEY_FILE`
//! to each other, or, when neither is set, a random key made for the run.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Parser;
use kvxfer::blocking::{DecodeAgent, PrefillAgent};
use kvxfer::{AgentConfig, BlockId, BlockLayout, ChildOutcome, EndKind, KvMemory, TransportChoice};
use kvxfer_mem::pattern;

#[derive(Parser, Debug)]
#[command(about = "Hand one parent request with n children from a prefill to a decode agent on 127.0.0.1")]
struct Args {
    /// Children of the parent request (parallel sampling n).
    #[arg(long, default_value_t = 4)]
    n: u32,
    /// Blocks each child leases.
    #[arg(long, default_value_t = 64)]
    blocks_per_child: u32,
    /// Bytes per block.
    #[arg(long, default_value_t = 65536)]
    block_bytes: u64,
    /// Data path: tcp, ucx (needs `--features ucx`) or auto.
    #[arg(long, default_value = "tcp")]
    transport: TransportChoice,
    /// UCX transports (UCX_TLS), e.g. "tcp" or "posix,cma,self".
    #[arg(long)]
    ucx_tls: Option<String>,
    /// Ask UCX for peer-failure reporting (UCX 1.13 then avoids shared-memory transports).
    #[arg(long)]
    ucx_peer_failure: bool,
    /// Children lease the same prompt blocks (prefix caching): they cross the wire once.
    #[arg(long)]
    shared_prompt: bool,
    /// The decode side drops this child before pulling it (`DecodeAgent::release`): it
    /// must end released.
    #[arg(long)]
    cancel_child: Option<u32>,
    /// The decode side never pulls this child: it must end expired after the lease.
    #[arg(long)]
    skip_child: Option<u32>,
    /// Lease time-to-live in milliseconds.
    #[arg(long, default_value_t = 30_000)]
    lease_ms: u64,
    /// Data connections from the decode to the prefill agent.
    #[arg(long, default_value_t = 2)]
    connections: usize,
    /// Print one JSON object as the last line.
    #[arg(long)]
    json: bool,
}

fn main() -> ExitCode {
    kvxfer::ucx_log_to_stderr();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        // No colour codes in a log written to a file or a pipe.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let args = Args::parse();
    match run(&args) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("loopback: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: &Args) -> Result<bool, Box<dyn std::error::Error>> {
    let n = args.n.max(1);
    let bpc = args.blocks_per_child.max(1);
    for (flag, v) in [("--cancel-child", args.cancel_child), ("--skip-child", args.skip_child)] {
        if v.is_some_and(|i| i >= n) {
            return Err(format!("{flag} must be below --n {n}").into());
        }
    }
    if args.cancel_child.is_some() && args.cancel_child == args.skip_child {
        return Err("--cancel-child and --skip-child name the same child".into());
    }
    let remote_blocks = if args.shared_prompt { bpc } else { n * bpc };
    // The prefill cache holds a verifiable pattern before anything is leased.
    let prefill_mem = pattern::alloc_filled(BlockLayout::single(remote_blocks, args.block_bytes)?)?;
    let decode_mem = KvMemory::alloc(BlockLayout::single(n * bpc, args.block_bytes)?)?;

    let ttl = Duration::from_millis(args.lease_ms);
    let key = kvxfer::ClusterKey::from_env()?.unwrap_or_else(kvxfer::ClusterKey::generate);
    let config = |name: &str| {
        AgentConfig::new(name)
            .transport(args.transport)
            .cluster_key(key.clone())
            .ucx_options(args.ucx_tls.clone(), args.ucx_peer_failure)
            .map_err(|e| e.to_string())
    };
    let prefill = PrefillAgent::start(config("prefill")?.lease_ttl(ttl), "127.0.0.1:0", prefill_mem)?;
    let decode = DecodeAgent::start(config("decode")?.connections_per_peer(args.connections), decode_mem)?;

    let remote: Vec<Vec<BlockId>> = (0..n)
        .map(|i| {
            let first = if args.shared_prompt { 0 } else { i * bpc };
            (first..first + bpc).collect()
        })
        .collect();
    let local: Vec<Vec<BlockId>> = (0..n).map(|i| (i * bpc..(i + 1) * bpc).collect()).collect();

    let started = Instant::now();
    let result = prefill.lease_parent("cmpl-loopback", remote.clone(), 1, None)?;
    // The dropped child is released, not pulled (a cancel right after submit would race a
    // fast pull, and lose to it now and then).
    let released = args.cancel_child.map(|i| decode.release(&result.children()[i as usize]));
    let selection: Vec<(u32, Vec<BlockId>)> = (0..n)
        .filter(|&i| Some(i) != args.skip_child && Some(i) != args.cancel_child)
        .map(|i| (i, local[i as usize].clone()))
        .collect();
    let handle = decode.submit_subset(&result, selection)?;
    let report = handle.wait();
    let pull_seconds = started.elapsed().as_secs_f64();

    // Verify every pulled child's local blocks against the pattern of its remote blocks.
    let mut verified = true;
    if released == Some(false) {
        eprintln!("the release of child {:?} was not applied", args.cancel_child);
        verified = false;
    }
    for c in &report.children {
        let i = c.child_index as usize;
        let ok = match &c.outcome {
            ChildOutcome::Done { .. } => {
                // SAFETY: the pull reported this child; nothing writes its blocks now.
                let bad = unsafe { pattern::check_blocks(decode.memory(), &remote[i], &local[i])? };
                if let Some(b) = bad {
                    eprintln!("child {i}: local block {b} does not hold its remote block's bytes");
                }
                bad.is_none()
            }
            other => {
                eprintln!("child {i}: expected done, got {other:?}");
                false
            }
        };
        verified &= ok;
    }

    // Every lease ends exactly once: wait for all n endings (the skipped one at its deadline).
    let mut ends = Vec::new();
    let deadline = Instant::now() + ttl + Duration::from_secs(5);
    while ends.len() < n as usize {
        let left = deadline.saturating_duration_since(Instant::now());
        match prefill.events().recv_timeout(left) {
            Ok(e) => ends.push(e),
            Err(_) => break,
        }
    }
    let count = |k| ends.iter().filter(|e| e.kind == k).count();
    let (pulled, released, expired) =
        (count(EndKind::Pulled), count(EndKind::Released), count(EndKind::Expired));
    let mut as_asked = ends.len() == n as usize;
    for e in &ends {
        let want = if Some(e.child_index) == args.cancel_child {
            EndKind::Released
        } else if Some(e.child_index) == args.skip_child {
            EndKind::Expired
        } else {
            EndKind::Pulled
        };
        if e.kind != want {
            eprintln!("lease {} ended {:?}, expected {want:?}", e.remote_request_id, e.kind);
            as_asked = false;
        }
    }
    let pstats = prefill.stats();
    let dstats = decode.stats();
    let bytes = report.delivered_bytes;
    let gib_per_s = bytes as f64 / (1u64 << 30) as f64 / report.elapsed.as_secs_f64().max(1e-9);
    println!(
        "kvxfer loopback over {}: parent {} with n={} ({} blocks of {} B per child{})",
        args.transport,
        report.parent_request_id,
        n,
        bpc,
        args.block_bytes,
        if args.shared_prompt { ", shared prompt" } else { "" }
    );
    for e in &ends {
        println!(
            "  child {} ({}): {:?}, {} consumer(s) notified",
            e.child_index, e.remote_request_id, e.kind, e.consumers_seen
        );
    }
    println!(
        "  pulled {:.1} MiB into local blocks ({:.1} MiB on the wire) in {:.3} s: {:.2} GiB/s; verified: {}",
        bytes as f64 / (1u64 << 20) as f64,
        report.wire_bytes as f64 / (1u64 << 20) as f64,
        report.elapsed.as_secs_f64(),
        gib_per_s,
        if verified { "every byte" } else { "MISMATCH" }
    );
    println!(
        "  leases: {} made, {pulled} pulled, {released} released, {expired} expired; unrecognized notifications: {}; bad tokens: {}",
        pstats.leases.leased, pstats.leases.unrecognized, pstats.leases.bad_token
    );
    if args.json {
        let j = serde_json::json!({
            "transport": args.transport.to_string(),
            "children": n,
            "pulled": pulled,
            "released": released,
            "expired": expired,
            "unrecognized_notifications": pstats.leases.unrecognized,
            "bad_tokens": pstats.leases.bad_token,
            "bytes": bytes,
            "wire_bytes": report.wire_bytes,
            "bytes_served": pstats.server.bytes_served,
            "bytes_pulled": dstats.bytes_pulled,
            "block_bytes": args.block_bytes,
            "blocks_per_child": bpc,
            "shared_prompt": args.shared_prompt,
            "verified": verified,
            "seconds": report.elapsed.as_secs_f64(),
            "wall_seconds": pull_seconds,
            "gib_per_s": gib_per_s,
            "ended_as_asked": as_asked,
        });
        println!("{j}");
    }
    Ok(verified && as_asked)
}
