//! MLX's own safetensors loader (lazy: each tensor is read when evaluated).

use std::collections::HashMap;
use std::ffi::CStr;
use std::path::Path;

use super::array::ffi;
use super::ops::cstring;
use super::sys;
use super::{Array, MlxError, Result};

/// Tensors and `__metadata__` of one safetensors file.
#[derive(Debug)]
pub struct SafetensorsFile {
    pub tensors: HashMap<String, Array>,
    pub metadata: HashMap<String, String>,
}

/// Loads a safetensors file lazily through MLX.
pub fn load_safetensors(path: &Path) -> Result<SafetensorsFile> {
    let p = path.to_str().ok_or_else(|| {
        MlxError::invalid(
            "load_safetensors",
            format!("path {} is not UTF-8", path.display()),
        )
    })?;
    let c = cstring("load_safetensors", p)?;
    let mut raw = std::ptr::null_mut();
    ffi!(
        "load_safetensors",
        sys::mlxs_load_safetensors(&mut raw, c.as_ptr())
    )?;
    if raw.is_null() {
        return Err(MlxError::invalid("load_safetensors", "null result"));
    }
    let text = |s: *const std::ffi::c_char| {
        // SAFETY: the shim returns pointers to strings owned by `raw`, which is
        // alive until freed below; they are copied immediately.
        unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned()
    };
    let mut file = SafetensorsFile {
        tensors: HashMap::new(),
        metadata: HashMap::new(),
    };
    // SAFETY (whole block): `raw` is a live handle from the shim; indices stay
    // below the lengths it reports; it is freed exactly once at the end.
    let collected = (|| -> Result<()> {
        let n = unsafe { sys::mlxs_safetensors_len(raw) };
        for i in 0..n {
            let name = text(unsafe { sys::mlxs_safetensors_name(raw, i) });
            let arr = Array::from_raw("load_safetensors", unsafe {
                sys::mlxs_safetensors_array(raw, i)
            })?;
            file.tensors.insert(name, arr);
        }
        let m = unsafe { sys::mlxs_safetensors_meta_len(raw) };
        for i in 0..m {
            let k = text(unsafe { sys::mlxs_safetensors_meta_key(raw, i) });
            let v = text(unsafe { sys::mlxs_safetensors_meta_value(raw, i) });
            file.metadata.insert(k, v);
        }
        Ok(())
    })();
    unsafe { sys::mlxs_safetensors_free(raw) };
    collected.map(|()| file)
}
