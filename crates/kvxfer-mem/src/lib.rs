//! Registered memory for kvxfer.
//!
//! A [`Region`] is a span of memory the engine reads from (prefill) or writes into
//! (decode): either owned here (page-aligned, for tests, examples and the bench) or borrowed
//! from the inference engine that owns the KV cache. A [`KvMemory`] pairs a
//! [`BlockLayout`] with one region per segment and maps block ids to byte ranges.
//!
//! # The access contract
//! The bytes of a region are shared with the worker that owns the KV cache, so the engine
//! cannot borrow-check them. Instead, the lease protocol decides who may touch a block:
//! - prefill: from the moment a block is leased until its lease ends (and its last read
//!   guard is dropped), the owner does not write it; the engine only reads it;
//! - decode: from `submit` until the pull reports a child, the engine is the only one
//!   writing that child's destination blocks, and nobody reads them.
//!
//! The raw accessors are `unsafe` and state that contract; every other crate calls them
//! with a `// SAFETY:` comment naming the lease or pull that makes the call sound.
//!
//! # Device memory
//! A region made with [`Region::borrowed_device`] (a CUDA KV cache) is never read or
//! written by the CPU: only UCX, with its CUDA transports, moves its bytes. Its byte
//! accessors panic (a guard: callers check [`KvMemory::is_device`] first and refuse the
//! CPU paths — TCP reads, CRC checks, local block copies — with an error).

use std::alloc::{self, Layout};
use std::any::Any;
use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;

use kvxfer_core::{BlockId, BlockLayout};

mod crc;
pub use crc::{crc32c_append, crc32c_combine, Crc32cShift};

/// Errors of registered memory.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MemError {
    /// The allocator could not provide the region.
    #[error("could not allocate a region of {0} bytes")]
    Alloc(usize),
    /// A region is shorter than its segment of the layout needs.
    #[error("segment {segment}: region has {have} bytes, layout needs {need}")]
    RegionTooShort {
        /// Segment index.
        segment: usize,
        /// Bytes in the region.
        have: usize,
        /// Bytes the layout needs.
        need: u64,
    },
    /// Not one region per segment.
    #[error("layout has {segments} segments but {regions} regions were given")]
    RegionCount {
        /// Segments in the layout.
        segments: usize,
        /// Regions given.
        regions: usize,
    },
    /// A block id outside the layout.
    #[error("block {block} is outside the layout of {num_blocks} blocks")]
    BlockOutOfRange {
        /// The block id.
        block: BlockId,
        /// Blocks in the layout.
        num_blocks: u32,
    },
    /// A KV-cache group the memory does not have (or a cache of no groups).
    #[error("KV-cache group {group} does not exist (the memory has {groups})")]
    NoSuchGroup {
        /// The group asked for.
        group: usize,
        /// Groups of the memory.
        groups: usize,
    },
    /// Host and device regions in one memory.
    #[error("a KV cache's regions are all host memory or all device memory, not both")]
    MixedMemory,
    /// A CPU operation (a block copy) on device memory.
    #[error("the KV cache is device memory, which the CPU does not read or write here")]
    DeviceMemory,
    /// Data of the wrong length for a block.
    #[error("block data is {have} bytes, a block is {need}")]
    BlockLength {
        /// Bytes given.
        have: usize,
        /// Bytes per block.
        need: u64,
    },
}

/// Size and alignment of owned regions: a page.
pub const PAGE: usize = 4096;

enum Keeper {
    Owned(Layout),
    Borrowed(#[allow(dead_code)] Option<Box<dyn Any + Send + Sync>>),
}

/// A span of memory registered with the engine.
pub struct Region {
    ptr: NonNull<u8>,
    len: usize,
    keeper: Keeper,
    /// Device memory (see the crate docs): the CPU never touches its bytes.
    device: bool,
}

// SAFETY: a Region is a pointer and a length; the memory it names is shared under the
// access contract in the crate docs, which is what makes cross-thread use sound. Owned
// regions are plain heap memory; borrowed ones promise (in `Region::borrowed`) to be valid
// from any thread.
unsafe impl Send for Region {}
// SAFETY: as above: shared access goes through the unsafe accessors and their contract.
unsafe impl Sync for Region {}

impl fmt::Debug for Region {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match self.keeper {
            Keeper::Owned(_) => "owned",
            Keeper::Borrowed(_) => "borrowed",
        };
        f.debug_struct("Region")
            .field("len", &self.len)
            .field("kind", &kind)
            .field("device", &self.device)
            .finish()
    }
}

impl Region {
    /// A zeroed, page-aligned region owned by the engine.
    pub fn alloc(len: usize) -> Result<Self, MemError> {
        let size = len.max(1).div_ceil(PAGE) * PAGE;
        let layout = Layout::from_size_align(size, PAGE).map_err(|_| MemError::Alloc(len))?;
        // SAFETY: `layout` has a non-zero size.
        let raw = unsafe { alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).ok_or(MemError::Alloc(len))?;
        Ok(Region { ptr, len, keeper: Keeper::Owned(layout), device: false })
    }

    /// A region over memory the worker already owns (its KV cache).
    ///
    /// # Safety
    /// - `ptr` is valid for reads and writes of `len` bytes from any thread, for as long as
    ///   this region (and every `Arc` of a [`KvMemory`] holding it) lives; `keep_alive`, if
    ///   given, is dropped with the region and may own that memory.
    /// - The caller follows the access contract in the crate docs: it does not write a
    ///   block while the block is leased (prefill) and does not touch a destination block
    ///   while a pull into it is under way (decode).
    pub unsafe fn borrowed(
        ptr: NonNull<u8>,
        len: usize,
        keep_alive: Option<Box<dyn Any + Send + Sync>>,
    ) -> Self {
        Region { ptr, len, keeper: Keeper::Borrowed(keep_alive), device: false }
    }

    /// A region over device memory (a CUDA KV cache), which only UCX's device transports
    /// read and write: the engine never dereferences `ptr` on the CPU (its byte accessors
    /// panic), and agents over such memory refuse every CPU path (TCP reads, CRC checks,
    /// local block copies).
    ///
    /// # Safety
    /// - `ptr .. ptr + len` is device memory the UCX loaded in this process can register
    ///   (`ucp_mem_map` detects its memory type), valid for as long as this region lives;
    ///   `keep_alive` is dropped with the region and may own it.
    /// - The access contract above holds for its blocks (on the device: no kernel writes a
    ///   leased block, none touches a destination block while a pull into it is under way).
    pub unsafe fn borrowed_device(
        ptr: NonNull<u8>,
        len: usize,
        keep_alive: Option<Box<dyn Any + Send + Sync>>,
    ) -> Self {
        Region { ptr, len, keeper: Keeper::Borrowed(keep_alive), device: true }
    }

    /// Whether this is device memory ([`Region::borrowed_device`]).
    pub fn is_device(&self) -> bool {
        self.device
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the region is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The start address (for registering with UCX or verbs).
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    fn check(&self, offset: usize, len: usize) {
        assert!(
            !self.device,
            "a CPU access to device memory ({len} bytes at {offset}): callers must refuse it"
        );
        assert!(
            offset.checked_add(len).is_some_and(|end| end <= self.len),
            "range {offset}+{len} outside region of {} bytes",
            self.len
        );
    }

    /// The bytes `offset .. offset + len`.
    ///
    /// # Safety
    /// Nobody writes these bytes while the returned slice lives (for the engine: the block
    /// is leased and a read guard is held).
    ///
    /// # Panics
    /// If the range is outside the region.
    pub unsafe fn slice(&self, offset: usize, len: usize) -> &[u8] {
        self.check(offset, len);
        // SAFETY: in bounds (checked above); no concurrent writer (caller's contract).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(offset), len) }
    }

    /// The bytes `offset .. offset + len`, writable.
    ///
    /// # Safety
    /// Nobody else reads or writes these bytes while the returned slice lives (for the
    /// engine: they are destination blocks of a pull under way).
    ///
    /// # Panics
    /// If the range is outside the region.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slice_mut(&self, offset: usize, len: usize) -> &mut [u8] {
        self.check(offset, len);
        // SAFETY: in bounds (checked above); exclusive access (caller's contract).
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().add(offset), len) }
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        if let Keeper::Owned(layout) = self.keeper {
            // SAFETY: allocated in `alloc` with this very layout, freed once here.
            unsafe { alloc::dealloc(self.ptr.as_ptr(), layout) };
        }
    }
}

/// One contiguous piece of a transfer: `len` bytes at `offset` in region `region`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Chunk {
    /// Index of the region (= segment).
    pub region: usize,
    /// Byte offset in the region.
    pub offset: usize,
    /// Bytes.
    pub len: usize,
}

/// A KV cache: a block layout and one region per segment, checked to fit. A cache of
/// several KV-cache groups (hybrid models: full attention, sliding window...) is its first
/// group's memory holding the further groups ([`Self::with_groups`]); each group has its
/// own layout, regions and block ids.
#[derive(Debug)]
pub struct KvMemory {
    layout: BlockLayout,
    regions: Vec<Region>,
    other_groups: Vec<KvMemory>,
}

impl KvMemory {
    /// Pairs a layout with its regions (one per segment, each long enough).
    pub fn new(layout: BlockLayout, regions: Vec<Region>) -> Result<Self, MemError> {
        if regions.len() != layout.segments().len() {
            return Err(MemError::RegionCount { segments: layout.segments().len(), regions: regions.len() });
        }
        for (segment, region) in regions.iter().enumerate() {
            let need = layout.region_len(segment).unwrap_or(0);
            if (region.len() as u64) < need {
                return Err(MemError::RegionTooShort { segment, have: region.len(), need });
            }
        }
        if regions.iter().any(Region::is_device) && !regions.iter().all(Region::is_device) {
            return Err(MemError::MixedMemory);
        }
        Ok(KvMemory { layout, regions, other_groups: Vec::new() })
    }

    /// A cache of several KV-cache groups: `self` is group 0, `others[i]` group `i + 1`
    /// (their own further groups, if any, are dropped into the list in order).
    pub fn with_groups(mut self, others: Vec<KvMemory>) -> Self {
        for mut g in others {
            let nested = std::mem::take(&mut g.other_groups);
            self.other_groups.push(g);
            self.other_groups.extend(nested);
        }
        self
    }

    /// Whether the memory is device memory (every region of every group is; see the crate
    /// docs): only UCX may move its bytes.
    pub fn is_device(&self) -> bool {
        self.regions.first().is_some_and(Region::is_device)
            || self.other_groups.iter().any(KvMemory::is_device)
    }

    /// Number of KV-cache groups (1 unless built with [`Self::with_groups`]).
    pub fn num_groups(&self) -> usize {
        1 + self.other_groups.len()
    }

    /// The memory of KV-cache group `group` (`None` past the last group; group 0 is `self`).
    pub fn group(&self, group: usize) -> Option<&KvMemory> {
        match group {
            0 => Some(self),
            g => self.other_groups.get(g - 1),
        }
    }

    /// Every group's layout, group 0 first.
    pub fn group_layouts(&self) -> impl Iterator<Item = &BlockLayout> + '_ {
        std::iter::once(&self.layout).chain(self.other_groups.iter().map(|g| &g.layout))
    }

    /// Every group's regions, group 0's first (what a one-sided transport registers).
    pub fn all_regions(&self) -> impl Iterator<Item = &Region> + '_ {
        self.regions.iter().chain(self.other_groups.iter().flat_map(|g| g.regions.iter()))
    }

    /// Owned, zeroed regions for every segment of `layout`.
    pub fn alloc(layout: BlockLayout) -> Result<Self, MemError> {
        Self::alloc_in(layout, &mut Region::alloc)
    }

    /// Regions for every segment of `layout` from `alloc`, called with each segment's
    /// length (for memory a transport wants to allocate itself, e.g. UCX shared memory:
    /// `kvxfer::ucx_region`).
    pub fn alloc_in(
        layout: BlockLayout,
        alloc: &mut dyn FnMut(usize) -> Result<Region, MemError>,
    ) -> Result<Self, MemError> {
        let regions = (0..layout.segments().len())
            .map(|s| {
                let need = layout.region_len(s).unwrap_or(0);
                alloc(usize::try_from(need).map_err(|_| MemError::Alloc(usize::MAX))?)
            })
            .collect::<Result<Vec<_>, _>>()?;
        Self::new(layout, regions)
    }

    /// The layout (of group 0 in a cache of several groups).
    pub fn layout(&self) -> &BlockLayout {
        &self.layout
    }

    /// The regions, one per segment (of group 0 in a cache of several groups).
    pub fn regions(&self) -> &[Region] {
        &self.regions
    }

    /// The chunks of blocks `start .. start + count`, in wire order: segment by segment,
    /// and within a segment one chunk for the whole run when blocks are packed, else one
    /// per block. A run of no blocks has no chunks, wherever it starts. The caller has
    /// checked the range against the layout.
    pub fn run_chunks(&self, start: BlockId, count: u32) -> impl Iterator<Item = Chunk> + '_ {
        self.layout.segments().iter().enumerate().flat_map(move |(region, seg)| {
            let stride = seg.stride as usize;
            let block_len = seg.block_len as usize;
            let packed = seg.is_packed();
            let pieces = match (count, packed) {
                (0, _) => 0,
                (_, true) => 1,
                (_, false) => count as usize,
            };
            (0..pieces).map(move |i| {
                let first = start as usize + i;
                let len = if packed { block_len * count as usize } else { block_len };
                Chunk { region, offset: first * stride, len }
            })
        })
    }

    /// The bytes of a chunk.
    ///
    /// # Safety
    /// As [`Region::slice`]: nobody writes these bytes while the slice lives.
    pub unsafe fn chunk(&self, c: Chunk) -> &[u8] {
        // SAFETY: forwarded contract.
        unsafe { self.regions[c.region].slice(c.offset, c.len) }
    }

    /// The bytes of a chunk, writable.
    ///
    /// # Safety
    /// As [`Region::slice_mut`]: nobody else touches these bytes while the slice lives.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn chunk_mut(&self, c: Chunk) -> &mut [u8] {
        // SAFETY: forwarded contract.
        unsafe { self.regions[c.region].slice_mut(c.offset, c.len) }
    }

    /// CRC-32C of blocks `(start, count)` of `runs`, in wire order (the order
    /// [`Self::run_chunks`] yields): what both sides of a read compute to check the payload.
    /// The caller has checked the runs against the layout.
    ///
    /// # Safety
    /// As [`Self::chunk`]: nobody writes these blocks while this runs.
    pub unsafe fn crc32c(&self, runs: impl IntoIterator<Item = (BlockId, u32)>) -> u32 {
        let mut crc = 0;
        for (start, count) in runs {
            for c in self.run_chunks(start, count) {
                // SAFETY: forwarded contract.
                crc = crc32c_append(crc, unsafe { self.chunk(c) });
            }
        }
        crc
    }

    /// CRC-32C of the bytes of `chunks`, in order (a head-slice read's payload).
    ///
    /// # Safety
    /// As [`Self::chunk`]: nobody writes these bytes while this runs.
    pub unsafe fn crc32c_chunks(&self, chunks: &[Chunk]) -> u32 {
        chunks.iter().fold(0, |crc, &c| {
            // SAFETY: forwarded contract.
            crate::crc32c_append(crc, unsafe { self.chunk(c) })
        })
    }

    fn check_block(&self, block: BlockId) -> Result<(), MemError> {
        if self.layout.contains(block) {
            Ok(())
        } else {
            Err(MemError::BlockOutOfRange { block, num_blocks: self.layout.num_blocks() })
        }
    }

    /// Writes a whole block (all segments, in layout order) — how an owner fills its cache.
    ///
    /// # Safety
    /// The block is not leased and no pull is writing it (the access contract).
    pub unsafe fn write_block(&self, block: BlockId, data: &[u8]) -> Result<(), MemError> {
        if self.is_device() {
            return Err(MemError::DeviceMemory);
        }
        self.check_block(block)?;
        if data.len() as u64 != self.layout.block_bytes() {
            return Err(MemError::BlockLength { have: data.len(), need: self.layout.block_bytes() });
        }
        let mut rest = data;
        for c in self.run_chunks(block, 1) {
            let (head, tail) = rest.split_at(c.len);
            // SAFETY: the caller guarantees nobody else touches this block.
            unsafe { self.chunk_mut(c) }.copy_from_slice(head);
            rest = tail;
        }
        Ok(())
    }

    /// Copies a whole block out (all segments, in layout order).
    ///
    /// # Safety
    /// Nobody writes the block meanwhile (the access contract).
    pub unsafe fn read_block(&self, block: BlockId, out: &mut [u8]) -> Result<(), MemError> {
        if self.is_device() {
            return Err(MemError::DeviceMemory);
        }
        self.check_block(block)?;
        if out.len() as u64 != self.layout.block_bytes() {
            return Err(MemError::BlockLength { have: out.len(), need: self.layout.block_bytes() });
        }
        let mut rest = out;
        for c in self.run_chunks(block, 1) {
            let (head, tail) = rest.split_at_mut(c.len);
            // SAFETY: the caller guarantees no concurrent writer.
            head.copy_from_slice(unsafe { self.chunk(c) });
            rest = tail;
        }
        Ok(())
    }

    /// Copies block `src` to block `dst` of this memory (siblings sharing a prompt block).
    ///
    /// # Safety
    /// Nobody writes `src` and nobody else touches `dst` meanwhile; `src != dst`.
    pub unsafe fn copy_block(&self, src: BlockId, dst: BlockId) -> Result<(), MemError> {
        if self.is_device() {
            return Err(MemError::DeviceMemory);
        }
        self.check_block(src)?;
        self.check_block(dst)?;
        if src == dst {
            return Ok(());
        }
        for (s, d) in self.run_chunks(src, 1).zip(self.run_chunks(dst, 1)) {
            // SAFETY: distinct blocks never overlap (stride >= block_len); contract as above.
            unsafe { self.chunk_mut(d) }.copy_from_slice(unsafe { self.chunk(s) });
        }
        Ok(())
    }
}

/// A shared handle to registered memory.
pub type SharedKvMemory = Arc<KvMemory>;

#[cfg(test)]
mod tests {
    use super::*;
    use kvxfer_core::Segment;

    /// Host memory flagged as device memory: the engine's CPU accessors refuse it (what a
    /// CUDA cache gets). Sound here: nothing dereferences the region through the flag.
    fn device_memory(host: &Region) -> KvMemory {
        let layout = BlockLayout::new(4, vec![Segment::packed(16)], "u8", 16).expect("layout");
        let ptr = NonNull::new(host.as_ptr()).expect("non-null");
        // SAFETY: `host` outlives the returned memory in every test below, and no byte is
        // accessed through it (the accessors refuse device regions).
        let region = unsafe { Region::borrowed_device(ptr, host.len(), None) };
        KvMemory::new(layout, vec![region]).expect("memory")
    }

    #[test]
    fn device_memory_is_never_copied_or_sliced_by_the_cpu() {
        let host = Region::alloc(64).expect("alloc");
        let mem = device_memory(&host);
        assert!(mem.is_device() && mem.regions()[0].is_device());
        // SAFETY: refused before any access.
        assert!(matches!(unsafe { mem.copy_block(0, 1) }, Err(MemError::DeviceMemory)));
        // SAFETY: refused before any access.
        assert!(matches!(unsafe { mem.write_block(0, &[0; 16]) }, Err(MemError::DeviceMemory)));
        // SAFETY: as above.
        assert!(matches!(unsafe { mem.read_block(0, &mut [0; 16]) }, Err(MemError::DeviceMemory)));
        let chunk = mem.run_chunks(0, 1).next().expect("chunk");
        // SAFETY: the accessor panics before touching the bytes.
        let touched =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| unsafe { mem.chunk(chunk) }.len()));
        assert!(touched.is_err(), "a CPU slice of device memory must panic");
        assert!(!KvMemory::alloc(BlockLayout::new(4, vec![Segment::packed(16)], "u8", 16).expect("l"))
            .expect("alloc")
            .is_device());
    }

    #[test]
    fn host_and_device_regions_do_not_mix_in_one_memory() {
        let host = Region::alloc(64).expect("alloc");
        let layout =
            BlockLayout::new(4, vec![Segment::packed(16), Segment::packed(16)], "u8", 16).expect("layout");
        // SAFETY: as in `device_memory`.
        let device = unsafe { Region::borrowed_device(NonNull::new(host.as_ptr()).expect("ptr"), 64, None) };
        let plain = Region::alloc(64).expect("alloc");
        assert!(matches!(KvMemory::new(layout, vec![plain, device]), Err(MemError::MixedMemory)));
    }

    #[test]
    fn owned_regions_are_page_aligned_and_zeroed() {
        let r = Region::alloc(10_000).expect("alloc");
        assert_eq!(r.as_ptr() as usize % PAGE, 0);
        // SAFETY: nobody else has this region.
        assert!(unsafe { r.slice(0, 10_000) }.iter().all(|&b| b == 0));
    }

    #[test]
    fn chunks_coalesce_packed_segments_and_split_strided_ones() {
        let layout =
            BlockLayout::new(8, vec![Segment::packed(16), Segment { block_len: 8, stride: 32 }], "u8", 16)
                .expect("layout");
        let mem = KvMemory::alloc(layout).expect("alloc");
        let chunks: Vec<_> = mem.run_chunks(2, 3).collect();
        assert_eq!(
            chunks,
            vec![
                Chunk { region: 0, offset: 32, len: 48 },
                Chunk { region: 1, offset: 64, len: 8 },
                Chunk { region: 1, offset: 96, len: 8 },
                Chunk { region: 1, offset: 128, len: 8 },
            ]
        );
        let data: Vec<u8> = (0..24).collect();
        // SAFETY: nobody else has this memory.
        unsafe {
            mem.write_block(5, &data).expect("write");
            mem.copy_block(5, 1).expect("copy");
            let mut out = vec![0; 24];
            mem.read_block(1, &mut out).expect("read");
            assert_eq!(out, data);
            assert!(matches!(mem.write_block(8, &data), Err(MemError::BlockOutOfRange { .. })));
            assert!(matches!(mem.write_block(1, &data[..3]), Err(MemError::BlockLength { .. })));
        }
    }

    #[test]
    fn a_run_of_zero_blocks_has_no_chunks() {
        // A packed segment used to yield one chunk at `start * stride` even for count 0,
        // which for a start outside the layout failed the region's bounds assertion.
        let layout =
            BlockLayout::new(8, vec![Segment::packed(16), Segment { block_len: 8, stride: 32 }], "u8", 16)
                .expect("layout");
        let mem = KvMemory::alloc(layout).expect("alloc");
        assert_eq!(mem.run_chunks(1000, 0).count(), 0);
        assert_eq!(mem.run_chunks(2, 0).count(), 0);
        // SAFETY: nobody else has this memory.
        assert_eq!(unsafe { mem.crc32c([(1000, 0)]) }, 0);
    }

    #[test]
    fn regions_must_fit_the_layout() {
        let layout = BlockLayout::single(4, 100).expect("layout");
        let short = Region::alloc(399).expect("alloc");
        assert!(matches!(KvMemory::new(layout.clone(), vec![short]), Err(MemError::RegionTooShort { .. })));
        assert!(matches!(KvMemory::new(layout, vec![]), Err(MemError::RegionCount { .. })));
    }
}

/// A verifiable byte pattern for tests, the loopback example and the benchmark: every
/// block gets bytes no other block has, so a block landing in the wrong place is caught.
pub mod pattern {
    use super::{KvMemory, MemError};
    use kvxfer_core::{BlockId, BlockLayout};

    /// Fills `out` with the pattern of `block`.
    pub fn fill(block: BlockId, out: &mut [u8]) {
        fill_in_group(0, block, out);
    }

    /// Fills `out` with the pattern of `block` of KV-cache group `group` (group 0: [`fill`]);
    /// block `b` of two groups differ, so a block read from the wrong group is caught.
    pub fn fill_in_group(group: usize, block: BlockId, out: &mut [u8]) {
        let seed = u64::from(block) ^ ((group as u64) << 40);
        let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        for chunk in out.chunks_mut(8) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            chunk.copy_from_slice(&x.to_le_bytes()[..chunk.len()]);
        }
    }

    /// New memory of `layout` with every block holding its pattern: what a prefill cache
    /// looks like in tests, the loopback example, the benchmark and the fault tools.
    pub fn alloc_filled(layout: BlockLayout) -> Result<KvMemory, MemError> {
        alloc_filled_in(layout, &mut super::Region::alloc)
    }

    /// [`alloc_filled`] over regions from `alloc` ([`KvMemory::alloc_in`]).
    pub fn alloc_filled_in(
        layout: BlockLayout,
        alloc: &mut dyn FnMut(usize) -> Result<super::Region, MemError>,
    ) -> Result<KvMemory, MemError> {
        let mem = KvMemory::alloc_in(layout, alloc)?;
        let mut buf = vec![0u8; mem.layout().block_bytes() as usize];
        for b in 0..mem.layout().num_blocks() {
            fill(b, &mut buf);
            // SAFETY: `mem` was just allocated and is not shared: nothing is leased and no
            // pull writes it.
            unsafe { mem.write_block(b, &buf)? };
        }
        Ok(mem)
    }

    /// New memory of several KV-cache groups (`layouts[g]` is group `g`), every block of
    /// every group holding its [`fill_in_group`] pattern.
    pub fn alloc_filled_groups(layouts: Vec<BlockLayout>) -> Result<KvMemory, MemError> {
        let mut groups = Vec::with_capacity(layouts.len());
        for (g, layout) in layouts.into_iter().enumerate() {
            let mem = KvMemory::alloc(layout)?;
            let mut buf = vec![0u8; mem.layout().block_bytes() as usize];
            for b in 0..mem.layout().num_blocks() {
                fill_in_group(g, b, &mut buf);
                // SAFETY: `mem` was just allocated and is not shared.
                unsafe { mem.write_block(b, &buf)? };
            }
            groups.push(mem);
        }
        if groups.is_empty() {
            return Err(MemError::NoSuchGroup { group: 0, groups: 0 });
        }
        let first = groups.remove(0);
        Ok(first.with_groups(groups))
    }

    /// Fills `out` with the pattern of head `head` (model-wide index) of `block`, segment
    /// `segment`, group `group` of a prefill engine: the same bytes on every rank holding
    /// that head, so a decode rank of another TP size can check what it assembled.
    pub fn fill_head(group: usize, segment: usize, block: BlockId, head: u32, out: &mut [u8]) {
        let id = (u64::from(block) << 16) ^ ((segment as u64) << 8) ^ u64::from(head);
        fill_in_group(group, (id ^ (id >> 32)) as BlockId, out);
    }

    /// New memory of `shape` (every group) with every head of every block holding its
    /// [`fill_head`] pattern: one prefill rank's cache.
    pub fn alloc_filled_shape(shape: &kvxfer_core::KvShape) -> Result<KvMemory, MemError> {
        let mut groups = Vec::with_capacity(shape.num_groups());
        let heads = shape.local_heads();
        for g in 0..shape.num_groups() {
            let Some(layout) = shape.block_layout(g) else { break };
            let mem = KvMemory::alloc(layout.clone())?;
            for (s, seg) in shape.segments(g).iter().enumerate() {
                let c = seg.head_bytes() as usize;
                let mut buf = vec![0u8; c];
                for b in 0..layout.num_blocks() {
                    for j in 0..heads.count {
                        fill_head(g, s, b, heads.first + j, &mut buf);
                        let offset = (u64::from(b) * seg.stride()) as usize + j as usize * c;
                        // SAFETY: `mem` was just allocated and is not shared.
                        unsafe { mem.regions()[s].slice_mut(offset, c) }.copy_from_slice(&buf);
                    }
                }
            }
            groups.push(mem);
        }
        if groups.is_empty() {
            return Err(MemError::NoSuchGroup { group: 0, groups: 0 });
        }
        let first = groups.remove(0);
        Ok(first.with_groups(groups))
    }

    /// Checks a decode rank's pull of one group: remote block `remote[i]` landed in local
    /// block `local[i / k]` at token slot `i % k` (`k`: the pair's block ratio), every head
    /// of the decode rank holding [`fill_head`] of that remote block. Returns the first
    /// local block that does not.
    ///
    /// # Safety
    /// Nobody writes the `local` blocks meanwhile (their pull has reported).
    pub unsafe fn check_shaped_blocks(
        mem: &KvMemory,
        pair: &kvxfer_core::TransferPair,
        group: usize,
        remote: &[BlockId],
        local: &[BlockId],
    ) -> Result<Option<BlockId>, MemError> {
        let Some(g) = mem.group(group) else {
            return Err(MemError::NoSuchGroup { group, groups: mem.num_groups() });
        };
        let decode = pair.decode();
        let (heads, k) = (decode.local_heads(), u64::from(pair.block_ratio()));
        for (s, seg) in decode.segments(group).iter().enumerate() {
            // One prefill block's worth of one head.
            let c = seg.head_bytes() / k;
            let (mut want, mut got) = (vec![0u8; c as usize], vec![0u8; c as usize]);
            for (i, &r) in remote.iter().enumerate() {
                let (l, slot) = (local[i / k as usize], i as u64 % k);
                g.check_block(l)?;
                for j in 0..heads.count {
                    fill_head(group, s, r, heads.first + j, &mut want);
                    let offset = u64::from(l) * seg.stride() + u64::from(j) * seg.head_bytes() + slot * c;
                    // SAFETY: in the layout (checked); forwarded contract.
                    got.copy_from_slice(unsafe { g.regions()[s].slice(offset as usize, c as usize) });
                    if want != got {
                        return Ok(Some(l));
                    }
                }
            }
        }
        Ok(None)
    }

    /// [`check_blocks`] for KV-cache group `group` of `mem` (group-local ids on both sides).
    ///
    /// # Safety
    /// As [`check_blocks`].
    pub unsafe fn check_group_blocks(
        mem: &KvMemory,
        group: usize,
        remote: &[BlockId],
        local: &[BlockId],
    ) -> Result<Option<BlockId>, MemError> {
        let Some(g) = mem.group(group) else {
            return Err(MemError::NoSuchGroup { group, groups: mem.num_groups() });
        };
        let len = g.layout().block_bytes() as usize;
        let (mut want, mut got) = (vec![0u8; len], vec![0u8; len]);
        for (&r, &l) in remote.iter().zip(local) {
            fill_in_group(group, r, &mut want);
            // SAFETY: forwarded contract.
            unsafe { g.read_block(l, &mut got)? };
            if want != got {
                return Ok(Some(l));
            }
        }
        Ok(None)
    }

    /// Checks that local block `local[i]` holds the pattern of remote block `remote[i]`;
    /// returns the first local block that does not.
    ///
    /// # Safety
    /// Nobody writes the `local` blocks meanwhile (their pull has reported).
    pub unsafe fn check_blocks(
        mem: &KvMemory,
        remote: &[BlockId],
        local: &[BlockId],
    ) -> Result<Option<BlockId>, MemError> {
        let len = mem.layout().block_bytes() as usize;
        let (mut want, mut got) = (vec![0u8; len], vec![0u8; len]);
        for (&r, &l) in remote.iter().zip(local) {
            fill(r, &mut want);
            // SAFETY: forwarded contract.
            unsafe { mem.read_block(l, &mut got)? };
            if want != got {
                return Ok(Some(l));
            }
        }
        Ok(None)
    }
}
