//! The value stored under an engine key: a versioned JSON record.

use std::fmt;
use std::net::IpAddr;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::error::{NameError, RecordError};
use crate::names::{AgentName, TransportName};

/// The record format version this build writes and reads.
pub const RECORD_VERSION: u64 = 1;
/// Values longer than this are refused before they are parsed.
pub const MAX_RECORD_LEN: usize = 4096;
/// The most transports a record may list.
pub const MAX_TRANSPORTS: usize = 8;
/// The longest host name (DNS limit).
const MAX_HOST_LEN: usize = 253;

/// The host part of an advertise address: an IP literal or a DNS name.
#[derive(Clone, PartialEq, Eq, Hash)]
pub enum Host {
    /// An IPv4 or IPv6 address.
    Ip(IpAddr),
    /// A DNS name (letters, digits, `-`, `_`, dot-separated labels of at most 63 bytes).
    Name(Arc<str>),
}

impl Host {
    /// Parses an IP literal (IPv6 with or without brackets) or a DNS name.
    pub fn parse(s: &str) -> Result<Self, RecordError> {
        let unbracketed = s.strip_prefix('[').and_then(|s| s.strip_suffix(']'));
        if let Some(inner) = unbracketed {
            return inner
                .parse::<std::net::Ipv6Addr>()
                .map(|ip| Host::Ip(IpAddr::V6(ip)))
                .map_err(|_| RecordError::Address(format!("{s:?} is not an IPv6 address")));
        }
        if let Ok(ip) = s.parse::<IpAddr>() {
            return Ok(Host::Ip(ip));
        }
        let label_ok = |l: &str| {
            !l.is_empty()
                && l.len() <= 63
                && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        };
        if s.is_empty() || s.len() > MAX_HOST_LEN || !s.split('.').all(label_ok) {
            return Err(RecordError::Address(format!("{s:?} is neither an IP address nor a host name")));
        }
        Ok(Host::Name(Arc::from(s)))
    }
}

impl fmt::Display for Host {
    /// The host as written in JSON: IPv6 without brackets.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Host::Ip(ip) => write!(f, "{ip}"),
            Host::Name(name) => f.write_str(name),
        }
    }
}

impl fmt::Debug for Host {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{self}")
    }
}

/// Where decode agents connect to an engine rank: host and port, kept apart so IPv6 needs
/// no bracket parsing in the stored value.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct AdvertiseAddr {
    /// The host.
    pub host: Host,
    /// The TCP port (never 0).
    pub port: u16,
}

impl AdvertiseAddr {
    /// An address from its parts; port 0 is refused (nobody can connect to it).
    pub fn new(host: Host, port: u16) -> Result<Self, RecordError> {
        if port == 0 {
            return Err(RecordError::Address("port 0".into()));
        }
        Ok(Self { host, port })
    }

    /// The address of a bound socket, e.g. a listener's `local_addr()`. An unspecified IP
    /// (`0.0.0.0`, `::`) is refused: others cannot connect to it, advertise a real one.
    pub fn from_socket_addr(addr: std::net::SocketAddr) -> Result<Self, RecordError> {
        if addr.ip().is_unspecified() {
            return Err(RecordError::Address(format!(
                "{addr} is unspecified; advertise a reachable address"
            )));
        }
        Self::new(Host::Ip(addr.ip()), addr.port())
    }
}

impl std::str::FromStr for AdvertiseAddr {
    type Err = RecordError;
    /// Parses `host:port`, `1.2.3.4:port` or `[v6]:port`.
    fn from_str(s: &str) -> Result<Self, RecordError> {
        let (host, port) =
            s.rsplit_once(':').ok_or_else(|| RecordError::Address(format!("{s:?} has no port")))?;
        if host.contains(':') && !host.starts_with('[') {
            return Err(RecordError::Address(format!("{s:?}: write an IPv6 address as [addr]:port")));
        }
        let port = port.parse::<u16>().map_err(|_| RecordError::Address(format!("{s:?} has a bad port")))?;
        Self::new(Host::parse(host)?, port)
    }
}

impl fmt::Display for AdvertiseAddr {
    /// `host:port`, with brackets around an IPv6 host: what `TcpStream::connect` takes.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.host {
            Host::Ip(IpAddr::V6(ip)) => write!(f, "[{ip}]:{}", self.port),
            host => write!(f, "{host}:{}", self.port),
        }
    }
}

impl fmt::Debug for AdvertiseAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{self}")
    }
}

/// What one engine rank publishes about itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineRecord {
    /// Where to connect.
    pub addr: AdvertiseAddr,
    /// The data paths it serves, best first as the agent sees it.
    pub transports: Vec<TransportName>,
    /// The compatibility hash of its KV layout (`BlockLayout::compat_hash`).
    pub compat_hash: u64,
    /// The wire protocol version it speaks (`kvxfer_proto::PROTOCOL_VERSION`).
    pub protocol_version: u32,
    /// Random per agent process: a different value under the same key is a restarted agent.
    /// 0 means "not stated" (never equal to a real one: agents draw a nonzero value).
    pub incarnation: u64,
    /// The agent's name, for logs.
    pub agent: AgentName,
    /// Draining: the engine takes no new hand-offs (its leases are refused) while the ones
    /// it made are still pulled. Routers stop sending it prefills; connections to it stay
    /// good. Written as `"draining":true`, and left out when false.
    pub draining: bool,
}

/// The JSON shape of version 1. Unknown fields are ignored (later additions within a
/// version must be optional); a breaking change bumps `v`.
#[derive(Serialize, Deserialize)]
struct WireV1 {
    v: u64,
    addr: WireAddr,
    transports: Vec<String>,
    compat_hash: String,
    protocol_version: u32,
    incarnation: String,
    #[serde(default)]
    agent: String,
    #[serde(default, skip_serializing_if = "is_false")]
    draining: bool,
}

fn is_false(b: &bool) -> bool {
    !*b
}

#[derive(Serialize, Deserialize)]
struct WireAddr {
    host: String,
    port: u16,
}

/// Only the version, read first so a newer format fails as "unsupported version", not as
/// whatever field it changed.
#[derive(Deserialize)]
struct Envelope {
    v: u64,
}

fn hex16(field: &'static str, value: &str) -> Result<u64, RecordError> {
    let bad = || RecordError::Hex { field, value: value.chars().take(40).collect() };
    if value.len() != 16 || !value.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(bad());
    }
    u64::from_str_radix(value, 16).map_err(|_| bad())
}

fn field(field: &'static str) -> impl Fn(NameError) -> RecordError {
    move |source| RecordError::Field { field, source }
}

impl EngineRecord {
    /// The stored value: compact JSON of the current version.
    pub fn to_json(&self) -> Vec<u8> {
        let wire = WireV1 {
            v: RECORD_VERSION,
            addr: WireAddr { host: self.addr.host.to_string(), port: self.addr.port },
            transports: self.transports.iter().map(|t| t.as_str().to_owned()).collect(),
            compat_hash: format!("{:016x}", self.compat_hash),
            protocol_version: self.protocol_version,
            incarnation: format!("{:016x}", self.incarnation),
            agent: self.agent.as_str().to_owned(),
            draining: self.draining,
        };
        serde_json::to_vec(&wire).expect("a struct of strings and integers always serializes")
    }

    /// Parses a stored value (from etcd: anyone with write access may have put anything).
    pub fn from_json(bytes: &[u8]) -> Result<Self, RecordError> {
        if bytes.len() > MAX_RECORD_LEN {
            return Err(RecordError::TooLarge { len: bytes.len(), max: MAX_RECORD_LEN });
        }
        let envelope: Envelope =
            serde_json::from_slice(bytes).map_err(|e| RecordError::Json(e.to_string()))?;
        if envelope.v != RECORD_VERSION {
            return Err(RecordError::UnsupportedVersion { found: envelope.v, supported: RECORD_VERSION });
        }
        let wire: WireV1 = serde_json::from_slice(bytes).map_err(|e| RecordError::Json(e.to_string()))?;
        if wire.transports.len() > MAX_TRANSPORTS {
            return Err(RecordError::TooManyTransports { count: wire.transports.len(), max: MAX_TRANSPORTS });
        }
        let transports = wire
            .transports
            .iter()
            .map(|t| TransportName::new(t))
            .collect::<Result<Vec<_>, _>>()
            .map_err(field("transports"))?;
        Ok(Self {
            addr: AdvertiseAddr::new(Host::parse(&wire.addr.host)?, wire.addr.port)?,
            transports,
            compat_hash: hex16("compat_hash", &wire.compat_hash)?,
            protocol_version: wire.protocol_version,
            incarnation: hex16("incarnation", &wire.incarnation)?,
            agent: AgentName::new(&wire.agent).map_err(field("agent"))?,
            draining: wire.draining,
        })
    }

    /// Whether `other` describes the same agent at the same place — everything but
    /// `draining` equal: connections made for one are good for the other.
    pub fn same_agent(&self, other: &EngineRecord) -> bool {
        let Self { addr, transports, compat_hash, protocol_version, incarnation, agent, draining: _ } = self;
        *addr == other.addr
            && *transports == other.transports
            && *compat_hash == other.compat_hash
            && *protocol_version == other.protocol_version
            && *incarnation == other.incarnation
            && *agent == other.agent
    }

    /// Whether it offers `transport`.
    pub fn offers(&self, transport: &str) -> bool {
        self.transports.iter().any(|t| t.as_str() == transport)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(host: &str) -> EngineRecord {
        EngineRecord {
            addr: AdvertiseAddr::new(Host::parse(host).expect("host"), 5559).expect("addr"),
            transports: vec![TransportName::tcp(), TransportName::ucx()],
            compat_hash: 0x0123_4567_89ab_cdef,
            protocol_version: 2,
            incarnation: 0xfeed_0000_0000_0001,
            agent: AgentName::new("prefill-0").expect("name"),
            draining: false,
        }
    }

    #[test]
    fn round_trips_ipv4_ipv6_and_names() {
        for host in ["10.0.0.7", "::1", "fe80::1:2", "prefill-0.cluster.local"] {
            let r = record(host);
            let json = r.to_json();
            assert_eq!(EngineRecord::from_json(&json), Ok(r.clone()), "{}", String::from_utf8_lossy(&json));
        }
        let v6 = record("::1");
        assert_eq!(v6.addr.to_string(), "[::1]:5559");
        let json = String::from_utf8(v6.to_json()).expect("utf8");
        assert!(json.contains(r#""host":"::1""#), "{json}");
        assert!(json.contains(r#""incarnation":"feed000000000001""#), "{json}");
        assert!(json.contains(r#""compat_hash":"0123456789abcdef""#), "{json}");
    }

    /// `draining` is written only when set (a serving engine's record is what it was), read
    /// back, and ignored by `same_agent`.
    #[test]
    fn draining_is_written_only_when_set() {
        let serving = record("10.0.0.7");
        let json = String::from_utf8(serving.to_json()).expect("utf8");
        assert!(!json.contains("draining"), "{json}");
        let draining = EngineRecord { draining: true, ..serving.clone() };
        let json = draining.to_json();
        assert!(String::from_utf8_lossy(&json).contains(r#""draining":true"#));
        assert_eq!(EngineRecord::from_json(&json), Ok(draining.clone()));
        assert!(serving.same_agent(&draining) && serving != draining);
        let moved = EngineRecord { incarnation: 2, ..serving.clone() };
        assert!(!serving.same_agent(&moved));
    }

    #[test]
    fn addresses_parse_like_connect_strings() {
        assert_eq!("[::1]:80".parse::<AdvertiseAddr>().expect("v6").to_string(), "[::1]:80");
        assert_eq!("1.2.3.4:80".parse::<AdvertiseAddr>().expect("v4").to_string(), "1.2.3.4:80");
        assert_eq!("host-a:80".parse::<AdvertiseAddr>().expect("name").to_string(), "host-a:80");
        assert!("::1:80".parse::<AdvertiseAddr>().is_err());
        assert!("host:0".parse::<AdvertiseAddr>().is_err());
        assert!("host".parse::<AdvertiseAddr>().is_err());
        assert!("bad host:1".parse::<AdvertiseAddr>().is_err());
        assert!(AdvertiseAddr::from_socket_addr("0.0.0.0:80".parse().expect("sa")).is_err());
    }

    #[test]
    fn foreign_values_are_refused_with_a_reason() {
        let ok = String::from_utf8(record("10.0.0.7").to_json()).expect("utf8");
        type Check = fn(&RecordError) -> bool;
        let cases: Vec<(String, Check)> = vec![
            ("not json".into(), |e| matches!(e, RecordError::Json(_))),
            ("".into(), |e| matches!(e, RecordError::Json(_))),
            (ok.replace(r#""v":1"#, r#""v":2"#), |e| {
                matches!(e, RecordError::UnsupportedVersion { found: 2, .. })
            }),
            (ok.replace(r#""v":1,"#, ""), |e| matches!(e, RecordError::Json(_))),
            (ok.replace("feed000000000001", "feed"), |e| {
                matches!(e, RecordError::Hex { field: "incarnation", .. })
            }),
            (ok.replace("0123456789abcdef", "0123456789abcdeg"), |e| matches!(e, RecordError::Hex { .. })),
            (ok.replace("10.0.0.7", "10.0.0.7:1"), |e| matches!(e, RecordError::Address(_))),
            (ok.replace("5559", "0"), |e| matches!(e, RecordError::Address(_))),
            (ok.replace("5559", "70000"), |e| matches!(e, RecordError::Json(_))),
            (ok.replace(r#""ucx""#, r#""UCX""#), |e| {
                matches!(e, RecordError::Field { field: "transports", .. })
            }),
            (ok.replace(r#"["tcp","ucx"]"#, &format!("[{}]", [r#""tcp""#; 9].join(","))), |e| {
                matches!(e, RecordError::TooManyTransports { count: 9, .. })
            }),
            (format!("{:width$}", ok, width = MAX_RECORD_LEN + 1), |e| {
                matches!(e, RecordError::TooLarge { .. })
            }),
        ];
        for (value, expected) in cases {
            match EngineRecord::from_json(value.as_bytes()) {
                Err(e) => assert!(expected(&e), "{value:?} gave {e:?}"),
                Ok(r) => panic!("{value:?} parsed as {r:?}"),
            }
        }
    }

    #[test]
    fn unknown_fields_are_ignored_within_a_version() {
        let ok = String::from_utf8(record("10.0.0.7").to_json()).expect("utf8");
        let extended = ok.replacen('{', r#"{"zone":"eu-1","weights":[1,2],"#, 1);
        assert_eq!(EngineRecord::from_json(extended.as_bytes()), Ok(record("10.0.0.7")));
    }

    proptest::proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..512)) {
            let _ = EngineRecord::from_json(&bytes);
        }

        #[test]
        fn mutated_records_never_panic(pos in 0usize..200, byte in proptest::prelude::any::<u8>()) {
            let mut json = record("fe80::1").to_json();
            let at = pos % json.len();
            json[at] = byte;
            let _ = EngineRecord::from_json(&json);
        }
    }
}
