//! The per-sequence caches: for every decoder layer the MLA latent cache
//! (`kv_lora_rank` normalized latent values plus the `qk_rope_head_dim`
//! rotated shared key, 576 values per token for GLM-5.2) and, on layers with
//! their own DSA indexer, the indexer key cache (`index_head_dim` values per
//! token).
//!
//! Buffers are preallocated in chunks of [`CACHE_CHUNK`] positions and written
//! with `slice_update`, so a decode step copies only its own rows. Rolling
//! back ([`ModelCache::truncate`]) only moves the length: positions beyond it
//! are overwritten by the next append.

use crate::mlx::{self, Array, Dtype, MlxError};

/// Positions added to a buffer whenever it runs out of room.
pub const CACHE_CHUNK: usize = 256;

/// A growing `[1, 1, capacity, width]` f32 buffer of per-position rows (one
/// of a layer's caches).
#[derive(Clone)]
pub struct SequenceBuffer {
    data: Option<Array>,
    len: usize,
    width: usize,
}

impl SequenceBuffer {
    fn new(width: usize) -> Self {
        Self {
            data: None,
            len: 0,
            width,
        }
    }

    fn capacity(&self) -> usize {
        self.data
            .as_ref()
            .and_then(|d| d.dim(2).ok())
            .map_or(0, |c| c as usize)
    }

    /// Appends `rows` (`[1, 1, n, width]`, f32) at the current length and
    /// returns the filled part `[1, 1, len, width]`.
    pub(crate) fn append(&mut self, rows: &Array) -> Result<Array, MlxError> {
        let shape = rows.shape();
        if shape.len() != 4 || shape[..2] != [1, 1] || shape[3] as usize != self.width {
            return Err(MlxError::invalid(
                "cache append",
                format!("rows {shape:?} do not match [1, 1, n, {}]", self.width),
            ));
        }
        let n = shape[2] as usize;
        let end = self.len + n;
        let width = self.width as i32;
        if end > self.capacity() {
            let capacity = end.div_ceil(CACHE_CHUNK) * CACHE_CHUNK;
            let extra = i32::try_from(capacity - self.len).map_err(|_| {
                MlxError::invalid("cache append", "cache capacity exceeds i32".to_owned())
            })?;
            let room = mlx::zeros(&[1, 1, extra, width], Dtype::Float32)?;
            self.data = Some(match &self.data {
                Some(d) if self.len > 0 => {
                    let kept = d.slice_axis(2, 0, self.len as i32)?;
                    mlx::concatenate(&[&kept, &room], 2)?
                }
                _ => room,
            });
        }
        let data = self
            .data
            .as_ref()
            .ok_or_else(|| MlxError::invalid("cache append", "no buffer".to_owned()))?;
        let (start, stop) = (self.len as i32, end as i32);
        let updated = data.slice_update(
            &rows.astype(Dtype::Float32)?,
            &[0, 0, start, 0],
            &[1, 1, stop, width],
        )?;
        let filled = updated.slice_axis(2, 0, stop)?;
        self.data = Some(updated);
        self.len = end;
        Ok(filled)
    }

    fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    fn bytes(&self) -> usize {
        self.capacity() * self.width * 4
    }
}

/// The caches of one decoder layer.
#[derive(Clone)]
pub struct LayerCache {
    pub(crate) latent: SequenceBuffer,
    pub(crate) rope_keys: SequenceBuffer,
    pub(crate) index_keys: Option<SequenceBuffer>,
}

impl LayerCache {
    /// Positions held.
    pub fn len(&self) -> usize {
        self.latent.len
    }

    /// True when no position is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// True when the layer keeps an indexer key cache (it has its own indexer).
    pub fn has_index_keys(&self) -> bool {
        self.index_keys.is_some()
    }

    fn buffers(&self) -> impl Iterator<Item = &SequenceBuffer> {
        [&self.latent, &self.rope_keys]
            .into_iter()
            .chain(self.index_keys.as_ref())
    }
}

/// The caches of one sequence for every decoder layer of a
/// [`Glm52Model`](super::Glm52Model) (made by
/// [`Glm52Model::new_cache`](super::Glm52Model::new_cache)).
#[derive(Clone)]
pub struct ModelCache {
    layers: Vec<LayerCache>,
    len: usize,
}

impl std::fmt::Debug for ModelCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelCache")
            .field("layers", &self.layers.len())
            .field("len", &self.len)
            .field("bytes", &self.bytes())
            .finish()
    }
}

impl ModelCache {
    /// Empty caches: per layer a latent cache of `latent_width`, a rotated key
    /// cache of `rope_width` and, where `index_widths[l]` is `Some`, an
    /// indexer key cache of that width.
    pub(crate) fn new(
        latent_width: usize,
        rope_width: usize,
        index_widths: &[Option<usize>],
    ) -> Self {
        let layers = index_widths
            .iter()
            .map(|w| LayerCache {
                latent: SequenceBuffer::new(latent_width),
                rope_keys: SequenceBuffer::new(rope_width),
                index_keys: w.map(SequenceBuffer::new),
            })
            .collect();
        Self { layers, len: 0 }
    }

    /// Positions held (the position the next token gets).
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when no position is held.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Decoder layers covered.
    pub fn layer_count(&self) -> usize {
        self.layers.len()
    }

    /// The cache of layer `l`.
    pub fn layer(&self, l: usize) -> Option<&LayerCache> {
        self.layers.get(l)
    }

    /// Rolls back to the first `len` positions (no-op when `len >= self.len()`).
    pub fn truncate(&mut self, len: usize) {
        for layer in &mut self.layers {
            layer.latent.truncate(len);
            layer.rope_keys.truncate(len);
            if let Some(k) = &mut layer.index_keys {
                k.truncate(len);
            }
        }
        self.len = self.len.min(len);
    }

    /// Forgets every position (keeps the allocated buffers).
    pub fn clear(&mut self) {
        self.truncate(0);
    }

    /// Bytes allocated by the buffers (capacity, not length).
    pub fn bytes(&self) -> usize {
        self.layers
            .iter()
            .flat_map(LayerCache::buffers)
            .map(SequenceBuffer::bytes)
            .sum()
    }

    pub(crate) fn layers_mut(&mut self) -> &mut [LayerCache] {
        &mut self.layers
    }

    pub(crate) fn set_len(&mut self, len: usize) {
        self.len = len;
    }

    /// The buffer arrays, for evaluating them together with a step's output.
    pub(crate) fn arrays(&self) -> Vec<&Array> {
        self.layers
            .iter()
            .flat_map(LayerCache::buffers)
            .filter_map(|b| b.data.as_ref())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(start: usize, n: usize, width: usize) -> Array {
        let v: Vec<f32> = (start * width..(start + n) * width)
            .map(|x| x as f32)
            .collect();
        Array::from_slice(&v, &[1, 1, n as i32, width as i32]).unwrap()
    }

    #[test]
    fn grows_past_chunks_keeps_rows_and_rolls_back() {
        let width = 3;
        let mut b = SequenceBuffer::new(width);
        b.append(&rows(0, 200, width)).unwrap();
        let all = b.append(&rows(200, 100, width)).unwrap();
        assert_eq!(all.shape(), vec![1, 1, 300, 3]);
        assert_eq!(b.capacity(), 2 * CACHE_CHUNK);
        let want: Vec<f32> = (0..300 * width).map(|x| x as f32).collect();
        assert_eq!(all.to_vec::<f32>().unwrap(), want);

        b.truncate(250);
        let replaced = b.append(&rows(1000, 2, width)).unwrap();
        assert_eq!(replaced.shape(), vec![1, 1, 252, 3]);
        let got = replaced.to_vec::<f32>().unwrap();
        assert_eq!(got[..250 * width], want[..250 * width]);
        let tail: Vec<f32> = (1000 * width..1002 * width).map(|x| x as f32).collect();
        assert_eq!(got[250 * width..], tail[..]);
        assert!(b.append(&rows(0, 1, width + 1)).is_err());
    }
}
