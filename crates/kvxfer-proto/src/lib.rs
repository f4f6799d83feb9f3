//! The kvxfer wire protocol: prost types generated at build time from
//! `proto/kvxfer/v1/kvxfer.proto`, the only definition of the wire format.
#![forbid(unsafe_code)]

/// Version 1 of the protocol.
pub mod v1 {
    #![allow(missing_docs, unreachable_pub, clippy::all, clippy::pedantic)]
    include!(concat!(env!("OUT_DIR"), "/kvxfer.v1.rs"));
}

pub use prost::Message;

/// The protocol version carried in every handshake (2: authenticated handshake, incarnations,
/// idempotent endings; 3: the connecting side proves the key first, and the accepting side's
/// MAC covers the whole transcript including its `HelloAck`).
pub const PROTOCOL_VERSION: u32 = 3;
