//! Machine-readable output. Each report is a list of rows of one `Serialize` type (flat: numbers,
//! strings, booleans, options), written as CSV or JSON by the same derive, so a new column is one
//! field. The tables stay hand-laid-out, but read the same rows.
//!
//! CSV: a header from the row type's field names, then one line per row (an absent value is an
//! empty field). Where a report has more than one kind of row, each kind is a block of its own
//! with its own header, after one empty line. JSON: one object per report (pretty-printed), its
//! rows under named keys.

use pinstream::{Error, Result};
use serde::Serialize;

/// How a report is printed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// Aligned columns for people.
    #[default]
    Table,
    /// Comma-separated values with a header line.
    Csv,
    /// One JSON object.
    Json,
}

/// A value parser for one of `names` in any letter case (with `ignore_case = true` on the
/// argument), giving the name in lower case: `--layout NHWC` is `--layout nhwc`.
pub fn one_of(
    names: &'static [&'static str],
) -> impl clap::builder::TypedValueParser<Value = String> {
    use clap::builder::TypedValueParser;
    clap::builder::PossibleValuesParser::new(names).map(|s| s.to_ascii_lowercase())
}

/// A value parser that takes any string and gives it in lower case (for lists checked later).
pub fn lower(s: &str) -> Result<String, String> {
    Ok(s.to_ascii_lowercase())
}

fn failed(format: &str, e: impl std::fmt::Display) -> Error {
    Error::InvalidArgument {
        op: "pinstream output",
        reason: format!("cannot write {format}: {e}"),
    }
}

/// `rows` as CSV: a header line from the field names, then one line per row. Empty for no rows.
pub fn csv<R: Serialize>(rows: &[R]) -> Result<String> {
    let mut w = csv::Writer::from_writer(Vec::new());
    for row in rows {
        w.serialize(row).map_err(|e| failed("CSV", e))?;
    }
    let bytes = w.into_inner().map_err(|e| failed("CSV", e.error()))?;
    String::from_utf8(bytes).map_err(|e| failed("CSV", e))
}

/// Several CSV tables, the empty ones left out, separated by one empty line.
pub fn csv_blocks(blocks: &[String]) -> String {
    let kept: Vec<&str> = blocks
        .iter()
        .map(String::as_str)
        .filter(|b| !b.is_empty())
        .collect();
    kept.join("\n")
}

/// `value` as pretty-printed JSON, with a final line break.
pub fn json<T: Serialize + ?Sized>(value: &T) -> Result<String> {
    let mut s = serde_json::to_string_pretty(value).map_err(|e| failed("JSON", e))?;
    s.push('\n');
    Ok(s)
}

/// Key-value pairs that serialize as one JSON object, in their order.
#[derive(Debug, Default)]
pub struct Ordered(pub Vec<(String, String)>);

impl Serialize for Ordered {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.collect_map(self.0.iter().map(|(k, v)| (k, v)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `one_of`, `lower` and `Format` with `ignore_case`, as the subcommands declare them.
    #[test]
    fn values_in_any_case() {
        use clap::Parser;
        #[derive(Parser)]
        struct Cli {
            #[arg(long, value_parser = one_of(&["nchw", "nhwc"]), ignore_case = true, default_value = "nchw")]
            layout: String,
            #[arg(long, value_delimiter = ',', value_parser = lower)]
            modes: Vec<String>,
            #[arg(long, value_enum, ignore_case = true, default_value_t = Format::Table)]
            format: Format,
        }
        let cli = Cli::try_parse_from([
            "x",
            "--layout",
            "NHWC",
            "--modes",
            "Serial,APEX",
            "--format",
            "Csv",
        ])
        .unwrap();
        assert_eq!(cli.layout, "nhwc");
        assert_eq!(cli.modes, ["serial", "apex"]);
        assert_eq!(cli.format, Format::Csv);
        let cli = Cli::try_parse_from(["x"]).unwrap();
        assert_eq!((cli.layout.as_str(), cli.format), ("nchw", Format::Table));
        assert!(Cli::try_parse_from(["x", "--layout", "nchw4"]).is_err());
    }

    #[derive(Serialize)]
    struct Row {
        name: String,
        bytes: usize,
        gbps: f64,
        note: Option<String>,
        ok: bool,
    }

    fn rows() -> Vec<Row> {
        vec![
            Row {
                name: "a, \"quoted\"\nname".into(),
                bytes: 4096,
                gbps: 12.5,
                note: None,
                ok: true,
            },
            Row {
                name: "plain".into(),
                bytes: 1,
                gbps: 0.25,
                note: Some("x".into()),
                ok: false,
            },
        ]
    }

    #[test]
    fn csv_has_a_header_quotes_and_empty_options() {
        let out = csv(&rows()).unwrap();
        assert_eq!(
            out,
            "name,bytes,gbps,note,ok\n\"a, \"\"quoted\"\"\nname\",4096,12.5,,true\nplain,1,0.25,x,false\n"
        );
        assert_eq!(csv::<Row>(&[]).unwrap(), "");
    }

    #[test]
    fn csv_blocks_skip_empty_ones() {
        let blocks = ["a\n1\n".to_string(), String::new(), "b\n2\n".to_string()];
        assert_eq!(csv_blocks(&blocks), "a\n1\n\nb\n2\n");
    }

    #[test]
    fn json_escapes_and_keeps_order() {
        let out = json(&rows()).unwrap();
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v[0]["name"], "a, \"quoted\"\nname");
        assert_eq!(v[0]["note"], serde_json::Value::Null);
        assert_eq!(v[1]["gbps"], 0.25);
        let ctx = Ordered(vec![("z".into(), "1".into()), ("a".into(), "2".into())]);
        assert_eq!(serde_json::to_string(&ctx).unwrap(), r#"{"z":"1","a":"2"}"#);
    }
}
