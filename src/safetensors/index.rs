//! A sharded checkpoint's index (`model.safetensors.index.json`, as `save_pretrained` writes
//! it): `{"metadata": {...}, "weight_map": {"tensor name": "shard file name", ...}}`, read with
//! serde_json through visitors that refuse a key given twice at any level (serde_json's `Value`
//! would keep the last one silently), a value of the weight map that is not a string, and a
//! shard name that is not a plain relative path inside the index's folder.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::path::{Component, Path};

use serde::de::{self, DeserializeSeed, IgnoredAny, MapAccess, Visitor};
use serde::Deserializer;

use super::header::format_error_of;
use super::json::{MetadataSeed, Values};
use crate::error::Result;

/// The largest index accepted, in bytes (as [`MAX_HEADER_BYTES`](super::MAX_HEADER_BYTES) for a
/// header: the index of a model of a trillion parameters in 100 000 tensors is about 10 MB).
pub const MAX_INDEX_BYTES: u64 = 100_000_000;

pub(crate) const FORMAT: &str = "safetensors index";

/// A parsed index: the weight map in the file's order, and the metadata (strings as they are,
/// other values as their compact JSON text: `"total_size": 123` gives `"123"`).
#[derive(Debug)]
pub(crate) struct Index {
    pub weight_map: Vec<(String, String)>,
    pub metadata: BTreeMap<String, String>,
}

/// Parses and checks an index's bytes; errors are [`Error::Format`](crate::Error::Format)
/// naming `path` and, where one is at fault, the tensor.
pub(crate) fn parse(path: &str, bytes: &[u8]) -> Result<Index> {
    let bad = |tensor: Option<&str>, detail: String| format_error_of(FORMAT, path, tensor, detail);
    let text = std::str::from_utf8(bytes)
        .map_err(|e| bad(None, format!("the index is not UTF-8 ({e})")))?;
    let current = RefCell::new(None::<String>);
    let mut de = serde_json::Deserializer::from_str(text);
    let index = IndexSeed { current: &current }
        .deserialize(&mut de)
        .and_then(|i| de.end().map(|()| i))
        .map_err(|e| {
            bad(
                current.borrow().as_deref(),
                format!("the index is not valid: {e}"),
            )
        })?;
    let Some(weight_map) = index.weight_map else {
        return Err(bad(None, "the index has no \"weight_map\"".into()));
    };
    if weight_map.is_empty() {
        return Err(bad(None, "the weight map names no tensor".into()));
    }
    for (tensor, shard) in &weight_map {
        check_shard_name(shard).map_err(|why| {
            bad(
                Some(tensor),
                format!("the shard name {shard:?} is refused: {why}"),
            )
        })?;
    }
    Ok(Index {
        weight_map,
        metadata: index.metadata.unwrap_or_default(),
    })
}

/// A shard name must be a relative path that stays inside the index's folder by its words
/// alone: not empty, no NUL, no root, no `..` (an index downloaded from elsewhere must not name
/// `/etc/passwd` or `../../secret`). Symbolic links on the way are followed (the Hugging Face
/// cache links every snapshot's files to `../../blobs/`): a link is put there by whoever owns
/// the folder, not by the index's text.
pub(crate) fn check_shard_name(name: &str) -> std::result::Result<(), &'static str> {
    if name.is_empty() {
        return Err("it is empty");
    }
    if name.contains('\0') {
        return Err("it holds a NUL byte");
    }
    let mut normal = false;
    for c in Path::new(name).components() {
        match c {
            Component::Normal(_) => normal = true,
            Component::CurDir => {}
            Component::ParentDir => return Err("it climbs out of the index's folder (\"..\")"),
            Component::RootDir | Component::Prefix(_) => {
                return Err("it is an absolute path, not one relative to the index's folder")
            }
        }
    }
    if !normal {
        return Err("it names no file");
    }
    Ok(())
}

/// A checked shard name with its `.` components and repeated or trailing `/` left out: two
/// spellings of one name give the same.
pub(crate) fn plain_shard_name(name: &str) -> String {
    Path::new(name)
        .components()
        .filter_map(|c| match c {
            Component::Normal(s) => s.to_str(),
            _ => None,
        })
        .collect::<Vec<_>>()
        .join("/")
}

struct RawIndex {
    weight_map: Option<Vec<(String, String)>>,
    metadata: Option<BTreeMap<String, String>>,
}

/// The top level: an object holding `weight_map` and perhaps `metadata` (other keys are
/// skipped, as the Hugging Face readers do), no key twice.
struct IndexSeed<'c> {
    current: &'c RefCell<Option<String>>,
}

impl<'de> DeserializeSeed<'de> for IndexSeed<'_> {
    type Value = RawIndex;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> std::result::Result<RawIndex, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for IndexSeed<'_> {
    type Value = RawIndex;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON object with \"weight_map\"")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> std::result::Result<RawIndex, A::Error> {
        let mut seen = HashSet::new();
        let mut out = RawIndex {
            weight_map: None,
            metadata: None,
        };
        while let Some(key) = map.next_key::<String>()? {
            if !seen.insert(key.clone()) {
                return Err(de::Error::custom(format!("the key {key:?} appears twice")));
            }
            match key.as_str() {
                "weight_map" => {
                    out.weight_map = Some(map.next_value_seed(WeightMapSeed {
                        current: self.current,
                    })?);
                    *self.current.borrow_mut() = None;
                }
                "metadata" => {
                    out.metadata = map.next_value_seed(MetadataSeed {
                        field: "metadata",
                        values: Values::AnyAsText,
                    })?
                }
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(out)
    }
}

/// `weight_map`: an object of strings, no tensor twice.
struct WeightMapSeed<'c> {
    current: &'c RefCell<Option<String>>,
}

impl<'de> DeserializeSeed<'de> for WeightMapSeed<'_> {
    type Value = Vec<(String, String)>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> std::result::Result<Self::Value, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for WeightMapSeed<'_> {
    type Value = Vec<(String, String)>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("\"weight_map\" as an object of tensor names to shard file names")
    }

    fn visit_map<A: MapAccess<'de>>(
        self,
        mut map: A,
    ) -> std::result::Result<Self::Value, A::Error> {
        let mut seen = HashSet::new();
        let mut out = Vec::new();
        while let Some(key) = map.next_key::<String>()? {
            *self.current.borrow_mut() = Some(key.clone());
            if !seen.insert(key.clone()) {
                return Err(de::Error::custom(
                    "\"weight_map\": the tensor appears twice".to_string(),
                ));
            }
            let shard: String = map.next_value().map_err(|e| {
                de::Error::custom(format!(
                    "\"weight_map\": its shard must be a file name (a string): {e}"
                ))
            })?;
            out.push((key, shard));
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;

    fn refused(json: &str, tensor: Option<&str>, needle: &str) {
        match parse("idx.json", json.as_bytes()) {
            Err(Error::Format {
                format,
                path,
                tensor: t,
                detail,
            }) => {
                assert_eq!(format, FORMAT);
                assert_eq!(path, "idx.json");
                assert_eq!(t.as_deref(), tensor, "{json}: {detail}");
                assert!(detail.contains(needle), "{json}: {detail}");
            }
            other => panic!("{json}: {other:?}"),
        }
    }

    #[test]
    fn a_hugging_face_index_parses() {
        let json = r#"{
          "metadata": {"total_size": 123, "total_parameters": 60, "format": "pt",
                       "nested": {"a": [1, "x", null, true, 1.5]}},
          "weight_map": {
            "lm_head.weight": "model-00002-of-00002.safetensors",
            "model.embed_tokens.weight": "model-00001-of-00002.safetensors",
            "model.norm.weight": "./model-00002-of-00002.safetensors"
          },
          "extra": [1, {"k": 2}]
        }"#;
        let i = parse("idx.json", json.as_bytes()).unwrap();
        assert_eq!(i.weight_map.len(), 3);
        assert_eq!(
            i.weight_map[1],
            (
                "model.embed_tokens.weight".into(),
                "model-00001-of-00002.safetensors".into()
            )
        );
        assert_eq!(i.metadata["total_size"], "123");
        assert_eq!(i.metadata["format"], "pt");
        assert_eq!(i.metadata["nested"], r#"{"a":[1,"x",null,true,1.5]}"#);
        // No metadata, or null.
        for json in [
            r#"{"weight_map": {"a": "s.safetensors"}}"#,
            r#"{"metadata": null, "weight_map": {"a": "s.safetensors"}}"#,
        ] {
            assert!(parse("i", json.as_bytes()).unwrap().metadata.is_empty());
        }
    }

    #[test]
    fn bad_indexes_are_format_errors() {
        refused("[1]", None, "not valid");
        refused("{", None, "not valid");
        refused(r#"{"weight_map": {}} {}"#, None, "trailing");
        refused(r#"{"metadata": {}}"#, None, "no \"weight_map\"");
        refused(r#"{"weight_map": {}}"#, None, "names no tensor");
        refused(r#"{"weight_map": []}"#, None, "not valid");
        // Not a string.
        for v in ["1", "null", "[\"a\"]", "{\"f\": \"a\"}", "true"] {
            refused(
                &format!(r#"{{"weight_map": {{"w": {v}}}}}"#),
                Some("w"),
                "must be a file name",
            );
        }
        // Duplicate keys, at every level.
        refused(
            r#"{"weight_map": {"w": "a"}, "weight_map": {"w": "a"}}"#,
            None,
            "\"weight_map\" appears twice",
        );
        refused(
            r#"{"weight_map": {"w": "a", "v": "a", "w": "b"}}"#,
            Some("w"),
            "appears twice",
        );
        // An escaped spelling of the same name is the same name.
        refused(
            r#"{"weight_map": {"w": "a", "\u0077": "a"}}"#,
            Some("w"),
            "appears twice",
        );
        refused(
            r#"{"metadata": {"k": 1, "k": 2}, "weight_map": {"w": "a"}}"#,
            None,
            "\"k\" appears twice",
        );
        refused(
            r#"{"metadata": {"k": {"x": 1, "x": 2}}, "weight_map": {"w": "a"}}"#,
            None,
            "\"x\" appears twice",
        );
        refused(
            r#"{"x": 1, "x": 2, "weight_map": {"w": "a"}}"#,
            None,
            "\"x\" appears twice",
        );
        refused(
            r#"{"metadata": [1], "weight_map": {"w": "a"}}"#,
            None,
            "metadata",
        );
        // Shard names that leave the folder.
        for (shard, why) in [
            ("", "empty"),
            ("../x.safetensors", "climbs out"),
            ("a/../../x.safetensors", "climbs out"),
            ("/etc/passwd", "absolute"),
            (".", "names no file"),
            ("a\\u0000b", "NUL"),
        ] {
            refused(
                &format!(r#"{{"weight_map": {{"v": "ok.safetensors", "w": "{shard}"}}}}"#),
                Some("w"),
                why,
            );
        }
        // Not UTF-8.
        match parse("i", b"{\"weight_map\": {\"w\": \"\xff\"}}") {
            Err(Error::Format { detail, .. }) => assert!(detail.contains("UTF-8"), "{detail}"),
            other => panic!("{other:?}"),
        }
        // Deep nesting: skipped without recursion in an ignored key, an error (serde_json's
        // recursion limit) elsewhere, never a stack overflow.
        let deep = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
        let ignored = format!(r#"{{"other": {deep}, "weight_map": {{"w": "a"}}}}"#);
        assert_eq!(parse("i", ignored.as_bytes()).unwrap().weight_map.len(), 1);
        for json in [
            format!(r#"{{"metadata": {{"k": {deep}}}, "weight_map": {{"w": "a"}}}}"#),
            format!(r#"{{"weight_map": {{"w": {deep}}}}}"#),
            deep.clone(),
        ] {
            assert!(matches!(
                parse("i", json.as_bytes()),
                Err(Error::Format { .. })
            ));
        }
    }

    #[test]
    fn shard_names() {
        for ok in [
            "model-00001-of-00002.safetensors",
            "./a.safetensors",
            "sub/a.safetensors",
            "a..b.safetensors",
        ] {
            assert_eq!(check_shard_name(ok), Ok(()), "{ok}");
        }
        for bad in ["", "..", "../a", "/a", "sub/../../a", "./", "a\0b"] {
            assert!(check_shard_name(bad).is_err(), "{bad:?}");
        }
    }
}
