//! NCCL, loaded at run time by this crate (feature `nccl`).
//!
//! `cudarc` loads NCCL only under `libnccl.so` and names like `libnccl.so.12`, never under
//! `libnccl.so.2`, NCCL's real soname and the only file a runtime-only install has (Debian's or
//! NVIDIA's `libnccl2` package without `libnccl-dev`, PyTorch's `nvidia-nccl-cu12` wheel). So the
//! `nccl` backend opens the library itself, once per process, and keeps a table of the NCCL
//! functions it calls; `cudarc` still provides the types (and the CUDA driver).
//!
//! Where the library comes from, in order:
//! 1. the file named by [`ENV_VAR`] (`BURN_PARALLEL_NCCL_LIB`) when it is set and not empty; it
//!    is then the only candidate: when it cannot be loaded the error names it (no fallback to
//!    another NCCL the user did not ask for);
//! 2. otherwise `libnccl.so.2`, then `libnccl.so`, found by the dynamic loader's search
//!    (`LD_LIBRARY_PATH`, the `ld.so` cache, the standard folders). A pip install's
//!    `site-packages/nvidia/nccl/lib` is not searched: name its file in [`ENV_VAR`] or add the
//!    folder to `LD_LIBRARY_PATH`.
//!
//! A library that cannot be opened or lacks one of the functions is an error whose text lists
//! every candidate tried and what to install (the `nccl` backend reports it as
//! [`CollectiveError::BackendUnavailable`](crate::CollectiveError::BackendUnavailable)); nothing
//! here panics.

use std::ffi::{OsString, c_char, c_int, c_void};
use std::fmt;
use std::path::PathBuf;
use std::sync::OnceLock;

use cudarc::nccl::sys::{
    self, cudaStream_t, ncclComm_t, ncclConfig_t, ncclDataType_t, ncclRedOp_t, ncclResult_t,
    ncclUniqueId,
};
use libloading::Library;

/// The environment variable naming the NCCL library file to load instead of searching for one.
pub(crate) const ENV_VAR: &str = "BURN_PARALLEL_NCCL_LIB";

/// The names searched when [`ENV_VAR`] is not set, in order: NCCL's soname (every install has
/// it), then the development link (`libnccl-dev`, or a link made by hand).
pub(crate) const DEFAULT_NAMES: [&str; 2] = ["libnccl.so.2", "libnccl.so"];

/// One place to load NCCL from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Candidate {
    /// A file the user named (through [`ENV_VAR`]).
    Path(PathBuf),
    /// A library name for the dynamic loader's search (`LD_LIBRARY_PATH`, `ld.so` cache).
    Name(&'static str),
}

impl fmt::Display for Candidate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Candidate::Path(path) => write!(f, "`{}` (from {ENV_VAR})", path.display()),
            Candidate::Name(name) => write!(f, "`{name}` (on the library path)"),
        }
    }
}

/// The candidates for a value of [`ENV_VAR`] (`None` when unset): the named file alone, or
/// [`DEFAULT_NAMES`] when the variable is unset or empty.
pub(crate) fn candidates(env: Option<OsString>) -> Vec<Candidate> {
    match env {
        Some(path) if !path.is_empty() => vec![Candidate::Path(path.into())],
        _ => DEFAULT_NAMES.into_iter().map(Candidate::Name).collect(),
    }
}

/// Declares the table of NCCL functions: each field's type is the `extern "C"` pointer type of
/// the function, with the parameter types of `cudarc::nccl::sys`'s declaration (checked at
/// compile time: the `const` items below coerce cudarc's function to the same parameter list).
macro_rules! nccl_table {
    ($( $field:ident = $symbol:ident ( $($arg:ty),* ) -> $ret:ty; )*) => {
        /// The NCCL functions the `nccl` backend calls, resolved from one loaded library. The
        /// pointers are valid as long as the table (which owns the library) lives.
        // The collectives are called by the device path only (features `nccl` and `cuda`).
        #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
        pub(crate) struct Nccl {
            $(
                #[doc = concat!("`", stringify!($symbol), "`.")]
                pub(crate) $field: unsafe extern "C" fn($($arg),*) -> $ret,
            )*
            /// Where the library came from (a [`Candidate`], displayed).
            origin: String,
            /// Keeps the library loaded while the pointers above are used.
            _library: Library,
        }

        // Signature checks against cudarc's declarations (same parameter and return types).
        $( const _: unsafe fn($($arg),*) -> $ret = sys::$symbol; )*

        impl Nccl {
            /// Resolves every function of the table in `library`.
            ///
            /// # Errors
            /// The names of the functions `library` lacks.
            ///
            /// # Safety
            /// `library` must be NCCL (or lack every symbol it is not NCCL's): the pointers are
            /// typed with NCCL's declarations.
            unsafe fn resolve(
                library: Library,
                origin: String,
            ) -> std::result::Result<Self, Vec<&'static str>> {
                let mut missing = Vec::new();
                $(
                    // SAFETY: the symbol is NCCL's function of this name, whose C declaration
                    // the pointer type copies (the caller guarantees the library is NCCL); the
                    // pointer is copied out and kept next to the library, which it never
                    // outlives.
                    let $field = unsafe {
                        library.get::<unsafe extern "C" fn($($arg),*) -> $ret>(
                            concat!(stringify!($symbol), "\0").as_bytes(),
                        )
                    }
                    .ok()
                    .map(|symbol| *symbol);
                    if $field.is_none() {
                        missing.push(stringify!($symbol));
                    }
                )*
                $( let Some($field) = $field else { return Err(missing) }; )*
                Ok(Self { $($field,)* origin, _library: library })
            }
        }
    };
}

nccl_table! {
    get_version = ncclGetVersion(*mut c_int) -> ncclResult_t;
    get_unique_id = ncclGetUniqueId(*mut ncclUniqueId) -> ncclResult_t;
    get_error_string = ncclGetErrorString(ncclResult_t) -> *const c_char;
    get_last_error = ncclGetLastError(ncclComm_t) -> *const c_char;
    comm_init_rank_config = ncclCommInitRankConfig(
        *mut ncclComm_t, c_int, ncclUniqueId, c_int, *mut ncclConfig_t
    ) -> ncclResult_t;
    comm_abort = ncclCommAbort(ncclComm_t) -> ncclResult_t;
    comm_get_async_error = ncclCommGetAsyncError(ncclComm_t, *mut ncclResult_t) -> ncclResult_t;
    all_reduce = ncclAllReduce(
        *const c_void, *mut c_void, usize, ncclDataType_t, ncclRedOp_t, ncclComm_t, cudaStream_t
    ) -> ncclResult_t;
    broadcast = ncclBroadcast(
        *const c_void, *mut c_void, usize, ncclDataType_t, c_int, ncclComm_t, cudaStream_t
    ) -> ncclResult_t;
    all_gather = ncclAllGather(
        *const c_void, *mut c_void, usize, ncclDataType_t, ncclComm_t, cudaStream_t
    ) -> ncclResult_t;
    reduce_scatter = ncclReduceScatter(
        *const c_void, *mut c_void, usize, ncclDataType_t, ncclRedOp_t, ncclComm_t, cudaStream_t
    ) -> ncclResult_t;
    send = ncclSend(*const c_void, usize, ncclDataType_t, c_int, ncclComm_t, cudaStream_t)
        -> ncclResult_t;
    recv = ncclRecv(*mut c_void, usize, ncclDataType_t, c_int, ncclComm_t, cudaStream_t)
        -> ncclResult_t;
    group_start = ncclGroupStart() -> ncclResult_t;
    group_end = ncclGroupEnd() -> ncclResult_t;
}

impl Nccl {
    /// Where the library was loaded from, for messages (e.g. "`libnccl.so.2` (on the library
    /// path)").
    pub(crate) fn origin(&self) -> &str {
        &self.origin
    }
}

impl fmt::Debug for Nccl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Nccl")
            .field("origin", &self.origin)
            .finish_non_exhaustive()
    }
}

/// The process's NCCL: loaded at the first call from the candidates of [`ENV_VAR`] (read then,
/// once); the outcome, success or error, is kept for the life of the process.
///
/// # Errors
/// Why NCCL cannot be loaded, as [`load_from`] reports it.
pub(crate) fn get() -> Result<&'static Nccl, String> {
    static NCCL: OnceLock<Result<Nccl, String>> = OnceLock::new();
    NCCL.get_or_init(|| load_from(&candidates(std::env::var_os(ENV_VAR))))
        .as_ref()
        .map_err(Clone::clone)
}

/// Loads NCCL from the first of `candidates` that opens and has every function of the table.
///
/// # Errors
/// When none does, why: the text lists each candidate with why it failed (the loader's error, or
/// the missing functions) and says what to install or set.
pub(crate) fn load_from(candidates: &[Candidate]) -> Result<Nccl, String> {
    let mut tried = Vec::with_capacity(candidates.len());
    for candidate in candidates {
        if let Candidate::Path(path) = candidate
            && path.is_dir()
        {
            tried.push(format!(
                "{candidate} is a folder: name the library file in it (libnccl.so.2)"
            ));
            continue;
        }
        // SAFETY: loading runs the library's initialisers; NCCL's (and those of any ordinary
        // shared library the user names) have no preconditions.
        let opened = unsafe {
            match candidate {
                Candidate::Path(path) => Library::new(path),
                Candidate::Name(name) => Library::new(*name),
            }
        };
        let library = match opened {
            Ok(library) => library,
            Err(e) => {
                tried.push(format!("{candidate}: {}", with_sources(&e)));
                continue;
            }
        };
        // SAFETY: a library that has these symbols is NCCL (they are NCCL's names), so the
        // declarations apply; one lacking any of them is refused before a pointer is used.
        match unsafe { Nccl::resolve(library, candidate.to_string()) } {
            Ok(nccl) => return Ok(nccl),
            Err(missing) => tried.push(format!(
                "{candidate} loaded but is not NCCL 2.14 or newer: it lacks {}",
                missing.join(", ")
            )),
        }
    }
    let advice = if candidates.iter().any(|c| matches!(c, Candidate::Path(_))) {
        format!(
            "Point {ENV_VAR} at the shared library of NCCL 2.14 or newer (e.g. \
             `.../site-packages/nvidia/nccl/lib/libnccl.so.2` of `pip install nvidia-nccl-cu12`, \
             or `/usr/lib/x86_64-linux-gnu/libnccl.so.2`), or unset it to search for \
             libnccl.so.2 and libnccl.so on the library path"
        )
    } else {
        format!(
            "Install NCCL 2.14 or newer (`apt install libnccl2` from NVIDIA's CUDA repository), \
             or `pip install nvidia-nccl-cu12` and set {ENV_VAR} to its \
             `.../site-packages/nvidia/nccl/lib/libnccl.so.2` (or add that folder to \
             LD_LIBRARY_PATH)"
        )
    };
    Err(format!(
        "libnccl cannot be loaded; tried {}. {advice}",
        if tried.is_empty() {
            "nothing".to_string()
        } else {
            tried.join("; ")
        }
    ))
}

/// An error's text followed by its sources' (libloading's "dlopen failed" carries the loader's
/// own message, with the reason, as its source).
fn with_sources(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_variable_is_the_only_candidate_when_set() {
        assert_eq!(
            candidates(Some("/opt/nccl/libnccl.so.2".into())),
            vec![Candidate::Path("/opt/nccl/libnccl.so.2".into())]
        );
        let defaults = vec![
            Candidate::Name("libnccl.so.2"),
            Candidate::Name("libnccl.so"),
        ];
        assert_eq!(candidates(None), defaults);
        assert_eq!(candidates(Some(OsString::new())), defaults);
    }

    #[test]
    fn a_missing_file_is_unavailable_naming_the_path() {
        let path = "/nonexistent/burn-parallel-test/libnccl.so.2";
        let reason = load_from(&[Candidate::Path(path.into())]).unwrap_err();
        assert!(reason.contains(path), "{reason}");
        assert!(reason.contains(ENV_VAR), "{reason}");
        assert!(reason.contains("libnccl"), "{reason}");
        // The loader's own message (which names the file again) is kept.
        assert!(reason.matches(path).count() >= 2, "{reason}");
    }

    #[test]
    fn a_folder_is_unavailable_naming_it() {
        let dir = std::env::temp_dir();
        let reason = load_from(&[Candidate::Path(dir.clone())]).unwrap_err();
        assert!(reason.contains(&*dir.to_string_lossy()), "{reason}");
        assert!(reason.contains("folder"), "{reason}");
    }

    /// A real shared library that is not NCCL: libc, by its path where this system has one.
    #[cfg(target_os = "linux")]
    fn libc() -> Candidate {
        [
            "/lib/x86_64-linux-gnu/libc.so.6",
            "/lib/aarch64-linux-gnu/libc.so.6",
            "/lib64/libc.so.6",
            "/usr/lib/libc.so.6",
        ]
        .into_iter()
        .map(PathBuf::from)
        .find(|p| p.is_file())
        .map_or(Candidate::Name("libc.so.6"), Candidate::Path)
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn a_library_without_nccl_symbols_is_unavailable_naming_them() {
        let libc = libc();
        let reason = load_from(std::slice::from_ref(&libc)).unwrap_err();
        if let Candidate::Path(path) = &libc {
            assert!(reason.contains(&*path.to_string_lossy()), "{reason}");
        }
        assert!(reason.contains("lacks"), "{reason}");
        for symbol in ["ncclCommInitRankConfig", "ncclAllReduce", "ncclGroupEnd"] {
            assert!(reason.contains(symbol), "{reason}");
        }
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn every_candidate_is_tried_in_order_and_listed() {
        let absent = Candidate::Name("libnccl-burn-parallel-test-absent.so.2");
        let reason = load_from(&[absent, Candidate::Name("libc.so.6")]).unwrap_err();
        let first = reason
            .find("libnccl-burn-parallel-test-absent.so.2")
            .expect(&reason);
        let second = reason.find("`libc.so.6`").expect(&reason);
        assert!(first < second, "{reason}");
        assert!(reason.contains("ncclGetVersion"), "{reason}");
        // No NCCL_LIB candidate: the advice is what to install.
        assert!(reason.contains("Install NCCL"), "{reason}");
    }

    /// The process's NCCL: whatever this machine has, the outcome is a table or an error
    /// (never a panic), and the same on every call.
    #[test]
    fn get_is_a_table_or_an_error() {
        match get() {
            Ok(nccl) => {
                assert!(get().is_ok());
                let mut version: c_int = 0;
                // SAFETY: `version` outlives the call; ncclGetVersion only writes it.
                let code = unsafe { (nccl.get_version)(&mut version) };
                assert_eq!(code, ncclResult_t::ncclSuccess);
                assert!(version > 0, "{}", nccl.origin());
            }
            Err(e) => {
                let text = e.clone();
                assert!(text.contains("libnccl"), "{text}");
                assert_eq!(get().unwrap_err(), e);
            }
        }
    }
}
