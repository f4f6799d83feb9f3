//! Finds UCX and generates bindings for the `ucp_*` / `ucs_*` API.
//!
//! Which UCX, first found wins:
//! 1. `UCX_HOME=<prefix>`: a prefix with `lib/pkgconfig/ucx.pc` (asked with pkg-config, its
//!    `prefix` redefined to `UCX_HOME`, so a relocated install such as the `libucx-cu12`
//!    wheel works) or else plain `lib/` + `include/` (the version read from
//!    `ucp/api/ucp_version.h`);
//! 2. in a build of the Python wheel (maturin sets `PYO3_PYTHON`): the `libucx` package of
//!    that Python (the `libucx-cu12` wheel, a build requirement and a dependency of the
//!    `kvxfer` wheel), the UCX the wheel's `kvxfer` package loads at import;
//! 3. the system UCX pkg-config finds.
//!
//! It also tells whether the headers have `ucp_ep_query`'s transport list (UCX >= 1.14):
//! `cargo:ep_transports=1` for dependents (`DEP_UCP_EP_TRANSPORTS`).
//!
//! Run time: nothing here makes a binary find the chosen libraries (an rpath emitted by this
//! build script would reach only this crate's own targets), so a binary built against
//! `UCX_HOME` runs with `LD_LIBRARY_PATH=$UCX_HOME/lib` (scripts/ucx-current.sh prints it);
//! `kvxfer-ucx` refuses to create a context when the libucp loaded is not the version these
//! bindings were generated from (the version is exported as `UCX_SYS_BUILT_VERSION`).

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

/// What the build links and includes.
struct Ucx {
    include_paths: Vec<PathBuf>,
    /// Where libucp was found (`None`: pkg-config's system paths).
    lib_dir: Option<PathBuf>,
    version: String,
}

fn main() {
    println!("cargo:rerun-if-changed=wrapper.h");
    println!("cargo:rerun-if-env-changed=UCX_HOME");
    println!("cargo:rerun-if-env-changed=PYO3_PYTHON");
    let (ucx, source) = match env::var_os("UCX_HOME").filter(|h| !h.is_empty()) {
        Some(home) => (from_home(Path::new(&home)), "UCX_HOME"),
        None => match python_libucx() {
            Some(home) => (from_home(&home), "the libucx Python package"),
            None => (from_system(), "the system (pkg-config)"),
        },
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
    let generated = bindings.to_string();
    if generated.contains("UCP_EP_ATTR_FIELD_TRANSPORTS") {
        println!("cargo:ep_transports=1");
    }
    println!("cargo:rustc-env=UCX_SYS_SOURCE={source}");
    if let Some(v) = ucx_version(&ucx.version) {
        println!("cargo:version={v}");
    }
    println!("cargo:rustc-env=UCX_SYS_BUILT_VERSION={}", ucx.version);
    let lib_dir = ucx.lib_dir.as_deref().map(|d| d.display().to_string()).unwrap_or_default();
    // For dependents' build scripts (DEP_UCP_LIBDIR) and the run-time mismatch message.
    println!("cargo:libdir={lib_dir}");
    println!("cargo:rustc-env=UCX_SYS_LIBDIR={lib_dir}");
}

/// In a maturin build (`PYO3_PYTHON` names the Python the wheel is built for): the install
/// prefix inside that Python's `libucx` package, when it has one with headers.
fn python_libucx() -> Option<PathBuf> {
    let python = env::var_os("PYO3_PYTHON").filter(|p| !p.is_empty())?;
    let out = Command::new(&python)
        .args(["-c", "import libucx, os; print(os.path.dirname(os.path.abspath(libucx.__file__)))"])
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    let dir = PathBuf::from(String::from_utf8(out.stdout).ok()?.trim());
    dir.join("include/ucp/api/ucp.h").exists().then_some(dir)
}

/// The system UCX, found by pkg-config (which also emits the link flags).
fn from_system() -> Ucx {
    match pkg_config::Config::new().atleast_version("1.12").probe("ucx") {
        Ok(lib) => Ucx { include_paths: lib.include_paths, lib_dir: None, version: lib.version },
        Err(e) => panic!(
            "\n\nucx-sys: UCX development files (ucx.pc, >= 1.12) were not found: {e}\n\
             On Debian/Ubuntu install them with:\n\n    apt-get install libucx-dev pkg-config libclang-dev\n\n\
             or name a UCX install with UCX_HOME=<prefix> (scripts/ucx-current.sh prints one),\n\
             or build kvxfer without the `ucx` feature.\n"
        ),
    }
}

/// The UCX installed under `home`; panics with what is missing.
fn from_home(home: &Path) -> Ucx {
    let home = home.canonicalize().unwrap_or_else(|e| panic!("ucx-sys: UCX_HOME={}: {e}", home.display()));
    let (include, lib) = (home.join("include"), home.join("lib"));
    for needed in [include.join("ucp/api/ucp.h"), lib.join("libucp.so")] {
        assert!(
            needed.exists(),
            "ucx-sys: UCX_HOME={} has no {} (UCX_HOME must be a prefix with lib/ and include/)",
            home.display(),
            needed.display()
        );
    }
    let pc_dir = lib.join("pkgconfig");
    let ucx = if pc_dir.join("ucx.pc").exists() {
        from_pc(&home, &pc_dir)
    } else {
        for l in ["ucp", "uct", "ucs"] {
            println!("cargo:rustc-link-lib=dylib={l}");
        }
        Ucx {
            include_paths: vec![include.clone()],
            lib_dir: Some(lib.clone()),
            version: header_version(&include),
        }
    };
    println!("cargo:rustc-link-search=native={}", lib.display());
    // Only files that exist: cargo reruns a build script whose named file is missing on
    // every build.
    for f in ["include/ucp/api/ucp_version.h", "lib/pkgconfig/ucx.pc"].map(|f| home.join(f)) {
        if f.exists() {
            println!("cargo:rerun-if-changed={}", f.display());
        }
    }
    Ucx { lib_dir: Some(lib), ..ucx }
}

/// `ucx.pc` under `pc_dir` (and only there), its `prefix` redefined as `home`: the `.pc` of a
/// relocated install (a wheel) names the prefix it was built in.
fn from_pc(home: &Path, pc_dir: &Path) -> Ucx {
    let pkg_config = env::var_os("PKG_CONFIG").unwrap_or_else(|| "pkg-config".into());
    let ask = |what: &[&str]| -> String {
        let out = Command::new(&pkg_config)
            .env("PKG_CONFIG_LIBDIR", pc_dir)
            .env_remove("PKG_CONFIG_PATH")
            .env_remove("PKG_CONFIG_SYSROOT_DIR")
            .arg(format!("--define-variable=prefix={}", home.display()))
            .args(what)
            .arg("ucx")
            .output()
            .unwrap_or_else(|e| panic!("ucx-sys: running pkg-config: {e}"));
        assert!(
            out.status.success(),
            "ucx-sys: pkg-config {what:?} ucx in {} failed: {}",
            pc_dir.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).expect("pkg-config prints UTF-8").trim().to_owned()
    };
    let version = ask(&["--modversion"]);
    let mut include_paths = Vec::new();
    for flag in ask(&["--cflags-only-I"]).split_whitespace() {
        if let Some(dir) = flag.strip_prefix("-I") {
            include_paths.push(PathBuf::from(dir));
        }
    }
    for flag in ask(&["--libs"]).split_whitespace() {
        if let Some(dir) = flag.strip_prefix("-L") {
            let dir = Path::new(dir);
            assert!(
                dir.starts_with(home),
                "ucx-sys: {}/ucx.pc links from {} outside UCX_HOME={}",
                pc_dir.display(),
                dir.display(),
                home.display()
            );
        } else if let Some(l) = flag.strip_prefix("-l") {
            println!("cargo:rustc-link-lib=dylib={l}");
        }
    }
    if include_paths.is_empty() {
        include_paths.push(home.join("include"));
    }
    Ucx { include_paths, lib_dir: None, version }
}

/// `major.minor` from `ucp/api/ucp_version.h` under `include`.
fn header_version(include: &Path) -> String {
    let path = include.join("ucp/api/ucp_version.h");
    let text =
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("ucx-sys: reading {}: {e}", path.display()));
    let define = |name: &str| {
        text.lines()
            .filter_map(|l| l.trim().strip_prefix("#define "))
            .find_map(|l| l.trim().strip_prefix(name).filter(|rest| rest.starts_with(char::is_whitespace)))
            .map(|v| v.trim().to_owned())
            .unwrap_or_else(|| panic!("ucx-sys: {} does not define {name}", path.display()))
    };
    format!("{}.{}", define("UCP_API_MAJOR"), define("UCP_API_MINOR"))
}

fn ucx_version(v: &str) -> Option<String> {
    (!v.is_empty()).then(|| v.to_owned())
}
