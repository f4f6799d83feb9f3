//! A `kvxfer-node` process driven by JSON lines on stdin and read by the JSON lines it
//! prints, killed when dropped: shared by the process tests (`kill.rs`, `sigterm.rs`).
// Each test binary uses some of it.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

const BIN: &str = env!("CARGO_BIN_EXE_kvxfer-node");

/// The cluster key every node of a test has, as a deployment's processes would (hex).
const KEY_HEX: &str = "6b696c6c2d7465737420636c7573746572206b6579";

/// A node process, killed when dropped.
pub(crate) struct Node {
    pub(crate) child: Child,
    /// `None` once [`Node::close_stdin`] closed it.
    stdin: Option<ChildStdin>,
    lines: Receiver<Value>,
    /// Lines [`Node::wait`] read past while looking for another.
    pub(crate) seen: Vec<Value>,
}

impl Node {
    /// Starts `kvxfer-node` with `args` and the test cluster key.
    pub(crate) fn start(args: &[&str]) -> Node {
        let mut child = Command::new(BIN)
            .args(args)
            .env(kvxfer::CLUSTER_KEY_ENV, KEY_HEX)
            .env_remove(kvxfer::CLUSTER_KEY_FILE_ENV)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn kvxfer-node");
        let stdin = child.stdin.take().expect("stdin");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for l in BufReader::new(stdout).lines().map_while(Result::ok) {
                let v: Value =
                    serde_json::from_str(&l).unwrap_or_else(|_| json!({"event": "unparsed", "line": l}));
                if tx.send(v).is_err() {
                    return;
                }
            }
        });
        Node { child, stdin: Some(stdin), lines, seen: Vec::new() }
    }

    /// Writes one command line.
    pub(crate) fn send(&mut self, cmd: Value) {
        writeln!(self.stdin.as_mut().expect("stdin is open"), "{cmd}").expect("write command");
    }

    /// Closes the node's stdin: the end of its commands.
    pub(crate) fn close_stdin(&mut self) {
        self.stdin = None;
    }

    /// The next line that `matches`, within `timeout` (other lines are kept in `seen`).
    pub(crate) fn wait(&mut self, what: &str, timeout: Duration, matches: impl Fn(&Value) -> bool) -> Value {
        let deadline = Instant::now() + timeout;
        loop {
            match self.lines.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                Ok(v) if matches(&v) => return v,
                Ok(v) => self.seen.push(v),
                Err(RecvTimeoutError::Timeout) => panic!("no {what} within {timeout:?}; saw {:?}", self.seen),
                Err(RecvTimeoutError::Disconnected) => {
                    panic!("node exited before {what}; saw {:?}", self.seen)
                }
            }
        }
    }

    /// The next line whose event is `event` (others are kept in `seen`).
    pub(crate) fn event(&mut self, event: &str, timeout: Duration) -> Value {
        self.wait(event, timeout, |v| v["event"] == event)
    }

    /// The next line whose event is `event`, skipping (and returning in `skipped`) others.
    pub(crate) fn wait_event(&self, event: &str, timeout: Duration, skipped: &mut Vec<Value>) -> Value {
        let deadline = Instant::now() + timeout;
        loop {
            match self.lines.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                Ok(v) if v["event"] == event => return v,
                Ok(v) => skipped.push(v),
                Err(RecvTimeoutError::Timeout) => panic!("no {event} within {timeout:?}; saw {skipped:?}"),
                Err(RecvTimeoutError::Disconnected) => panic!("node exited before {event}; saw {skipped:?}"),
            }
        }
    }

    /// `count` events named `event`, in arrival order, and the lines skipped meanwhile.
    pub(crate) fn wait_events(
        &self,
        event: &str,
        count: usize,
        timeout: Duration,
    ) -> (Vec<Value>, Vec<Value>) {
        let deadline = Instant::now() + timeout;
        let mut skipped = Vec::new();
        let got = (0..count)
            .map(|_| self.wait_event(event, deadline.saturating_duration_since(Instant::now()), &mut skipped))
            .collect();
        (got, skipped)
    }

    /// Sends `signal` (`STOP`, `CONT`, `TERM`) to the process.
    pub(crate) fn signal(&self, signal: &str) {
        let ok = Command::new("kill")
            .args([&format!("-{signal}"), &self.child.id().to_string()])
            .status()
            .expect("run kill");
        assert!(ok.success(), "kill -{signal}");
    }

    /// The next line within `timeout`, if any (`Err` also when the node exited).
    pub(crate) fn next_line(&self, timeout: Duration) -> Result<Value, RecvTimeoutError> {
        self.lines.recv_timeout(timeout)
    }

    /// `kill -9`: no destructor, no goodbye frame.
    pub(crate) fn kill9(&mut self) {
        self.child.kill().expect("kill -9");
        let _ = self.child.wait();
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
