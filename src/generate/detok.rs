//! Streaming detokenization that never splits a character.
//!
//! Byte-level BPE tokens can end in the middle of a UTF-8 sequence, and some decoders
//! change a token's text depending on its neighbours (leading spaces). The decoder
//! keeps a window of the last emitted tokens, decodes the window with and without the
//! new tokens, and emits the difference only once it does not end in U+FFFD (an
//! incomplete sequence). The concatenation of all deltas plus [`IncrementalDecoder::finish`]
//! equals decoding all ids at once.

use super::error::Result;
use super::tokenizer::Tokenizer;

/// Turns a stream of ids into a stream of text deltas.
#[derive(Debug)]
pub struct IncrementalDecoder<'t> {
    tokenizer: &'t Tokenizer,
    skip_special: bool,
    ids: Vec<u32>,
    /// Start of the context window (tokens already emitted, kept for spacing).
    prefix: usize,
    /// End of the emitted tokens.
    read: usize,
}

impl<'t> IncrementalDecoder<'t> {
    /// A decoder with no tokens yet.
    pub fn new(tokenizer: &'t Tokenizer, skip_special: bool) -> Self {
        Self {
            tokenizer,
            skip_special,
            ids: Vec::new(),
            prefix: 0,
            read: 0,
        }
    }

    /// Adds `id` and returns the text that became stable (possibly empty).
    pub fn push(&mut self, id: u32) -> Result<String> {
        self.ids.push(id);
        let before = self
            .tokenizer
            .decode(&self.ids[self.prefix..self.read], self.skip_special)?;
        let after = self
            .tokenizer
            .decode(&self.ids[self.prefix..], self.skip_special)?;
        if after.len() > before.len() && !after.ends_with('\u{FFFD}') {
            if let Some(delta) = after.strip_prefix(before.as_str()) {
                let delta = delta.to_owned();
                self.prefix = self.read;
                self.read = self.ids.len();
                return Ok(delta);
            }
        }
        Ok(String::new())
    }

    /// Returns whatever is still held back (an incomplete character decodes as
    /// U+FFFD) and resets the window.
    pub fn finish(&mut self) -> Result<String> {
        if self.read == self.ids.len() {
            return Ok(String::new());
        }
        let before = self
            .tokenizer
            .decode(&self.ids[self.prefix..self.read], self.skip_special)?;
        let after = self
            .tokenizer
            .decode(&self.ids[self.prefix..], self.skip_special)?;
        self.prefix = self.ids.len();
        self.read = self.ids.len();
        Ok(match after.strip_prefix(before.as_str()) {
            Some(delta) => delta.to_owned(),
            None => after,
        })
    }

    /// All ids pushed so far.
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }
}
