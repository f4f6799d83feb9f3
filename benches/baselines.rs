//! The machine's ceilings, measured in the same run: raw TCP on 127.0.0.1 (bandwidth, in
//! this process or from the `serve` process of a two-process run, and a one-block round
//! trip, likewise) and memcpy.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::time::Instant;

/// Bytes per write of the raw TCP baseline: kvxfer's server sends a read's payload in
/// vectored writes of about this many bytes (`CRC_GROUP` in kvxfer-tcp's `read.rs`: each
/// group is checksummed, then written; the header rides with the first, the CRC trailer
/// with the last).
pub(crate) const RAW_WRITE_BYTES: usize = 256 * 1024;

/// Sends `src` as kvxfer's server sends a payload: writes of [`RAW_WRITE_BYTES`].
fn write_like_kvxfer(s: &mut TcpStream, src: &[u8]) -> std::io::Result<()> {
    src.chunks(RAW_WRITE_BYTES).try_for_each(|c| s.write_all(c))
}

/// Fills `dst` as kvxfer's client fills a child's blocks: `read_span` bytes at a time (one
/// read's contiguous run), each read taking as much as the socket holds; the bytes read
/// (all of `dst`), or the error that stopped it (an early end of stream included).
fn read_like_kvxfer(s: &mut TcpStream, dst: &mut [u8], read_span: u64) -> std::io::Result<usize> {
    let span = (read_span as usize).max(4096);
    dst.chunks_mut(span).try_for_each(|c| s.read_exact(c))?;
    Ok(dst.len())
}

/// CPU nanoseconds the raw TCP threads of this process spent sending and receiving bytes
/// (each thread's own CPU clock, from its start to its last write or read: the kernel's
/// share of a transfer, without the threads' start-up or their buffers' first touch).
static RAW_TCP_SEND_NS: AtomicU64 = AtomicU64::new(0);
static RAW_TCP_RECEIVE_NS: AtomicU64 = AtomicU64::new(0);

/// CPU seconds the raw TCP baseline's sending and receiving threads of this process have
/// spent moving bytes so far (both in a one-process run; a two-process run sends from
/// `serve` and receives in `pull`).
pub(crate) fn raw_tcp_cpu_seconds() -> (f64, f64) {
    let s = |c: &AtomicU64| c.load(Ordering::SeqCst) as f64 / 1e9;
    (s(&RAW_TCP_SEND_NS), s(&RAW_TCP_RECEIVE_NS))
}

/// Sending threads of this process that have finished and added their CPU: a `pull` waits
/// for `serve`'s senders of a run to reach it before it reads their CPU.
static RAW_TCP_SENDERS_DONE: AtomicU64 = AtomicU64::new(0);

/// [`RAW_TCP_SENDERS_DONE`] now.
pub(crate) fn raw_tcp_senders_done() -> u64 {
    RAW_TCP_SENDERS_DONE.load(Ordering::SeqCst)
}

/// Sources of this process that have freed their buffer (once their peer hung up, after its
/// clocks were read): a `pull` waits for a run's sources to reach it before its next
/// iteration, so freeing 512 MiB is not counted as kvxfer's.
static RAW_TCP_SOURCES_FREED: AtomicU64 = AtomicU64::new(0);

/// [`RAW_TCP_SOURCES_FREED`] now.
pub(crate) fn raw_tcp_sources_freed() -> u64 {
    RAW_TCP_SOURCES_FREED.load(Ordering::SeqCst)
}

/// Windows shorter than this in all (a figure's windows summed) give no machine-wide
/// figure: `/proc/stat` counts in 10 ms ticks, too coarse for them.
pub(crate) const MIN_MACHINE_WINDOW_SECS: f64 = 0.25;

/// Runs `f` on this thread, adding the CPU it took to `counter`.
fn counted<T>(counter: &AtomicU64, f: impl FnOnce() -> T) -> T {
    let t0 = crate::procstat::thread_cpu_ns();
    let out = f();
    counter.fetch_add(crate::procstat::thread_cpu_ns().saturating_sub(t0), Ordering::SeqCst);
    out
}

/// GiB/s of `bytes` moved in `secs`.
fn gib_per_s(bytes: usize, secs: f64) -> f64 {
    bytes as f64 / f64::from(1u32 << 30) / secs
}

/// Joins raw TCP threads: the bytes the receivers read (senders count 0), or the first
/// error (a failed socket must not pass as a fast one).
fn join_all(threads: Vec<std::thread::JoinHandle<std::io::Result<usize>>>) -> Result<usize, String> {
    let mut bytes = 0;
    let mut first_err = None;
    for t in threads {
        match t.join() {
            Ok(Ok(b)) => bytes += b,
            Ok(Err(e)) => first_err = first_err.or(Some(format!("raw tcp: {e}"))),
            Err(_) => first_err = first_err.or(Some("raw tcp thread panicked".into())),
        }
    }
    first_err.map_or(Ok(bytes), Err)
}

/// One raw TCP run's window: its GiB/s and this machine's busy CPU seconds over it
/// ([`crate::procstat::machine_busy_seconds`]: the kernel threads that finish loopback's
/// receive work included), from the go to the last byte read, every buffer still held (their
/// allocation and freeing are not the transfer's).
#[derive(Debug)]
pub(crate) struct RawWindow {
    pub(crate) gib_per_s: f64,
    pub(crate) machine_cpu_seconds: Option<f64>,
    /// The window's length (the go to the last byte read), for judging whether `/proc/stat`'s
    /// 10 ms ticks resolve it ([`MIN_MACHINE_WINDOW_SECS`]; callers sum windows first).
    pub(crate) secs: f64,
}

/// The machine's busy CPU seconds from `before` to now (tick-resolution: judge the window's
/// length, or the sum of several, against [`MIN_MACHINE_WINDOW_SECS`]).
fn machine_since(before: Option<f64>) -> Option<f64> {
    Some(crate::procstat::machine_busy_seconds()? - before?)
}

/// Raw TCP, one process: `connections` sockets on 127.0.0.1 moving `total` bytes from one
/// buffer to another, written as kvxfer's server writes ([`RAW_WRITE_BYTES`]) and read
/// `read_span` bytes at a time (kvxfer's read of one child), no protocol, a sender and a
/// receiver thread per socket. Buffers are allocated and touched and connections made
/// before the clock starts, and freed after it stops.
pub(crate) fn raw_tcp_gib_per_s(total: u64, connections: usize, read_span: u64) -> Result<RawWindow, String> {
    let connections = connections.max(1);
    let per = (total / connections as u64) as usize;
    let listener = TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    let clients: Vec<TcpStream> = (0..connections)
        .map(|_| TcpStream::connect(addr).map_err(|e| e.to_string()))
        .collect::<Result<_, _>>()?;
    let servers: Vec<TcpStream> = (0..connections)
        .map(|_| listener.accept().map(|(s, _)| s).map_err(|e| e.to_string()))
        .collect::<Result<_, _>>()?;
    // Senders, receivers and this thread start together, and end together: every thread
    // holds its buffer until this one has read the clocks.
    let start = Arc::new(Barrier::new(2 * connections + 1));
    let end = Arc::new(Barrier::new(2 * connections + 1));
    let mut threads = Vec::new();
    for mut s in servers {
        let (start, end) = (start.clone(), end.clone());
        threads.push(std::thread::spawn(move || {
            let src = vec![0x5au8; per];
            start.wait();
            let sent = counted(&RAW_TCP_SEND_NS, || write_like_kvxfer(&mut s, &src)).map(|()| 0);
            if sent.is_err() {
                // Likewise for a receiver still reading from it.
                drop(s);
            }
            end.wait();
            sent
        }));
    }
    let readers = receive(clients, per, read_span, &start, &end);
    threads.extend(readers);
    start.wait();
    let (t0, machine0) = (Instant::now(), crate::procstat::machine_busy_seconds());
    end.wait();
    let secs = t0.elapsed().as_secs_f64();
    let machine_cpu_seconds = machine_since(machine0);
    let read = join_all(threads)?;
    Ok(RawWindow { gib_per_s: gib_per_s(read, secs), machine_cpu_seconds, secs })
}

/// Receiver threads, one per socket, each filling `per` bytes once `start` opens and
/// returning the bytes read or the error that stopped it, its buffer and socket held until
/// `end` opens; a socket with a `serve` source at the other end is first sent one byte (its
/// go), and its closing tells the source to free its buffer.
fn receive(
    sockets: Vec<TcpStream>,
    per: usize,
    read_span: u64,
    start: &Arc<Barrier>,
    end: &Arc<Barrier>,
) -> Vec<std::thread::JoinHandle<std::io::Result<usize>>> {
    sockets
        .into_iter()
        .map(|mut s| {
            let (start, end) = (start.clone(), end.clone());
            std::thread::spawn(move || {
                let mut dst = vec![1u8; per];
                start.wait();
                let read = counted(&RAW_TCP_RECEIVE_NS, || read_like_kvxfer(&mut s, &mut dst, read_span));
                std::hint::black_box(&dst);
                if read.is_err() {
                    // A sender blocked writing to this socket must see it closed before the
                    // barrier (a close with unread bytes resets it), or neither reaches it.
                    drop(s);
                }
                end.wait();
                read
            })
        })
        .collect()
}

/// The `serve` half of the two-process raw TCP baseline: listens on 127.0.0.1, and for
/// each of `connections` sockets accepted sends its share of `total` bytes (buffers
/// allocated and touched before this returns) as kvxfer's server writes, once the socket's
/// peer sent one byte; each buffer is freed once its peer closed the socket (after the
/// peer's clocks were read). Returns the address to connect to.
pub(crate) fn raw_tcp_source(total: u64, connections: usize) -> Result<String, String> {
    let connections = connections.max(1);
    let per = (total / connections as u64) as usize;
    let listener = TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?.to_string();
    let sources: Vec<Vec<u8>> = (0..connections).map(|_| vec![0x5au8; per]).collect();
    std::thread::spawn(move || {
        for src in sources {
            let Ok((mut s, _)) = listener.accept() else { return };
            std::thread::spawn(move || {
                let mut go = [0u8; 1];
                // A failure shows on the pull side, whose read then ends early.
                let sent = s
                    .read_exact(&mut go)
                    .and_then(|()| counted(&RAW_TCP_SEND_NS, || write_like_kvxfer(&mut s, &src)));
                RAW_TCP_SENDERS_DONE.fetch_add(1, Ordering::SeqCst);
                if let Err(e) = sent {
                    eprintln!("kvxfer-bench serve: raw tcp source: {e}");
                } else {
                    // Held until the peer hangs up (its end of the run), read or error alike.
                    let _ = s.read(&mut go);
                }
                drop(src);
                RAW_TCP_SOURCES_FREED.fetch_add(1, Ordering::SeqCst);
            });
        }
    });
    Ok(addr)
}

/// The pull half of the two-process raw TCP baseline: connects `connections` sockets to a
/// [`raw_tcp_source`] at `addr`, and reads `total` bytes from them (`read_span` at a time)
/// into touched buffers; the clock starts when the go bytes are sent.
pub(crate) fn raw_tcp_sink_gib_per_s(
    addr: &str,
    total: u64,
    connections: usize,
    read_span: u64,
) -> Result<RawWindow, String> {
    let connections = connections.max(1);
    let per = (total / connections as u64) as usize;
    let sockets: Vec<TcpStream> = (0..connections)
        .map(|_| TcpStream::connect(addr).map_err(|e| format!("raw source {addr}: {e}")))
        .collect::<Result<_, _>>()?;
    let mut goes =
        sockets.iter().map(TcpStream::try_clone).collect::<Result<Vec<_>, _>>().map_err(|e| e.to_string())?;
    let start = Arc::new(Barrier::new(connections + 1));
    let end = Arc::new(Barrier::new(connections + 1));
    let threads = receive(sockets, per, read_span, &start, &end);
    start.wait();
    let (t0, machine0) = (Instant::now(), crate::procstat::machine_busy_seconds());
    let go =
        goes.iter_mut().try_for_each(|g| g.write_all(&[1])).map_err(|e| format!("raw source {addr}: {e}"));
    if go.is_err() {
        // Sockets that got no go would wait for ever: end every receiver's read.
        goes.iter().for_each(|g| drop(g.shutdown(std::net::Shutdown::Both)));
    }
    end.wait();
    let secs = t0.elapsed().as_secs_f64();
    let machine_cpu_seconds = machine_since(machine0);
    // The go clones hold the sockets open: dropped, the sources see the end and free.
    drop(goes);
    let read = join_all(threads);
    go?;
    Ok(RawWindow { gib_per_s: gib_per_s(read?, secs), machine_cpu_seconds, secs })
}

/// Requests a [`raw_rtt_responder`] of this process answered (all of them, every block
/// size): the two-process test checks that the round trips really reached `serve`.
static RAW_RTT_ROUNDS_SERVED: AtomicU64 = AtomicU64::new(0);

/// Requests the raw round-trip responders of this process have answered so far.
pub(crate) fn raw_rtt_rounds_served() -> u64 {
    RAW_RTT_ROUNDS_SERVED.load(Ordering::SeqCst)
}

/// The server half of [`RawRtt`]: listens on 127.0.0.1, accepts one connection and answers
/// every 64-byte request on it with `block` bytes until the client hangs up. Returns the
/// address and the thread; in a two-process run it lives in `serve`, so the round trip
/// crosses processes as kvxfer's hand-off does.
pub(crate) fn raw_rtt_responder(block: u64) -> Result<(String, std::thread::JoinHandle<()>), String> {
    let listener = TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?.to_string();
    let len = usize::try_from(block).map_err(|e| e.to_string())?;
    let server = std::thread::spawn(move || {
        let Ok((mut s, _)) = listener.accept() else { return };
        let _ = s.set_nodelay(true);
        let data = vec![7u8; len];
        let mut req = [0u8; 64];
        while s.read_exact(&mut req).is_ok() {
            // Counted before the answer, so a client that has its answer sees the count.
            RAW_RTT_ROUNDS_SERVED.fetch_add(1, Ordering::SeqCst);
            if s.write_all(&data).is_err() {
                break;
            }
        }
    });
    Ok((addr, server))
}

/// Round trips on 127.0.0.1 of a 64-byte request answered with one `block` of data read
/// into a buffer: what a one-block hand-off cannot beat. The connection and its server
/// thread stay up, so samples can be taken between kvxfer's iterations (interleaved, over
/// the same minutes of a noisy machine) rather than in one burst after them.
pub(crate) struct RawRtt {
    client: TcpStream,
    buf: Vec<u8>,
    /// The responder thread when it runs in this process.
    server: Option<std::thread::JoinHandle<()>>,
}

impl RawRtt {
    /// Connects a client to a responder thread of this process (one-process runs).
    pub(crate) fn start(block: u64) -> Result<Self, String> {
        let (addr, server) = raw_rtt_responder(block)?;
        let mut rtt = Self::connect(&addr, block)?;
        rtt.server = Some(server);
        Ok(rtt)
    }

    /// Connects a client to the [`raw_rtt_responder`] at `addr` (in a `serve` process).
    pub(crate) fn connect(addr: &str, block: u64) -> Result<Self, String> {
        let client = TcpStream::connect(addr).map_err(|e| format!("raw rtt responder {addr}: {e}"))?;
        client.set_nodelay(true).map_err(|e| e.to_string())?;
        let len = usize::try_from(block).map_err(|e| e.to_string())?;
        Ok(RawRtt { client, buf: vec![0u8; len], server: None })
    }

    /// `rounds` round trips, each in microseconds.
    pub(crate) fn sample(&mut self, rounds: usize) -> Result<Vec<f64>, String> {
        let mut samples = Vec::with_capacity(rounds);
        for _ in 0..rounds {
            let t0 = Instant::now();
            self.client.write_all(&[1u8; 64]).map_err(|e| e.to_string())?;
            self.client.read_exact(&mut self.buf).map_err(|e| e.to_string())?;
            samples.push(t0.elapsed().as_secs_f64() * 1e6);
        }
        Ok(samples)
    }
}

impl Drop for RawRtt {
    fn drop(&mut self) {
        let _ = self.client.shutdown(std::net::Shutdown::Both);
        if let Some(t) = self.server.take() {
            let _ = t.join();
        }
    }
}

/// Quantiles of round-trip samples as the report gives them: p10, p50, p90, p99 and count.
pub(crate) fn rtt_distribution(samples: &mut [f64]) -> serde_json::Value {
    samples.sort_by(f64::total_cmp);
    serde_json::json!({
        "p10": percentile(samples, 0.1), "p50": percentile(samples, 0.5),
        "p90": percentile(samples, 0.9), "p99": percentile(samples, 0.99), "samples": samples.len(),
    })
}

/// One memcpy of `total` bytes between two pre-touched buffers.
pub(crate) fn memcpy_gib_per_s(total: u64) -> f64 {
    let src = vec![0xa5u8; total as usize];
    let mut dst = vec![0u8; total as usize];
    dst.iter_mut().step_by(4096).for_each(|b| *b = 1);
    let t0 = Instant::now();
    dst.copy_from_slice(&src);
    let secs = t0.elapsed().as_secs_f64();
    std::hint::black_box(&dst);
    total as f64 / f64::from(1u32 << 30) / secs
}

/// The median of unsorted samples ([`percentile`] 0.5 once sorted; 0 when there are none).
pub(crate) fn median(mut samples: Vec<f64>) -> f64 {
    samples.sort_by(f64::total_cmp);
    percentile(&samples, 0.5)
}

/// The `p` quantile (0..=1) of sorted samples (0 when there are none).
pub(crate) fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let idx = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[idx.min(sorted.len() - 1)]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A raw source that hangs up before sending anything fails the sink's run: it is not
    /// reported as bytes moved in no time.
    #[test]
    fn a_source_that_hangs_up_fails_the_raw_run() {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr").to_string();
        let closer = std::thread::spawn(move || {
            for _ in 0..2 {
                let (s, _) = listener.accept().expect("accept");
                drop(s);
            }
        });
        let got = raw_tcp_sink_gib_per_s(&addr, 2 << 20, 2, 64 << 10);
        closer.join().expect("closer");
        assert!(got.is_err(), "a source that sent nothing gave {got:?}");
    }

    /// A good raw run reads every byte it divides by.
    #[test]
    fn a_raw_run_counts_the_bytes_it_read() {
        let addr = raw_tcp_source(1 << 20, 2).expect("source");
        let got = raw_tcp_sink_gib_per_s(&addr, 1 << 20, 2, 64 << 10).expect("raw run").gib_per_s;
        assert!(got.is_finite() && got > 0.0, "{got}");
    }
}
