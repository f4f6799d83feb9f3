//! Compiles `proto/kvxfer/v1/*.proto` with protox (a pure-Rust protobuf compiler), so no
//! `protoc` is needed on the machine, and feeds the descriptors to prost-build.

use std::path::PathBuf;

fn main() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../proto");
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
