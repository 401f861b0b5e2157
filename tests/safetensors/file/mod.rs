//! Trials of `pinstream::safetensors` (feature `safetensors`). CPU: headers read from files,
//! errors that name the file and the tensor, and `load_file` without a GPU. GPU (ignored
//! without one): fresh random model-like files (a few tensors of tens of MiB, many small ones
//! down to a few bytes and empty ones, a dozen dtypes, odd sizes) loaded in each `Direct` mode
//! and checked byte for byte, as the whole data region, per tensor and through typed views, from
//! another stream than the upload's; `Auto` on a cold and a warm file; `/dev/shm` with
//! `Always`; a file cut after its header was read; misaligned tensors; DLPack export.

use std::io::Write;
use std::path::{Path, PathBuf};

use crate::common::{ensure, R};
use libtest_mimic::Trial;
use pinstream::dlpack::abi::{KDL_BFLOAT, KDL_BOOL, KDL_FLOAT, KDL_INT, KDL_UINT};
use pinstream::dlpack::Element;
use pinstream::safetensors::{
    self, Direct, Dtype, Header, LoadOptions, Weights, KDL_COMPLEX, KDL_FLOAT8_E4M3FN,
    KDL_FLOAT8_E5M2,
};
use pinstream::{bf16, f16, Device, Error, Stager, StagerConfig, Stream};
use rand::rngs::SmallRng;
use rand::{Rng, RngCore, SeedableRng};

use crate::common;
use crate::common::trial;

/// Prefix of this module's trial names (its path in the binary).
const PREFIX: &str = "file/";

pub mod hostile;
pub mod hostile2;
pub mod hostile32;
pub mod sharded;

/// The trials of this module, named `file/...`.
pub fn trials() -> Vec<Trial> {
    let no_gpu = !pinstream::available();
    let mut trials = vec![
        trial(PREFIX, "cpu/header_from_a_file", header_from_a_file),
        trial(
            PREFIX,
            "cpu/bad_files_name_file_and_tensor",
            bad_files_name_file_and_tensor,
        ),
        trial(PREFIX, "cpu/writer_layout_is_valid", writer_layout_is_valid),
        // Without a GPU: the header is checked first, then the device is asked for.
        trial(
            PREFIX,
            "no_device/load_file_is_no_device",
            load_file_is_no_device,
        )
        .with_ignored_flag(!no_gpu),
    ];
    let mut gpu = |name: &str, f: fn() -> R| {
        trials.push(trial(PREFIX, name, f).with_ignored_flag(no_gpu));
    };
    gpu("load/model_each_mode", model_each_mode);
    gpu("load/auto_cold_and_warm", auto_cold_and_warm);
    gpu("load/dev_shm_always", dev_shm_always);
    gpu("load/truncated_after_header", truncated_after_header);
    gpu(
        "load/typed_errors_and_misaligned",
        typed_errors_and_misaligned,
    );
    gpu("load/empty_and_tiny_files", empty_and_tiny_files);
    gpu("load/wrong_stream_device_refused", wrong_stream_refused);
    gpu("dlpack/into_dlpack", into_dlpack);
    trials
}

// ----- writing files ---------------------------------------------------------------------------

/// One tensor to write.
struct Spec {
    name: String,
    dtype: Dtype,
    shape: Vec<usize>,
}

/// A written file: where, its bytes, and each tensor's byte range in the data region.
struct Written {
    path: PathBuf,
    bytes: Vec<u8>,
    data_start: usize,
    tensors: Vec<(String, Dtype, Vec<usize>, std::ops::Range<usize>)>,
    seed: u64,
}

impl Written {
    fn data(&self) -> &[u8] {
        &self.bytes[self.data_start..]
    }
}

impl Drop for Written {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

fn byte_len(dtype: Dtype, shape: &[usize]) -> usize {
    shape.iter().product::<usize>() * dtype.bits() / 8
}

/// Writes `specs` as the reference writer does: sorted by element size (largest first) so every
/// tensor is aligned, the JSON padded with spaces to a multiple of 8 (`pad_header`), random
/// contents; `order` shuffles the JSON's keys against the data's order.
fn write_file(
    dir: &Path,
    specs: Vec<Spec>,
    pad_header: bool,
    rng: &mut SmallRng,
    seed: u64,
) -> Written {
    let mut specs = specs;
    specs.sort_by_key(|s| std::cmp::Reverse(s.dtype.bits()));
    let mut at = 0;
    let mut tensors = Vec::new();
    for s in specs {
        let n = byte_len(s.dtype, &s.shape);
        tensors.push((s.name, s.dtype, s.shape, at..at + n));
        at += n;
    }
    let mut entries: Vec<String> = tensors
        .iter()
        .map(|(name, d, shape, r)| {
            format!(
                r#""{name}":{{"dtype":"{d}","shape":{shape:?},"data_offsets":[{},{}]}}"#,
                r.start, r.end
            )
        })
        .collect();
    entries.push(r#""__metadata__":{"format":"pt","made_by":"pinstream tests"}"#.into());
    // The JSON's order need not be the data's.
    for i in (1..entries.len()).rev() {
        entries.swap(i, rng.random_range(0..=i));
    }
    let mut json = format!("{{{}}}", entries.join(",")).into_bytes();
    if pad_header {
        while json.len() % 8 != 0 {
            json.push(b' ');
        }
    }
    // The order the header reports: by offset, empty tensors at one offset by name.
    tensors.sort_by(|a, b| (a.3.start, a.3.end, &a.0).cmp(&(b.3.start, b.3.end, &b.0)));
    let mut bytes = (json.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(&json);
    let data_start = bytes.len();
    bytes.resize(data_start + at, 0);
    rng.fill_bytes(&mut bytes[data_start..]);
    let path = dir.join(format!(
        ".pinstream-st-{}-{}.safetensors",
        std::process::id(),
        rng.random::<u64>()
    ));
    std::fs::File::create(&path)
        .and_then(|mut f| f.write_all(&bytes))
        .expect("write the test file");
    Written {
        path,
        bytes,
        data_start,
        tensors,
        seed,
    }
}

/// A model-like mix: three tensors of tens of MiB (odd shapes), two hundred small ones of
/// random dtypes down to one element, scalars and empty tensors.
fn model_specs(rng: &mut SmallRng) -> Vec<Spec> {
    let spec = |name: String, dtype, shape: Vec<usize>| Spec { name, dtype, shape };
    let mut v = vec![
        spec("embed.weight".into(), Dtype::BF16, vec![5003, 4099]),
        spec("lm_head.weight".into(), Dtype::F32, vec![2049, 4097]),
        spec("layers.0.mlp.w1".into(), Dtype::F16, vec![3001, 5001]),
        spec("scalar".into(), Dtype::F64, vec![]),
        spec("empty".into(), Dtype::F32, vec![0, 7]),
        spec("mask".into(), Dtype::Bool, vec![3, 5]),
        spec("fp8.weight".into(), Dtype::F8E4M3, vec![33, 17]),
        spec("fp8.grad".into(), Dtype::F8E5M2, vec![9]),
        spec("fp4.packed".into(), Dtype::F4, vec![5, 6]),
        spec("complex".into(), Dtype::C64, vec![3]),
    ];
    let small = [
        Dtype::F32,
        Dtype::F16,
        Dtype::BF16,
        Dtype::I64,
        Dtype::I32,
        Dtype::I16,
        Dtype::I8,
        Dtype::U8,
        Dtype::U16,
        Dtype::U32,
        Dtype::U64,
        Dtype::F64,
    ];
    for i in 0..200 {
        let d = small[rng.random_range(0..small.len())];
        let shape = match rng.random_range(0..4) {
            0 => vec![rng.random_range(1..4)],
            1 => vec![rng.random_range(1..300)],
            2 => vec![rng.random_range(1..40), rng.random_range(1..40)],
            _ => vec![2, rng.random_range(0..3), 3],
        };
        v.push(spec(format!("layers.{}.p{i}", i % 7), d, shape));
    }
    v
}

fn scratch_dirs() -> Vec<PathBuf> {
    // The working directory's filesystem usually allows O_DIRECT; /tmp may be tmpfs.
    let mut v = vec![std::env::current_dir().expect("cwd")];
    let t = std::env::temp_dir();
    if !v.contains(&t) {
        v.push(t);
    }
    v
}

fn stager(dev: &Device) -> pinstream::Result<Stager> {
    Stager::new(
        dev,
        StagerConfig {
            threads: 4,
            slots: 8,
            ..StagerConfig::default()
        },
    )
}

// ----- checking --------------------------------------------------------------------------------

/// Downloads `name` through a typed view of `T` on `stream` and compares its bits with the
/// file's (random floats include NaNs, which `==` would call different).
fn typed<T: Element>(w: &Weights, stream: &Stream, name: &str, want: &[u8], seed: u64) -> R {
    let v = w.get::<T>(name)?;
    let shape_elems: usize = w.info(name)?.shape().iter().product();
    ensure(v.len() == shape_elems, || {
        format!(
            "{name}: view of {} elements, shape has {shape_elems}",
            v.len()
        )
    })?;
    let got = v.to_vec(stream)?;
    common::same(
        &format!("typed view of {name}"),
        bytemuck::cast_slice::<T, u8>(&got),
        want,
        seed,
    )
}

/// Everything about a loaded file against what was written: names and order, dtypes, shapes,
/// metadata, the whole data region (through the stager), every tensor's bytes, and a typed view
/// of every tensor whose dtype has an element type, all read on `reader` (not the upload's
/// stream: the arena's tracker must order the reads after the upload).
fn check_all(w: &Weights, f: &Written, stager: &Stager, reader: &Stream) -> R {
    let seed = f.seed;
    ensure(w.len() == f.tensors.len(), || {
        format!("{} tensors, want {}", w.len(), f.tensors.len())
    })?;
    let names: Vec<&str> = w.names().collect();
    let want: Vec<&str> = f.tensors.iter().map(|t| t.0.as_str()).collect();
    ensure(names == want, || format!("names {names:?}, want {want:?}"))?;
    ensure(
        w.metadata().get("made_by").map(String::as_str) == Some("pinstream tests"),
        || format!("metadata {:?}", w.metadata()),
    )?;
    let mut all = vec![0u8; f.data().len()];
    stager.download(reader, &w.bytes()?, &mut all)?;
    common::same("the data region", &all, f.data(), seed)?;
    for (name, dtype, shape, range) in &f.tensors {
        let info = w.info(name)?;
        ensure(
            info.dtype() == *dtype && info.shape() == &shape[..] && info.data_offsets() == *range,
            || format!("{name}: {info:?}, want {dtype} {shape:?} {range:?}"),
        )?;
        let bytes = w.bytes_of(name)?.to_vec(reader)?;
        let want = &f.data()[range.clone()];
        common::same(&format!("bytes of {name}"), &bytes, want, seed)?;
        match dtype {
            Dtype::F32 => typed::<f32>(w, reader, name, want, seed)?,
            Dtype::F16 => typed::<f16>(w, reader, name, want, seed)?,
            Dtype::BF16 => typed::<bf16>(w, reader, name, want, seed)?,
            Dtype::F64 => typed::<f64>(w, reader, name, want, seed)?,
            Dtype::I64 => typed::<i64>(w, reader, name, want, seed)?,
            Dtype::I32 => typed::<i32>(w, reader, name, want, seed)?,
            Dtype::I16 => typed::<i16>(w, reader, name, want, seed)?,
            Dtype::I8 => typed::<i8>(w, reader, name, want, seed)?,
            Dtype::U8 => typed::<u8>(w, reader, name, want, seed)?,
            Dtype::U16 => typed::<u16>(w, reader, name, want, seed)?,
            Dtype::U32 => typed::<u32>(w, reader, name, want, seed)?,
            Dtype::U64 => typed::<u64>(w, reader, name, want, seed)?,
            // No element type: bytes only, and a typed view is refused.
            _ => ensure(
                matches!(w.get::<u8>(name), Err(Error::InvalidArgument { .. })),
                || format!("{name} ({dtype}) as u8 must be refused"),
            )?,
        }
    }
    Ok(())
}

fn seeded() -> (SmallRng, u64) {
    let seed = rand::random::<u64>();
    (SmallRng::seed_from_u64(seed), seed)
}

// ----- CPU trials ------------------------------------------------------------------------------

fn header_from_a_file() -> R {
    let (mut rng, seed) = seeded();
    let f = write_file(
        &std::env::temp_dir(),
        model_specs(&mut rng),
        true,
        &mut rng,
        seed,
    );
    let h = Header::read(&f.path)?;
    ensure(h.len() == f.tensors.len(), || {
        format!("{} tensors", h.len())
    })?;
    ensure(
        h.data_start() as usize == f.data_start && h.data_len() as usize == f.data().len(),
        || format!("data at {} + {}", h.data_start(), h.data_len()),
    )?;
    ensure(h.source() == Some(f.path.as_path()), || {
        format!("{:?}", h.source())
    })?;
    for (t, (name, dtype, shape, range)) in h.tensors().iter().zip(&f.tensors) {
        ensure(
            t.name() == name
                && t.dtype() == *dtype
                && t.shape() == &shape[..]
                && t.data_offsets() == *range,
            || format!("{t:?} against {name} {dtype} {shape:?} {range:?} (seed {seed})"),
        )?;
    }
    // The same bytes parsed from memory give the same tensors.
    let m = Header::parse(&f.bytes, f.bytes.len() as u64)?;
    ensure(
        m.tensors() == h.tensors() && m.metadata() == h.metadata(),
        || "parse and read differ".into(),
    )
}

/// A file with a bad header: `Error::Format` with the file's path and the tensor's name in the
/// message, from `Header::read` (and `load_file`, before any device is touched).
fn bad_files_name_file_and_tensor() -> R {
    let dir = std::env::temp_dir();
    let cases: [(&str, usize, Option<&str>, &str); 4] = [
        (
            r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"a":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}}"#,
            16,
            Some("a"),
            "appears twice",
        ),
        (
            r#"{"w":{"dtype":"Q8","shape":[2],"data_offsets":[0,2]}}"#,
            2,
            Some("w"),
            "unknown dtype \"Q8\"",
        ),
        (
            r#"{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#,
            9,
            Some("w"),
            "belong to no tensor",
        ),
        (
            r#"{"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}"#,
            8,
            Some("w"),
            "is 12 bytes",
        ),
    ];
    for (json, data, tensor, needle) in cases {
        let mut b = (json.len() as u64).to_le_bytes().to_vec();
        b.extend_from_slice(json.as_bytes());
        b.resize(b.len() + data, 0);
        let path = dir.join(format!(
            "pinstream-st-bad-{}.safetensors",
            rand::random::<u64>()
        ));
        std::fs::write(&path, &b)?;
        let got = [
            Header::read(&path).map(drop),
            safetensors::load_file(&path, 0).map(drop),
        ];
        let _ = std::fs::remove_file(&path);
        for r in got {
            match r {
                Err(e @ Error::Format { .. }) => {
                    let text = e.to_string();
                    let Error::Format { tensor: t, .. } = &e else {
                        unreachable!()
                    };
                    ensure(
                        t.as_deref() == tensor
                            && text.contains(needle)
                            && text.contains(&path.display().to_string()),
                        || format!("{json}: {text}"),
                    )?;
                }
                other => return Err(format!("{json}: {other:?}").into()),
            }
        }
    }
    // A file that is not there.
    match Header::read("/nonexistent/model.safetensors") {
        Err(Error::Io { path, .. }) if path.contains("nonexistent") => Ok(()),
        other => Err(format!("a missing file gave {other:?}").into()),
    }
}

/// The writer of these trials gives files the header accepts, with every tensor aligned.
fn writer_layout_is_valid() -> R {
    for _ in 0..20 {
        let (mut rng, seed) = seeded();
        let specs: Vec<Spec> = model_specs(&mut rng)
            .into_iter()
            .filter(|s| byte_len(s.dtype, &s.shape) < 1 << 20)
            .collect();
        let f = write_file(&std::env::temp_dir(), specs, true, &mut rng, seed);
        let h = Header::parse(&f.bytes, f.bytes.len() as u64)?;
        for t in h.tensors() {
            ensure(
                (h.data_start() as usize + t.data_offsets().start) % t.dtype().align() == 0,
                || format!("{} misaligned (seed {seed})", t.name()),
            )?;
        }
    }
    Ok(())
}

fn load_file_is_no_device() -> R {
    let (mut rng, seed) = seeded();
    let specs = vec![Spec {
        name: "w".into(),
        dtype: Dtype::F32,
        shape: vec![4],
    }];
    let f = write_file(&std::env::temp_dir(), specs, true, &mut rng, seed);
    match safetensors::load_file(&f.path, 0) {
        Err(e) if e.is_no_device() => Ok(()),
        other => Err(format!("without a GPU load_file gave {other:?}").into()),
    }
}

// ----- GPU trials ------------------------------------------------------------------------------

fn model_each_mode() -> R {
    let dev = Device::get(0)?;
    let stream = dev.stream()?;
    let reader = dev.stream()?;
    let stager = stager(&dev)?;
    let mut report = Vec::new();
    for dir in scratch_dirs() {
        let (mut rng, seed) = seeded();
        // Padded and unpadded headers: the data region starts at any offset.
        for pad in [true, false] {
            let f = write_file(&dir, model_specs(&mut rng), pad, &mut rng, seed);
            for mode in [Direct::Never, Direct::Auto, Direct::Always] {
                if !pad && mode == Direct::Always {
                    // O_DIRECT keeps an unpadded file's misalignment (the typed reads refuse
                    // it): `typed_errors_and_misaligned` covers that.
                    continue;
                }
                let opts = LoadOptions::new().direct(mode);
                let w = match safetensors::load(&stager, &stream, &f.path, opts) {
                    Ok(w) => w,
                    Err(Error::Io { message, .. })
                        if mode == Direct::Always && message.contains("O_DIRECT") =>
                    {
                        report.push(format!("{}: Always refused ({message})", dir.display()));
                        continue;
                    }
                    Err(e) => return Err(format!("{mode:?} in {}: {e}", dir.display()).into()),
                };
                ensure(
                    w.used_direct() == (mode == Direct::Always) || mode == Direct::Auto,
                    || format!("{mode:?}: used_direct {}", w.used_direct()),
                )?;
                let want_offset = if w.used_direct() {
                    f.data_start % 4096
                } else {
                    0
                };
                ensure(w.data_offset() == want_offset, || {
                    format!(
                        "data offset {} for data start {}",
                        w.data_offset(),
                        f.data_start
                    )
                })?;
                // No synchronize: reads on `reader` must wait for the upload by themselves.
                check_all(&w, &f, &stager, &reader).map_err(|e| {
                    format!(
                        "{mode:?}, {} (pad {pad}): {}",
                        dir.display(),
                        e.message().unwrap_or("failed")
                    )
                })?;
                report.push(format!(
                    "{}: {mode:?} ok (direct: {}), {} MB",
                    dir.display(),
                    w.used_direct(),
                    f.data().len() / 1_000_000
                ));
            }
        }
    }
    println!("{}", report.join("\n"));
    Ok(())
}

/// Drops the file's pages from the page cache (clean pages go without privileges).
fn evict(path: &Path) -> std::io::Result<()> {
    let f = std::fs::File::open(path)?;
    f.sync_all()?;
    use std::os::unix::io::AsRawFd;
    // SAFETY: posix_fadvise on an open descriptor only advises the kernel.
    let rc = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    if rc != 0 {
        return Err(std::io::Error::from_raw_os_error(rc));
    }
    Ok(())
}

/// `Auto` on a file of 96 MiB: after its pages were dropped it reads with `O_DIRECT` (where the
/// filesystem has it and the pages really went), once the file was read it takes the page cache.
fn auto_cold_and_warm() -> R {
    let dev = Device::get(0)?;
    let stream = dev.stream()?;
    let stager = stager(&dev)?;
    let (mut rng, seed) = seeded();
    let dir = std::env::current_dir()?;
    let specs = vec![
        Spec {
            name: "big".into(),
            dtype: Dtype::F32,
            shape: vec![6 << 20, 4],
        },
        Spec {
            name: "small".into(),
            dtype: Dtype::U8,
            shape: vec![77],
        },
    ];
    let f = write_file(&dir, specs, true, &mut rng, seed);
    let direct_ok = pinstream::FileSource::open_direct(&f.path).is_ok();
    let region = (f.data_start as u64, f.data().len() as u64);
    let before = safetensors::resident_fraction(&f.path, region.0, region.1);
    evict(&f.path)?;
    let evicted = safetensors::resident_fraction(&f.path, region.0, region.1);
    ensure(before.is_some_and(|r| r > 0.9), || {
        format!("a file just written: {before:?} resident")
    })?;
    let cold = safetensors::load(&stager, &stream, &f.path, LoadOptions::default())?;
    check_all(&cold, &f, &stager, &stream)?;
    let cold_direct = cold.used_direct();
    drop(cold);
    // Read it through the page cache: warm now.
    let _ = std::fs::read(&f.path)?;
    let warm = safetensors::load(&stager, &stream, &f.path, LoadOptions::default())?;
    check_all(&warm, &f, &stager, &stream)?;
    ensure(!warm.used_direct(), || {
        "a warm file was read with O_DIRECT".into()
    })?;
    println!(
        "O_DIRECT possible: {direct_ok}; resident {before:?}, after eviction {evicted:?}; the \
         cold load used O_DIRECT: {cold_direct}"
    );
    // Where O_DIRECT works and the pages went, the cold load must have used it.
    ensure(
        !(direct_ok && evicted.is_some_and(|r| r < 0.5)) || cold_direct,
        || format!("a cold file ({evicted:?} resident) was read through the page cache"),
    )
}

/// `/dev/shm` (tmpfs) refuses O_DIRECT: `Always` is an `Error::Io` saying so, `Auto` and `Never`
/// read through the page cache.
fn dev_shm_always() -> R {
    let shm = Path::new("/dev/shm");
    if !shm.is_dir() {
        println!("no /dev/shm: nothing to check");
        return Ok(());
    }
    let dev = Device::get(0)?;
    let stream = dev.stream()?;
    let stager = stager(&dev)?;
    let (mut rng, seed) = seeded();
    let specs = vec![
        Spec {
            name: "a".into(),
            dtype: Dtype::F32,
            shape: vec![17 << 20],
        },
        Spec {
            name: "b".into(),
            dtype: Dtype::I64,
            shape: vec![3],
        },
    ];
    let f = write_file(shm, specs, true, &mut rng, seed);
    match safetensors::load(
        &stager,
        &stream,
        &f.path,
        LoadOptions::new().direct(Direct::Always),
    ) {
        Err(Error::Io { message, path, .. }) if message.contains("O_DIRECT") => {
            ensure(path.contains("/dev/shm"), || path.clone())?
        }
        Ok(w) => {
            // A tmpfs that takes O_DIRECT (Linux 6.6+ accepts it on tmpfs): then it must be right.
            println!("/dev/shm accepted O_DIRECT");
            check_all(&w, &f, &stager, &stream)?;
        }
        Err(e) => return Err(format!("Always on /dev/shm: {e}").into()),
    }
    for mode in [Direct::Auto, Direct::Never] {
        let w = safetensors::load(&stager, &stream, &f.path, LoadOptions::new().direct(mode))?;
        ensure(!w.used_direct(), || {
            format!("{mode:?} used O_DIRECT on tmpfs")
        })?;
        check_all(&w, &f, &stager, &stream)?;
    }
    Ok(())
}

/// A file cut after its header was read: `load_header` finds the length changed
/// (`Error::Io`); a header that no longer matches the file is refused as `Error::Format`; and
/// the stager still works afterwards.
fn truncated_after_header() -> R {
    let dev = Device::get(0)?;
    let stream = dev.stream()?;
    let stager = stager(&dev)?;
    let (mut rng, seed) = seeded();
    let specs = vec![
        Spec {
            name: "a".into(),
            dtype: Dtype::F16,
            shape: vec![9 << 20],
        },
        Spec {
            name: "b".into(),
            dtype: Dtype::U8,
            shape: vec![1001],
        },
    ];
    for direct in [Direct::Never, Direct::Always] {
        let f = write_file(
            &std::env::current_dir()?,
            specs_clone(&specs),
            true,
            &mut rng,
            seed,
        );
        let header = Header::read(&f.path)?;
        std::fs::OpenOptions::new()
            .write(true)
            .open(&f.path)?
            .set_len((f.data_start + (5 << 20)) as u64)?;
        match safetensors::load_header(&stager, &stream, header, LoadOptions::new().direct(direct))
        {
            Err(Error::Io { message, .. }) if message.contains("changed after its header") => {}
            other => return Err(format!("{direct:?}: a file cut short gave {other:?}").into()),
        }
        match safetensors::load(&stager, &stream, &f.path, LoadOptions::new().direct(direct)) {
            Err(Error::Format { tensor, detail, .. }) => ensure(
                tensor.as_deref() == Some("a") || detail.contains("data region"),
                || format!("{tensor:?}: {detail}"),
            )?,
            other => return Err(format!("{direct:?}: a cut file gave {other:?}").into()),
        }
    }
    // The stager and the device are fine afterwards.
    let f = write_file(&std::env::temp_dir(), specs, false, &mut rng, seed);
    let w = safetensors::load(&stager, &stream, &f.path, LoadOptions::default())?;
    check_all(&w, &f, &stager, &stream)
}

fn specs_clone(s: &[Spec]) -> Vec<Spec> {
    s.iter()
        .map(|s| Spec {
            name: s.name.clone(),
            dtype: s.dtype,
            shape: s.shape.clone(),
        })
        .collect()
}

/// Writes a file by hand: `tensors` in this order, no padding anywhere.
fn write_raw(
    dir: &Path,
    tensors: &[(&str, Dtype, Vec<usize>)],
    rng: &mut SmallRng,
    seed: u64,
) -> Written {
    let mut at = 0;
    let mut out = Vec::new();
    let mut entries = Vec::new();
    for (name, d, shape) in tensors {
        let n = byte_len(*d, shape);
        entries.push(format!(
            r#""{name}":{{"dtype":"{d}","shape":{shape:?},"data_offsets":[{at},{}]}}"#,
            at + n
        ));
        out.push((name.to_string(), *d, shape.clone(), at..at + n));
        at += n;
    }
    entries.push(r#""__metadata__":{"made_by":"pinstream tests"}"#.into());
    let json = format!("{{{}}}", entries.join(","));
    out.sort_by(|a, b| (a.3.start, a.3.end, &a.0).cmp(&(b.3.start, b.3.end, &b.0)));
    let mut bytes = (json.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(json.as_bytes());
    let data_start = bytes.len();
    bytes.resize(data_start + at, 0);
    rng.fill_bytes(&mut bytes[data_start..]);
    let path = dir.join(format!(
        ".pinstream-st-raw-{}.safetensors",
        rng.random::<u64>()
    ));
    std::fs::write(&path, &bytes).expect("write");
    Written {
        path,
        bytes,
        data_start,
        tensors: out,
        seed,
    }
}

/// Wrong types and names are typed errors; a tensor misaligned in the file is refused as a
/// typed view and by `into_dlpack` (naming it), and readable as bytes.
fn typed_errors_and_misaligned() -> R {
    let dev = Device::get(0)?;
    let stream = dev.stream()?;
    let stager = stager(&dev)?;
    let (mut rng, seed) = seeded();
    // The header's length is whatever the JSON is; "odd" starts at an odd byte of the region.
    let f = write_raw(
        &std::env::temp_dir(),
        &[
            ("b", Dtype::U8, vec![3]),
            ("odd", Dtype::F32, vec![5]),
            ("i", Dtype::U8, vec![1]),
        ],
        &mut rng,
        seed,
    );
    let w = safetensors::load(&stager, &stream, &f.path, LoadOptions::default())?;
    let misaligned = (w.data_offset() + 3) % 4 != 0;
    for (what, r) in [
        ("wrong type", w.get::<f32>("b").map(drop)),
        ("missing name", w.get::<u8>("nope").map(drop)),
        ("missing bytes", w.bytes_of("nope").map(drop)),
    ] {
        ensure(matches!(r, Err(Error::InvalidArgument { .. })), || {
            format!("{what}: {r:?}")
        })?;
    }
    match (w.get::<f32>("odd"), misaligned) {
        (Err(Error::InvalidArgument { reason, .. }), true) => ensure(
            reason.contains("alignment") && reason.contains("odd"),
            || reason.clone(),
        )?,
        (Ok(_), false) => {}
        (other, m) => return Err(format!("misaligned {m}: {other:?}").into()),
    }
    let odd = w.bytes_of("odd")?.to_vec(&stream)?;
    common::same("odd as bytes", &odd, &f.data()[3..23], seed)?;
    match (w.into_dlpack(), misaligned) {
        (Err(Error::InvalidArgument { reason, .. }), true) => {
            ensure(reason.contains("\"odd\""), || reason.clone())
        }
        (Ok(t), false) => ensure(t.len() == 3, || format!("{} tensors", t.len())),
        (other, m) => {
            Err(format!("into_dlpack, misaligned {m}: {:?}", other.map(|v| v.len())).into())
        }
    }
}

/// A file without tensors, one of empty tensors only, and one of a single byte.
fn empty_and_tiny_files() -> R {
    let dev = Device::get(0)?;
    let stream = dev.stream()?;
    let stager = stager(&dev)?;
    let (mut rng, seed) = seeded();
    let dir = std::env::current_dir()?;
    for tensors in [
        vec![],
        vec![("e", Dtype::F32, vec![0]), ("f", Dtype::I64, vec![3, 0])],
        vec![("one", Dtype::U8, vec![1])],
    ] {
        let f = write_raw(&dir, &tensors, &mut rng, seed);
        for mode in [Direct::Never, Direct::Always, Direct::Auto] {
            let w =
                match safetensors::load(&stager, &stream, &f.path, LoadOptions::new().direct(mode))
                {
                    Err(Error::Io { message, .. }) if message.contains("O_DIRECT") => continue,
                    r => r?,
                };
            check_all(&w, &f, &stager, &stream)?;
            w.synchronize()?;
            let t = w.into_dlpack()?;
            ensure(t.len() == tensors.len(), || format!("{} tensors", t.len()))?;
        }
    }
    Ok(())
}

/// A stream of another device than the stager's is refused (with two GPUs; with one, the
/// trial checks that the right stream is accepted).
fn wrong_stream_refused() -> R {
    let dev = Device::get(0)?;
    let stager = stager(&dev)?;
    let (mut rng, seed) = seeded();
    let f = write_raw(
        &std::env::temp_dir(),
        &[("a", Dtype::U8, vec![10])],
        &mut rng,
        seed,
    );
    if Device::count()? >= 2 {
        let other = Device::get(1)?.stream()?;
        match safetensors::load(&stager, &other, &f.path, LoadOptions::default()) {
            Err(Error::WrongDevice { .. }) => {}
            other => return Err(format!("a stream of device 1 gave {:?}", other.map(drop)).into()),
        }
    }
    let w = safetensors::load(&stager, &dev.stream()?, &f.path, LoadOptions::default())?;
    check_all(&w, &f, &stager, &dev.stream()?)
}

/// `into_dlpack`: one tensor per entry, in the data region's order, with its shape and DLPack
/// dtype, pointing into the arena at its offset; writable; handed over and released one by one.
fn into_dlpack() -> R {
    let dev = Device::get(0)?;
    let stream = dev.stream()?;
    let stager = stager(&dev)?;
    let (mut rng, seed) = seeded();
    let specs: Vec<Spec> = model_specs(&mut rng)
        .into_iter()
        .filter(|s| byte_len(s.dtype, &s.shape) < 1 << 20)
        .collect();
    let f = write_file(&std::env::temp_dir(), specs, true, &mut rng, seed);
    let w = safetensors::load(&stager, &stream, &f.path, LoadOptions::default())?;
    let base = w.arena().as_device_ptr() as usize + w.data_offset();
    let tensors = w.into_dlpack()?;
    ensure(tensors.len() == f.tensors.len(), || {
        format!("{} tensors", tensors.len())
    })?;
    for ((name, t), (want_name, dtype, shape, range)) in tensors.iter().zip(&f.tensors) {
        ensure(name == want_name, || format!("{name} against {want_name}"))?;
        let (code, bits) = match dtype {
            Dtype::Bool => (KDL_BOOL, 8),
            Dtype::F8E4M3 => (KDL_FLOAT8_E4M3FN, 8),
            Dtype::F8E5M2 => (KDL_FLOAT8_E5M2, 8),
            Dtype::C64 => (KDL_COMPLEX, 64),
            Dtype::F4 => (KDL_UINT, 8),
            Dtype::F16 | Dtype::F32 | Dtype::F64 => (KDL_FLOAT, dtype.bits() as u8),
            Dtype::BF16 => (KDL_BFLOAT, 16),
            Dtype::I8 | Dtype::I16 | Dtype::I32 | Dtype::I64 => (KDL_INT, dtype.bits() as u8),
            _ => (KDL_UINT, dtype.bits() as u8),
        };
        let want_shape: Vec<i64> = if *dtype == Dtype::F4 {
            vec![range.len() as i64]
        } else {
            shape.iter().map(|&n| n as i64).collect()
        };
        ensure(
            t.dtype().code == code && t.dtype().bits == bits && t.dtype().lanes == 1,
            || format!("{name}: {:?}, want code {code} bits {bits}", t.dtype()),
        )?;
        ensure(t.shape() == &want_shape[..], || {
            format!("{name}: shape {:?}", t.shape())
        })?;
        ensure(
            t.flags() & pinstream::dlpack::abi::FLAG_READ_ONLY == 0,
            || format!("{name}: read-only"),
        )?;
        if !range.is_empty() {
            ensure(t.data_ptr() as usize == base + range.start, || {
                format!(
                    "{name}: data at {:p}, want {:#x}",
                    t.data_ptr(),
                    base + range.start
                )
            })?;
        }
    }
    // Hand one over to a consumer stream and release it; drop the others: the arena goes
    // when the last one does.
    let mut it = tensors.into_iter();
    if let Some((_, t)) = it.next() {
        let raw = t.into_versioned(Some(&stream)).map_err(|e| e.error)?;
        // SAFETY: `raw` was just handed over by `into_versioned` and is released once here.
        unsafe {
            if let Some(del) = (*raw).deleter {
                del(raw);
            }
        }
    }
    drop(it);
    stream.synchronize()?;
    // The typed views' dtype check compares with these.
    ensure(
        Some(<f32 as Element>::DTYPE) == Dtype::F32.to_dlpack()
            && Some(<bf16 as Element>::DTYPE) == Dtype::BF16.to_dlpack(),
        || format!("element types (seed {seed})"),
    )
}
