//! Logging strings a peer controls.
//!
//! Request ids, consumer ids, agent names and error messages decoded from frames reach the
//! log through [`Peer`]: at most [`MAX_PEER_CHARS`] characters of it are written, control
//! characters, quotes and backslashes escaped (`char::escape_debug`), so a peer can neither
//! forge log lines with a newline nor fill the log with one huge string.
//!
//! Values every log line and output writes the same way: an engine's incarnation through
//! [`Incarnation`].

use std::fmt::{self, Display, Write};

/// Most characters [`Peer`] writes of a peer's string (escapes included), before the
/// ellipsis and the original length.
pub const MAX_PEER_CHARS: usize = 128;

/// A peer-controlled value for a log line: its `Display` output escaped and truncated to
/// [`MAX_PEER_CHARS`] characters; a truncated one ends in `…` and the original length in
/// bytes (`…(1048576 bytes)`). Works on anything `Display` (a `&str`, an error whose message
/// came from the wire).
#[derive(Debug, Clone, Copy)]
pub struct Peer<T>(pub T);

/// An engine process's incarnation as every log line, error and output writes it: 16
/// lower-case hex digits (`00a2c4e6f8091b3d`), as etcd records hold it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Incarnation(pub u64);

impl Display for Incarnation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

/// Escapes and bounds what is written through it, counting the bytes of the original.
struct Bounded<'a, 'b> {
    out: &'a mut fmt::Formatter<'b>,
    written: usize,
    total_bytes: usize,
    truncated: bool,
}

impl Write for Bounded<'_, '_> {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        self.total_bytes += s.len();
        if self.truncated {
            return Ok(());
        }
        for c in s.chars() {
            let escaped = c.escape_debug();
            let len = escaped.len();
            if self.written + len > MAX_PEER_CHARS {
                self.truncated = true;
                return Ok(());
            }
            self.written += len;
            for e in escaped {
                self.out.write_char(e)?;
            }
        }
        Ok(())
    }
}

impl<T: Display> Display for Peer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut w = Bounded { out: f, written: 0, total_bytes: 0, truncated: false };
        write!(w, "{}", self.0)?;
        let (truncated, total) = (w.truncated, w.total_bytes);
        if truncated {
            write!(f, "…({total} bytes)")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn incarnations_are_written_as_16_hex_digits() {
        assert_eq!(Incarnation(0xa2).to_string(), "00000000000000a2");
        assert_eq!(Incarnation(u64::MAX).to_string(), "ffffffffffffffff");
    }

    #[test]
    fn short_strings_are_written_as_they_are() {
        assert_eq!(Peer("req-1/child-0").to_string(), "req-1/child-0");
        assert_eq!(Peer("").to_string(), "");
        assert_eq!(Peer("décodé").to_string(), "décodé");
    }

    #[test]
    fn control_characters_are_escaped() {
        let s = Peer("a\nINFO forged line\r\t\u{1b}[31m\0\"\\").to_string();
        assert_eq!(s, "a\\nINFO forged line\\r\\t\\u{1b}[31m\\0\\\"\\\\");
        assert!(!s.chars().any(char::is_control));
    }

    #[test]
    fn long_strings_are_truncated_with_their_length() {
        let long = "x".repeat(1 << 20);
        let s = Peer(&long).to_string();
        assert_eq!(s, format!("{}…({} bytes)", "x".repeat(MAX_PEER_CHARS), 1 << 20));
        // Exactly the bound is not truncated.
        let exact = "y".repeat(MAX_PEER_CHARS);
        assert_eq!(Peer(&exact).to_string(), exact);
        // Escapes count towards the bound, and one is never cut in half.
        let newlines = "\n".repeat(100);
        let s = Peer(&newlines).to_string();
        assert_eq!(s, format!("{}…(100 bytes)", "\\n".repeat(MAX_PEER_CHARS / 2)));
        assert!(s.chars().count() <= MAX_PEER_CHARS + 20);
    }

    #[test]
    fn any_display_is_bounded() {
        let err = format!("refused: {}", "\n".repeat(1000));
        let s = Peer(format_args!("{err}")).to_string();
        assert!(s.starts_with("refused: \\n"));
        assert!(s.ends_with(&format!("…({} bytes)", err.len())));
        assert!(!s.contains('\n'));
    }
}
