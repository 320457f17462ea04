//! NVRTC, loaded at run time, to compile the CUDA expert kernels ourselves.
//!
//! MLX's `cuda_kernel` compiles each custom kernel with NVRTC on first use
//! in every process, wrapping it in MLX's device headers, and MLX 0.32.4
//! does not keep custom kernels in its PTX disk cache: 2.6–2.9 s for the
//! gate/up + down pair at the first decode token on the H200
//! (benches/RESULTS.md, kernels3). The kernels here need no
//! MLX header, so compiling them alone to PTX takes a fraction of that, and
//! the CUDA driver caches the PTX → SASS step across processes. The PTX is
//! handed to MLX's `precompiled_cuda_kernel`.
//!
//! Opt-in with `GLM_STREAM_NVRTC`: `on` uses the NVRTC the CUDA `libmlx`
//! already loaded (`libnvrtc.so.13`, found with `RTLD_NOLOAD`), a path names
//! the library to open (CI compiles every kernel variant with PyPI's
//! `nvidia-cuda-nvrtc` on machines without a GPU); unset or `off` leaves the
//! compiling to MLX. On the H200 this path took the first decode token of a
//! fresh process from 3.6 s to 0.84 s (benches/RESULTS.md, kernels3); it is
//! not the default because its final form (code kept in a handle, one
//! compiled kernel per specialization) has not been re-run on the GPU.

use std::ffi::{CStr, CString, c_char, c_int, c_void};

/// An NVRTC failure: the library or a symbol is missing, or a compile failed
/// (with NVRTC's log).
#[derive(Debug, thiserror::Error)]
pub enum NvrtcError {
    /// No library could be opened, or it lacks a symbol.
    #[error("NVRTC unavailable: {0}")]
    Unavailable(String),
    /// `nvrtcCompileProgram` failed.
    #[error("NVRTC could not compile {name}: {log}")]
    Compile {
        /// The kernel's entry point.
        name: String,
        /// The compiler log.
        log: String,
    },
    /// Another NVRTC call returned an error code.
    #[error("NVRTC {call} failed with code {code}")]
    Call {
        /// The function.
        call: &'static str,
        /// Its result code.
        code: c_int,
    },
}

type Program = *mut c_void;
type CreateFn = unsafe extern "C" fn(
    *mut Program,
    *const c_char,
    *const c_char,
    c_int,
    *const *const c_char,
    *const *const c_char,
) -> c_int;
type CompileFn = unsafe extern "C" fn(Program, c_int, *const *const c_char) -> c_int;
type SizeFn = unsafe extern "C" fn(Program, *mut usize) -> c_int;
type GetFn = unsafe extern "C" fn(Program, *mut c_char) -> c_int;
type DestroyFn = unsafe extern "C" fn(*mut Program) -> c_int;
type VersionFn = unsafe extern "C" fn(*mut c_int, *mut c_int) -> c_int;

/// The NVRTC entry points used here.
pub struct Nvrtc {
    create: CreateFn,
    compile: CompileFn,
    log_size: SizeFn,
    log: GetFn,
    ptx_size: SizeFn,
    ptx: GetFn,
    destroy: DestroyFn,
    version: (i32, i32),
    /// Where the library came from (for messages).
    origin: String,
}

impl std::fmt::Debug for Nvrtc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Nvrtc")
            .field("version", &self.version)
            .field("origin", &self.origin)
            .finish()
    }
}

/// Sonames tried, newest first.
const SONAMES: [&str; 2] = ["libnvrtc.so.13", "libnvrtc.so.12"];

impl Nvrtc {
    /// As `GLM_STREAM_NVRTC` says: `on`, an NVRTC already loaded into the
    /// process (by the CUDA `libmlx`; nothing new is loaded); a path, that
    /// library; unset or `off`, none (MLX compiles the kernels).
    pub fn load() -> Result<Self, NvrtcError> {
        match std::env::var("GLM_STREAM_NVRTC") {
            Err(_) => Err(NvrtcError::Unavailable(
                "GLM_STREAM_NVRTC is not set".into(),
            )),
            Ok(v) if v == "off" || v.is_empty() => {
                Err(NvrtcError::Unavailable("GLM_STREAM_NVRTC=off".into()))
            }
            Ok(path) if path != "on" => Self::open(&path, false),
            Ok(_) => {
                let mut why = Vec::new();
                for name in SONAMES {
                    match Self::open(name, true) {
                        Ok(n) => return Ok(n),
                        Err(e) => why.push(e.to_string()),
                    }
                }
                Err(NvrtcError::Unavailable(why.join("; ")))
            }
        }
    }

    /// Opens `name` (only if already loaded with `loaded_only`) and binds
    /// the entry points.
    pub fn open(name: &str, loaded_only: bool) -> Result<Self, NvrtcError> {
        let c = CString::new(name)
            .map_err(|_| NvrtcError::Unavailable(format!("bad library name {name:?}")))?;
        let flags =
            libc::RTLD_NOW | libc::RTLD_LOCAL | if loaded_only { libc::RTLD_NOLOAD } else { 0 };
        // SAFETY: dlopen with a valid C string; the handle is never closed,
        // so every symbol taken from it stays valid for the process.
        let handle = unsafe { libc::dlopen(c.as_ptr(), flags) };
        if handle.is_null() {
            return Err(NvrtcError::Unavailable(format!(
                "{name} is not {}",
                if loaded_only { "loaded" } else { "loadable" }
            )));
        }
        let sym = |s: &str| -> Result<*mut c_void, NvrtcError> {
            let cs = CString::new(s).map_err(|_| NvrtcError::Unavailable(s.into()))?;
            // SAFETY: a valid handle and C string; a null result is checked.
            let p = unsafe { libc::dlsym(handle, cs.as_ptr()) };
            if p.is_null() {
                Err(NvrtcError::Unavailable(format!("{name} lacks {s}")))
            } else {
                Ok(p)
            }
        };
        // SAFETY: each symbol is NVRTC's documented C function of exactly
        // the signature it is transmuted to (nvrtc.h, CUDA 12 and 13).
        let n = unsafe {
            Self {
                create: std::mem::transmute::<*mut c_void, CreateFn>(sym("nvrtcCreateProgram")?),
                compile: std::mem::transmute::<*mut c_void, CompileFn>(sym("nvrtcCompileProgram")?),
                log_size: std::mem::transmute::<*mut c_void, SizeFn>(sym(
                    "nvrtcGetProgramLogSize",
                )?),
                log: std::mem::transmute::<*mut c_void, GetFn>(sym("nvrtcGetProgramLog")?),
                ptx_size: std::mem::transmute::<*mut c_void, SizeFn>(sym("nvrtcGetPTXSize")?),
                ptx: std::mem::transmute::<*mut c_void, GetFn>(sym("nvrtcGetPTX")?),
                destroy: std::mem::transmute::<*mut c_void, DestroyFn>(sym("nvrtcDestroyProgram")?),
                version: (0, 0),
                origin: name.to_string(),
            }
        };
        // SAFETY: a bound NVRTC function writing two ints.
        let version = unsafe {
            let f = std::mem::transmute::<*mut c_void, VersionFn>(sym("nvrtcVersion")?);
            let (mut major, mut minor) = (0, 0);
            let rc = f(&mut major, &mut minor);
            if rc != 0 {
                return Err(NvrtcError::Call {
                    call: "nvrtcVersion",
                    code: rc,
                });
            }
            (major, minor)
        };
        Ok(Self { version, ..n })
    }

    /// NVRTC's (major, minor) version.
    pub fn version(&self) -> (i32, i32) {
        self.version
    }

    /// Compiles `source` (a whole translation unit defining the `extern
    /// "C"` kernel `name`) to PTX for `arch` (e.g. `compute_80`).
    pub fn compile_ptx(&self, name: &str, source: &str, arch: &str) -> Result<Vec<u8>, NvrtcError> {
        let bad = |what: &str| NvrtcError::Compile {
            name: name.to_string(),
            log: format!("{what} contains a NUL byte"),
        };
        let src = CString::new(source).map_err(|_| bad("the source"))?;
        let file = CString::new(format!("{name}.cu")).map_err(|_| bad("the name"))?;
        let options = [
            format!("--gpu-architecture={arch}"),
            "-std=c++17".to_string(),
        ]
        .into_iter()
        .map(|o| CString::new(o).map_err(|_| bad("an option")))
        .collect::<Result<Vec<_>, _>>()?;
        let option_ptrs: Vec<*const c_char> = options.iter().map(|o| o.as_ptr()).collect();
        let call = |call: &'static str, code: c_int| {
            if code == 0 {
                Ok(())
            } else {
                Err(NvrtcError::Call { call, code })
            }
        };
        let mut prog: Program = std::ptr::null_mut();
        // SAFETY: valid C strings that outlive the call; no headers.
        call("nvrtcCreateProgram", unsafe {
            (self.create)(
                &mut prog,
                src.as_ptr(),
                file.as_ptr(),
                0,
                std::ptr::null(),
                std::ptr::null(),
            )
        })?;
        // Destroys the program on every path out.
        struct Guard<'a>(&'a Nvrtc, Program);
        impl Drop for Guard<'_> {
            fn drop(&mut self) {
                // SAFETY: the program was created above and is destroyed once.
                unsafe {
                    (self.0.destroy)(&mut self.1);
                }
            }
        }
        let guard = Guard(self, prog);
        // SAFETY: a live program; option pointers valid for the call.
        let rc =
            unsafe { (self.compile)(guard.1, option_ptrs.len() as c_int, option_ptrs.as_ptr()) };
        if rc != 0 {
            let mut n = 0usize;
            // SAFETY: a live program; the buffer has the size NVRTC reported.
            let log = unsafe {
                if (self.log_size)(guard.1, &mut n) == 0 && n > 0 {
                    let mut buf = vec![0u8; n];
                    if (self.log)(guard.1, buf.as_mut_ptr().cast()) == 0 {
                        CStr::from_bytes_until_nul(&buf)
                            .map(|s| s.to_string_lossy().into_owned())
                            .unwrap_or_default()
                    } else {
                        String::new()
                    }
                } else {
                    String::new()
                }
            };
            return Err(NvrtcError::Compile {
                name: name.to_string(),
                log,
            });
        }
        let mut n = 0usize;
        // SAFETY: a live, compiled program.
        call("nvrtcGetPTXSize", unsafe {
            (self.ptx_size)(guard.1, &mut n)
        })?;
        let mut ptx = vec![0u8; n];
        // SAFETY: the buffer has the size NVRTC reported (it includes the
        // terminating NUL, which MLX's module loader needs).
        call("nvrtcGetPTX", unsafe {
            (self.ptx)(guard.1, ptx.as_mut_ptr().cast())
        })?;
        Ok(ptx)
    }
}
