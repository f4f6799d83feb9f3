//! `PrefillAgent`: leases (and arms) children's blocks, serves them, and reports how each
//! lease ended.

use std::time::Duration;

use kvxfer::{AgentConfig, EndKind, LeaseEnd, LeaseRequest, TransportChoice};
use kvxfer_core::CancelOutcome;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::{raise, to_py, ConfigError, LeaseError};
use crate::host::{runtime, Hosted};
use crate::memory::Memory;
use crate::params::{handoff_from_py, seconds, BlockLists, Handoff};
use crate::shape::KvShape;

/// Options both agents share, from keyword arguments.
#[allow(clippy::too_many_arguments)]
pub(crate) fn base_config(
    py: Python<'_>,
    agent_name: &str,
    engine_id: Option<&str>,
    rank: u32,
    cluster_key: Option<&str>,
    io_timeout: f64,
    worker_threads: usize,
    (transport, ucx_tls, ucx_peer_failure): (&str, Option<&str>, Option<bool>),
    shutdown_grace: f64,
) -> PyResult<AgentConfig> {
    let mut c = AgentConfig::new(agent_name).rank(rank).worker_threads(worker_threads);
    if let Some(id) = engine_id {
        c = c.engine_id(id);
    }
    c = match cluster_key {
        Some(hex) => c.cluster_key(
            kvxfer::ClusterKey::from_hex(hex)
                .map_err(|e| raise::<ConfigError>(py, format!("cluster_key: {e}"), &[]))?,
        ),
        None => c.cluster_key_from_env().map_err(|e| to_py(py, e))?,
    };
    c = c.io_timeout(seconds(py, "io_timeout", io_timeout)?);
    c = c.shutdown_grace(seconds(py, "shutdown_grace", shutdown_grace)?);
    c.transport = transport_choice(py, transport)?;
    #[cfg(feature = "ucx")]
    {
        c.ucx.tls = ucx_tls.map(str::to_owned);
        if let Some(on) = ucx_peer_failure {
            // An explicit choice, for every peer (as `AgentConfig::ucx_options`).
            c.ucx.peer_failure_handling = on;
            c.ucx.same_host_shared_memory = false;
        }
    }
    #[cfg(not(feature = "ucx"))]
    if ucx_tls.is_some() || ucx_peer_failure.is_some() {
        return Err(raise::<ConfigError>(
            py,
            "UCX options: this kvxfer is built without UCX".to_owned(),
            &[],
        ));
    }
    Ok(c)
}

/// `"auto"` (UCX where both peers offer it, else TCP), `"tcp"` or `"ucx"`; in a build without
/// UCX, `"auto"` is TCP and `"ucx"` an error.
fn transport_choice(py: Python<'_>, transport: &str) -> PyResult<TransportChoice> {
    let choice: TransportChoice = transport.parse().map_err(|e: String| raise::<ConfigError>(py, e, &[]))?;
    if cfg!(not(feature = "ucx")) {
        return match choice {
            TransportChoice::Ucx => Err(raise::<ConfigError>(
                py,
                "transport \"ucx\": this kvxfer is built without UCX (the TCP data path only); \
                 install the wheel built with it (pip install kvxfer) or use \"tcp\"/\"auto\""
                    .to_owned(),
                &[],
            )),
            _ => Ok(TransportChoice::Tcp),
        };
    }
    Ok(choice)
}

/// `config` with `shape` (completed from `memory`'s layouts): its TP size and rank become
/// the agent's. `given` is the `(rank, tp_size)` passed beside it: anything but the
/// defaults must agree with the shape.
pub(crate) fn apply_shape(
    py: Python<'_>,
    config: AgentConfig,
    shape: &KvShape,
    memory: &Memory,
    given: (u32, u32),
) -> PyResult<AgentConfig> {
    let spec = shape.spec_for(py, memory.layouts())?;
    for (name, value, default, want) in
        [("rank", given.0, 0, spec.tp_rank), ("tp_size", given.1, 1, spec.tp_size)]
    {
        if value != default && value != want {
            return Err(raise::<ConfigError>(
                py,
                format!("{name}={value} disagrees with kv_shape's {want} (give it once, in kv_shape)"),
                &[("field", crate::errors::s(py, name))],
            ));
        }
    }
    Ok(config.kv_shape(spec))
}

/// How a lease ended, as Python sees it.
fn end_kind(k: EndKind) -> &'static str {
    match k {
        EndKind::Pulled => "pulled",
        EndKind::Released => "released",
        EndKind::Expired => "expired",
    }
}

/// A lease end as a dict.
fn end_dict<'py>(py: Python<'py>, e: &LeaseEnd) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("remote_request_id", &*e.remote_request_id)?;
    d.set_item("parent_request_id", &*e.parent_request_id)?;
    d.set_item("child_index", e.child_index)?;
    d.set_item("n", e.n)?;
    d.set_item("kind", end_kind(e.kind))?;
    d.set_item("blocks", e.blocks.to_vec())?;
    let groups: Vec<Vec<u32>> =
        std::iter::once(e.blocks.to_vec()).chain(e.other_groups.iter().cloned()).collect();
    d.set_item("group_blocks", groups)?;
    d.set_item("consumers_seen", e.consumers_seen)?;
    d.set_item("expected_consumers", e.expected_consumers)?;
    d.set_item("generation", e.generation)?;
    d.set_item("life_seconds", e.ended_at.saturating_duration_since(e.leased_at).as_secs_f64())?;
    Ok(d)
}

/// The outcome of a cancel, as a string.
pub(crate) fn cancel_outcome(o: CancelOutcome) -> &'static str {
    match o {
        CancelOutcome::Released => "released",
        CancelOutcome::Unrecognized => "unrecognized",
        CancelOutcome::BadToken => "bad_token",
        CancelOutcome::AlreadyEnded(EndKind::Pulled) => "already_pulled",
        CancelOutcome::AlreadyEnded(EndKind::Released) => "already_released",
        CancelOutcome::AlreadyEnded(EndKind::Expired) => "already_expired",
    }
}

/// A prefill worker's agent: serves the registered KV cache over TCP, leases children's
/// blocks (or arms leases minted elsewhere), and reports how each lease ended — pulled,
/// released or expired, once each. Do not write a leased block until its end is reported.
#[pyclass(module = "kvxfer._kvxfer", frozen)]
pub(crate) struct PrefillAgent {
    host: Hosted<kvxfer::PrefillAgent>,
    engine_id: String,
    /// The lease ends, kept past a shutdown (which releases every live lease: those ends
    /// are still reported).
    ends: crossbeam_channel::Receiver<LeaseEnd>,
}

impl PrefillAgent {
    fn agent(&self, py: Python<'_>) -> PyResult<std::sync::Arc<kvxfer::PrefillAgent>> {
        Ok(self.host.get(py)?.0)
    }
}

#[pymethods]
impl PrefillAgent {
    /// Starts an agent serving `memory` (which it takes over) on `listen` (port 0: a free
    /// port). Without `cluster_key` (hex), `KVXFER_CLUSTER_KEY` / `KVXFER_CLUSTER_KEY_FILE`
    /// are read; with neither, peers are not authenticated. Durations are in seconds.
    #[new]
    #[pyo3(signature = (
        memory, listen = "127.0.0.1:0", *, agent_name = "prefill", engine_id = None, rank = 0, tp_size = 1,
        kv_shape = None, advertise_host = None, cluster_key = None, lease_ttl = 30.0, arm_wait = 5.0, max_lease_lifetime = 600.0,
        io_timeout = 10.0, worker_threads = 2, transport = "auto", ucx_tls = None, ucx_peer_failure_handling = None,
        shutdown_grace = 5.0
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        memory: &Memory,
        listen: &str,
        agent_name: &str,
        engine_id: Option<&str>,
        rank: u32,
        tp_size: u32,
        kv_shape: Option<Bound<'_, KvShape>>,
        advertise_host: Option<String>,
        cluster_key: Option<&str>,
        lease_ttl: f64,
        arm_wait: f64,
        max_lease_lifetime: f64,
        io_timeout: f64,
        worker_threads: usize,
        transport: &str,
        ucx_tls: Option<&str>,
        ucx_peer_failure_handling: Option<bool>,
        shutdown_grace: f64,
    ) -> PyResult<Self> {
        let mut config = base_config(
            py,
            agent_name,
            engine_id,
            rank,
            cluster_key,
            io_timeout,
            worker_threads,
            (transport, ucx_tls, ucx_peer_failure_handling),
            shutdown_grace,
        )?;
        config = config
            .lease_ttl(seconds(py, "lease_ttl", lease_ttl)?)
            .arm_wait(seconds(py, "arm_wait", arm_wait)?)
            .max_lease_lifetime(seconds(py, "max_lease_lifetime", max_lease_lifetime)?);
        config.tp_size = tp_size;
        if let Some(shape) = kv_shape {
            config = apply_shape(py, config, shape.get(), memory, (rank, tp_size))?;
        }
        config.advertise_host = advertise_host;
        let engine_id = config.engine_id.clone();
        let memory = memory.take(py)?;
        let rt = runtime(py, agent_name, worker_threads)?;
        let handle = rt.handle().clone();
        let listen = listen.to_owned();
        let started =
            py.detach(|| rt.block_on(kvxfer::PrefillAgent::start_on(handle, config, &listen, memory)));
        let agent = started.map_err(|e| to_py(py, e))?;
        let ends = agent.events().clone();
        Ok(PrefillAgent { host: Hosted::new(agent, rt, "prefill agent"), engine_id, ends })
    }

    /// The engine id hand-offs name (`remote_engine_id`).
    #[getter]
    fn engine_id(&self) -> &str {
        &self.engine_id
    }

    /// `(host, port)` hand-offs name (the advertised host and the listening port).
    #[getter]
    fn address(&self, py: Python<'_>) -> PyResult<(String, u16)> {
        let a = self.agent(py)?;
        Ok((a.advertised_host().to_owned(), a.local_addr().port()))
    }

    /// The port the agent listens on.
    #[getter]
    fn port(&self, py: Python<'_>) -> PyResult<u16> {
        Ok(self.agent(py)?.local_addr().port())
    }

    /// This agent process's incarnation (random per start; in every hand-off).
    #[getter]
    fn incarnation(&self, py: Python<'_>) -> PyResult<u64> {
        Ok(self.agent(py)?.incarnation())
    }

    /// Starts draining: new leases (`lease`, `lease_parent`) raise `LeaseError` with kind
    /// `'draining'` (an `arm` does not: its hand-off already left), while leases made before
    /// are still pulled and end as usual (their ends keep arriving on `poll_ends`). Shut down once `stats()` shows no live lease.
    fn drain(&self, py: Python<'_>) -> PyResult<()> {
        self.agent(py)?.drain();
        Ok(())
    }

    /// Ends a drain started by `drain()`.
    fn undrain(&self, py: Python<'_>) -> PyResult<()> {
        self.agent(py)?.undrain();
        Ok(())
    }

    /// Whether the agent offers the UCX data path (it started UCX: transport `"auto"` or
    /// `"ucx"` in a build with UCX, and UCX started here).
    #[getter]
    fn offers_ucx(&self, py: Python<'_>) -> PyResult<bool> {
        Ok(self.agent(py)?.offers_ucx())
    }

    /// Whether the agent is draining (new leases refused).
    #[getter]
    fn draining(&self, py: Python<'_>) -> PyResult<bool> {
        Ok(self.agent(py)?.is_draining())
    }

    /// Leases child `child_index` of `parent` (`n` children) over `blocks` (a list, or one
    /// list per KV-cache group); the lease is registered before the hand-off is returned.
    /// `ttl` in seconds (default: `lease_ttl`).
    #[pyo3(signature = (parent, child_index, n, blocks, *, expected_consumers = 1, ttl = None))]
    #[allow(clippy::too_many_arguments)]
    fn lease(
        &self,
        py: Python<'_>,
        parent: &str,
        child_index: u32,
        n: u32,
        blocks: Bound<'_, PyAny>,
        expected_consumers: u32,
        ttl: Option<f64>,
    ) -> PyResult<Handoff> {
        let blocks = BlockLists::extract(&blocks)?;
        let mut req =
            LeaseRequest::grouped(parent, child_index, n, blocks.into_groups()).consumers(expected_consumers);
        req.ttl = ttl.map(|t| seconds(py, "ttl", t)).transpose()?;
        let agent = self.agent(py)?;
        let h = agent.lease(req).map_err(|e| to_py(py, e))?;
        Ok(Handoff { inner: h })
    }

    /// Leases every child of `parent` (`blocks[i]` for child i, n = len(blocks): a list, or
    /// one list per KV-cache group) and returns one hand-off per child, child 0 first. On
    /// error no lease of the call remains.
    #[pyo3(signature = (parent, blocks, *, expected_consumers = 1, ttl = None))]
    fn lease_parent(
        &self,
        py: Python<'_>,
        parent: &str,
        blocks: Vec<Bound<'_, PyAny>>,
        expected_consumers: u32,
        ttl: Option<f64>,
    ) -> PyResult<Vec<Handoff>> {
        let blocks = BlockLists::extract_each(&blocks)?;
        let ttl: Option<Duration> = ttl.map(|t| seconds(py, "ttl", t)).transpose()?;
        let agent = self.agent(py)?;
        let blocks = blocks.into_iter().map(BlockLists::into_groups).collect();
        let result =
            agent.lease_parent_groups(parent, blocks, expected_consumers, ttl).map_err(|e| to_py(py, e))?;
        Ok(result.children().iter().map(|h| Handoff { inner: h.clone() }).collect())
    }

    /// Arms the lease a scheduler process minted into `params` (the second phase of a
    /// two-phase lease): exactly its `remote_request_id`, `kvxfer_lease_token`, parent, child
    /// index, n, `remote_block_ids`, consumers and ttl. `params` must name this agent's
    /// engine (`remote_engine_id`), and, when it states one, its incarnation. Reads and
    /// notifications that arrived first waited for this (`arm_wait`) and are answered now.
    fn arm(&self, py: Python<'_>, params: &Bound<'_, PyAny>) -> PyResult<Handoff> {
        let h = handoff_from_py(params, "")?;
        let agent = self.agent(py)?;
        let engine = h.engine();
        let mine = agent.as_ref();
        let own_id = &self.engine_id;
        if engine.engine_id != *own_id
            || (engine.incarnation != 0 && engine.incarnation != mine.incarnation())
        {
            return Err(raise::<LeaseError>(
                py,
                format!(
                    "arming {}: the params name engine {} (incarnation {}), this agent is engine {own_id} \
                     (incarnation {})",
                    h.remote_request_id(),
                    engine.engine_id,
                    engine.incarnation,
                    mine.incarnation()
                ),
                &[("kind", crate::errors::s(py, "wrong_engine"))],
            ));
        }
        let groups = h.groups().map(<[u32]>::to_vec).collect();
        let mut req = LeaseRequest::grouped(h.parent_request_id(), h.child_index(), h.n(), groups)
            .consumers(h.expected_consumers());
        req.ttl = Some(h.ttl());
        let armed = agent.arm(h.remote_request_id(), req, *h.token()).map_err(|e| to_py(py, e))?;
        Ok(Handoff { inner: armed })
    }

    /// Releases a lease from the owner's side (the request was aborted): `handoff` is a
    /// `Handoff` or its params dict. Returns "released", or how it had ended already
    /// ("already_pulled", ...), or "unrecognized".
    fn cancel(&self, py: Python<'_>, handoff: &Bound<'_, PyAny>) -> PyResult<&'static str> {
        let h = match handoff.cast::<Handoff>() {
            Ok(h) => h.get().inner.clone(),
            Err(_) => handoff_from_py(handoff, "")?,
        };
        Ok(cancel_outcome(self.agent(py)?.cancel(&h)))
    }

    /// Lease ends not yet taken, without waiting (at most `max`): dicts with
    /// `remote_request_id`, `parent_request_id`, `child_index`, `n`, `kind` ("pulled",
    /// "released", "expired"), `blocks` (free again; group 0's), `group_blocks` (every
    /// KV-cache group's, group 0 first), `consumers_seen`,
    /// `expected_consumers`, `generation`, `life_seconds` (from lease to end). Each end is
    /// delivered once — also after `shutdown()`, which ends every live lease as released.
    #[pyo3(signature = (max = None))]
    fn poll_ends<'py>(&self, py: Python<'py>, max: Option<usize>) -> PyResult<Vec<Bound<'py, PyDict>>> {
        self.ends.try_iter().take(max.unwrap_or(usize::MAX)).map(|e| end_dict(py, &e)).collect()
    }

    /// Waits up to `timeout` seconds (GIL released) until `count` lease ends arrived, and
    /// returns the ends received (fewer on timeout).
    #[pyo3(signature = (count = 1, timeout = 10.0))]
    fn wait_ends<'py>(
        &self,
        py: Python<'py>,
        count: usize,
        timeout: f64,
    ) -> PyResult<Vec<Bound<'py, PyDict>>> {
        let timeout = seconds(py, "timeout", timeout)?;
        let events = self.ends.clone();
        let got = py.detach(move || {
            let deadline = std::time::Instant::now() + timeout;
            let mut got = Vec::new();
            while got.len() < count {
                match events.recv_deadline(deadline) {
                    Ok(e) => got.push(e),
                    Err(_) => break,
                }
            }
            got
        });
        got.iter().map(|e| end_dict(py, e)).collect()
    }

    /// Counters: `{"leases": {...}, "server": {...}}` (leased, pulled, released, expired,
    /// live, unrecognized, ...; bytes and reads served, arm waits, refusals, ...).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        // Destructured in full: a counter added to the engine fails to compile here until
        // it is exposed.
        let kvxfer::PrefillStats { leases: l, server: v, connections_open } = self.agent(py)?.stats();
        let kvxfer_core::LeaseStats {
            leased,
            pulled,
            released,
            expired,
            retracted,
            live,
            draining,
            unrecognized,
            bad_token,
            duplicate,
            reads_refused,
            already_ended,
            ended_records_evicted,
        } = l;
        let leases = PyDict::new(py);
        for (k, n) in [
            ("leased", leased),
            ("pulled", pulled),
            ("released", released),
            ("expired", expired),
            ("retracted", retracted),
            ("live", live),
            ("draining", draining),
            ("unrecognized", unrecognized),
            ("bad_token", bad_token),
            ("duplicate", duplicate),
            ("reads_refused", reads_refused),
            ("already_ended", already_ended),
            ("ended_records_evicted", ended_records_evicted),
        ] {
            leases.set_item(k, n)?;
        }
        let kvxfer_tcp::ServerStats {
            bytes_served,
            bytes_served_one_sided,
            bytes_served_tcp,
            reads_served,
            reads_refused,
            connections,
            handshakes_refused,
            handshakes_abandoned,
            protocol_errors,
            pins,
            pins_open,
            connections_refused,
            pins_refused,
            pins_expired,
            stalled_frames,
            auth_required,
            auth_failed,
            peer_connections_refused,
            idle_closed,
            preauth_refused,
            slow_transfers,
            arm_waits,
            arm_wait_refused,
            arm_wait_expired,
            crc_bytes_precomputed,
            crc_bytes_at_lease,
        } = v;
        let server = PyDict::new(py);
        for (k, n) in [
            ("bytes_served", bytes_served),
            ("bytes_served_one_sided", bytes_served_one_sided),
            ("bytes_served_tcp", bytes_served_tcp),
            ("reads_served", reads_served),
            ("reads_refused", reads_refused),
            ("connections", connections),
            ("connections_open", connections_open),
            ("handshakes_refused", handshakes_refused),
            ("handshakes_abandoned", handshakes_abandoned),
            ("protocol_errors", protocol_errors),
            ("pins", pins),
            ("pins_open", pins_open),
            ("pins_refused", pins_refused),
            ("pins_expired", pins_expired),
            ("connections_refused", connections_refused),
            ("peer_connections_refused", peer_connections_refused),
            ("stalled_frames", stalled_frames),
            ("auth_required", auth_required),
            ("auth_failed", auth_failed),
            ("idle_closed", idle_closed),
            ("preauth_refused", preauth_refused),
            ("slow_transfers", slow_transfers),
            ("arm_waits", arm_waits),
            ("arm_wait_refused", arm_wait_refused),
            ("arm_wait_expired", arm_wait_expired),
            ("crc_bytes_precomputed", crc_bytes_precomputed),
            ("crc_bytes_at_lease", crc_bytes_at_lease),
        ] {
            server.set_item(k, n)?;
        }
        let d = PyDict::new(py);
        d.set_item("leases", leases)?;
        d.set_item("server", server)?;
        Ok(d)
    }

    /// Shuts the agent down (GIL released): stops accepting, lets reads in flight finish
    /// (up to `shutdown_grace`), releases every live lease (each end still reported by
    /// `poll_ends`), closes connections. Later calls return at once.
    fn shutdown(&self, py: Python<'_>) {
        py.detach(|| self.host.shutdown(|a| async move { a.shutdown().await }));
    }

    /// Whether the agent was shut down.
    #[getter]
    fn closed(&self) -> bool {
        self.host.is_closed()
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, pyo3::types::PyTuple>) {
        self.shutdown(py);
    }
}

impl Drop for PrefillAgent {
    fn drop(&mut self) {
        self.host.shutdown_detached(|a| async move { a.shutdown().await });
    }
}
