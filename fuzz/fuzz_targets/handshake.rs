//! Both sides of the handshake (`kvxfer_tcp::handshake::accept` and `initiate`) against a
//! peer whose frames come from the input, over `tokio::io::duplex` on a paused clock.
//!
//! The first byte picks the side under test (bit 0: 0 = accepting, 1 = connecting), whether
//! it holds the cluster key (bit 1), whether the peer follows the handshake's frame order
//! with fields from the input (bit 3: a keyed hello or a bare-nonce challenge extended by
//! the first chunk, then a MAC frame whose MAC is the next chunk), and whether the peer holds
//! the key too and computes its MACs honestly over whatever it sent (bit 2), so the paths
//! after a verified MAC — compatibility checks, the `HelloAck` and its MAC — see arbitrary
//! hellos and acks. The rest is a list of chunks (`len: u8`, then `len` bytes) the peer
//! sends one after another, reading one frame of the side under test between them.
//!
//! Checked: nothing panics; a keyed side never authenticates a peer that does not hold the
//! key; and a keyed accepting side sends nothing but a bare-nonce challenge or an error
//! before the peer's proof verified.
#![no_main]

use std::sync::Arc;
use std::time::Duration;

use kvxfer_core::{BlockLayout, EngineInfo, LeaseConfig, LeaseTable};
use kvxfer_mem::KvMemory;
use kvxfer_proto::v1;
use kvxfer_proto::Message;
use kvxfer_tcp::frame::{self, Frame, HEADER_LEN};
use kvxfer_tcp::handshake::{accept, initiate, NONCE_LEN};
use kvxfer_tcp::{ClusterKey, Limits, ServeContext, ServerCounters, Transcript};
use libfuzzer_sys::fuzz_target;
use tokio::io::{AsyncWriteExt, DuplexStream};

fn layout() -> BlockLayout {
    BlockLayout::single(4, 64).expect("layout")
}

fn key() -> ClusterKey {
    ClusterKey::from_bytes(vec![7u8; 32]).expect("key")
}

fn ack() -> v1::HelloAck {
    v1::HelloAck {
        protocol_version: kvxfer_proto::PROTOCOL_VERSION,
        engine_id: "prefill".into(),
        agent_name: "p".into(),
        compat_hash: layout().compat_hash(),
        layout: Some(layout().to_wire()),
        transports: vec![v1::TransportOffer { transport: v1::Transport::Tcp as i32, connection_info: vec![] }],
        incarnation: 7,
        authenticated: false,
        other_group_layouts: vec![],
        kv_shape: None,
    }
}

fn hello() -> v1::Hello {
    v1::Hello {
        protocol_version: kvxfer_proto::PROTOCOL_VERSION,
        engine_id: "decode".into(),
        agent_name: "d".into(),
        compat_hash: layout().compat_hash(),
        layout: Some(layout().to_wire()),
        ..Default::default()
    }
}

fn frame_bytes(f: &Frame) -> Vec<u8> {
    let mut out = Vec::new();
    f.encode(&mut out);
    out
}

/// A frame of type `ty` whose body is `body`, byte for byte.
fn raw_frame(ty: v1::FrameType, body: &[u8]) -> Vec<u8> {
    let mut out = ((body.len() + 1) as u32).to_be_bytes().to_vec();
    out.push(ty as u8);
    out.extend_from_slice(body);
    out
}

/// Reads one frame of the side under test, or `None` once it waits for us (or is gone).
async fn next_frame(peer: &mut DuplexStream) -> Option<Frame> {
    let mut buf = Vec::new();
    let read = frame::read_frame(peer, 1 << 20, &mut buf);
    tokio::time::timeout(Duration::from_secs(1), read).await.ok()?.ok()
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else { return };
    let (connecting, keyed, honest) = (mode & 1 == 1, mode & 2 != 0, mode & 4 != 0);
    let honest = honest && keyed;
    let structured = honest || mode & 8 != 0;
    let mut chunks = Vec::new();
    let mut rest = rest;
    while let Some((&len, tail)) = rest.split_first() {
        let len = (len as usize).min(tail.len());
        chunks.push(tail[..len].to_vec());
        rest = &tail[len..];
    }
    let engine = EngineInfo { engine_id: "prefill".into(), host: "127.0.0.1".into(), port: 1, tp_size: 1, incarnation: 7 };
    let ctx = ServeContext {
        table: Arc::new(LeaseTable::new(LeaseConfig::new(engine, 4), [1; 32])),
        memory: Arc::new(KvMemory::alloc(layout()).expect("memory")),
        shape: None,
        hello_ack: ack(),
        cluster_key: keyed.then(key),
        limits: Limits::default(),
        counters: Arc::new(ServerCounters::default()),
        leases_made: Arc::new(tokio::sync::Notify::new()),
    };
    let runtime =
        tokio::runtime::Builder::new_current_thread().enable_time().start_paused(true).build().expect("runtime");
    runtime.block_on(async {
        let (mut ours, mut peer) = tokio::io::duplex(1 << 16);
        let key = key();
        let side = async {
            let outcome = if connecting {
                initiate(&mut ours, "peer", &hello(), keyed.then_some(&key), &Limits::default()).await.is_ok()
            } else {
                matches!(accept(&mut ours, &ctx, "peer", &mut Vec::new(), &mut Vec::new()).await, Ok(Some(_)))
            };
            drop(ours);
            outcome
        };
        let script = async {
            // What the peer knows of the transcript so far (its honest MACs need it).
            let (mut nonce_d, mut nonce_p, mut hello_body, mut proof) = (None, None, None::<Vec<u8>>, None);
            let mut proof_sent = false;
            let mut chunks = chunks.into_iter();
            let mut seen = Vec::new();
            if connecting {
                seen.extend(next_frame(&mut peer).await);
            }
            loop {
                // The side under test spoke: learn from it.
                for f in seen.drain(..) {
                    match f {
                        Frame::Hello(h) => {
                            nonce_d = Some(h.nonce.clone());
                            hello_body = Some(frame_bytes(&Frame::Hello(h))[HEADER_LEN..].to_vec());
                        }
                        Frame::HelloChallenge(ch) => {
                            // A keyed accepting side says nothing computed with the key
                            // before the peer's proof verified.
                            assert!(ch.mac.is_empty(), "a challenge with a MAC");
                            nonce_p = Some(ch.nonce);
                        }
                        Frame::HelloProof(p) if connecting => proof = Some(p.mac),
                        Frame::HelloAck(_) | Frame::HelloProof(_) if keyed && !connecting => {
                            assert!(honest && proof_sent, "the accepting side answered an unproven peer")
                        }
                        _ => {}
                    }
                }
                let Some(chunk) = chunks.next() else { break };
                let bytes = match (structured, connecting) {
                    // The peer connects: its first chunk extends a keyed hello (appended
                    // fields override), and once challenged it proves the key (honestly, or
                    // with the next chunk as its MAC).
                    (true, false) => match (&hello_body, &nonce_p) {
                        (None, _) => {
                            let mut h = hello();
                            (h.nonce, h.authenticated) = (vec![3; NONCE_LEN], true);
                            let mut body = h.encode_to_vec();
                            body.extend_from_slice(&chunk);
                            let decoded = v1::Hello::decode(&body[..]).ok();
                            nonce_d = decoded.map(|h| h.nonce);
                            hello_body = Some(body.clone());
                            raw_frame(v1::FrameType::Hello, &body)
                        }
                        (Some(body), Some(p)) if !proof_sent => {
                            let d = nonce_d.clone().unwrap_or_default();
                            let t = Transcript { nonce_d: &d, nonce_p: p, hello: body };
                            let mac = if honest { key.proof_mac(&t) } else { chunk };
                            proof_sent = true;
                            frame_bytes(&Frame::HelloProof(v1::HelloProof { mac }))
                        }
                        _ => chunk,
                    },
                    // The peer accepts: it challenges with a nonce from the input, then sends
                    // a HelloAck (a valid one with the chunk appended) and its MAC (honest,
                    // or the chunk).
                    (true, true) => match (&nonce_p, &proof) {
                        (None, _) => {
                            let mut n = chunk.clone();
                            n.resize(NONCE_LEN, 0);
                            nonce_p = Some(n.clone());
                            frame_bytes(&Frame::HelloChallenge(v1::HelloChallenge { nonce: n, mac: vec![] }))
                        }
                        (Some(p), Some(mac_d)) => {
                            let mut body = v1::HelloAck { authenticated: true, ..ack() }.encode_to_vec();
                            body.extend_from_slice(&chunk);
                            let (d, h) = (nonce_d.clone().unwrap_or_default(), hello_body.clone().unwrap_or_default());
                            let t = Transcript { nonce_d: &d, nonce_p: p, hello: &h };
                            let mac = if honest { key.ack_mac(&t, mac_d, &body) } else { chunk };
                            let mut out = raw_frame(v1::FrameType::HelloAck, &body);
                            out.extend(frame_bytes(&Frame::HelloProof(v1::HelloProof { mac })));
                            proof = None;
                            out
                        }
                        _ => chunk,
                    },
                    (false, _) => chunk,
                };
                if peer.write_all(&bytes).await.is_err() {
                    break;
                }
                seen.extend(next_frame(&mut peer).await);
            }
            let _ = peer.shutdown().await;
            while let Some(f) = next_frame(&mut peer).await {
                seen.push(f);
            }
            (proof_sent, seen)
        };
        let (authenticated, (proof_sent, rest)) = tokio::join!(side, script);
        if keyed && !connecting {
            for f in rest {
                assert!(
                    matches!(f, Frame::Error(_) | Frame::HelloChallenge(_)) || (honest && proof_sent),
                    "the accepting side answered an unproven peer: {f:?}"
                );
            }
        }
        // Without the key, no peer authenticates to a keyed side.
        if keyed && !honest {
            assert!(!authenticated, "a peer without the key was authenticated");
        }
    });
});
