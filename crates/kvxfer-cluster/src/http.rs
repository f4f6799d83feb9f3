//! The `/metrics` HTTP endpoint (HTTP/1.1, hyper).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::header::{HeaderValue, ACCEPT, ALLOW, CONTENT_TYPE, VARY};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::runtime::Handle;
use tokio::sync::{oneshot, Semaphore};
use tokio::task::{JoinHandle, JoinSet};

use crate::error::{Error, MetricsError};
use crate::metrics::{Format, Metrics};

/// Most scrapes served at once; further connections are closed at once.
const MAX_CONNECTIONS: usize = 64;
/// A request's head must arrive within this (a stalled client cannot hold a slot).
const HEADER_TIMEOUT: Duration = Duration::from_secs(5);
/// How long shutdown waits for scrapes in progress.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);
/// Longest life of one connection (keep-alive included): a client that pipelines requests
/// and never reads the answers, which blocks the connection in a write, frees its slot.
const CONNECTION_LIFETIME: Duration = Duration::from_secs(30);

/// Serves `GET /metrics`: the Prometheus text format 0.0.4, or OpenMetrics text when the
/// request's `Accept` header prefers it ([`Format::negotiate`]); every other path is 404,
/// other methods 405.
#[derive(Debug)]
pub struct MetricsServer {
    addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<()>>,
}

impl MetricsServer {
    /// Binds `listen` (port 0 picks a free port) and serves on `runtime` until shut down.
    pub fn start(runtime: &Handle, listen: &str, metrics: Arc<Metrics>) -> Result<Self, Error> {
        let bind_err = |source| MetricsError::Bind { addr: listen.to_owned(), source };
        let std_listener = std::net::TcpListener::bind(listen).map_err(bind_err)?;
        std_listener.set_nonblocking(true).map_err(bind_err)?;
        let addr = std_listener.local_addr().map_err(bind_err)?;
        let listener = {
            let _entered = runtime.enter();
            tokio::net::TcpListener::from_std(std_listener).map_err(bind_err)?
        };
        let (stop_tx, stop_rx) = oneshot::channel();
        let task = runtime.spawn(serve(listener, metrics, stop_rx));
        tracing::info!(%addr, "serving metrics at /metrics");
        Ok(Self { addr, stop: Some(stop_tx), task: Some(task) })
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops accepting, lets scrapes in progress finish (bounded), and closes.
    pub async fn shutdown(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

async fn serve(listener: tokio::net::TcpListener, metrics: Arc<Metrics>, mut stop: oneshot::Receiver<()>) {
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    // The connections' tasks: ended with this task (dropping the set aborts them).
    let mut connections = JoinSet::new();
    loop {
        while connections.try_join_next().is_some() {}
        let (stream, peer) = tokio::select! {
            _ = &mut stop => break,
            accepted = listener.accept() => match accepted {
                Ok(pair) => pair,
                Err(e) => {
                    // Out of descriptors and the like: pause instead of spinning.
                    tracing::warn!(error = %e, "metrics endpoint: accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            tracing::debug!(%peer, "metrics endpoint: too many connections, closing one");
            continue;
        };
        let metrics = metrics.clone();
        let service = hyper::service::service_fn(move |req| {
            let metrics = metrics.clone();
            async move { Ok::<_, Infallible>(respond(&metrics, &req)) }
        });
        let conn = hyper::server::conn::http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(HEADER_TIMEOUT)
            .serve_connection(TokioIo::new(stream), service);
        let conn = graceful.watch(conn);
        connections.spawn(async move {
            match tokio::time::timeout(CONNECTION_LIFETIME, conn).await {
                Ok(Err(e)) => tracing::debug!(%peer, error = %e, "metrics connection ended with an error"),
                Err(_) => tracing::debug!(%peer, "metrics connection closed at the end of its lifetime"),
                Ok(Ok(())) => {}
            }
            drop(slot);
        });
    }
    drop(listener);
    if tokio::time::timeout(SHUTDOWN_GRACE, graceful.shutdown()).await.is_err() {
        tracing::debug!(
            open = connections.len(),
            "metrics endpoint: closing scrapes still open after the grace period"
        );
    }
    connections.abort_all();
    while connections.join_next().await.is_some() {}
}

fn text(status: StatusCode, body: &'static str) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from_static(body.as_bytes())));
    *response.status_mut() = status;
    response.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("text/plain; charset=utf-8"));
    response
}

fn respond(metrics: &Metrics, req: &Request<Incoming>) -> Response<Full<Bytes>> {
    if req.uri().path() != "/metrics" {
        return text(StatusCode::NOT_FOUND, "not found: metrics are at /metrics\n");
    }
    if req.method() != Method::GET && req.method() != Method::HEAD {
        let mut response = text(StatusCode::METHOD_NOT_ALLOWED, "use GET\n");
        response.headers_mut().insert(ALLOW, HeaderValue::from_static("GET, HEAD"));
        return response;
    }
    // Several Accept headers are one list.
    let accept: Vec<&str> = req.headers().get_all(ACCEPT).iter().filter_map(|v| v.to_str().ok()).collect();
    let format = Format::negotiate((!accept.is_empty()).then(|| accept.join(",")).as_deref());
    match metrics.encode_as(format) {
        Ok(body) => {
            let mut response = Response::new(Full::new(Bytes::from(body)));
            let headers = response.headers_mut();
            headers.insert(CONTENT_TYPE, HeaderValue::from_static(format.content_type()));
            headers.insert(VARY, HeaderValue::from_static("Accept"));
            response
        }
        Err(e) => {
            tracing::warn!(error = %e, "metrics endpoint: encoding failed");
            text(StatusCode::INTERNAL_SERVER_ERROR, "encoding the metrics failed\n")
        }
    }
}
