//! The cluster key: loading it (bytes, hex, a file, the environment) and keeping it secret
//! (never printed, wiped when dropped). Below `context` (which holds the agent's key) and
//! `handshake` (which computes its MACs under it, and re-exports this module's items).

use std::sync::Arc;

use zeroize::Zeroizing;

/// Shortest cluster key accepted, in bytes.
pub const MIN_KEY_LEN: usize = 16;
/// Environment variable holding the cluster key as hex (at least 32 hex digits).
pub const CLUSTER_KEY_ENV: &str = "KVXFER_CLUSTER_KEY";
/// Environment variable naming a file that holds the cluster key as hex (whitespace ignored).
pub const CLUSTER_KEY_FILE_ENV: &str = "KVXFER_CLUSTER_KEY_FILE";

/// The secret every agent of one cluster shares; peers prove they hold it in the handshake.
/// Never printed (its `Debug` shows no byte of it), wiped from memory when the last clone
/// is dropped.
#[derive(Clone)]
pub struct ClusterKey(pub(crate) Arc<Zeroizing<Vec<u8>>>);

impl std::fmt::Debug for ClusterKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClusterKey(<redacted>)")
    }
}

/// Why a cluster key could not be loaded. Messages never contain key material.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// Fewer than [`MIN_KEY_LEN`] bytes.
    #[error("a cluster key needs at least {MIN_KEY_LEN} bytes ({} hex digits); this one has {len}", MIN_KEY_LEN * 2)]
    TooShort {
        /// Bytes given.
        len: usize,
    },
    /// Not an even number of hex digits.
    #[error("the cluster key from {source_name} is not hex")]
    NotHex {
        /// Where it came from (an environment variable or a file path).
        source_name: String,
    },
    /// Both [`CLUSTER_KEY_ENV`] and [`CLUSTER_KEY_FILE_ENV`] are set.
    #[error("both {CLUSTER_KEY_ENV} and {CLUSTER_KEY_FILE_ENV} are set; set one")]
    BothSet,
    /// The key file could not be read.
    #[error("reading the cluster key file {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
}

impl ClusterKey {
    /// A key of these bytes (at least [`MIN_KEY_LEN`]).
    pub fn from_bytes(bytes: impl Into<Vec<u8>>) -> Result<Self, KeyError> {
        let bytes = Zeroizing::new(bytes.into());
        if bytes.len() < MIN_KEY_LEN {
            return Err(KeyError::TooShort { len: bytes.len() });
        }
        Ok(ClusterKey(Arc::new(bytes)))
    }

    /// A key from hex text (surrounding whitespace ignored).
    pub fn from_hex(text: &str) -> Result<Self, KeyError> {
        Self::from_hex_named(text, "hex text")
    }

    fn from_hex_named(text: &str, source_name: &str) -> Result<Self, KeyError> {
        let bytes = Zeroizing::new(
            hex::decode(text.trim()).map_err(|_| KeyError::NotHex { source_name: source_name.to_owned() })?,
        );
        Self::from_bytes(bytes.to_vec())
    }

    /// A key from a file holding it as hex.
    pub fn from_file(path: impl AsRef<std::path::Path>) -> Result<Self, KeyError> {
        let path = path.as_ref();
        let name = path.display().to_string();
        let text = Zeroizing::new(
            std::fs::read_to_string(path).map_err(|source| KeyError::Read { path: name.clone(), source })?,
        );
        Self::from_hex_named(&text, &name)
    }

    /// The key configured in the environment: hex in [`CLUSTER_KEY_ENV`], or a file named by
    /// [`CLUSTER_KEY_FILE_ENV`]; `None` when neither is set (the agent then runs without
    /// authentication).
    pub fn from_env() -> Result<Option<Self>, KeyError> {
        let inline = std::env::var_os(CLUSTER_KEY_ENV).filter(|v| !v.is_empty());
        let file = std::env::var_os(CLUSTER_KEY_FILE_ENV).filter(|v| !v.is_empty());
        match (inline, file) {
            (Some(_), Some(_)) => Err(KeyError::BothSet),
            (Some(v), None) => {
                let text = Zeroizing::new(
                    v.into_string()
                        .map_err(|_| KeyError::NotHex { source_name: CLUSTER_KEY_ENV.to_owned() })?,
                );
                Self::from_hex_named(&text, CLUSTER_KEY_ENV).map(Some)
            }
            (None, Some(path)) => Self::from_file(path).map(Some),
            (None, None) => Ok(None),
        }
    }

    /// A fresh random 32-byte key (for processes that run every agent of their cluster
    /// themselves, such as the loopback example).
    pub fn generate() -> Self {
        let mut bytes = Zeroizing::new(vec![0u8; 32]);
        rand::fill(&mut bytes[..]);
        ClusterKey(Arc::new(bytes))
    }
}
