//! Compiles the C++20 shim over MLX and finds (or installs) MLX itself.
//!
//! MLX is found, in order, at: `MLX_DIR` (the installed `mlx` package folder,
//! holding `include/` and `lib/`), the `mlx` package importable by Python
//! (`PYTHON`, default `python3`), or a pinned wheel that this script installs
//! with pip into a cache folder it owns (`GLM_STREAM_CACHE`, default
//! `~/.cache/glm-stream`). The library path is baked in as an rpath so tests,
//! examples and benches load libmlx without `LD_LIBRARY_PATH`.

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

const MLX_VERSION: &str = "0.32.4";

fn main() {
    println!("cargo:rerun-if-changed=csrc/mlx_shim.cpp");
    println!("cargo:rerun-if-env-changed=MLX_DIR");
    println!("cargo:rerun-if-env-changed=PYTHON");
    println!("cargo:rerun-if-env-changed=GLM_STREAM_CACHE");

    let prefix = match find_mlx() {
        Ok(p) => p,
        Err(e) => {
            eprintln!("glm-stream: could not find or install MLX {MLX_VERSION}: {e}");
            std::process::exit(1);
        }
    };
    check_version(&prefix);

    let include = prefix.join("include");
    let lib = prefix.join("lib");
    cc::Build::new()
        .cpp(true)
        .std("c++20")
        .file("csrc/mlx_shim.cpp")
        .flag("-isystem")
        .flag(include.to_string_lossy().as_ref())
        .flag_if_supported("-Wno-unused-parameter")
        .warnings(true)
        .compile("glm_stream_mlx_shim");

    println!("cargo:rustc-link-search=native={}", lib.display());
    println!("cargo:rustc-link-lib=dylib=mlx");
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.display());
    // `links = "mlx"`: dependents read DEP_MLX_LIBDIR / DEP_MLX_PREFIX to add the rpath.
    println!("cargo:libdir={}", lib.display());
    println!("cargo:prefix={}", prefix.display());
    println!("cargo:rustc-env=GLM_STREAM_MLX_PREFIX={}", prefix.display());
}

fn is_mlx_prefix(p: &Path) -> bool {
    p.join("include/mlx/mlx.h").is_file()
        && (p.join("lib/libmlx.so").is_file() || p.join("lib/libmlx.dylib").is_file())
}

fn find_mlx() -> Result<PathBuf, String> {
    if let Some(dir) = env::var_os("MLX_DIR") {
        let p = PathBuf::from(dir);
        return if is_mlx_prefix(&p) {
            Ok(p)
        } else {
            Err(format!(
                "MLX_DIR={} has no include/mlx/mlx.h and lib/libmlx.{{so,dylib}}",
                p.display()
            ))
        };
    }
    let python = env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    if let Some(p) = python_mlx(&python) {
        if is_mlx_prefix(&p) {
            return Ok(p);
        }
    }
    install_pinned(&python)
}

/// The folder of the importable `mlx` package (this does not load libmlx).
fn python_mlx(python: &str) -> Option<PathBuf> {
    let out = Command::new(python)
        .args(["-c", "import mlx; print(list(mlx.__path__)[0])"])
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    let s = String::from_utf8(out.stdout).ok()?;
    let s = s.trim();
    (!s.is_empty()).then(|| PathBuf::from(s))
}

fn install_pinned(python: &str) -> Result<PathBuf, String> {
    let (package, platform) = if cfg!(target_os = "macos") {
        ("mlx", "macos")
    } else {
        ("mlx-cpu", "linux")
    };
    let cache = match env::var_os("GLM_STREAM_CACHE") {
        Some(c) => PathBuf::from(c),
        None => {
            let home =
                env::var_os("HOME").ok_or("HOME is not set and GLM_STREAM_CACHE is not given")?;
            PathBuf::from(home).join(".cache/glm-stream")
        }
    };
    let target = cache.join(format!("mlx-{MLX_VERSION}-{platform}"));
    let prefix = target.join("mlx");
    if is_mlx_prefix(&prefix) {
        return Ok(prefix);
    }
    std::fs::create_dir_all(&cache).map_err(|e| format!("creating {}: {e}", cache.display()))?;
    // Install into a scratch folder, then rename: an interrupted install never
    // leaves a half-filled cache that looks complete.
    let scratch = cache.join(format!(
        "mlx-{MLX_VERSION}-{platform}.partial-{}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&scratch);
    println!(
        "cargo:warning=installing {package}=={MLX_VERSION} into {}",
        target.display()
    );
    let status = Command::new(python)
        .args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--only-binary=:all:",
            "--target",
        ])
        .arg(&scratch)
        .arg(format!("{package}=={MLX_VERSION}"))
        .status()
        .map_err(|e| format!("running {python} -m pip: {e}"))?;
    if !status.success() {
        return Err(format!(
            "pip install {package}=={MLX_VERSION} failed ({status})"
        ));
    }
    if !is_mlx_prefix(&scratch.join("mlx")) {
        return Err(format!(
            "{package}=={MLX_VERSION} did not provide mlx/include and mlx/lib"
        ));
    }
    let _ = std::fs::remove_dir_all(&target);
    std::fs::rename(&scratch, &target)
        .map_err(|e| format!("moving MLX into {}: {e}", target.display()))?;
    Ok(prefix)
}

fn check_version(prefix: &Path) {
    let header = prefix.join("include/mlx/version.h");
    let Ok(text) = std::fs::read_to_string(&header) else {
        return;
    };
    let field = |name: &str| {
        text.lines()
            .find(|l| l.contains(&format!("#define {name} ")))
            .and_then(|l| l.split_whitespace().nth(2).map(str::to_owned))
    };
    if let (Some(a), Some(b), Some(c)) = (
        field("MLX_VERSION_MAJOR"),
        field("MLX_VERSION_MINOR"),
        field("MLX_VERSION_PATCH"),
    ) {
        let found = format!("{a}.{b}.{c}");
        if found != MLX_VERSION {
            println!(
                "cargo:warning=MLX at {} is {found}; glm-stream is tested with {MLX_VERSION}",
                prefix.display()
            );
        }
    }
}
