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

#[cfg(test)]
mod tests {
    use super::crc32c_append;

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
}
