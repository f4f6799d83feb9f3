//! Passes on what ucx-sys found in the UCX headers: `cfg(ucx_ep_transports)` where
//! `ucp_ep_query` can list an endpoint's transports (UCX >= 1.14).

fn main() {
    println!("cargo::rustc-check-cfg=cfg(ucx_ep_transports)");
    println!("cargo:rerun-if-env-changed=DEP_UCP_EP_TRANSPORTS");
    if std::env::var("DEP_UCP_EP_TRANSPORTS").is_ok_and(|v| v == "1") {
        println!("cargo:rustc-cfg=ucx_ep_transports");
    }
}
