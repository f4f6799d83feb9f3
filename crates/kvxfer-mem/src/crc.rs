//! CRC-32C (Castagnoli), the integrity check of every TCP read and of opt-in UCX
//! verification, computed with `crc-fast`'s carry-less-multiply folding (VPCLMULQDQ /
//! PCLMULQDQ / NEON, chosen at run time): 2x the `crc32c` crate's SSE 4.2 `crc32`
//! instruction loop on the test machine, in cache and from cold memory (BENCHMARKING.md).

use crc_fast::{CrcAlgorithm, Digest};

/// The CRC-32C of `crc`'s bytes followed by `data` (`crc` = 0 for an empty prefix): the
/// same value as `crc32c::crc32c_append`, so either side may compute its part with either.
pub fn crc32c_append(crc: u32, data: &[u8]) -> u32 {
    // The digest's state is the register before the final xor (CRC-32C: init and xorout
    // are both 0xffffffff), so a finished CRC resumes from its complement.
    let mut digest = Digest::new_with_init_state(CrcAlgorithm::Crc32Iscsi, u64::from(!crc));
    digest.update(data);
    // The CRC-32 family's digest fits in 32 bits.
    digest.finalize() as u32
}

/// CRC-32C's polynomial, bit-reflected.
const POLY: u32 = 0x82F6_3B78;

/// `a * b` modulo the polynomial, both reflected (bit 31 is x^0): 32 shift-and-xor steps at
/// most, no table (zlib's `multmodp`, bounded).
const fn multmodp(a: u32, mut b: u32) -> u32 {
    let mut p = 0;
    let mut m = 1u32 << 31;
    while m != 0 {
        if a & m != 0 {
            p ^= b;
        }
        m >>= 1;
        b = if b & 1 != 0 { (b >> 1) ^ POLY } else { b >> 1 };
    }
    p
}

/// `X2N[k]` = x^(2^k) modulo the polynomial (reflected), up to x^(8 * 2^63).
const X2N: [u32; 67] = {
    let mut t = [0u32; 67];
    t[0] = 1 << 30; // x^1
    let mut k = 1;
    while k < 67 {
        t[k] = multmodp(t[k - 1], t[k - 1]);
        k += 1;
    }
    t
};

/// What appending `len` bytes does to a CRC-32C that came before them: multiplying by
/// x^(8 len) modulo the polynomial. Made once per length ([`Crc32cShift::new`], ~log2(len)
/// multiplications) and applied per combination ([`Crc32cShift::combine`], one
/// multiplication: 32 shift-and-xor steps) — the CRC of a payload from stored CRCs of its
/// pieces without reading their bytes again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Crc32cShift(u32);

impl Crc32cShift {
    /// The shift of `len` bytes.
    pub const fn new(len: u64) -> Self {
        // x^(8 len) = product of x^(2^(k+3)) over the set bits k of len.
        let mut p = 1u32 << 31; // x^0
        let (mut n, mut k) = (len, 3);
        while n != 0 {
            if n & 1 != 0 {
                p = multmodp(X2N[k], p);
            }
            n >>= 1;
            k += 1;
        }
        Crc32cShift(p)
    }

    /// The CRC-32C of A followed by B, from `crc_a` (A's CRC, 0 for nothing) and `crc_b`
    /// (B's CRC), this being the shift of B's length: the same value as
    /// `crc32c_append(crc_a, B)`.
    pub const fn combine(self, crc_a: u32, crc_b: u32) -> u32 {
        multmodp(self.0, crc_a) ^ crc_b
    }
}

/// The CRC-32C of A followed by B from their CRCs and B's length (`crc32c::crc32c_combine`'s
/// value; that one squares 32x32 bit matrices per bit of `len_b`, this makes a
/// [`Crc32cShift`]: for many combinations of one length, make the shift once).
pub fn crc32c_combine(crc_a: u32, crc_b: u32, len_b: u64) -> u32 {
    Crc32cShift::new(len_b).combine(crc_a, crc_b)
}

#[cfg(test)]
mod tests {
    use super::{crc32c_append, crc32c_combine, Crc32cShift};

    proptest::proptest! {
        #![proptest_config(proptest::test_runner::Config::with_cases(24))]
        /// The sizes the data path uses (256 KiB CRC groups, blocks up to MiBs), at any
        /// offset into the buffer (alignment) and resumed at any split: same value as the
        /// reference.
        #[test]
        fn matches_the_crc32c_crate_on_large_unaligned_buffers(
            len in 0usize..(4 << 20),
            offset in 0usize..64,
            split_frac in 0.0f64..1.0,
            seed in proptest::prelude::any::<u32>(),
        ) {
            let data: Vec<u8> = (0..(len + offset) as u32)
                .map(|i| (i.wrapping_add(seed).wrapping_mul(2_654_435_761) >> 13) as u8)
                .collect();
            let buf = &data[offset..];
            let split = ((len as f64) * split_frac) as usize;
            let want = crc32c::crc32c(buf);
            proptest::prop_assert_eq!(crc32c_append(0, buf), want);
            proptest::prop_assert_eq!(crc32c_append(crc32c_append(0, &buf[..split]), &buf[split..]), want);
        }
    }

    /// Matches the reference implementation on splits of buffers around the folding
    /// widths (16, 64, 256 bytes and up), and the check value of the CRC catalogue.
    #[test]
    fn matches_the_crc32c_crate_at_every_split() {
        assert_eq!(crc32c_append(0, b"123456789"), 0xe306_9283);
        let data: Vec<u8> = (0..5000u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
        for len in [0, 1, 15, 16, 17, 63, 64, 65, 255, 256, 257, 1024, 4099, 5000] {
            let buf = &data[..len];
            assert_eq!(crc32c_append(0, buf), crc32c::crc32c(buf), "len {len}");
            for split in [0, 1, 7, len / 3, len / 2, len.saturating_sub(1), len] {
                let split = split.min(len);
                let resumed = crc32c_append(crc32c_append(0, &buf[..split]), &buf[split..]);
                assert_eq!(resumed, crc32c::crc32c(buf), "len {len} split {split}");
                let mixed = crc32c_append(crc32c::crc32c(&buf[..split]), &buf[split..]);
                assert_eq!(mixed, crc32c::crc32c(buf), "len {len} split {split}, crc32c prefix");
            }
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::test_runner::Config::with_cases(64))]
        /// Cutting a buffer into arbitrary pieces, CRC-ing each alone and combining the
        /// values gives the CRC of the whole, and the `crc32c` crate's combination agrees.
        #[test]
        fn combined_pieces_equal_the_streamed_crc(
            len in 0usize..(1 << 18),
            cuts in proptest::collection::vec(0.0f64..1.0, 0..12),
            seed in proptest::prelude::any::<u32>(),
        ) {
            let buf: Vec<u8> = (0..len as u32)
                .map(|i| (i.wrapping_add(seed).wrapping_mul(2_654_435_761) >> 13) as u8)
                .collect();
            let mut at: Vec<usize> = cuts.iter().map(|f| ((len as f64) * f) as usize).collect();
            at.push(0);
            at.push(len);
            at.sort_unstable();
            let mut crc = 0;
            for w in at.windows(2) {
                let piece = &buf[w[0]..w[1]];
                let alone = crc32c_append(0, piece);
                let reference = crc32c::crc32c_combine(crc, alone, piece.len());
                crc = crc32c_combine(crc, alone, piece.len() as u64);
                proptest::prop_assert_eq!(crc, reference);
            }
            proptest::prop_assert_eq!(crc, crc32c::crc32c(&buf));
        }
    }

    /// Lengths the data path combines (blocks of KiBs to GiBs, and 0), against the
    /// reference combination.
    #[test]
    fn shifts_of_large_and_empty_lengths_match_the_reference() {
        for len in [0usize, 1, 3, 4096, 65_536, 2 << 20, (1 << 30) + 7, usize::MAX >> 1] {
            for (a, b) in [(0u32, 0u32), (0xdead_beef, 0x1234_5678), (u32::MAX, 1)] {
                // No bytes have CRC 0 (the reference ignores `b` then).
                let b = if len == 0 { 0 } else { b };
                assert_eq!(crc32c_combine(a, b, len as u64), crc32c::crc32c_combine(a, b, len), "len {len}");
            }
        }
        assert_eq!(Crc32cShift::new(0).combine(0x1234, 0), 0x1234, "no bytes: unchanged");
    }
}
