use std::os::raw::c_int;

/// MLX element types. The discriminants are the codes `csrc/mlx_shim.cpp` uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(i32)]
pub enum Dtype {
    Bool = 0,
    Uint8 = 1,
    Uint16 = 2,
    Uint32 = 3,
    Uint64 = 4,
    Int8 = 5,
    Int16 = 6,
    Int32 = 7,
    Int64 = 8,
    Float16 = 9,
    Float32 = 10,
    Float64 = 11,
    Bfloat16 = 12,
    Complex64 = 13,
}

impl Dtype {
    pub(crate) fn code(self) -> c_int {
        self as c_int
    }

    pub(crate) fn from_code(code: c_int) -> Option<Self> {
        use Dtype::*;
        Some(match code {
            0 => Bool,
            1 => Uint8,
            2 => Uint16,
            3 => Uint32,
            4 => Uint64,
            5 => Int8,
            6 => Int16,
            7 => Int32,
            8 => Int64,
            9 => Float16,
            10 => Float32,
            11 => Float64,
            12 => Bfloat16,
            13 => Complex64,
            _ => return None,
        })
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        use Dtype::*;
        match self {
            Bool | Uint8 | Int8 => 1,
            Uint16 | Int16 | Float16 | Bfloat16 => 2,
            Uint32 | Int32 | Float32 => 4,
            Uint64 | Int64 | Float64 | Complex64 => 8,
        }
    }

    /// True for the floating point types.
    pub fn is_float(self) -> bool {
        matches!(
            self,
            Dtype::Float16 | Dtype::Float32 | Dtype::Float64 | Dtype::Bfloat16
        )
    }
}

mod sealed {
    pub trait Sealed {}
}

/// Plain element types that can be copied in and out of arrays: every bit
/// pattern of their size is a valid value, so raw bytes from MLX are sound.
pub trait Element: sealed::Sealed + Copy + Default + 'static {
    /// The matching MLX dtype.
    const DTYPE: Dtype;
}

macro_rules! element {
    ($($t:ty => $d:ident),* $(,)?) => {$(
        impl sealed::Sealed for $t {}
        impl Element for $t { const DTYPE: Dtype = Dtype::$d; }
    )*};
}

element! {
    u8 => Uint8, u16 => Uint16, u32 => Uint32, u64 => Uint64,
    i8 => Int8, i16 => Int16, i32 => Int32, i64 => Int64,
    f32 => Float32, f64 => Float64,
    half::f16 => Float16, half::bf16 => Bfloat16,
}
