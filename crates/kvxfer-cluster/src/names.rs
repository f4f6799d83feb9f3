//! Names that become parts of etcd keys or values, checked once when they are made.

use std::fmt;
use std::sync::Arc;

use crate::error::NameError;

/// The key layout version, the path segment after the namespace.
pub const KEY_LAYOUT: &str = "v1";

/// Checks a name made of printable ASCII other than `/` (so it is one key segment).
fn check_segment(what: &'static str, value: &str, max: usize) -> Result<(), NameError> {
    if value.is_empty() || value.len() > max {
        return Err(NameError::Length { what, len: value.len(), max });
    }
    if value == "." || value == ".." {
        return Err(NameError::Reserved { what, value: value.to_owned() });
    }
    if let Some(ch) = value.chars().find(|c| !c.is_ascii_graphic() || *c == '/') {
        return Err(NameError::Character {
            what,
            value: value.to_owned(),
            ch,
            allowed: "printable ASCII without spaces or '/'",
        });
    }
    Ok(())
}

macro_rules! segment_name {
    ($(#[$doc:meta])* $name:ident, $what:literal, $max:expr) => {
        $(#[$doc])*
        #[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name(Arc<str>);

        impl $name {
            /// The longest accepted value, in bytes.
            pub const MAX_LEN: usize = $max;

            /// Checks `value` (printable ASCII, no spaces, no `/`, not `.` or `..`).
            pub fn new(value: &str) -> Result<Self, NameError> {
                check_segment($what, value, Self::MAX_LEN)?;
                Ok(Self(Arc::from(value)))
            }

            /// The name.
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Debug::fmt(&*self.0, f)
            }
        }

        impl std::borrow::Borrow<str> for $name {
            fn borrow(&self) -> &str {
                &self.0
            }
        }

        impl std::str::FromStr for $name {
            type Err = NameError;
            fn from_str(s: &str) -> Result<Self, NameError> {
                Self::new(s)
            }
        }
    };
}

segment_name!(
    /// The first key segment: one deployment's engines (several can share an etcd).
    Namespace,
    "namespace",
    64
);
segment_name!(
    /// An engine id as it appears in hand-offs (`remote_engine_id`), e.g. a UUID.
    EngineId,
    "engine id",
    128
);

/// A transport an agent offers, as a short lowercase token (`tcp`, `ucx`, `rdma`, ...).
/// Unknown tokens are kept, so a newer agent's offer does not make a record unreadable.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TransportName(Arc<str>);

impl TransportName {
    /// The longest accepted token.
    pub const MAX_LEN: usize = 16;

    /// The TCP data path.
    pub fn tcp() -> Self {
        Self(Arc::from("tcp"))
    }

    /// The UCX data path.
    pub fn ucx() -> Self {
        Self(Arc::from("ucx"))
    }

    /// Checks a token: 1..=16 of `a-z`, `0-9`, `_`, `-`.
    pub fn new(value: &str) -> Result<Self, NameError> {
        const WHAT: &str = "transport";
        if value.is_empty() || value.len() > Self::MAX_LEN {
            return Err(NameError::Length { what: WHAT, len: value.len(), max: Self::MAX_LEN });
        }
        if let Some(ch) =
            value.chars().find(|c| !(c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_' || *c == '-'))
        {
            return Err(NameError::Character {
                what: WHAT,
                value: value.to_owned(),
                ch,
                allowed: "a-z, 0-9, '_', '-'",
            });
        }
        Ok(Self(Arc::from(value)))
    }

    /// The token.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for TransportName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for TransportName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

/// An agent's human-readable name (for logs): up to 128 bytes, no control characters.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct AgentName(Arc<str>);

impl AgentName {
    /// The longest accepted name, in bytes.
    pub const MAX_LEN: usize = 128;

    /// Checks a name: 0..=128 bytes without control characters.
    pub fn new(value: &str) -> Result<Self, NameError> {
        if value.len() > Self::MAX_LEN {
            return Err(NameError::Length { what: "agent name", len: value.len(), max: Self::MAX_LEN });
        }
        if let Some(ch) = value.chars().find(|c| c.is_control()) {
            return Err(NameError::Character {
                what: "agent name",
                value: value.to_owned(),
                ch,
                allowed: "no control characters",
            });
        }
        Ok(Self(Arc::from(value)))
    }

    /// The name.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for AgentName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for AgentName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

/// Where one engine rank registers: `/<namespace>/v1/engines/<engine_id>/<rank>`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct EngineKey {
    /// The deployment.
    pub namespace: Namespace,
    /// The engine.
    pub engine_id: EngineId,
    /// The rank within the engine (tensor-parallel worker index).
    pub rank: u32,
}

impl EngineKey {
    /// The key of `engine_id`'s rank `rank` in `namespace`.
    pub fn new(namespace: Namespace, engine_id: EngineId, rank: u32) -> Self {
        Self { namespace, engine_id, rank }
    }

    /// The etcd key.
    pub fn to_key(&self) -> String {
        format!("{}{}/{}", engines_prefix(&self.namespace), self.engine_id, self.rank)
    }

    /// The etcd key that drains this rank's whole engine while it exists:
    /// `/<namespace>/v1/drain/<engine_id>` ([`drain_key`]).
    pub fn drain_key(&self) -> String {
        drain_key(&self.namespace, &self.engine_id)
    }

    /// Parses a key found under `engines_prefix(namespace)`: exactly `<engine_id>/<rank>`
    /// follows the prefix, with a canonical decimal rank.
    pub fn parse(namespace: &Namespace, key: &[u8]) -> Result<Self, NameError> {
        let bad = |reason| NameError::Key { key: String::from_utf8_lossy(key).into_owned(), reason };
        let prefix = engines_prefix(namespace);
        let rest = key.strip_prefix(prefix.as_bytes()).ok_or_else(|| bad("outside the prefix"))?;
        let rest = std::str::from_utf8(rest).map_err(|_| bad("not UTF-8"))?;
        let (engine, rank) = rest.split_once('/').ok_or_else(|| bad("no rank"))?;
        let engine_id = EngineId::new(engine).map_err(|_| bad("bad engine id"))?;
        let canonical = rank == "0" || (!rank.starts_with('0') && rank.bytes().all(|b| b.is_ascii_digit()));
        if !canonical {
            return Err(bad("rank is not a canonical decimal number"));
        }
        let rank = rank.parse::<u32>().map_err(|_| bad("rank out of range"))?;
        Ok(Self { namespace: namespace.clone(), engine_id, rank })
    }
}

/// The full etcd key, namespace included ([`EngineKey::to_key`]): every log line names a
/// key this one way.
impl fmt::Display for EngineKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}/{}", engines_prefix(&self.namespace), self.engine_id, self.rank)
    }
}

/// The prefix every engine key of `namespace` starts with: `/<namespace>/v1/engines/`.
pub fn engines_prefix(namespace: &Namespace) -> String {
    format!("/{namespace}/{KEY_LAYOUT}/engines/")
}

/// The key an operator puts (any value) to drain every rank of `engine_id`, and deletes to
/// undrain it: `/<namespace>/v1/drain/<engine_id>`. Outside the engines prefix, so a
/// directory never reads it as an engine.
pub fn drain_key(namespace: &Namespace, engine_id: &EngineId) -> String {
    format!("/{namespace}/{KEY_LAYOUT}/drain/{engine_id}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ns() -> Namespace {
        Namespace::new("prod").expect("valid")
    }

    #[test]
    fn key_round_trips() {
        let key = EngineKey::new(ns(), EngineId::new("75192ab7-d1c6-48cf").expect("valid"), 3);
        assert_eq!(key.to_key(), "/prod/v1/engines/75192ab7-d1c6-48cf/3");
        assert_eq!(EngineKey::parse(&ns(), key.to_key().as_bytes()), Ok(key));
    }

    /// Logs name a key one way, the full key (`registered in etcd` wrote it with the
    /// namespace, `etcd registration revoked` and the directory's lines without).
    #[test]
    fn a_key_is_displayed_as_the_full_etcd_key() {
        let key = EngineKey::new(ns(), EngineId::new("e").expect("valid"), 0);
        assert_eq!(key.to_string(), key.to_key());
        assert_eq!(key.to_string(), "/prod/v1/engines/e/0");
    }

    #[test]
    fn bad_keys_are_refused() {
        for key in [
            &b"/prod/v1/engines/e"[..],
            b"/prod/v1/engines/e/",
            b"/prod/v1/engines/e/01",
            b"/prod/v1/engines/e/-1",
            b"/prod/v1/engines/e/4294967296",
            b"/prod/v1/engines/e/1/extra",
            b"/prod/v1/engines//1",
            b"/prod/v1/engines/../1",
            b"/prod/v1/engines/e\xff/1",
            b"/prod/v1/engines/e f/1",
            b"/other/v1/engines/e/1",
        ] {
            assert!(EngineKey::parse(&ns(), key).is_err(), "{:?}", String::from_utf8_lossy(key));
        }
        assert!(EngineKey::parse(&ns(), b"/prod/v1/engines/e/4294967295").is_ok());
    }

    #[test]
    fn names_are_checked() {
        assert!(Namespace::new("").is_err());
        assert!(Namespace::new("a/b").is_err());
        assert!(Namespace::new("..").is_err());
        assert!(Namespace::new(&"n".repeat(65)).is_err());
        assert!(EngineId::new("engine-0:tp@host").is_ok());
        assert!(EngineId::new("tab\tinside").is_err());
        assert!(TransportName::new("ucx").is_ok());
        assert!(TransportName::new("UCX").is_err());
        assert!(TransportName::new("").is_err());
        assert!(AgentName::new("prefill 0 (host a)").is_ok());
        assert!(AgentName::new("bell\u{7}").is_err());
    }
}
