//! Quantization codecs of the Colibri container.

pub mod encode;
