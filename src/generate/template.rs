//! Hugging Face chat templates rendered with `minijinja`.
//!
//! The environment mirrors `transformers`: `trim_blocks` and `lstrip_blocks` on, loop
//! controls, Python string/dict methods (`.strip()`, `.items()`, …), a `tojson` that
//! writes like Python's `json.dumps(ensure_ascii=False)` (no HTML escaping, `", "` and
//! `": "` separators) and `raise_exception(msg)`.

use std::collections::BTreeMap;
use std::io;
use std::path::{Path, PathBuf};

use minijinja::syntax::SyntaxConfig;
use minijinja::value::{Kwargs, Serde};
use minijinja::{Environment, ErrorKind, Value};
use serde::Serialize;

use super::error::{GenerateError, Result};

/// One chat turn.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, `observation`, …
    pub role: String,
    /// The text of the turn.
    pub content: String,
}

impl ChatMessage {
    /// A message with `role` and `content`.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
    }

    /// A `user` message.
    pub fn user(content: impl Into<String>) -> Self {
        Self::new("user", content)
    }
}

/// A compiled-on-demand chat template with the special-token variables it sees.
#[derive(Debug, Clone)]
pub struct ChatTemplate {
    source: String,
    path: PathBuf,
    vars: BTreeMap<String, String>,
}

impl ChatTemplate {
    /// A template `source` read from `path` (named in errors); `vars` are extra string
    /// variables such as `bos_token` and `eos_token`. Syntax errors are reported here.
    pub fn new(source: String, path: PathBuf, vars: BTreeMap<String, String>) -> Result<Self> {
        let template = Self { source, path, vars };
        let env = environment();
        env.template_from_str(&template.source)
            .map_err(|e| template.error(e))?;
        Ok(template)
    }

    /// The template text.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The file the template came from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn error(&self, source: minijinja::Error) -> GenerateError {
        GenerateError::Template {
            path: self.path.clone(),
            source,
        }
    }

    /// Renders `messages` (anything serializable as a list of role/content maps).
    pub fn render<T: Serialize>(
        &self,
        messages: &[T],
        add_generation_prompt: bool,
    ) -> Result<String> {
        let env = environment();
        let template = env
            .template_from_str(&self.source)
            .map_err(|e| self.error(e))?;
        let mut ctx: BTreeMap<&str, Value> = self
            .vars
            .iter()
            .map(|(k, v)| (k.as_str(), Value::from(v.as_str())))
            .collect();
        ctx.insert("messages", Value::from(Serde(messages)));
        ctx.insert("add_generation_prompt", Value::from(add_generation_prompt));
        template.render(ctx).map_err(|e| self.error(e))
    }
}

fn environment() -> Environment<'static> {
    let mut env = Environment::new();
    // The default delimiters always build; keep the default syntax if that changes.
    if let Ok(syntax) = SyntaxConfig::builder()
        .trim_blocks(true)
        .lstrip_blocks(true)
        .build()
    {
        env.set_syntax(syntax);
    }
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_filter("tojson", tojson);
    env.add_function("raise_exception", raise_exception);
    env
}

fn raise_exception(message: String) -> std::result::Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
}

/// Python `json.dumps(value, ensure_ascii=False, indent=indent)`.
fn tojson(value: Value, kwargs: Kwargs) -> std::result::Result<Value, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    kwargs.assert_all_used()?;
    let mut out = Vec::new();
    let mut ser = serde_json::Serializer::with_formatter(&mut out, PyFormatter::new(indent));
    value
        .serialize(&mut ser)
        .map_err(|e| minijinja::Error::new(ErrorKind::BadSerialization, e.to_string()))?;
    let text = String::from_utf8(out)
        .map_err(|e| minijinja::Error::new(ErrorKind::BadSerialization, e.to_string()))?;
    Ok(Value::from_safe_string(text))
}

/// A `serde_json` formatter that spaces like Python's `json.dumps`.
struct PyFormatter {
    indent: Option<usize>,
    level: usize,
    has_value: bool,
}

impl PyFormatter {
    fn new(indent: Option<usize>) -> Self {
        Self {
            indent,
            level: 0,
            has_value: false,
        }
    }

    fn newline<W: ?Sized + io::Write>(&self, w: &mut W) -> io::Result<()> {
        if let Some(n) = self.indent {
            w.write_all(b"\n")?;
            for _ in 0..n * self.level {
                w.write_all(b" ")?;
            }
        }
        Ok(())
    }

    fn separator<W: ?Sized + io::Write>(&self, w: &mut W, first: bool) -> io::Result<()> {
        if !first {
            w.write_all(if self.indent.is_some() { b"," } else { b", " })?;
        }
        self.newline(w)
    }

    fn open<W: ?Sized + io::Write>(&mut self, w: &mut W, bracket: &[u8]) -> io::Result<()> {
        self.level += 1;
        self.has_value = false;
        w.write_all(bracket)
    }

    fn close<W: ?Sized + io::Write>(&mut self, w: &mut W, bracket: &[u8]) -> io::Result<()> {
        self.level = self.level.saturating_sub(1);
        if self.has_value {
            self.newline(w)?;
        }
        self.has_value = true;
        w.write_all(bracket)
    }
}

impl serde_json::ser::Formatter for PyFormatter {
    fn begin_array<W: ?Sized + io::Write>(&mut self, w: &mut W) -> io::Result<()> {
        self.open(w, b"[")
    }
    fn end_array<W: ?Sized + io::Write>(&mut self, w: &mut W) -> io::Result<()> {
        self.close(w, b"]")
    }
    fn begin_array_value<W: ?Sized + io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> io::Result<()> {
        self.separator(w, first)
    }
    fn end_array_value<W: ?Sized + io::Write>(&mut self, _w: &mut W) -> io::Result<()> {
        self.has_value = true;
        Ok(())
    }
    fn begin_object<W: ?Sized + io::Write>(&mut self, w: &mut W) -> io::Result<()> {
        self.open(w, b"{")
    }
    fn end_object<W: ?Sized + io::Write>(&mut self, w: &mut W) -> io::Result<()> {
        self.close(w, b"}")
    }
    fn begin_object_key<W: ?Sized + io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> io::Result<()> {
        self.separator(w, first)
    }
    fn begin_object_value<W: ?Sized + io::Write>(&mut self, w: &mut W) -> io::Result<()> {
        w.write_all(b": ")
    }
    fn end_object_value<W: ?Sized + io::Write>(&mut self, _w: &mut W) -> io::Result<()> {
        self.has_value = true;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(src: &str, messages: &[ChatMessage]) -> String {
        ChatTemplate::new(src.into(), PathBuf::from("t.jinja"), BTreeMap::new())
            .and_then(|t| t.render(messages, true))
            .unwrap_or_else(|e| format!("ERROR {e}"))
    }

    #[test]
    fn tojson_matches_python_json_dumps() {
        let m = [ChatMessage::user("<a> é")];
        assert_eq!(
            render("{{ messages | tojson }}", &m),
            r#"[{"role": "user", "content": "<a> é"}]"#
        );
        assert_eq!(
            render("{{ messages[0] | tojson(indent=2) }}", &m),
            "{\n  \"role\": \"user\",\n  \"content\": \"<a> é\"\n}"
        );
        assert_eq!(
            render("{{ [] | tojson }}|{{ {} | tojson(indent=2) }}", &m),
            "[]|{}"
        );
    }

    #[test]
    fn python_methods_loop_controls_and_trim_blocks() {
        let m = [
            ChatMessage::user("  hi  "),
            ChatMessage::new("assistant", "x"),
        ];
        let src = "{% for m in messages %}\n  {% if loop.index > 1 %}{% break %}{% endif %}\n[{{ m.content.strip() }}]{% endfor %}";
        assert_eq!(render(src, &m), "[hi]");
    }

    #[test]
    fn errors_name_the_file() {
        let e = ChatTemplate::new(
            "{% for %}".into(),
            PathBuf::from("cfg.json"),
            BTreeMap::new(),
        )
        .map(|_| ())
        .map_err(|e| e.to_string());
        assert!(matches!(&e, Err(s) if s.contains("cfg.json")), "{e:?}");
        let raised = render("{{ raise_exception('nope') }}", &[]);
        assert!(
            raised.starts_with("ERROR") && raised.contains("nope"),
            "{raised}"
        );
    }
}
