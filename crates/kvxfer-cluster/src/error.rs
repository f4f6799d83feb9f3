//! Errors: one `#[non_exhaustive]` top-level [`Error`] wrapping narrow enums.

use std::time::Duration;

/// Everything that can go wrong in this crate.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A name (namespace, engine id, agent name, transport) or key is not acceptable.
    #[error(transparent)]
    Name(#[from] NameError),
    /// A value under the namespace is not an engine record this version understands.
    #[error(transparent)]
    Record(#[from] RecordError),
    /// Talking to etcd failed.
    #[error(transparent)]
    Etcd(#[from] EtcdError),
    /// A setting is out of range.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The metrics endpoint failed.
    #[error(transparent)]
    Metrics(#[from] MetricsError),
    /// An engine named by a hand-off cannot be pulled from.
    #[error(transparent)]
    Resolve(#[from] ResolveError),
    /// A registration gave up for a reason retrying cannot mend.
    #[error(transparent)]
    Registration(#[from] RegistrationError),
}

/// Why a registration gave up for good (its state is then [`crate::EtcdState::Failed`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RegistrationError {
    /// Another live process holds this engine rank's key: two processes registered the same
    /// engine id and rank. The one that came second is refused; the first keeps its key.
    #[error(
        "engine rank {key} is already registered by a live process ({holder}; its lease {lease:x} is \
         being kept alive): two processes cannot share an engine id and rank, so this one is not \
         registered. Stop the other process or give this one another engine id (a restart after a \
         crash waits for the old key's lease to expire instead)"
    )]
    EngineTaken {
        /// The key.
        key: String,
        /// Who holds it: the incarnation and address of its record.
        holder: String,
        /// The holder's etcd lease.
        lease: i64,
    },
    /// etcd refused this client for a reason retrying cannot mend: wrong user name or
    /// password, credentials missing while etcd has authentication on, a role without access
    /// to the namespace, or a certificate etcd or this client does not trust.
    #[error(
        "etcd refused this client: {reason}. Check the etcd user and password, its role's \
         permissions on the namespace prefix, and the TLS certificates; nothing is retried"
    )]
    Refused {
        /// etcd's (or the TLS layer's) answer.
        reason: String,
    },
    /// The key holds a value on no lease (written by hand): it never expires, so waiting for
    /// it cannot help.
    #[error(
        "engine rank {key} holds a value on no etcd lease ({holder}), which never expires: this process \
         is not registered. Delete the key (etcdctl del {key}) if no process owns it"
    )]
    HeldWithoutLease {
        /// The key.
        key: String,
        /// What it holds.
        holder: String,
    },
}

/// Why the directory cannot give a usable address for an engine rank.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ResolveError {
    /// The directory has not listed etcd yet (it says nothing about the engine).
    #[error("the engine directory has not listed etcd yet; {engine}/{rank} is unknown so far")]
    NotSynced {
        /// The engine id.
        engine: String,
        /// The rank.
        rank: u32,
    },
    /// No such engine rank is registered (never was, shut down, or its lease expired).
    #[error("engine {engine} rank {rank} is not registered (shut down, crashed, or never started)")]
    NotRegistered {
        /// The engine id.
        engine: String,
        /// The rank.
        rank: u32,
    },
    /// Registered, but by another process than the one that issued the hand-off.
    #[error(
        "engine {engine} rank {rank} restarted: the hand-off is from incarnation {handoff:016x}, \
         the registered one is {registered:016x}"
    )]
    StaleIncarnation {
        /// The engine id.
        engine: String,
        /// The rank.
        rank: u32,
        /// The incarnation the hand-off names.
        handoff: u64,
        /// The incarnation registered now.
        registered: u64,
    },
    /// The incarnation that issued the hand-off was seen to leave etcd (deregistered, its
    /// lease expired after a crash, or replaced by a restart) and is not registered again.
    #[error(
        "engine {engine} incarnation {incarnation:016x} left etcd (deregistered, its lease expired after a \
         crash, or replaced by a restart): its leases are gone"
    )]
    Gone {
        /// The engine id.
        engine: String,
        /// The incarnation the hand-off names.
        incarnation: u64,
    },
}

/// A name or key that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum NameError {
    /// Empty, or longer than allowed.
    #[error("{what} must be 1..={max} bytes long, got {len}")]
    Length {
        /// What was being named.
        what: &'static str,
        /// Its length.
        len: usize,
        /// The longest allowed.
        max: usize,
    },
    /// A character that is not allowed.
    #[error("{what} {value:?} contains {ch:?}, which is not allowed ({allowed})")]
    Character {
        /// What was being named.
        what: &'static str,
        /// The rejected value (escaped when printed).
        value: String,
        /// The first rejected character.
        ch: char,
        /// What is allowed, in words.
        allowed: &'static str,
    },
    /// `.` and `..` would read as path steps.
    #[error("{what} cannot be {value:?}")]
    Reserved {
        /// What was being named.
        what: &'static str,
        /// The rejected value.
        value: String,
    },
    /// A key under the engines prefix that is not `<engine_id>/<rank>`.
    #[error("key {key:?} is not <prefix><engine_id>/<rank>: {reason}")]
    Key {
        /// The key, lossily decoded.
        key: String,
        /// What is wrong with it.
        reason: &'static str,
    },
}

/// A value that is not an engine record this version understands.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RecordError {
    /// Larger than any record this version writes.
    #[error("record of {len} bytes exceeds the {max}-byte limit")]
    TooLarge {
        /// Its length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// Not JSON, or not the JSON of a record (the parser's message).
    #[error("record is not valid JSON for its version: {0}")]
    Json(String),
    /// A record format version this build does not read.
    #[error("record format version {found} is not supported (this build reads {supported})")]
    UnsupportedVersion {
        /// The version found.
        found: u64,
        /// The version this build reads.
        supported: u64,
    },
    /// A hex field that is not 16 hex digits.
    #[error("{field} must be 16 hex digits, got {value:?}")]
    Hex {
        /// The field.
        field: &'static str,
        /// What it held.
        value: String,
    },
    /// An advertise address that cannot be connected to.
    #[error("bad advertise address: {0}")]
    Address(String),
    /// A field that breaks a name rule.
    #[error("bad {field}: {source}")]
    Field {
        /// The field.
        field: &'static str,
        /// Why.
        source: NameError,
    },
    /// More transports than a record may list.
    #[error("{count} transports listed, at most {max} allowed")]
    TooManyTransports {
        /// How many were listed.
        count: usize,
        /// The limit.
        max: usize,
    },
}

/// Which etcd operation failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum EtcdOp {
    /// Creating the client.
    Connect,
    /// Granting a lease.
    Grant,
    /// Asking for a lease's remaining time.
    TimeToLive,
    /// Writing the registration.
    Put,
    /// Keeping a lease alive.
    KeepAlive,
    /// Revoking a lease.
    Revoke,
    /// Listing the engines.
    List,
    /// Watching the engines.
    Watch,
    /// Checking that a member answers (a linearizable read) before using it.
    Health,
    /// Reading a key.
    Get,
}

impl std::fmt::Display for EtcdOp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            EtcdOp::Connect => "connect",
            EtcdOp::Grant => "lease grant",
            EtcdOp::TimeToLive => "lease time-to-live",
            EtcdOp::Put => "put",
            EtcdOp::KeepAlive => "lease keep-alive",
            EtcdOp::Revoke => "lease revoke",
            EtcdOp::List => "list",
            EtcdOp::Watch => "watch",
            EtcdOp::Health => "health check",
            EtcdOp::Get => "get",
        })
    }
}

/// Talking to etcd failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EtcdError {
    /// etcd answered with an error, or the connection failed.
    #[error("etcd {op} failed: {source}")]
    Client {
        /// The operation.
        op: EtcdOp,
        /// The client's error.
        source: etcd_client::Error,
    },
    /// No answer in time (etcd down, unreachable, or overloaded).
    #[error("etcd {op} got no answer within {after:?}")]
    Timeout {
        /// The operation.
        op: EtcdOp,
        /// How long it waited.
        after: Duration,
    },
    /// No endpoint answered a health check (every member down, unreachable, or without a
    /// quorum).
    #[error("no etcd endpoint answered: {tried}")]
    NoEndpoint {
        /// Each endpoint tried, with its failure.
        tried: String,
    },
    /// A stream (watch or keep-alive) ended or was cancelled by etcd.
    #[error("etcd {op} stream ended: {reason}")]
    StreamEnded {
        /// The operation.
        op: EtcdOp,
        /// Why, as far as known.
        reason: String,
    },
}

impl EtcdError {
    /// Whether retrying cannot help: etcd (or TLS) refused this client — wrong credentials,
    /// none given while authentication is on, no permission on the keys, an untrusted
    /// certificate. Unreachable members, timeouts and expired auth tokens are not.
    pub fn is_permanent(&self) -> bool {
        let EtcdError::Client { source, .. } = self else { return false };
        // The whole chain: TLS failures sit in the transport error's sources.
        let mut text = source.to_string();
        let mut cause: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(source);
        while let Some(c) = cause {
            text.push_str(": ");
            text.push_str(&c.to_string());
            cause = c.source();
        }
        // rustls names alerts by their `Debug` form (`BadCertificate`), so both spellings.
        const PERMANENT: [&str; 11] = [
            "authentication failed",
            "user name is empty",
            "user name not found",
            "permission denied",
            "invalid peer certificate",
            "certificate required",
            "certificaterequired",
            "bad certificate",
            "badcertificate",
            "unknown ca",
            "unknownca",
        ];
        // A certificate out of its validity period is a clock or a rotation under way, not
        // a wrong setting: retried.
        const PASSING: [&str; 3] = ["expired", "notvalidyet", "not valid yet"];
        let text = text.to_ascii_lowercase();
        PERMANENT.iter().any(|p| text.contains(p)) && !PASSING.iter().any(|p| text.contains(p))
    }
}

/// A setting out of range.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// No etcd endpoint given.
    #[error("no etcd endpoint given")]
    NoEndpoints,
    /// An etcd endpoint that cannot be used as given.
    #[error("etcd endpoint {endpoint:?}: {reason}")]
    Endpoint {
        /// The endpoint as given.
        endpoint: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A TLS file that cannot be used.
    #[error("etcd TLS {what} {path}: {reason}")]
    TlsFile {
        /// Which file (CA certificate, client certificate, client key).
        what: &'static str,
        /// Its path.
        path: String,
        /// Why.
        reason: String,
    },
    /// Security settings from the environment (`KVXFER_ETCD_*`) that do not fit together,
    /// or an empty user name.
    #[error("etcd security settings: {reason}")]
    Env {
        /// What is wrong.
        reason: String,
    },
    /// A lease TTL etcd would not honour.
    #[error("lease TTL {ttl:?} is out of range ({min}..={max} whole seconds)")]
    LeaseTtl {
        /// The TTL asked for.
        ttl: Duration,
        /// The shortest TTL (etcd's default minimum).
        min: u64,
        /// The longest TTL.
        max: u64,
    },
}

/// The metrics endpoint failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MetricsError {
    /// The listen address could not be bound.
    #[error("cannot listen for /metrics on {addr}: {source}")]
    Bind {
        /// The address.
        addr: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// Encoding the registry failed.
    #[error("encoding the metrics failed")]
    Encode,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn client_error(text: &str) -> EtcdError {
        EtcdError::Client { op: EtcdOp::Connect, source: etcd_client::Error::InvalidArgs(text.to_owned()) }
    }

    /// Review: rustls names TLS alerts by their `Debug` form (`received fatal alert:
    /// BadCertificate`), which the spaced patterns never matched, so a client certificate
    /// etcd does not trust was retried for ever; and a certificate out of its validity
    /// period (a clock at boot, a rotation) is not a wrong setting.
    #[test]
    fn tls_refusals_are_final_but_certificates_out_of_date_are_retried() {
        for text in [
            "transport error: received fatal alert: BadCertificate",
            "transport error: received fatal alert: UnknownCA",
            "transport error: received fatal alert: CertificateRequired",
            "invalid peer certificate: UnknownIssuer",
            "etcdserver: authentication failed, invalid user ID or password",
            "etcdserver: permission denied",
        ] {
            assert!(client_error(text).is_permanent(), "{text}");
        }
        for text in [
            "invalid peer certificate: Expired",
            "invalid peer certificate: NotValidYet",
            "transport error: connection refused",
            "etcdserver: invalid auth token",
        ] {
            assert!(!client_error(text).is_permanent(), "{text}");
        }
    }
}
