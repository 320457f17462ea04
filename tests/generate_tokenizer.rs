//! Tokenizer and chat template on a generated tiny model, checked against Python's
//! `tokenizers` and `transformers` (tests/oracle/tokenizer_oracle.py).

use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};

use glm_stream::generate::{ChatMessage, GenerateError, Tokenizer, tiny_model_dir_in};
use glm_stream::tiny::{SourceDtype, TinyModelSpec, generate_hf_checkpoint, tokenizer_vocab_len};
use serde_json::{Value, json};

fn tiny_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    generate_hf_checkpoint(dir.path(), &TinyModelSpec::default(), 3, SourceDtype::Bf16)
        .expect("tiny checkpoint");
    dir
}

const TEXTS: [&str; 7] = [
    "Hello, the world! They were there in the antenna.",
    "héllo wörld — naïve café",
    "你好，世界 🙂👍🏽 emoji",
    "  leading spaces\n\ttabs\r\nand newlines  ",
    "<|user|>special[gMASK]<sop> tokens<|assistant|>\nok<|endoftext|>",
    "",
    "ÿ\u{0}\u{7f} bytes",
];

fn chats() -> Vec<(Vec<ChatMessage>, bool)> {
    vec![
        (vec![ChatMessage::user("Hello there")], true),
        (vec![ChatMessage::user("Hello there")], false),
        (
            vec![
                ChatMessage::new("system", "You are terse."),
                ChatMessage::user("Qu'est-ce que c'est? 你好 🙂"),
                ChatMessage::new("assistant", "Rien.\nDu tout."),
                ChatMessage::user("  encore  "),
            ],
            true,
        ),
    ]
}

fn oracle(dir: &Path, request: &Value) -> Value {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/oracle/tokenizer_oracle.py");
    let mut child = Command::new("python3")
        .arg(&script)
        .arg(dir)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("python3 with `tokenizers` and `transformers` is required");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(request.to_string().as_bytes())
        .expect("write request");
    let out = child.wait_with_output().expect("oracle ran");
    assert!(
        out.status.success(),
        "oracle failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("oracle JSON")
}

fn ids(v: &Value) -> Vec<u32> {
    serde_json::from_value(v.clone()).expect("id list")
}

#[test]
fn encoding_and_chat_template_match_python() {
    let dir = tiny_dir();
    let tok = Tokenizer::from_model_dir(dir.path()).expect("tokenizer");
    let chats = chats();
    let request = json!({
        "texts": TEXTS,
        "chats": chats.iter().map(|(m, g)| json!({"messages": m, "add_generation_prompt": g})).collect::<Vec<_>>(),
    });
    let want = oracle(dir.path(), &request);
    for (i, text) in TEXTS.iter().enumerate() {
        let w = &want["texts"][i];
        assert_eq!(
            tok.encode(text, false).expect("encode"),
            ids(&w["ids"]),
            "{text:?}"
        );
        assert_eq!(
            tok.encode(text, true).expect("encode"),
            ids(&w["ids_special"]),
            "{text:?}"
        );
        let round = tok.decode(&ids(&w["ids"]), false).expect("decode");
        assert_eq!(round, w["decoded"].as_str().expect("str"), "{text:?}");
    }
    for (i, (messages, gen_prompt)) in chats.iter().enumerate() {
        let w = &want["chats"][i];
        let text = tok
            .apply_chat_template(messages, *gen_prompt)
            .expect("render");
        assert_eq!(text, w["text"].as_str().expect("str"), "chat {i}");
        let chat_ids = tok.encode_chat(messages, *gen_prompt).expect("encode chat");
        assert_eq!(chat_ids, ids(&w["ids"]), "chat {i}");
    }
}

#[test]
fn round_trip_and_special_tokens() {
    let dir = tiny_dir();
    let tok = Tokenizer::from_model_dir(dir.path()).expect("tokenizer");
    assert_eq!(tok.vocab_size(), tokenizer_vocab_len());
    for text in TEXTS {
        let ids = tok.encode(text, false).expect("encode");
        assert_eq!(tok.decode(&ids, false).expect("decode"), text);
    }
    for special in [
        "<|endoftext|>",
        "[gMASK]",
        "<sop>",
        "<|user|>",
        "<|assistant|>",
    ] {
        let id = tok.token_to_id(special).expect("special id");
        assert_eq!(
            tok.encode(special, false).expect("encode"),
            [id],
            "{special}"
        );
        assert_eq!(
            tok.decode(&[id], true).expect("decode"),
            "",
            "{special} skipped"
        );
    }
    let user = tok.token_to_id("<|user|>").expect("id");
    let ids = tok.encode("a<|user|>b", false).expect("encode");
    assert_eq!(ids.len(), 3);
    assert_eq!(ids[1], user);
    // The tiny vocabulary merges "the" after a space into one token.
    assert_eq!(tok.encode(" the", false).expect("encode").len(), 1);
    // The default prompt is one user turn with the generation prompt; raw is as is.
    let chat = tok.encode_prompt("hi", false).expect("chat prompt");
    let rendered = tok.decode(&chat, false).expect("decode");
    assert_eq!(rendered, "[gMASK]<sop><|user|>\nhi<|assistant|>\n");
    assert_eq!(
        tok.encode_prompt("hi", true).expect("raw"),
        tok.encode("hi", false).expect("encode")
    );
}

#[test]
fn incremental_decoding_never_splits_characters() {
    let dir = tiny_dir();
    let tok = Tokenizer::from_model_dir(dir.path()).expect("tokenizer");
    for skip_special in [false, true] {
        for text in TEXTS {
            let ids = tok.encode(text, false).expect("encode");
            let mut decoder = tok.incremental_decoder(skip_special);
            let mut streamed = String::new();
            for &id in &ids {
                let delta = decoder.push(id).expect("push");
                assert!(
                    !delta.contains('\u{FFFD}'),
                    "{text:?}: split character in {delta:?}"
                );
                streamed.push_str(&delta);
            }
            streamed.push_str(&decoder.finish().expect("finish"));
            assert_eq!(
                streamed,
                tok.decode(&ids, skip_special).expect("decode"),
                "{text:?}"
            );
        }
    }
    // A 4-byte character is one delta, emitted with its last byte's token.
    let ids = tok.encode("a🙂", false).expect("encode");
    assert_eq!(ids.len(), 5, "byte-level: 1 + 4 tokens");
    let mut decoder = tok.incremental_decoder(true);
    let deltas: Vec<String> = ids
        .iter()
        .map(|&id| decoder.push(id).expect("push"))
        .collect();
    assert_eq!(deltas, ["a", "", "", "", "🙂"]);
    // A truncated character is flushed as U+FFFD by finish.
    let mut decoder = tok.incremental_decoder(true);
    for &id in &ids[..3] {
        decoder.push(id).expect("push");
    }
    assert_eq!(decoder.finish().expect("finish"), "\u{FFFD}");
}

#[test]
fn missing_and_broken_files_are_typed_errors() {
    let empty = tempfile::tempdir().expect("tempdir");
    assert!(matches!(
        Tokenizer::from_model_dir(empty.path()),
        Err(GenerateError::MissingFile { .. })
    ));
    let dir = tiny_dir();
    std::fs::write(dir.path().join("tokenizer_config.json"), "{not json").expect("write");
    let err = Tokenizer::from_model_dir(dir.path()).expect_err("bad JSON");
    assert!(err.to_string().contains("tokenizer_config.json"), "{err}");
    std::fs::write(
        dir.path().join("tokenizer_config.json"),
        r#"{"chat_template": "{% for m in messages %}"}"#,
    )
    .expect("write");
    let err = Tokenizer::from_model_dir(dir.path()).expect_err("bad template");
    assert!(matches!(err, GenerateError::Template { .. }), "{err:?}");
    assert!(err.to_string().contains("tokenizer_config.json"), "{err}");
    std::fs::write(dir.path().join("tokenizer_config.json"), "{}").expect("write");
    let tok = Tokenizer::from_model_dir(dir.path()).expect("no template is fine");
    let err = tok
        .apply_chat_template(&[ChatMessage::user("x")], true)
        .expect_err("none");
    assert!(
        matches!(err, GenerateError::MissingTemplate { .. }),
        "{err:?}"
    );
    std::fs::write(dir.path().join("tokenizer.json"), "{}").expect("write");
    let err = Tokenizer::from_model_dir(dir.path()).expect_err("bad tokenizer");
    assert!(matches!(err, GenerateError::Tokenizer { .. }), "{err:?}");
    // chat_template.jinja wins over the config.
    let dir = tiny_dir();
    std::fs::write(
        dir.path().join("chat_template.jinja"),
        "{{ messages[0].content }}!",
    )
    .expect("write");
    let tok = Tokenizer::from_model_dir(dir.path()).expect("tokenizer");
    assert_eq!(
        tok.apply_chat_template(&[ChatMessage::user("x")], true)
            .expect("render"),
        "x!"
    );
}

#[test]
fn cached_tiny_model_is_built_once_atomically() {
    let root = tempfile::tempdir().expect("tempdir");
    let dir = tiny_model_dir_in(root.path()).expect("build");
    assert_eq!(dir, root.path().join("tiny-model-v1"));
    for f in [
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ] {
        assert!(dir.join(f).is_file(), "{f}");
    }
    assert!(
        dir.join("out-00000.safetensors").is_file(),
        "converted weights"
    );
    let stamp = std::fs::metadata(dir.join("config.json"))
        .and_then(|m| m.modified())
        .expect("mtime");
    assert_eq!(tiny_model_dir_in(root.path()).expect("cached"), dir);
    let again = std::fs::metadata(dir.join("config.json"))
        .and_then(|m| m.modified())
        .expect("mtime");
    assert_eq!(stamp, again, "not rebuilt");
    let leftovers: Vec<_> = std::fs::read_dir(root.path())
        .expect("ls")
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name() != "tiny-model-v1")
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
    // The generation config's stop ids load from the converted dir.
    let gc = glm_stream::container::GenerationConfig::load(&dir.join("generation_config.json"))
        .expect("generation config");
    assert_eq!(gc.eos_token_id.map(|e| e.to_vec().len()), Some(3));
    Tokenizer::from_model_dir(&dir).expect("tokenizer in the converted dir");
}
