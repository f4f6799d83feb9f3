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

/// Median round trip on 127.0.0.1 of a 64-byte request answered with one `block` of data
/// read into a buffer: what a one-block hand-off cannot beat.
pub(crate) fn raw_tcp_rtt_p50_us(block: u64) -> Result<f64, String> {
    let listener = TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    let len = block as usize;
    let rounds = 200;
    let server = std::thread::spawn(move || -> Result<(), String> {
        let (mut s, _) = listener.accept().map_err(|e| e.to_string())?;
        s.set_nodelay(true).map_err(|e| e.to_string())?;
        let data = vec![7u8; len];
        let mut req = [0u8; 64];
        for _ in 0..rounds {
            s.read_exact(&mut req).map_err(|e| e.to_string())?;
            s.write_all(&data).map_err(|e| e.to_string())?;
        }
        Ok(())
    });
    let mut c = TcpStream::connect(addr).map_err(|e| e.to_string())?;
    c.set_nodelay(true).map_err(|e| e.to_string())?;
    let mut buf = vec![0u8; len];
    let mut samples = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        let t0 = Instant::now();
        c.write_all(&[1u8; 64]).map_err(|e| e.to_string())?;
        c.read_exact(&mut buf).map_err(|e| e.to_string())?;
        samples.push(t0.elapsed().as_secs_f64() * 1e6);
    }
    server.join().map_err(|_| "rtt server panicked".to_string())??;
    samples.sort_by(f64::total_cmp);
    Ok(percentile(&samples, 0.5))
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
