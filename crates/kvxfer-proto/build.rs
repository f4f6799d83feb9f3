//! Compiles `proto/kvxfer/v1/*.proto` with protox (a pure-Rust protobuf compiler), so no
//! `protoc` is needed on the machine, and feeds the descriptors to prost-build.

use std::path::PathBuf;

fn main() {
    // Read at run time, not with `env!` at the build script's compile time: cargo may reuse a
    // compiled build script from another checkout sharing the target directory (its unit
    // hashes are relative to the workspace), which would compile that checkout's proto file.
    let Some(manifest_dir) = std::env::var_os("CARGO_MANIFEST_DIR") else {
        panic!("CARGO_MANIFEST_DIR is not set: build kvxfer-proto with cargo");
    };
    let root = PathBuf::from(manifest_dir).join("../../proto");
    let file = root.join("kvxfer/v1/kvxfer.proto");
    println!("cargo:rerun-if-changed={}", file.display());
    let fds = match protox::compile([&file], [&root]) {
        Ok(fds) => fds,
        Err(e) => panic!("compiling {}: {e:?}", file.display()),
    };
    if let Err(e) = prost_build::Config::new().compile_fds(fds) {
        panic!("generating Rust from {}: {e}", file.display());
    }
}
