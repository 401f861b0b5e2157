//! File sources (`pinstream bandwidth --file`): a file's bytes to the device, read and copied,
//! through `upload_file` with the page cache warm, and through `upload_file` with `O_DIRECT`.

use pinstream::memory::DeviceBuffer;
use pinstream::staging::{FileSource, Stager};
use pinstream::{Error, Result, Stream};

use super::{pattern, Row};
use crate::bench;

/// File source rows (h2d) for `pinstream bandwidth --file`: the first `bytes` of `path` (at most
/// the whole file) to the device, read into pageable memory then copied plainly
/// (`file read+copy`), through `stager.upload_file` with the page cache warm
/// (`file upload_file`), and through `upload_file` with `O_DIRECT` (`file O_DIRECT`) where the
/// filesystem allows it (otherwise skipped, with a note on stderr). Host clock, each sample one
/// read and copy with the stream synchronised ([`bench::staging::file`]).
///
/// The first two are checked by `bench::staging::file` (the device data from `upload_file`
/// against what `read` gave); the `O_DIRECT` row by one more `O_DIRECT` upload compared with
/// the file.
pub fn file_rows(
    stager: &Stager,
    stream: &Stream,
    path: &std::path::Path,
    bytes: usize,
    samples: usize,
) -> Result<Vec<Row>> {
    let how = bench::staging::describe(stager);
    let measured = bench::staging::file(stager, stream, path, bytes, samples.max(1), true)?;
    let mut rows = Vec::new();
    for m in measured {
        let (kind, note, verified) = match m.what.as_str() {
            "file: read + copy" => ("file read+copy", m.note.clone(), true),
            "file: upload_file" => ("file upload_file", format!("page cache warm; {how}"), true),
            "file: upload_file O_DIRECT" => (
                "file O_DIRECT",
                format!("O_DIRECT; {how}"),
                check_direct(stager, stream, path, m.bytes)?,
            ),
            _ => ("file", m.note.clone(), true),
        };
        rows.push(Row {
            device: stager.device().ordinal().to_string(),
            kind,
            direction: "h2d",
            bytes: m.bytes,
            copies_per_sample: 1,
            gbps: m.gbps.clone(),
            host_gbps: Some(m.gbps),
            host_memcpy_gbps: None,
            verified,
            gate_timed_out: false,
            partly_alone: false,
            note: Some(note),
        });
    }
    Ok(rows)
}

/// One `O_DIRECT` `upload_file` of the first `bytes` of `path`, compared with a plain read.
fn check_direct(
    stager: &Stager,
    stream: &Stream,
    path: &std::path::Path,
    bytes: usize,
) -> Result<bool> {
    use std::io::Read;
    let source = FileSource::open_direct(path)?;
    let mut d = DeviceBuffer::<u8>::new(&stager.device(), bytes)?;
    stager.upload_file(stream, &source, 0, &mut d)?;
    let mut want = pattern(bytes)?;
    std::fs::File::open(path)
        .and_then(|mut f| f.read_exact(&mut want))
        .map_err(|e| Error::Io {
            op: "bench::sweep::file_rows",
            path: path.display().to_string(),
            offset: 0,
            len: bytes,
            message: e.to_string(),
        })?;
    let mut got = pattern(bytes)?;
    stream.copy_d2h(&d, &mut got[..])?.wait()?;
    Ok(got == want)
}
