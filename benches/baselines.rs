//! The machine's ceilings, measured in the same run: raw TCP on 127.0.0.1 (bandwidth and a
//! one-block round trip) and memcpy.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Instant;

use crate::measure::percentile;

/// Raw TCP: `connections` sockets on 127.0.0.1 moving `total` bytes from one buffer to
/// another, `block`-sized writes and reads, no protocol. Buffers are allocated and touched
/// and connections made before the clock starts.
pub(crate) fn raw_tcp_gib_per_s(total: u64, connections: usize, block: u64) -> Result<f64, String> {
    use std::sync::{Arc, Barrier};
    let connections = connections.max(1);
    let per = (total / connections as u64) as usize;
    let chunk = (block as usize).clamp(4096, 1 << 21);
    let listener = TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    let clients: Vec<TcpStream> = (0..connections)
        .map(|_| TcpStream::connect(addr).map_err(|e| e.to_string()))
        .collect::<Result<_, _>>()?;
    let servers: Vec<TcpStream> = (0..connections)
        .map(|_| listener.accept().map(|(s, _)| s).map_err(|e| e.to_string()))
        .collect::<Result<_, _>>()?;
    // Senders, receivers and this thread start together.
    let start = Arc::new(Barrier::new(2 * connections + 1));
    let mut threads = Vec::new();
    for mut s in servers {
        let start = start.clone();
        threads.push(std::thread::spawn(move || {
            let src = vec![0x5au8; per];
            start.wait();
            for c in src.chunks(chunk) {
                if s.write_all(c).is_err() {
                    return;
                }
            }
        }));
    }
    for mut s in clients {
        let start = start.clone();
        threads.push(std::thread::spawn(move || {
            let mut dst = vec![1u8; per];
            start.wait();
            for c in dst.chunks_mut(chunk) {
                if s.read_exact(c).is_err() {
                    return;
                }
            }
            std::hint::black_box(&dst);
        }));
    }
    start.wait();
    let t0 = Instant::now();
    for t in threads {
        t.join().map_err(|_| "raw tcp thread panicked".to_string())?;
    }
    Ok((per * connections) as f64 / f64::from(1u32 << 30) / t0.elapsed().as_secs_f64())
}

/// Round trips on 127.0.0.1 of a 64-byte request answered with one `block` of data read
/// into a buffer: what a one-block hand-off cannot beat. The connection and its server
/// thread stay up, so samples can be taken between kvxfer's iterations (interleaved, over
/// the same minutes of a noisy machine) rather than in one burst after them.
pub(crate) struct RawRtt {
    client: TcpStream,
    buf: Vec<u8>,
    server: Option<std::thread::JoinHandle<()>>,
}

impl RawRtt {
    /// Connects a client to a server thread that answers every 64-byte request with `block`
    /// bytes (until the client hangs up).
    pub(crate) fn start(block: u64) -> Result<Self, String> {
        let listener = TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
        let addr = listener.local_addr().map_err(|e| e.to_string())?;
        let len = block as usize;
        let server = std::thread::spawn(move || {
            let Ok((mut s, _)) = listener.accept() else { return };
            let _ = s.set_nodelay(true);
            let data = vec![7u8; len];
            let mut req = [0u8; 64];
            while s.read_exact(&mut req).is_ok() && s.write_all(&data).is_ok() {}
        });
        let client = TcpStream::connect(addr).map_err(|e| e.to_string())?;
        client.set_nodelay(true).map_err(|e| e.to_string())?;
        Ok(RawRtt { client, buf: vec![0u8; len], server: Some(server) })
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
