//! The UCX version the process runs with, and the check that it is the one built against.

use std::ffi::CStr;

use ucx_sys as sys;

use super::UcxError;

/// The UCX a process runs with (`ucp_get_version`) and the one its bindings were generated
/// from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UcxVersion {
    /// `ucp_get_version_string()`: the loaded libucp's version, e.g. `"1.22.0"`.
    pub runtime: String,
    /// Major, minor and release numbers of the loaded libucp.
    pub runtime_numbers: (u32, u32, u32),
    /// The version of the UCX the bindings were built against (`ucx-sys`'s build script).
    pub built: &'static str,
    /// That UCX's `lib/` when it came from `UCX_HOME` or a `libucx` package; empty for the
    /// system UCX.
    pub built_lib_dir: &'static str,
    /// Where that UCX came from (`ucx_sys::UCX_SYS_SOURCE`).
    pub built_from: &'static str,
}

impl UcxVersion {
    /// Whether the loaded libucp has the major and minor version of the headers built
    /// against (a different one would take structures laid out for another API).
    pub fn matches_build(&self) -> bool {
        (self.runtime_numbers.0, self.runtime_numbers.1) == (sys::UCP_API_MAJOR, sys::UCP_API_MINOR)
    }
}

/// The UCX loaded in this process, and the one built against.
pub fn ucx_version() -> UcxVersion {
    let (mut major, mut minor, mut release) = (0u32, 0u32, 0u32);
    // SAFETY: ucp_get_version only writes the three numbers through valid pointers; it needs
    // no context.
    unsafe { sys::ucp_get_version(&mut major, &mut minor, &mut release) };
    // SAFETY: ucp_get_version_string returns a pointer to a static NUL-terminated string.
    let text = unsafe { CStr::from_ptr(sys::ucp_get_version_string()) };
    UcxVersion {
        runtime: text.to_string_lossy().into_owned(),
        runtime_numbers: (major, minor, release),
        built: sys::UCX_SYS_BUILT_VERSION,
        built_lib_dir: sys::UCX_SYS_LIBDIR,
        built_from: sys::UCX_SYS_SOURCE,
    }
}

/// `Ok` when the loaded libucp is the major.minor built against; else an error naming both
/// and where the right one is (UCX itself only warns, and a binary built against a
/// `UCX_HOME` would otherwise run on the system's libucp when `LD_LIBRARY_PATH` is unset).
pub(super) fn check_version() -> Result<(), UcxError> {
    let v = ucx_version();
    if v.matches_build() {
        return Ok(());
    }
    let hint = if v.built_lib_dir.is_empty() {
        "the system UCX (pkg-config); is LD_LIBRARY_PATH pointing at another UCX?".to_owned()
    } else if v.built_from.starts_with("the libucx") {
        format!(
            "the libucx-cu12 wheel (pip install libucx-cu12=={}); the `kvxfer` package loads it \
             unless KVXFER_UCX_HOME names another UCX",
            v.built
        )
    } else {
        format!("{0}; run with LD_LIBRARY_PATH={0}", v.built_lib_dir)
    };
    Err(UcxError::other(
        "ucp_init",
        format!(
            "the loaded libucp is UCX {} but kvxfer was built against UCX {} from {hint}",
            v.runtime, v.built
        ),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A process runs on the UCX it was built against (with UCX_HOME, only when the
    /// library path names it: the check that CI's UCX_HOME run did not load the system's).
    #[test]
    fn the_loaded_ucx_is_the_one_built_against() {
        let v = ucx_version();
        assert!(v.matches_build(), "{v:?}");
        assert!(check_version().is_ok());
        let (major, minor, release) = v.runtime_numbers;
        assert_eq!(v.runtime, format!("{major}.{minor}.{release}"), "{v:?}");
        assert!(
            v.built.starts_with(&format!("{major}.{minor}.")) || v.built == format!("{major}.{minor}"),
            "{v:?}"
        );
    }
}
