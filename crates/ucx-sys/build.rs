//! Finds the system UCX with pkg-config and generates bindings for the `ucp_*` / `ucs_*` API.

use std::env;
use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-changed=wrapper.h");
    let ucx = match pkg_config::Config::new().atleast_version("1.12").probe("ucx") {
        Ok(lib) => lib,
        Err(e) => panic!(
            "\n\nucx-sys: UCX development files (ucx.pc, >= 1.12) were not found: {e}\n\
             On Debian/Ubuntu install them with:\n\n    apt-get install libucx-dev pkg-config libclang-dev\n\n\
             (or build kvxfer without the `ucx` feature).\n"
        ),
    };
    let mut builder = bindgen::Builder::default()
        .header("wrapper.h")
        .allowlist_function("ucp_.*")
        .allowlist_function("ucs_status_string")
        .allowlist_type("ucp_.*")
        .allowlist_type("ucs_status_t")
        .allowlist_type("ucs_status_ptr_t")
        .allowlist_type("ucs_thread_mode_t")
        .allowlist_var("UCP_.*")
        .allowlist_var("UCS_.*")
        .prepend_enum_name(false)
        .derive_default(true)
        .layout_tests(false)
        .parse_callbacks(Box::new(bindgen::CargoCallbacks::new()));
    for path in &ucx.include_paths {
        builder = builder.clang_arg(format!("-I{}", path.display()));
    }
    let bindings = builder.generate().unwrap_or_else(|e| {
        panic!("ucx-sys: bindgen failed on <ucp/api/ucp.h> ({e}); is libclang-dev installed?")
    });
    let out = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    bindings.write_to_file(out.join("bindings.rs")).expect("writing bindings.rs");
    if let Some(v) = ucx_version(&ucx.version) {
        println!("cargo:version={v}");
    }
}

fn ucx_version(v: &str) -> Option<String> {
    (!v.is_empty()).then(|| v.to_owned())
}
