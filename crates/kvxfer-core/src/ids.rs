//! Request ids and lease tokens.

use std::fmt;

use rand::RngCore;

use crate::error::HandoffError;

/// The request id vLLM gives child `index` of parent `parent` under parallel sampling
/// (`"{index}_{parent}"`); a parent with `n == 1` is not forked and keeps its own id.
pub fn child_request_id(parent: &str, index: u32, n: u32) -> String {
    if n == 1 {
        parent.to_owned()
    } else {
        format!("{index}_{parent}")
    }
}

/// An unguessable 128-bit lease token. Compared in constant time; shown in hex.
#[derive(Clone, Copy)]
pub struct LeaseToken([u8; 16]);

impl LeaseToken {
    /// Byte length of a token on the wire.
    pub const LEN: usize = 16;

    /// A fresh token from a cryptographically secure generator.
    pub fn generate<R: RngCore + rand::CryptoRng>(rng: &mut R) -> Self {
        let mut bytes = [0u8; 16];
        rng.fill_bytes(&mut bytes);
        LeaseToken(bytes)
    }

    /// The token's bytes.
    pub fn as_bytes(&self) -> &[u8; 16] {
        &self.0
    }

    /// Parses a token from its 16 wire bytes.
    pub fn from_wire(bytes: &[u8]) -> Result<Self, HandoffError> {
        let arr: [u8; 16] = bytes.try_into().map_err(|_| HandoffError::BadTokenLength(bytes.len()))?;
        Ok(LeaseToken(arr))
    }

    /// Parses a token from 32 hex digits.
    pub fn from_hex(s: &str) -> Result<Self, HandoffError> {
        let bad = || HandoffError::BadTokenHex(s.chars().take(40).collect());
        if s.len() != 32 || !s.is_ascii() {
            return Err(bad());
        }
        let mut out = [0u8; 16];
        for (i, byte) in out.iter_mut().enumerate() {
            *byte = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).map_err(|_| bad())?;
        }
        Ok(LeaseToken(out))
    }

    /// Lower-case hex, 32 digits.
    pub fn to_hex(&self) -> String {
        use fmt::Write;
        let mut s = String::with_capacity(32);
        for b in self.0 {
            let _ = write!(s, "{b:02x}");
        }
        s
    }

    /// Constant-time comparison against wire bytes of any length.
    pub fn matches(&self, other: &[u8]) -> bool {
        if other.len() != 16 {
            return false;
        }
        let mut diff = 0u8;
        for (a, b) in self.0.iter().zip(other) {
            diff |= a ^ b;
        }
        diff == 0
    }
}

impl PartialEq for LeaseToken {
    fn eq(&self, other: &Self) -> bool {
        self.matches(&other.0)
    }
}
impl Eq for LeaseToken {}

impl fmt::Debug for LeaseToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never print a whole token into logs: the first 4 hex digits identify it enough.
        write!(f, "LeaseToken({}…)", &self.to_hex()[..4])
    }
}

/// 64-bit FNV-1a: stable across builds and platforms, used for compatibility hashes and
/// for picking a lease shard (the per-shard map itself uses a keyed hasher).
pub(crate) fn fnv1a(bytes: &[u8], mut h: u64) -> u64 {
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// FNV-1a's offset basis.
pub(crate) const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn child_ids_follow_vllm() {
        assert_eq!(child_request_id("R", 1, 3), "1_R");
        assert_eq!(child_request_id("R", 0, 1), "R");
    }

    #[test]
    fn token_hex_round_trip_and_compare() {
        let mut rng = rand_chacha::ChaCha12Rng::from_seed([7; 32]);
        let t = LeaseToken::generate(&mut rng);
        let back = LeaseToken::from_hex(&t.to_hex()).expect("hex parses");
        assert_eq!(t, back);
        assert!(t.matches(t.as_bytes()));
        assert!(!t.matches(&t.as_bytes()[..15]));
        let mut other = *t.as_bytes();
        other[15] ^= 1;
        assert!(!t.matches(&other));
        assert!(LeaseToken::from_hex("zz").is_err());
        assert!(LeaseToken::from_hex(&"g".repeat(32)).is_err());
        assert!(LeaseToken::from_wire(&[0; 15]).is_err());
        assert!(!format!("{t:?}").contains(&t.to_hex()));
    }

    use rand::SeedableRng;
}
