//! JSON pieces the header and the index share: a metadata object read with serde_json through
//! visitors that refuse a key given twice (serde_json's `Value` would keep the last one
//! silently).

use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::fmt::Write as _;

use serde::de::{self, DeserializeSeed, MapAccess, SeqAccess, Visitor};
use serde::Deserializer;

/// What a metadata object's values may be.
#[derive(Clone, Copy)]
pub(super) enum Values {
    /// Strings only (a safetensors header's `__metadata__`).
    Strings,
    /// Any JSON: strings kept, other values as compact JSON, no key twice at any depth (an
    /// index's `metadata`).
    AnyAsText,
}

/// The metadata object `field`: `null`, or an object of [`Values`], no key twice.
pub(super) struct MetadataSeed {
    pub(super) field: &'static str,
    pub(super) values: Values,
}

impl MetadataSeed {
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.values {
            Values::Strings => write!(f, "{:?} as an object of strings", self.field),
            Values::AnyAsText => write!(f, "{:?} as an object", self.field),
        }
    }
}

impl<'de> DeserializeSeed<'de> for MetadataSeed {
    type Value = Option<BTreeMap<String, String>>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> std::result::Result<Self::Value, D::Error> {
        d.deserialize_option(self)
    }
}

impl<'de> Visitor<'de> for MetadataSeed {
    type Value = Option<BTreeMap<String, String>>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        MetadataSeed::expecting(self, f)
    }

    fn visit_none<E: de::Error>(self) -> std::result::Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_unit<E: de::Error>(self) -> std::result::Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> std::result::Result<Self::Value, D::Error> {
        d.deserialize_map(MetadataMap(self)).map(Some)
    }
}

struct MetadataMap(MetadataSeed);

impl<'de> Visitor<'de> for MetadataMap {
    type Value = BTreeMap<String, String>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.expecting(f)
    }

    fn visit_map<A: MapAccess<'de>>(
        self,
        mut map: A,
    ) -> std::result::Result<Self::Value, A::Error> {
        let field = self.0.field;
        let mut out = BTreeMap::new();
        while let Some(key) = map.next_key::<String>()? {
            if out.contains_key(&key) {
                return Err(de::Error::custom(format!(
                    "{field:?}: the key {key:?} appears twice"
                )));
            }
            let context = |e: A::Error| de::Error::custom(format!("{field:?}: {key:?}: {e}"));
            let value = match self.0.values {
                Values::Strings => map.next_value::<String>().map_err(context)?,
                Values::AnyAsText => {
                    let mut text = String::new();
                    let string = map
                        .next_value_seed(JsonText { out: &mut text })
                        .map_err(context)?;
                    string.unwrap_or(text)
                }
            };
            out.insert(key, value);
        }
        Ok(out)
    }
}

/// Any JSON value written to `out` as compact JSON, refusing a key given twice in any object;
/// a top-level string is returned as it is instead (`Some`). serde_json's recursion limit (128)
/// ends deep nesting with an error, never a stack overflow.
struct JsonText<'o> {
    out: &'o mut String,
}

impl<'de> DeserializeSeed<'de> for JsonText<'_> {
    type Value = Option<String>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> std::result::Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }
}

/// A string as a JSON string literal.
fn quoted(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| format!("{s:?}"))
}

impl<'de> Visitor<'de> for JsonText<'_> {
    type Value = Option<String>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> std::result::Result<Self::Value, E> {
        let _ = write!(self.out, "{v}");
        Ok(None)
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> std::result::Result<Self::Value, E> {
        let _ = write!(self.out, "{v}");
        Ok(None)
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> std::result::Result<Self::Value, E> {
        let _ = write!(self.out, "{v}");
        Ok(None)
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> std::result::Result<Self::Value, E> {
        self.out
            .push_str(&serde_json::to_string(&v).unwrap_or_else(|_| "null".into()));
        Ok(None)
    }

    fn visit_str<E: de::Error>(self, v: &str) -> std::result::Result<Self::Value, E> {
        Ok(Some(v.to_string()))
    }

    fn visit_unit<E: de::Error>(self) -> std::result::Result<Self::Value, E> {
        self.out.push_str("null");
        Ok(None)
    }

    fn visit_seq<A: SeqAccess<'de>>(
        self,
        mut seq: A,
    ) -> std::result::Result<Self::Value, A::Error> {
        self.out.push('[');
        let mut first = true;
        loop {
            let mut item = String::new();
            let Some(s) = seq.next_element_seed(JsonText { out: &mut item })? else {
                break;
            };
            if !first {
                self.out.push(',');
            }
            first = false;
            match s {
                Some(s) => self.out.push_str(&quoted(&s)),
                None => self.out.push_str(&item),
            }
        }
        self.out.push(']');
        Ok(None)
    }

    fn visit_map<A: MapAccess<'de>>(
        self,
        mut map: A,
    ) -> std::result::Result<Self::Value, A::Error> {
        let mut seen = HashSet::new();
        self.out.push('{');
        while let Some(key) = map.next_key::<String>()? {
            if !seen.insert(key.clone()) {
                return Err(de::Error::custom(format!("the key {key:?} appears twice")));
            }
            if seen.len() > 1 {
                self.out.push(',');
            }
            self.out.push_str(&quoted(&key));
            self.out.push(':');
            let mut item = String::new();
            match map.next_value_seed(JsonText { out: &mut item })? {
                Some(s) => self.out.push_str(&quoted(&s)),
                None => self.out.push_str(&item),
            }
        }
        self.out.push('}');
        Ok(None)
    }
}
