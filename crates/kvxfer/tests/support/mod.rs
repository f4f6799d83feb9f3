//! Shared harness of the engine's integration tests: agents on 127.0.0.1 (free ports),
//! patterned prefill memory, verification, and waiting for lease ends.
//!
//! Agents made here hold the test cluster key ([`test_key`]) unless made with
//! [`prefill_unkeyed`] / [`decode_unkeyed`]: the suite runs authenticated, and the tests
//! that speak raw frames or script fake peers run without a key.
#![allow(dead_code, unreachable_pub, missing_docs)]

use std::time::{Duration, Instant};

use kvxfer::blocking::{DecodeAgent, PrefillAgent};
use kvxfer::{AgentConfig, BlockId, BlockLayout, ClusterKey, KvMemory, LeaseEnd};
use kvxfer_mem::pattern;

pub const BLOCK: u64 = 4096;

/// The cluster key of the test suite, as hex (what `KVXFER_CLUSTER_KEY` would hold).
pub const TEST_KEY_HEX: &str = "6b767866657220746573742d737569746520636c7573746572206b6579";

/// The cluster key of the test suite.
pub fn test_key() -> ClusterKey {
    ClusterKey::from_hex(TEST_KEY_HEX).expect("test key")
}

/// `config` with the test cluster key, unless it has a key already.
pub fn keyed(config: AgentConfig) -> AgentConfig {
    if config.cluster_key.is_some() {
        config
    } else {
        config.cluster_key(test_key())
    }
}

/// The data paths the suite runs over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    /// kvxfer's own TCP path.
    Tcp,
    /// UCX with `UCX_TLS=tcp` (and peer-failure handling, and CRC-checked reads).
    #[cfg(feature = "ucx")]
    UcxTcp,
    /// UCX over shared memory (`posix,sysv,cma,self`, no peer-failure handling, which UCX
    /// 1.13's shared-memory transports do not support).
    #[cfg(feature = "ucx")]
    UcxShm,
}

impl Transport {
    /// `config` set up for this data path.
    pub fn config(self, config: AgentConfig) -> AgentConfig {
        match self {
            Transport::Tcp => config.transport(kvxfer::TransportChoice::Tcp),
            #[cfg(feature = "ucx")]
            Transport::UcxTcp => {
                let mut c = config.transport(kvxfer::TransportChoice::Ucx);
                // This path also checks every one-sided read against the pin's CRC-32C.
                c.ucx = kvxfer::UcxConfig {
                    tls: Some("tcp".into()),
                    peer_failure_handling: true,
                    // Peer failures reported for same-host peers too (the tests' peers).
                    same_host_shared_memory: false,
                    verify_payloads: true,
                };
                c
            }
            #[cfg(feature = "ucx")]
            Transport::UcxShm => {
                let mut c = config.transport(kvxfer::TransportChoice::Ucx);
                c.ucx = kvxfer::UcxConfig {
                    tls: Some("posix,sysv,cma,self".into()),
                    peer_failure_handling: false,
                    same_host_shared_memory: true,
                    verify_payloads: false,
                };
                c
            }
        }
    }

    /// A prefill agent over `blocks` patterned blocks (see [`TEST_ARM_WAIT`]).
    pub fn prefill(self, blocks: u32, ttl: Duration) -> PrefillAgent {
        let config = self.config(
            AgentConfig::new("prefill")
                .lease_ttl(ttl)
                .io_timeout(Duration::from_secs(5))
                .arm_wait(TEST_ARM_WAIT),
        );
        prefill_with(config, BlockLayout::single(blocks, BLOCK).expect("layout"))
    }

    /// A decode agent with `blocks` zeroed blocks.
    pub fn decode(self, blocks: u32) -> DecodeAgent {
        let config = self.config(AgentConfig::new("decode").io_timeout(Duration::from_secs(5)));
        decode_with(config, BlockLayout::single(blocks, BLOCK).expect("layout"))
    }
}

/// Instantiates `fn name(t: Transport)` tests once per data path, in modules `tcp`,
/// `ucx_tcp` and `ucx_shm` (the UCX ones with the `ucx` feature).
#[macro_export]
macro_rules! per_transport {
    ($($name:ident),* $(,)?) => {
        mod tcp {
            $( #[test] fn $name() { super::$name($crate::support::Transport::Tcp) } )*
        }
        #[cfg(feature = "ucx")]
        mod ucx_tcp {
            $( #[test] fn $name() { super::$name($crate::support::Transport::UcxTcp) } )*
        }
        #[cfg(feature = "ucx")]
        mod ucx_shm {
            $( #[test] fn $name() { super::$name($crate::support::Transport::UcxShm) } )*
        }
    };
}

pub fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_test_writer()
        .try_init();
}

/// How long the test prefill agents let a request naming an unknown lease (or a wrong
/// token) wait for an arm: below the test decode agents' 5 s io timeout, as the defaults
/// are (5 s against 10 s) — with equal bounds the decode side's timer and the
/// "unrecognized" answer race, and a wrong token can fail as a timeout.
pub const TEST_ARM_WAIT: Duration = Duration::from_millis(500);

/// A prefill agent over `blocks` patterned blocks, with lease ttl `ttl` (see
/// [`TEST_ARM_WAIT`]).
pub fn prefill(blocks: u32, ttl: Duration) -> PrefillAgent {
    let config =
        AgentConfig::new("prefill").lease_ttl(ttl).io_timeout(Duration::from_secs(5)).arm_wait(TEST_ARM_WAIT);
    prefill_with(config, BlockLayout::single(blocks, BLOCK).expect("layout"))
}

/// A prefill agent with the test cluster key (unless `config` has another).
pub fn prefill_with(config: AgentConfig, layout: BlockLayout) -> PrefillAgent {
    prefill_unkeyed(keyed(config), layout)
}

/// A prefill agent with exactly `config`'s key (none: unauthenticated peers).
pub fn prefill_unkeyed(config: AgentConfig, layout: BlockLayout) -> PrefillAgent {
    init_tracing();
    let mem = pattern::alloc_filled(layout).expect("patterned memory");
    PrefillAgent::start(config, "127.0.0.1:0", mem).expect("prefill agent")
}

/// `config` for a prefill agent that grants pins: with the `ucx` feature, one offering UCX
/// (over tcp). An agent serving TCP alone refuses every pin (pins exist for one-sided reads);
/// without the feature `config` is returned as it is.
pub fn one_sided(config: AgentConfig) -> AgentConfig {
    #[cfg(feature = "ucx")]
    return Transport::UcxTcp.config(config);
    #[cfg(not(feature = "ucx"))]
    config
}

/// A decode agent with `blocks` zeroed local blocks.
pub fn decode(blocks: u32) -> DecodeAgent {
    let config = AgentConfig::new("decode").io_timeout(Duration::from_secs(5));
    decode_with(config, BlockLayout::single(blocks, BLOCK).expect("layout"))
}

/// A decode agent with the test cluster key (unless `config` has another).
pub fn decode_with(config: AgentConfig, layout: BlockLayout) -> DecodeAgent {
    decode_unkeyed(keyed(config), layout)
}

/// A decode agent with exactly `config`'s key (none: unauthenticated).
pub fn decode_unkeyed(config: AgentConfig, layout: BlockLayout) -> DecodeAgent {
    init_tracing();
    DecodeAgent::start(config, KvMemory::alloc(layout).expect("alloc")).expect("decode agent")
}

/// Whether local blocks hold the bytes of the remote blocks they were pulled from.
pub fn verify(decode: &DecodeAgent, remote: &[BlockId], local: &[BlockId]) -> bool {
    // SAFETY: callers verify only children whose pull has reported.
    let bad = unsafe { pattern::check_blocks(decode.memory(), remote, local) }.expect("in layout");
    bad.is_none()
}

/// Receives `count` lease ends, or panics after `timeout`.
pub fn wait_ends(prefill: &PrefillAgent, count: usize, timeout: Duration) -> Vec<LeaseEnd> {
    let deadline = Instant::now() + timeout;
    let mut out = Vec::new();
    while out.len() < count {
        let left = deadline.saturating_duration_since(Instant::now());
        match prefill.events().recv_timeout(left) {
            Ok(e) => out.push(e),
            Err(_) => panic!("only {} of {count} lease ends within {timeout:?}: {out:?}", out.len()),
        }
    }
    out.sort_by_key(|e| e.child_index);
    out
}

/// Asserts no further lease end arrives within `quiet`.
pub fn assert_no_more_ends(prefill: &PrefillAgent, quiet: Duration) {
    if let Ok(e) = prefill.events().recv_timeout(quiet) {
        panic!("unexpected extra lease end: {e:?}");
    }
}

/// A small deterministic shuffle (xorshift), so failures reproduce.
pub fn shuffle<T>(v: &mut [T], seed: u64) {
    let mut x = seed | 1;
    for i in (1..v.len()).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.swap(i, (x % (i as u64 + 1)) as usize);
    }
}

/// Waits up to 5 s for `cond` (counters updated by another thread after a reply was sent).
pub fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// The hello a raw test client (not a DecodeAgent) sends to a prefill agent of `layout`.
pub fn raw_hello(layout: &BlockLayout, engine_id: &str) -> kvxfer_proto::v1::Hello {
    kvxfer_proto::v1::Hello {
        protocol_version: kvxfer_proto::PROTOCOL_VERSION,
        engine_id: engine_id.into(),
        agent_name: "raw-test-client".into(),
        compat_hash: layout.compat_hash(),
        layout: Some(layout.to_wire()),
        transports: vec![],
        ..Default::default()
    }
}

/// One whole frame (header and body), for tests that speak the protocol by hand.
pub fn frame_bytes(ty: kvxfer_proto::v1::FrameType, body: &impl kvxfer_proto::Message) -> Vec<u8> {
    let b = body.encode_to_vec();
    let mut out = ((b.len() + 1) as u32).to_be_bytes().to_vec();
    out.push(ty as u8);
    out.extend_from_slice(&b);
    out
}

/// A raw test connection holding the test cluster key.
pub async fn raw_connect(
    addr: &str,
    hello: &kvxfer_proto::v1::Hello,
) -> Result<kvxfer_tcp::Connection, kvxfer_tcp::ClientError> {
    kvxfer_tcp::Connection::connect_with_key(addr, hello, Some(&test_key()), kvxfer_tcp::Limits::default())
        .await
}

/// Reads one frame from a blocking socket: (type, body).
pub fn read_raw_frame(s: &mut std::net::TcpStream) -> Option<(u8, Vec<u8>)> {
    use std::io::Read;
    let mut h = [0u8; 5];
    s.read_exact(&mut h).ok()?;
    let len = u32::from_be_bytes([h[0], h[1], h[2], h[3]]) as usize;
    let mut body = vec![0u8; len.checked_sub(1)?];
    s.read_exact(&mut body).ok()?;
    Some((h[4], body))
}

/// The authenticated handshake by hand over a blocking socket, with `key`: hello, the
/// challenge (a bare nonce), the proof; a `HelloAck` answer must be followed by the
/// accepting side's MAC over it (checked). Returns the type of the frame that answers the
/// proof (a `HelloAck` when accepted) and its body.
pub fn raw_handshake(
    s: &mut std::net::TcpStream,
    layout: &BlockLayout,
    key: &ClusterKey,
) -> Option<(u8, Vec<u8>)> {
    use kvxfer_proto::v1;
    use kvxfer_proto::Message;
    use kvxfer_tcp::Transcript;
    use std::io::Write;
    let mut hello = raw_hello(layout, "raw");
    hello.authenticated = true;
    hello.nonce = kvxfer_tcp::handshake::nonce();
    let hello_bytes = frame_bytes(v1::FrameType::Hello, &hello);
    s.write_all(&hello_bytes).ok()?;
    let (ty, body) = read_raw_frame(s)?;
    if ty != v1::FrameType::HelloChallenge as u8 {
        return Some((ty, body));
    }
    let ch = v1::HelloChallenge::decode(&body[..]).ok()?;
    assert!(ch.mac.is_empty(), "a challenge carries no MAC");
    let t = Transcript { nonce_d: &hello.nonce, nonce_p: &ch.nonce, hello: &hello_bytes[5..] };
    let proof = key.proof_mac(&t);
    s.write_all(&frame_bytes(v1::FrameType::HelloProof, &v1::HelloProof { mac: proof.clone() })).ok()?;
    let (ty, body) = read_raw_frame(s)?;
    if ty == v1::FrameType::HelloAck as u8 {
        let (proof_ty, tag) = read_raw_frame(s)?;
        assert_eq!(proof_ty, v1::FrameType::HelloProof as u8, "the HelloAck is followed by its MAC");
        let tag = v1::HelloProof::decode(&tag[..]).ok()?.mac;
        assert!(key.verify_ack_mac(&t, &proof, &body, &tag), "the MAC covers the HelloAck bytes");
    }
    Some((ty, body))
}

/// Two KV-cache groups: group 0 (full attention) of two segments, one strided; group 1
/// (sliding window) of one smaller segment, `g1_blocks` blocks. Block sizes differ between
/// the groups, so a block read from or into the wrong group is caught by length as well as
/// bytes.
pub fn group_layouts(g0_blocks: u32, g1_blocks: u32) -> Vec<kvxfer::BlockLayout> {
    vec![
        kvxfer::BlockLayout::new(
            g0_blocks,
            vec![kvxfer::Segment::packed(2048), kvxfer::Segment { block_len: 1024, stride: 1536 }],
            "bf16",
            16,
        )
        .expect("group 0"),
        kvxfer::BlockLayout::new(g1_blocks, vec![kvxfer::Segment::packed(512)], "bf16", 16).expect("group 1"),
    ]
}
